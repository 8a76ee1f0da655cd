"""The store's operations on the reload history (RFC 0000 §6, ``GET /v1/reloads``), written once for
both backends like ``agentd.store.operations``, apart from I/O."""

from __future__ import annotations

from agentd.store import codec
from agentd.store.base import ReloadRow
from agentd.store.sansio import Op, execute, fetch_all


def record_reload(reload: ReloadRow, keep: int) -> Op[None]:
    """``Store.record_reload``: one row more; rows older than the newest ``keep`` deleted (bounded history)."""
    yield from execute(
        "INSERT INTO reloads (generation, at, applied, errors, changed, swapped_total, replica)"
        " VALUES (:generation, :at, :applied, :errors, :changed, :swapped_total, :replica)",
        generation=reload.generation,
        at=reload.at,
        applied=reload.applied,
        errors=codec.encode_json(reload.errors),
        changed=codec.encode_json(reload.changed),
        swapped_total=reload.swapped_total,
        replica=reload.replica,
    )
    yield from execute("DELETE FROM reloads WHERE n <= (SELECT MAX(n) FROM reloads) - :keep", keep=keep)


def reloads(limit: int) -> Op[list[ReloadRow]]:
    """``Store.reloads``: the newest ``limit`` rows of the history, newest first."""
    rows = yield from fetch_all(
        "SELECT generation, at, applied, errors, changed, swapped_total, replica FROM reloads"
        " ORDER BY n DESC LIMIT :limit",
        limit=limit,
    )
    return [
        ReloadRow(
            generation=row["generation"],
            at=float(row["at"]),
            applied=bool(row["applied"]),
            errors=codec.decode_reload_errors(row["errors"]),
            changed=codec.decode_strings(row["changed"]),
            swapped_total=row["swapped_total"],
            replica=row["replica"],
        )
        for row in rows
    ]
