"""The store operations of approvals (RFC 0012 §4), written once for both backends like
``agentd.store.operations`` (kept apart so that neither module outgrows the layout bound).

Two tables: ``approvals``, one row per tool call a human decides on, and ``parked_turns``, the run
of a pending turn that stopped for them (``agentd.approvals.ParkedRun``, JSON). A turn *awaits
approval* while it has a parked run and a pending approval (``AWAITING``): no restart, no failover
scan runs it then. A decision is one conditional UPDATE (``status = 'pending'``), so exactly one
decision wins, whichever replica it is made on. The transaction that ends a turn cancels its
pending approvals and drops its parked run (``end_approvals``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from agentd.approvals import Approval, ApprovalRequest, ApprovalStatus, ParkedRun
from agentd.store import codec
from agentd.store.base import AlreadyDecided, Lease, ParkResult, UnknownApproval
from agentd.store.sansio import Op, Row, execute, fetch_all, fetch_one, pending_turn_row

__all__ = [
    "AWAITING",
    "approval_from_row",
    "awaiting_sessions",
    "awaiting_turn",
    "decide_approval",
    "decode_run",
    "encode_run",
    "end_approvals",
    "expire_approvals",
    "get_approval",
    "list_approvals",
    "next_expiry",
    "park_turn",
    "parked_run",
    "pending_approvals",
    "unpark_for_swap",
]

#: A condition on a turn row aliased ``t``: the turn waits for approvals (not to be run now).
AWAITING = (
    "(EXISTS (SELECT 1 FROM parked_turns p WHERE p.session = t.session AND p.turn = t.id AND p.run <> '')"
    " AND EXISTS (SELECT 1 FROM approvals a WHERE a.session = t.session AND a.turn = t.id AND a.status = 'pending'))"
)
COLUMNS = (
    "id, session, turn, call_id, tool, arguments, parameters, status, reason, requested_at, decided_at, expires_at"
)

_run_decoder = msgspec.json.Decoder(ParkedRun)


def encode_run(run: ParkedRun) -> str:
    return codec.encode_json(run)


def decode_run(text: str) -> ParkedRun:
    return _run_decoder.decode(text)


def approval_from_row(row: Row) -> Approval:
    return Approval(
        id=row["id"],
        session=row["session"],
        turn=row["turn"],
        call_id=row["call_id"],
        tool=row["tool"],
        arguments=codec.decode_arguments(row["arguments"]),
        parameters=codec.decode_arguments(row["parameters"]),
        status=ApprovalStatus(row["status"]),
        reason=row["reason"],
        requested_at=float(row["requested_at"]),
        decided_at=None if row["decided_at"] is None else float(row["decided_at"]),
        expires_at=None if row["expires_at"] is None else float(row["expires_at"]),
    )


def _turn_approvals(session_id: str, turn_id: str, *, pending_only: bool = False) -> Op[list[Approval]]:
    only = " AND status = 'pending'" if pending_only else ""  # a literal: see agentd.store.sansio
    rows = yield from fetch_all(
        f"SELECT {COLUMNS} FROM approvals WHERE session = :session AND turn = :turn{only} ORDER BY n",
        session=session_id,
        turn=turn_id,
    )
    return [approval_from_row(row) for row in rows]


def park_turn(
    session_id: str,
    turn_id: str,
    *,
    run: str,
    model: str,
    requests: Sequence[tuple[str, ApprovalRequest]],
    now: float,
    expires_at: float | None,
    lease: Lease | None,
) -> Op[ParkResult]:
    """``Store.park_turn``: store a run that stopped for approvals and an approval per request
    (``(new id, request)``). A pending approval of the turn for the same tool and arguments (a
    run a restart-turn swap discarded asked for it) is kept, same id; other pending ones of the
    turn are cancelled. Fenced like every write of a running turn."""
    refusal = f"cannot park session {session_id} turn {turn_id}"
    yield from pending_turn_row(session_id, turn_id, refusal, lease)
    waiting = yield from _turn_approvals(session_id, turn_id, pending_only=True)
    # A run a swap discarded left a marker (``run`` empty) with when: approvals decided since
    # (while its re-run ran) are kept with their decision when the re-run asks for the same call.
    marker = yield from fetch_one(
        "SELECT parked_at FROM parked_turns WHERE session = :session AND turn = :turn AND run = ''",
        session=session_id,
        turn=turn_id,
    )
    if marker is not None:
        everything = yield from _turn_approvals(session_id, turn_id)
        waiting += [a for a in everything if a.decided_at is not None and a.decided_at >= float(marker["parked_at"])]
    ids, new = [], []
    for approval_id, request in requests:
        kept = next((a for a in waiting if a.tool == request.tool and a.arguments == request.arguments), None)
        if kept is not None:
            waiting.remove(kept)
            yield from execute("UPDATE approvals SET call_id = :call WHERE id = :id", call=request.call_id, id=kept.id)
            ids.append(kept.id)
            continue
        yield from execute(
            f"INSERT INTO approvals ({COLUMNS}) VALUES (:id, :session, :turn, :call, :tool, :arguments,"
            " :parameters, 'pending', NULL, :now, NULL, :expires_at)",
            id=approval_id,
            session=session_id,
            turn=turn_id,
            call=request.call_id,
            tool=request.tool,
            arguments=codec.encode_json(request.arguments),
            parameters=codec.encode_json(request.parameters),
            now=now,
            expires_at=expires_at,
        )
        ids.append(approval_id)
        new.append(approval_id)
    reason = "restart-turn: the run that asked for it was discarded, and its re-run did not ask for it again"
    for stale in waiting:
        if stale.status is ApprovalStatus.PENDING:
            yield from _cancel(stale.id, reason, now)
    yield from execute(
        "DELETE FROM parked_turns WHERE session = :session AND turn = :turn", session=session_id, turn=turn_id
    )
    yield from execute(
        "INSERT INTO parked_turns (session, turn, run, model, parked_at) VALUES (:session, :turn, :run, :model, :now)",
        session=session_id,
        turn=turn_id,
        run=run,
        model=model,
        now=now,
    )
    stored = {a.id: a for a in (yield from _turn_approvals(session_id, turn_id))}
    return ParkResult(
        approvals=[stored[i] for i in ids],
        new=new,
        cancelled=[stored[s.id] for s in waiting if s.status is ApprovalStatus.PENDING and s.id in stored],
    )


def _cancel(approval_id: str, reason: str, now: float) -> Op[int]:
    return (
        yield from execute(
            "UPDATE approvals SET status = 'cancelled', reason = :reason, decided_at = :now"
            " WHERE id = :id AND status = 'pending'",
            reason=reason,
            now=now,
            id=approval_id,
        )
    )


def end_approvals(session_id: str, turn_id: str, reason: str, now: float) -> Op[None]:
    """Inside the transaction that ends a turn: its parked run dropped, its pending approvals cancelled.

    Approvals are written only by ``park_turn``, which writes the turn's parked run in the same
    transaction, and the run stays (as a marker, if a swap discarded it) until the turn ends: a
    turn without one never parked and has no approval, so most turns end with one statement here.
    """
    parked = yield from execute(
        "DELETE FROM parked_turns WHERE session = :session AND turn = :turn", session=session_id, turn=turn_id
    )
    if not parked:
        return
    yield from execute(
        "UPDATE approvals SET status = 'cancelled', reason = :reason, decided_at = :now"
        " WHERE session = :session AND turn = :turn AND status = 'pending'",
        reason=reason,
        now=now,
        session=session_id,
        turn=turn_id,
    )


def _turn_ready(session_id: str, turn_id: str) -> Op[bool]:
    """Whether the turn has a parked run, is pending, and no approval of it waits any more."""
    row = yield from fetch_one(
        "SELECT 1 AS ready FROM parked_turns p JOIN turns t ON t.session = p.session AND t.id = p.turn"
        " WHERE p.session = :session AND p.turn = :turn AND p.run <> '' AND t.status = 'pending' AND NOT EXISTS"
        " (SELECT 1 FROM approvals a WHERE a.session = p.session AND a.turn = p.turn AND a.status = 'pending')",
        session=session_id,
        turn=turn_id,
    )
    return row is not None


def decide_approval(
    approval_id: str, *, status: str, reason: str | None, arguments: str | None, now: float
) -> Op[tuple[Approval, bool]]:
    """``Store.decide_approval``: one conditional UPDATE, so one decision wins; the approval as
    decided and whether its turn can go on now. UnknownApproval, or AlreadyDecided."""
    row = yield from fetch_one(
        "UPDATE approvals SET status = :status, reason = :reason, decided_at = :now,"
        " arguments = COALESCE(:arguments, arguments) WHERE id = :id AND status = 'pending'"
        f" RETURNING {COLUMNS}",
        status=status,
        reason=reason,
        now=now,
        arguments=arguments,
        id=approval_id,
    )
    if row is None:
        current = yield from fetch_one(f"SELECT {COLUMNS} FROM approvals WHERE id = :id", id=approval_id)
        if current is None:
            raise UnknownApproval(f"no approval {approval_id!r}")
        raise AlreadyDecided(approval_from_row(current))
    approval = approval_from_row(row)
    ready = yield from _turn_ready(approval.session, approval.turn)
    return approval, ready


def expire_approvals(now: float, limit: int, reason: str) -> Op[tuple[list[Approval], list[tuple[str, str]]]]:
    """``Store.expire_approvals``: pending approvals past ``expires_at`` become expired; them, and
    the turns that can go on now."""
    rows = yield from fetch_all(
        "UPDATE approvals SET status = 'expired', reason = :reason, decided_at = :now WHERE status = 'pending'"
        " AND id IN (SELECT id FROM approvals WHERE status = 'pending' AND expires_at IS NOT NULL"
        f" AND expires_at <= :now ORDER BY expires_at LIMIT :limit) RETURNING {COLUMNS}",
        reason=reason,
        now=now,
        limit=limit,
    )
    expired = [approval_from_row(row) for row in rows]
    ready = []
    for session_id, turn_id in dict.fromkeys((a.session, a.turn) for a in expired):
        if (yield from _turn_ready(session_id, turn_id)):
            ready.append((session_id, turn_id))
    return expired, ready


def next_expiry() -> Op[float | None]:
    """``Store.next_expiry``: when the next pending approval expires (None: none will)."""
    row = yield from fetch_one("SELECT MIN(expires_at) AS at FROM approvals WHERE status = 'pending'")
    return None if row is None or row["at"] is None else float(row["at"])


def parked_run(session_id: str, turn_id: str) -> Op[tuple[ParkedRun, list[Approval]] | None]:
    """``Store.parked_run``: the turn's parked run and all its approvals (None: it has no parked run)."""
    row = yield from fetch_one(
        "SELECT run FROM parked_turns WHERE session = :session AND turn = :turn AND run <> ''",
        session=session_id,
        turn=turn_id,
    )
    if row is None:
        return None
    approvals = yield from _turn_approvals(session_id, turn_id)
    return decode_run(row["run"]), approvals


