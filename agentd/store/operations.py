"""Every store operation, written once, apart from I/O (RFC 0003 §3, RFC 0009 §3–§4, RFC 0008 §5).

One generator per ``Store`` call (the protocol: ``agentd.store.sansio``), in the neutral SQL of
``agentd.store.dialect``, run by each backend inside its own transaction machinery. So the rules
an operation keeps — what it checks and in which order, what it writes, the fence, recognising a
commit that landed — are one piece of code for both backends. Arguments were checked before
(``agentd.store.sqlstore``) and free text made storable by the backend's dialect: an operation
only talks to the database.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

import msgspec

from agentd.budget import TurnStatus, Usage
from agentd.config import Price
from agentd.messages import Message, UserMessage
from agentd.records import PENDING, JournalEntry, StartedTurn, TurnRecord
from agentd.store import codec
from agentd.store.approval_ops import AWAITING, end_approvals
from agentd.store.base import (
    ORPHANS,
    CommittedTurn,
    Lease,
    ReplicaRow,
    SpendRow,
    StoredEntry,
    StoredSession,
    StoreError,
    UnknownSession,
)
from agentd.store.sansio import (
    SESSION_COLUMNS,
    TURN_SELECT,
    WATCHERS,
    Op,
    Row,
    check_fence,
    execute,
    execute_many,
    fenced_turn_row,
    fetch_all,
    fetch_one,
    insert_entries,
    lease_from_row,
    pending_turn_row,
    prune_journal,
    read_session,
    session_from_row,
    session_row,
    started_from_row,
    turn_from_row,
    turn_row,
)

# --------------------------------------------------------------------------- sessions


def create_session(
    session_id: str, *, assistant: str, generation: int, model: str, created_at: float, transcript: Sequence[Message]
) -> Op[StoredSession]:
    """``Store.create_session``: the session row and its initial transcript; StoreError if the id is taken."""
    inserted = yield from execute(
        "INSERT INTO sessions (id, assistant, state, generation, model, created_at, updated_at)"
        " VALUES (:id, :assistant, 'idle', :generation, :model, :created_at, :created_at) ON CONFLICT (id) DO NOTHING",
        id=session_id,
        assistant=assistant,
        generation=generation,
        model=model,
        created_at=created_at,
    )
    if inserted == 0:
        raise StoreError(f"session {session_id} already exists")
    yield from insert_entries(session_id, transcript)
    loaded = yield from read_session(session_id)
    assert loaded is not None
    return loaded


def update_session(session_id: str, fields: dict[str, Any], now: float, lease: Lease | None) -> Op[None]:
    """``Store.update_session``: set ``fields`` (checked by ``codec.session_fields``) and ``updated_at``."""
    where = f"session {session_id}"
    row = yield from session_row(session_id, lock=True)
    if row is None:
        raise UnknownSession(f"{where} is unknown")
    check_fence(row, lease, f"cannot update {where}")
    assignments = "".join(f"{name} = :{name}, " for name in fields)
    yield from execute(
        f"UPDATE sessions SET {assignments}updated_at = :updated_at WHERE id = :id",
        **fields,
        updated_at=now,
        id=session_id,
    )


def load_session(session_id: str) -> Op[StoredSession | None]:
    """``Store.load_session``: the session with its active transcript and all its turns."""
    return (yield from read_session(session_id))


def ended_turn(session_id: str, turn_id: str) -> Op[tuple[TurnRecord, list[StoredEntry]] | None]:
    """``Store.ended_turn``: a turn that ended and its active entries, without the rest of the transcript."""
    row = yield from turn_row(session_id, turn_id)
    record = turn_from_row(row) if row is not None else None
    if not isinstance(record, TurnRecord):
        return None
    entries = yield from fetch_all(
        "SELECT seq, message FROM entries WHERE session = :session AND turn = :turn AND active = {true} ORDER BY seq",
        session=session_id,
        turn=turn_id,
    )
    return record, [StoredEntry(entry["seq"], codec.decode_message(entry["message"])) for entry in entries]


def session_summary(session_id: str) -> Op[StoredSession | None]:
    """``Store.session_summary``: the session's row only."""
    row = yield from session_row(session_id)
    return None if row is None else session_from_row(row)


