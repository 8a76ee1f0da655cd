"""The store's operations on idempotency keys (RFC 0010 §2), written once for both backends like
``agentd.store.operations`` (whose rules they follow), apart from I/O."""

from __future__ import annotations

import msgspec

from agentd.store.base import IdempotencyRecord
from agentd.store.sansio import Op, Row, execute, fetch_one

_IDEMPOTENCY_COLUMNS = "scope, key, fingerprint, owner, session, turn, status, answer, headers, created_at, expires_at"


def _idempotency_from_row(row: Row) -> IdempotencyRecord:
    return IdempotencyRecord(
        scope=row["scope"],
        key=row["key"],
        fingerprint=row["fingerprint"],
        owner=row["owner"],
        session=row["session"],
        turn=row["turn"],
        status=row["status"],
        answer=row["answer"],
        headers=msgspec.json.decode(row["headers"], type=dict[str, str]),
        created_at=float(row["created_at"]),
        expires_at=float(row["expires_at"]),
    )


def idempotency_claim(
    scope: str, key: str, fingerprint: str, owner: str, session: str | None, turn: str | None, ttl: float
) -> Op[IdempotencyRecord | None]:
    """``Store.idempotency_claim``: None once the key is claimed for ``owner``, else the record that
    holds it (an unexpired one). Every expired record is deleted first."""
    yield from execute("DELETE FROM idempotency WHERE expires_at <= {now}")
    inserted = yield from execute(
        "INSERT INTO idempotency (scope, key, fingerprint, owner, session, turn, created_at, expires_at)"
        " VALUES (:scope, :key, :fingerprint, :owner, :session, :turn, {now}, {now} + :ttl)"
        " ON CONFLICT (scope, key) DO NOTHING",
        scope=scope,
        key=key,
        fingerprint=fingerprint,
        owner=owner,
        session=session,
        turn=turn,
        ttl=float(ttl),
    )
    if inserted:
        return None
    row = yield from fetch_one(
        f"SELECT {_IDEMPOTENCY_COLUMNS} FROM idempotency WHERE scope = :scope AND key = :key", scope=scope, key=key
    )
    assert row is not None  # the conflict was with it, in this very transaction
    return _idempotency_from_row(row)


def idempotency_take_over(scope: str, key: str, owner: str, previous: str | None) -> Op[bool]:
    """``Store.idempotency_take_over``: ``owner`` answers the key now, if ``previous`` still held
    it and no answer was stored."""
    held = "owner IS NULL" if previous is None else "owner = :previous"  # a NULL parameter has no type
    taken = yield from execute(
        f"UPDATE idempotency SET owner = :owner WHERE scope = :scope AND key = :key AND status IS NULL AND {held}",
        owner=owner,
        scope=scope,
        key=key,
        previous=previous,
    )
    return bool(taken)


def idempotency_release(scope: str, key: str, owner: str) -> Op[None]:
    """``Store.idempotency_release``: ``owner`` no longer answers the key (no answer was stored)."""
    yield from execute(
        "UPDATE idempotency SET owner = NULL WHERE scope = :scope AND key = :key AND owner = :owner",
        scope=scope,
        key=key,
        owner=owner,
    )


def idempotency_answer(scope: str, key: str, status: int, answer: str, headers: str) -> Op[None]:
    """``Store.idempotency_answer``: the answer a later request with the key is given, for good."""
    yield from execute(
        "UPDATE idempotency SET status = :status, answer = :answer, headers = :headers, owner = NULL"
        " WHERE scope = :scope AND key = :key",
        status=status,
        answer=answer,
        headers=headers,
        scope=scope,
        key=key,
    )