def awaiting_turn(session_id: str) -> Op[str | None]:
    """``Store.awaiting_turn``: the session's turn that awaits approval, if it has one."""
    row = yield from fetch_one(
        f"SELECT t.id FROM turns t WHERE t.session = :session AND t.status = 'pending' AND {AWAITING}",
        session=session_id,
    )
    return None if row is None else str(row["id"])


def awaiting_sessions(session_ids: Sequence[str]) -> Op[set[str]]:
    """``Store.awaiting_sessions``: which of ``session_ids`` have a turn awaiting approval."""
    if not session_ids:
        return set()
    names = {f"s{i}": session_id for i, session_id in enumerate(session_ids)}
    rows = yield from fetch_all(
        f"SELECT t.session FROM turns t WHERE t.status = 'pending' AND t.session IN"
        f" ({', '.join(':' + name for name in names)}) AND {AWAITING}",
        **names,
    )
    return {str(row["session"]) for row in rows}


def get_approval(approval_id: str) -> Op[Approval | None]:
    row = yield from fetch_one(f"SELECT {COLUMNS} FROM approvals WHERE id = :id", id=approval_id)
    return None if row is None else approval_from_row(row)


def list_approvals(status: str | None, session: str | None, limit: int, after: str | None) -> Op[list[Approval]]:
    """``Store.list_approvals``: one page, oldest first, filtered by status and session."""
    start = 0
    if after is not None:
        row = yield from fetch_one("SELECT n FROM approvals WHERE id = :id", id=after)
        if row is None:
            raise UnknownApproval(f"no approval {after!r} to page after")
        start = row["n"]
    where: list[str] = ["n > :start"]
    params: dict[str, Any] = {"start": start, "limit": limit}
    if status is not None:
        where.append("status = :status")
        params["status"] = status
    if session is not None:
        where.append("session = :session")
        params["session"] = session
    rows = yield from fetch_all(
        f"SELECT {COLUMNS} FROM approvals WHERE {' AND '.join(where)} ORDER BY n LIMIT :limit", **params
    )
    return [approval_from_row(row) for row in rows]