def transcript(session_id: str, exclude_turn: str | None) -> Op[list[Message]]:
    """``Store.transcript``: the active transcript, ``exclude_turn``'s entries left out."""
    rows = yield from fetch_all(
        "SELECT message FROM entries WHERE session = :session AND active = {true} AND (turn IS NULL OR turn != :turn)"
        " ORDER BY seq",
        session=session_id,
        turn=exclude_turn or "",
    )
    return [codec.decode_message(row["message"]) for row in rows]


#: What ``usage_report`` groups by: the ``turn_spend`` column of each grouping.
USAGE_GROUPS = {"assistant": "assistant", "model": "model", "session": "session"}
_SPEND_COUNTS = ("input_tokens", "output_tokens", "cached_input_tokens", "reasoning_tokens", "requests", "unreported")
_SPEND_PRICE = ("currency", "input_price", "output_price", "cached_input_price")


def usage_report(
    group_by: str, since: float | None, until: float | None, limit: int | None = None, after: str | None = None
) -> Op[list[SpendRow]]:
    """``Store.usage_report``: token sums per group, model and price, added up by the database
    (the ``turn_spend_ended`` index finds the time range); costs are the caller's exact arithmetic.
    ``limit``: only the first ``limit`` groups in key order after ``after`` (a page)."""
    column = USAGE_GROUPS[group_by]
    in_range = [
        cond for cond, value in (("ended_at >= :since", since), ("ended_at < :until", until)) if value is not None
    ]
    if after is not None:
        in_range.append(f"{column} > :after")
    conditions = list(in_range)
    if limit is not None:  # the page's groups: the first ``limit`` keys (the grouping's index gives their order)
        conditions.append(
            f"{column} IN (SELECT DISTINCT {column} FROM turn_spend"
            f"{' WHERE ' + ' AND '.join(in_range) if in_range else ''} ORDER BY {column} LIMIT :limit)"
        )
    where = " AND ".join(conditions)
    sums = ", ".join(f"SUM({name}) AS {name}" for name in _SPEND_COUNTS)
    # Grouped in the order of that grouping's index (SQLite reads it without sorting).
    keys = ", ".join(dict.fromkeys((column, "model", *_SPEND_PRICE)))
    rows = yield from fetch_all(
        f"SELECT {column} AS grp, model, {', '.join(_SPEND_PRICE)}, {sums} FROM turn_spend"
        f"{' WHERE ' + where if where else ''} GROUP BY {keys}",
        since=since,
        until=until,
        after=after,
        limit=limit,
    )
    prices: dict[tuple[Any, ...], Price | None] = {}  # few distinct prices, many rows: each parsed once
    return [_spend_row(row, prices) for row in rows]


def _spend_row(row: Row, prices: dict[tuple[Any, ...], Price | None]) -> SpendRow:
    # int(): PostgreSQL sums BIGINTs as NUMERIC (psycopg's Decimal).
    usage = Usage(*(int(row[name]) for name in _SPEND_COUNTS))
    key = (row["model"], *(row[name] for name in _SPEND_PRICE))
    if key not in prices:
        prices[key] = None
        if row["currency"] is not None:
            prices[key] = Price(
                model=row["model"],
                currency=row["currency"],
                input_per_mtok=Decimal(row["input_price"]),
                output_per_mtok=Decimal(row["output_price"]),
                cached_input_per_mtok=None if row["cached_input_price"] is None else Decimal(row["cached_input_price"]),
            )
    return SpendRow(key=row["grp"], model=row["model"], usage=usage, price=prices[key])


def list_sessions(
    limit: int, after: str | None, state: str | None = None, assistant: str | None = None
) -> Op[list[StoredSession]]:
    """``Store.list_sessions``: one page in creation order (``{order}``), with each session's turn count,
    of the sessions in ``state`` (checked before) on ``assistant`` when given."""
    start = 0
    if after is not None:
        row = yield from fetch_one("SELECT {order} AS n FROM sessions WHERE id = :id", id=after)
        if row is None:
            raise UnknownSession(f"no session {after!r} to page after")
        start = row["n"]
    where, params = "", dict[str, Any]()
    if state is not None:
        where += " AND state = :state"
        params["state"] = state
    if assistant is not None:
        where += " AND assistant = :assistant"
        params["assistant"] = assistant
    rows = yield from fetch_all(
        f"SELECT {SESSION_COLUMNS}, (SELECT COUNT(*) FROM turns WHERE turns.session = sessions.id) AS turns"
        f" FROM sessions WHERE {{order}} > :start{where} ORDER BY {{order}} LIMIT :limit",
        start=start,
        limit=limit,
        **params,
    )
    return [msgspec.structs.replace(session_from_row(row), turn_count=row["turns"]) for row in rows]


def interrupted_turns() -> Op[list[tuple[StoredSession, StartedTurn]]]:
    """``Store.interrupted_turns``: every pending turn of a session that is not closed, oldest first
    (but those that await approval: nothing runs them until they are decided, RFC 0012 §4)."""
    turns = yield from fetch_all(
        f"{TURN_SELECT} WHERE t.status = 'pending' AND NOT {AWAITING} ORDER BY t.started_at, t.n"
    )
    if not turns:
        return []
    rows = yield from fetch_all(
        f"SELECT {SESSION_COLUMNS} FROM sessions WHERE state != 'closed'"
        " AND id IN (SELECT session FROM turns WHERE status = 'pending')",
    )
    sessions = {row["id"]: row for row in rows}
    return [
        (session_from_row(sessions[turn["session"]]), started_from_row(turn))
        for turn in turns
        if turn["session"] in sessions
    ]


def sessions_of_turn(turn_id: str) -> Op[list[str]]:
    """``Store.sessions_of_turn``: the sessions that have a turn with this id (one, unless ids collide)."""
    rows = yield from fetch_all("SELECT session FROM turns WHERE id = :id ORDER BY n", id=turn_id)
    return [row["session"] for row in rows]


def session_counts() -> Op[dict[str, int]]:
    """``Store.session_counts``: sessions per state, every state named."""
    counts = dict.fromkeys(sorted(codec.SESSION_STATES), 0)
    rows = yield from fetch_all("SELECT state, COUNT(*) AS count FROM sessions GROUP BY state")
    counts.update({row["state"]: row["count"] for row in rows})
    return counts


def open_sessions_by_assistant() -> Op[dict[str, int]]:
    """``Store.open_sessions_by_assistant``: sessions that are not closed, per assistant."""
    rows = yield from fetch_all(
        "SELECT assistant, COUNT(*) AS count FROM sessions WHERE state != 'closed' GROUP BY assistant"
    )
    return {row["assistant"]: row["count"] for row in rows}


# --------------------------------------------------------------------------- turns


@functools.cache
def _update_turn_sql(columns: tuple[str, ...]) -> str:
    """The UPDATE that sets ``columns`` of the turn row ``:n`` (made once per set of columns)."""
    return f"UPDATE turns SET {', '.join(f'{name} = :{name}' for name in columns)} WHERE n = :n"


@functools.cache
def _insert_sql(table: str, columns: tuple[str, ...]) -> str:
    """The INSERT of one row of ``columns`` into ``table`` (made once per table and columns)."""
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join(':' + name for name in columns)})"


def begin_turn(
    session_id: str,
    turn_id: str,
    message: UserMessage | None,
    started_at: float,
    *,
    relaxed: str | None,
    trace: str | None = None,
) -> Op[int | None]:
    """``Store.begin_turn`` (``message`` already tagged with the turn); ``relaxed``: the dialect's
    statement that lets this commit return before it is synced, when the caller asked for that."""
    where = f"session {session_id} turn {turn_id}"
    if relaxed is not None:
        yield from execute(relaxed)
    row = yield from session_row(session_id, lock=True)
    if row is None:
        raise UnknownSession(f"cannot begin {where}: the session is unknown")
    if row["state"] == "closed":
        raise StoreError(f"cannot begin {where}: the session is closed")
    # Both refusals in one statement (a round trip less on PostgreSQL), each half an index search.
    clashes = yield from fetch_all(
        "SELECT id, 1 AS pending FROM turns WHERE session = :session AND status = 'pending'"
        " UNION ALL SELECT id, 0 AS pending FROM turns WHERE session = :session AND id = :id",
        session=session_id,
        id=turn_id,
    )
    for clash in sorted(clashes, key=lambda row: -row["pending"]):
        if clash["pending"]:
            raise StoreError(f"cannot begin {where}: turn {clash['id']} is still pending")
        raise StoreError(f"cannot begin {where}: the session already has a turn with this id")
    seq = None if message is None else (yield from insert_entries(session_id, [message]))[0]
    yield from execute(
        "INSERT INTO turns (session, id, status, message_seq, started_at, trace)"
        " VALUES (:session, :id, 'pending', :seq, :started_at, :trace)",
        session=session_id,
        id=turn_id,
        seq=seq,
        started_at=started_at,
        trace=trace,
    )
    yield from execute(
        "UPDATE sessions SET state = 'running', updated_at = :now WHERE id = :id", now=started_at, id=session_id
    )
    return seq