def pending_approvals() -> Op[int]:
    """``Store.pending_approvals``: how many wait for a decision."""
    row = yield from fetch_one("SELECT COUNT(*) AS count FROM approvals WHERE status = 'pending'")
    return 0 if row is None else int(row["count"])


def unpark_for_swap(assistant: str, model: str, now: float) -> Op[list[tuple[str, str]]]:
    """``Store.unpark_for_swap``: restart-turn (RFC 0012 §5): the parked runs of turns awaiting
    approval on ``assistant`` that ran on another model are dropped; the turns, to re-run now. Their
    pending approvals stay (a re-run that asks for the same call keeps one); the parked run is
    replaced by a marker (``run`` empty) of when it was discarded."""
    rows = yield from fetch_all(
        "SELECT t.session, t.id FROM turns t JOIN sessions s ON s.id = t.session"
        " JOIN parked_turns pk ON pk.session = t.session AND pk.turn = t.id"
        f" WHERE t.status = 'pending' AND s.state != 'closed' AND s.assistant = :assistant AND pk.model != :model"
        f" AND {AWAITING}",
        assistant=assistant,
        model=model,
    )
    turns = [(row["session"], row["id"]) for row in rows]
    for session_id, turn_id in turns:  # a marker of when, for the re-run (``park_turn``)
        yield from execute(
            "UPDATE parked_turns SET run = '', parked_at = :now WHERE session = :session AND turn = :turn",
            now=now,
            session=session_id,
            turn=turn_id,
        )
    return turns