def commit_turn(
    session_id: str,
    record: TurnRecord,
    status: TurnStatus,
    columns: dict[str, Any],
    *,
    assistant: str,
    messages: Sequence[Message],
    rewrite: bool,
    model: str | None,
    lease: Lease | None,
) -> Op[tuple[CommittedTurn, bool]]:
    """``Store.commit_turn``: the committed turn, and whether an earlier attempt had written it already.

    ``columns`` is the turn row's ended state as stored (``codec.ended_turn_columns``, its error
    made storable); ``messages`` the new entries, the whole new active transcript if ``rewrite``.
    """
    refusal = f"cannot commit session {session_id} turn {record.id}"
    turn = yield from fenced_turn_row(session_id, record.id, refusal, lease)
    if turn["status"] == PENDING:
        seqs = yield from _write_commit(session_id, turn, columns, messages, rewrite, assistant, model)
        rows = codec.spend_rows(session_id, record)
        if rows:
            yield from execute_many(
                _insert_sql("turn_spend", tuple(rows[0])),
                rows,
            )
    else:  # ended already: by this very commit, whose answer was lost with its connection?
        landed = yield from _landed_commit(session_id, turn, columns, messages, rewrite)
        if landed is None:
            raise codec.not_pending(refusal, turn["status"])
        seqs = landed
    stored = msgspec.structs.replace(record, status=status, started_at=turn["started_at"])
    return CommittedTurn(stored, seqs), turn["status"] != PENDING


def _write_commit(
    session_id: str,
    turn: Row,
    columns: dict[str, Any],
    messages: Sequence[Message],
    rewrite: bool,
    assistant: str,
    model: str | None,
) -> Op[tuple[int, ...]]:
    """Write a pending turn's results in the caller's transaction: its entries (``rewrite``: as the
    new active transcript), its row, its session's assistant, model and state; delete its journal."""
    if rewrite:
        yield from execute(
            "UPDATE entries SET active = {false} WHERE session = :session AND active = {true}", session=session_id
        )
    # While a turn is pending nothing else appends to its session (``_first_commit_seq`` relies on
    # it too), so its input message is the last entry: no need to read where the entries end.
    last = turn["message_seq"]
    seqs = yield from insert_entries(session_id, messages, last=None if last is None else int(last))
    yield from execute(_update_turn_sql(tuple(columns)), **columns, n=turn["n"])
    yield from execute(
        "UPDATE sessions SET assistant = :assistant, updated_at = :ended_at, model = COALESCE(:model, model),"
        " state = CASE state WHEN 'closed' THEN 'closed' ELSE 'idle' END WHERE id = :id",
        assistant=assistant,
        ended_at=columns["ended_at"],
        model=model,
        id=session_id,
    )
    yield from prune_journal(session_id, turn["id"])
    yield from end_approvals(session_id, turn["id"], f"the turn ended ({columns['status']})", columns["ended_at"])
    return tuple(seqs)


def _landed_commit(
    session_id: str, turn: Row, columns: dict[str, Any], messages: Sequence[Message], rewrite: bool
) -> Op[tuple[int, ...] | None]:
    """The seqs an earlier commit of these very results wrote, or None if the turn ended otherwise
    (``codec.landed_commit_seqs``). Reads only; the caller holds the session's write lock."""
    first = yield from _first_commit_seq(session_id, turn, rewrite)
    rows: list[Row] = []
    if first is not None:
        rows = yield from fetch_all(
            "SELECT e.seq, e.active, e.message, EXISTS (SELECT 1 FROM turns t WHERE t.session = e.session"
            " AND t.message_seq = e.seq) AS input FROM entries e WHERE e.session = :session AND e.seq >= :first"
            " ORDER BY e.seq LIMIT :limit",
            session=session_id,
            first=first,
            limit=len(messages) + 1,
        )
    entries = [codec.EntryRow(row["seq"], bool(row["active"]), row["message"], bool(row["input"])) for row in rows]
    encoded = [codec.encode_message(message) for message in messages]
    stored = {name: turn[name] for name in columns}  # what landed_commit_seqs compares
    return codec.landed_commit_seqs(stored, columns, entries, encoded)


def _first_commit_seq(session_id: str, turn: Row, rewrite: bool) -> Op[int | None]:
    """Where the commit that ended ``turn`` started writing entries (None: no entry says where).

    While a turn is pending nothing else writes the session's entries, so its commit wrote right
    after its input message. An opener turn has none: its commit wrote the first entry tagged with
    the turn or, when it rewrote the transcript, the first entry that is still active. A wrong
    guess only makes ``codec.landed_commit_seqs`` find other entries, and refuse.
    """
    if turn["message_seq"] is not None:
        return int(turn["message_seq"]) + 1
    where = "active = {true}" if rewrite else "turn = :turn"
    row = yield from fetch_one(
        f"SELECT MIN(seq) AS first FROM entries WHERE session = :session AND {where}",
        session=session_id,
        turn=turn["id"],
    )
    return None if row is None or row["first"] is None else int(row["first"])


def abandon_turn(
    session_id: str,
    turn_id: str,
    *,
    status: str,
    error: str | None,
    ended_at: float,
    lease: Lease | None,
    spent: TurnRecord | None = None,
) -> Op[None]:
    """``Store.abandon_turn``: end a pending turn without results; a running session becomes idle.
    ``spent``: what the turn spent before it ended (its row's usage columns and its ``turn_spend``
    rows), like a commit writes them."""
    refusal = f"cannot abandon session {session_id} turn {turn_id}"
    turn = yield from pending_turn_row(session_id, turn_id, refusal, lease)
    columns: dict[str, Any] = {"status": status, "error": error, "ended_at": ended_at}
    if spent is not None:
        columns = codec.ended_turn_columns(spent, TurnStatus(status)) | columns
    yield from execute(_update_turn_sql(tuple(columns)), **columns, n=turn["n"])
    rows = codec.spend_rows(session_id, spent) if spent is not None else []
    if rows:
        yield from execute_many(
            _insert_sql("turn_spend", tuple(rows[0])),
            rows,
        )
    yield from prune_journal(session_id, turn_id)
    ended = f"the turn ended ({status}): {error}" if error else f"the turn ended ({status})"
    yield from end_approvals(session_id, turn_id, ended, ended_at)
    yield from execute(
        "UPDATE sessions SET updated_at = :ended_at, state = CASE state WHEN 'running' THEN 'idle' ELSE state END"
        " WHERE id = :id",
        ended_at=ended_at,
        id=session_id,
    )


def pending_turn(session_id: str) -> Op[StartedTurn | None]:
    """``Store.pending_turn``: the session's pending turn with its input; UnknownSession if the session is unknown."""
    if (yield from session_row(session_id)) is None:
        raise UnknownSession(f"session {session_id} is unknown")
    row = yield from fetch_one(f"{TURN_SELECT} WHERE t.session = :session AND t.status = 'pending'", session=session_id)
    return None if row is None else started_from_row(row)


def request_cancel(session_id: str, turn_id: str) -> Op[bool]:
    """``Store.request_cancel``: mark the pending turn as asked to cancel; False if it is not pending."""
    updated = yield from execute(
        "UPDATE turns SET cancel_requested = {true} WHERE session = :session AND id = :id AND status = 'pending'",
        session=session_id,
        id=turn_id,
    )
    return updated == 1


# --------------------------------------------------------------------------- the tool journal (RFC 0008 §5)


def journal_start(
    session_id: str, turn_id: str, seq: int, *, call: str, tool: str, arguments: str, now: float, lease: Lease | None
) -> Op[None]:
    """``Store.journal_start``: a started call of a pending turn, once (``arguments`` as stored)."""
    where = f"session {session_id} turn {turn_id} call {seq}"
    yield from pending_turn_row(session_id, turn_id, f"cannot journal {where}", lease)
    inserted = yield from execute(
        "INSERT INTO journal (session, turn, seq, call, tool, arguments, started_at)"
        " VALUES (:session, :turn, :seq, :call, :tool, :arguments, :now) ON CONFLICT DO NOTHING",
        session=session_id,
        turn=turn_id,
        seq=seq,
        call=call,
        tool=tool,
        arguments=arguments,
        now=now,
    )
    if inserted != 1:
        raise StoreError(f"cannot journal {where}: it is journaled already")


def journal_finish(
    session_id: str, turn_id: str, seq: int, *, content: str | None, is_error: bool, now: float, lease: Lease | None
) -> Op[None]:
    """``Store.journal_finish``: the result of a started call, once."""
    refusal = f"cannot journal the result of session {session_id} turn {turn_id} call {seq}"
    yield from pending_turn_row(session_id, turn_id, refusal, lease)
    updated = yield from execute(
        "UPDATE journal SET finished_at = :now, content = :content, is_error = :is_error"
        " WHERE session = :session AND turn = :turn AND seq = :seq AND finished_at IS NULL",
        now=now,
        content=content,
        is_error=is_error,
        session=session_id,
        turn=turn_id,
        seq=seq,
    )
    if updated != 1:
        raise StoreError(f"{refusal}: no such call is waiting for its result")


def journal_entries(session_id: str, turn_id: str) -> Op[list[JournalEntry]]:
    """``Store.journal_entries``: a turn's journaled calls in order."""
    rows = yield from fetch_all(
        "SELECT seq, call, tool, arguments, finished_at, content, is_error FROM journal"
        " WHERE session = :session AND turn = :turn ORDER BY seq",
        session=session_id,
        turn=turn_id,
    )
    return [
        JournalEntry(
            seq=row["seq"],
            call=row["call"],
            tool=row["tool"],
            arguments=codec.decode_arguments(row["arguments"]),
            finished=row["finished_at"] is not None,
            content=row["content"] or "",
            is_error=bool(row["is_error"]),
        )
        for row in rows
    ]


# --------------------------------------------------------------------------- leases (RFC 0009 §3)


def claim(session_id: str, replica: str, ttl: float, turn: str | None) -> Op[Lease | None]:
    """``Store.claim``. One statement: it waits for the row's lock (PostgreSQL), then checks the
    conditions on the newest row; when it changed nothing, a second read says why."""
    what = f"cannot claim session {session_id}"
    turn_pending = (
        ""
        if turn is None
        else " AND EXISTS (SELECT 1 FROM turns t WHERE t.session = :id AND t.id = :turn AND t.status = 'pending')"
    )
    row = yield from fetch_one(
        "UPDATE sessions SET owner = :replica, fence = CASE WHEN owner = :replica THEN fence ELSE fence + 1 END,"
        " lease_expires = {now} + :ttl WHERE id = :id AND state != 'closed'"
        " AND (owner IS NULL OR owner = :replica OR lease_expires <= {now})"
        f"{turn_pending} RETURNING fence, lease_expires, {WATCHERS}",
        replica=replica,
        ttl=float(ttl),
        id=session_id,
        turn=turn,
    )
    if row is not None:
        return lease_from_row(session_id, replica, row)
    current = yield from session_row(session_id)
    if current is None:
        raise UnknownSession(f"{what}: the session is unknown")
    if current["state"] == "closed":
        raise StoreError(f"{what}: the session is closed")
    return None  # another replica's lease has not expired, or the turn is no longer pending


def renew(replica: str, ttl: float) -> Op[dict[str, Lease]]:
    """``Store.renew``: extend every lease ``replica`` holds."""
    rows = yield from fetch_all(
        "UPDATE sessions SET lease_expires = {now} + :ttl WHERE owner = :replica RETURNING id, fence, lease_expires",
        ttl=float(ttl),
        replica=replica,
    )
    return {row["id"]: lease_from_row(row["id"], replica, row, watchers=False) for row in rows}


def release(lease: Lease, notice: str | None) -> Op[bool]:
    """``Store.release``; ``notice``: the dialect's statement that wakes other replicas' failover
    scans for the pending turn a released session leaves behind (a drain), if it has one."""
    released = yield from execute(
        "UPDATE sessions SET owner = NULL, lease_expires = NULL WHERE id = :id AND owner = :owner AND fence = :token",
        id=lease.session,
        owner=lease.replica,
        token=lease.token,
    )
    if not released and (yield from session_row(lease.session)) is None:
        raise UnknownSession(f"cannot release session {lease.session}: the session is unknown")
    if released and notice is not None:
        yield from execute(notice, channel=ORPHANS, session=lease.session)
    return bool(released)


def claim_orphaned(replica: str, ttl: float, limit: int) -> Op[list[Lease]]:
    """``Store.claim_orphaned``: the failover scan, oldest pending turn first; rows another scan
    holds are skipped, not waited for (``{skip_locked}``)."""
    pending_turn_of = "(SELECT t.{0} FROM turns t WHERE t.session = sessions.id AND t.status = 'pending') AS {0}"
    rows = yield from fetch_all(
        "WITH orphans AS ("
        " SELECT s.id FROM sessions s JOIN turns t ON t.session = s.id AND t.status = 'pending'"
        " WHERE s.state != 'closed' AND (s.owner IS NULL OR (s.owner != :replica AND s.lease_expires <= {now}))"
        f" AND NOT {AWAITING}"
        " ORDER BY t.started_at, t.n LIMIT :limit{skip_locked})"
        " UPDATE sessions SET owner = :replica, fence = sessions.fence + 1, lease_expires = {now} + :ttl"
        " FROM orphans WHERE sessions.id = orphans.id"
        f" RETURNING sessions.id, sessions.fence, sessions.lease_expires, {pending_turn_of.format('started_at')},"
        f" {pending_turn_of.format('n')}, {WATCHERS}",
        replica=replica,
        limit=limit,
        ttl=float(ttl),
    )
    ordered = sorted(rows, key=lambda row: (row["started_at"], row["n"]))  # RETURNING has no order
    return [lease_from_row(row["id"], replica, row) for row in ordered]


def lease_of(session_id: str) -> Op[Lease | None]:
    """``Store.lease_of``: the live lease, by the lease clock."""
    row = yield from fetch_one(
        "SELECT owner, fence, lease_expires, {now} AS now FROM sessions WHERE id = :id", id=session_id
    )
    if row is None:
        raise UnknownSession(f"session {session_id} is unknown")
    if row["owner"] is None or row["lease_expires"] <= row["now"]:
        return None
    return Lease(session=session_id, replica=row["owner"], token=row["fence"], expires_at=row["lease_expires"])


# --------------------------------------------------------------------------- the replica registry (RFC 0009 §7)


def _replica_from_row(row: Row) -> ReplicaRow:
    return ReplicaRow(
        id=row["id"], generation=row["generation"], sessions=row["sessions"], seen_at=float(row["seen_at"])
    )


def beat(replica: str, generation: int, sessions: int) -> Op[ReplicaRow]:
    """``Store.beat``: the replica's row, created or replaced, seen now by the lease clock."""
    row = yield from fetch_one(
        "INSERT INTO replicas (id, generation, sessions, seen_at) VALUES (:id, :generation, :sessions, {now})"
        " ON CONFLICT (id) DO UPDATE SET generation = excluded.generation,"
        " sessions = excluded.sessions, seen_at = excluded.seen_at"
        " RETURNING id, generation, sessions, seen_at",
        id=replica,
        generation=generation,
        sessions=sessions,
    )
    assert row is not None
    return _replica_from_row(row)


def live_replicas(max_age: float) -> Op[list[ReplicaRow]]:
    """``Store.live_replicas``: the replicas seen within ``max_age`` seconds, by id."""
    rows = yield from fetch_all(
        "SELECT id, generation, sessions, seen_at FROM replicas WHERE seen_at > {now} - :max_age ORDER BY id",
        max_age=float(max_age),
    )
    return [_replica_from_row(row) for row in rows]


def watch(replica: str, sessions: Sequence[str], ttl: float) -> Op[None]:
    """``Store.watch``: ``replica``'s watches of ``sessions`` until ``ttl`` from now; expired ones deleted."""
    yield from execute_many(
        "INSERT INTO watches (session, replica, until) VALUES (:session, :replica, {now} + :ttl)"
        " ON CONFLICT (session, replica) DO UPDATE SET until = excluded.until",
        [{"session": session, "replica": replica, "ttl": float(ttl)} for session in sessions],
    )
    yield from execute("DELETE FROM watches WHERE until <= {now}")


def unwatch(replica: str, sessions: Sequence[str]) -> Op[None]:
    """``Store.unwatch``: forget ``replica``'s watches of ``sessions``."""
    yield from execute_many(
        "DELETE FROM watches WHERE replica = :replica AND session = :session",
        [{"replica": replica, "session": session} for session in sessions],
    )
