"""The building blocks of the store's operations, apart from I/O (``agentd.store.operations``).

An operation is a generator (``Op``): it yields a ``Query`` — a statement in the neutral form of
``agentd.store.dialect``, its named parameters, and what it wants back — and is sent the answer:
a row (or None) for ``ONE``, a list of rows for ``ALL``, the number of rows changed for ``RUN``,
None for ``MANY`` (one statement run once per parameter set). It returns the operation's result,
or raises a ``StoreError`` that the caller hears as is. A row is read by column name only
(``Row``): a ``sqlite3.Row`` and psycopg's dict rows both are one.

A status is written into the SQL as a literal (``status = 'pending'``), never bound: SQLite uses a
partial index on a status (``turns_one_pending``) for a bound value only by preparing the statement
again on every run (``tests/test_store_plans.py`` keeps every turn's statement so).

A backend runs an operation with ``run`` (sync: SQLite, in its worker thread) or ``run_async``
(PostgreSQL), giving the function that answers one query on its connection; everything else
here — the row decoders and the steps several operations share (the fence, appending entries,
reading a session) — is pure.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Generator, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, TypeAlias, TypeVar

from agentd.budget import TurnStatus, Usage
from agentd.messages import Message, UserMessage
from agentd.records import PENDING, StartedTurn, TurnRecord
from agentd.store import codec
from agentd.store.base import Lease, LeaseLost, StoredEntry, StoredSession, StoreError, UnknownSession

__all__ = [
    "SESSION_COLUMNS",
    "TURN_COLUMNS",
    "TURN_SELECT",
    "WATCHERS",
    "Kind",
    "Op",
    "Query",
    "Row",
    "check_fence",
    "execute",
    "execute_many",
    "fenced_turn_row",
    "fetch_all",
    "fetch_one",
    "insert_entries",
    "lease_from_row",
    "pending_turn_row",
    "prune_journal",
    "read_session",
    "run",
    "run_async",
    "session_from_row",
    "session_row",
    "started_from_row",
    "turn_from_row",
    "turn_row",
]

T = TypeVar("T")


class Row(Protocol):
    """A result row, read by column name (``sqlite3.Row``, psycopg's ``dict_row``)."""

    def __getitem__(self, key: str, /) -> Any: ...


class Kind(enum.Enum):
    """What a query's answer is."""

    ONE = "one"  # the first row, or None
    ALL = "all"  # every row
    RUN = "run"  # how many rows it changed
    MANY = "many"  # the statement once per parameter set; None


class Query(NamedTuple):
    """One statement for the driver to run: neutral SQL, its named parameters, what it answers.

    ``MANY`` runs it once per parameter set of ``each`` (iterated once, as it runs: a message is
    encoded just before its row is written); ``params`` is for the others.
    """

    kind: Kind
    sql: str
    params: Mapping[str, Any]
    each: Iterable[Mapping[str, Any]] = ()


Op: TypeAlias = Generator[Query, Any, T]


def fetch_one(sql: str, **params: Any) -> Op[Row | None]:
    """The first row ``sql`` reads, or None."""
    row: Row | None = yield Query(Kind.ONE, sql, params)
    return row


def fetch_all(sql: str, **params: Any) -> Op[list[Row]]:
    """Every row ``sql`` reads."""
    rows: list[Row] = yield Query(Kind.ALL, sql, params)
    return rows


def execute(sql: str, **params: Any) -> Op[int]:
    """How many rows ``sql`` changed."""
    count: int = yield Query(Kind.RUN, sql, params)
    return count


def execute_many(sql: str, each: Iterable[Mapping[str, Any]]) -> Op[None]:
    """``sql`` once per parameter set of ``each``."""
    yield Query(Kind.MANY, sql, {}, each)


def run(op: Op[T], answer: Callable[[Query], Any]) -> T:
    """Run ``op`` to its end, each of its queries answered by ``answer`` (a sync driver's)."""
    try:
        query = next(op)
        while True:
            query = op.send(answer(query))
    except StopIteration as stop:
        result: T = stop.value
        return result
    finally:
        op.close()  # a query that raised leaves the generator suspended: end it now, not at collection


async def run_async(op: Op[T], answer: Callable[[Query], Awaitable[Any]]) -> T:
    """``run`` for an async driver: each query is answered by awaiting ``answer``."""
    reply: Any = None
    try:
        while True:
            reply = await answer(op.send(reply))
    except StopIteration as stop:
        result: T = stop.value
        return result
    finally:
        op.close()


# --------------------------------------------------------------------------- rows


SESSION_COLUMNS = "id, assistant, state, generation, model, created_at, updated_at, owner, lease_expires, fence"
# A turn with its input message (for a pending turn, which has no record yet).
TURN_COLUMNS = (
    "t.n, t.session, t.id, t.status, t.message_seq, t.models, t.steps, t.restarts, t.discarded,"
    " t.input_tokens, t.output_tokens, t.started_at, t.ended_at, t.error, t.cancel_requested, t.spend, t.trace"
)
TURN_SELECT = (
    f"SELECT {TURN_COLUMNS}, CASE WHEN t.status = 'pending' THEN e.message END AS input"
    " FROM turns t LEFT JOIN entries e ON e.session = t.session AND e.seq = t.message_seq"
)
#: A claim's column: the other replicas watching the claimed session (``Lease.watchers``).
WATCHERS = (
    "{words(}SELECT w.replica AS value FROM watches w WHERE w.session = sessions.id AND w.replica <> :replica"
    " AND w.until > {now} ORDER BY w.replica{)words} AS watchers"
)


def session_from_row(
    row: Row, transcript: list[StoredEntry] | None = None, turns: list[TurnRecord | StartedTurn] | None = None
) -> StoredSession:
    return StoredSession(
        id=row["id"],
        assistant=row["assistant"],
        state=row["state"],
        generation=row["generation"],
        model=row["model"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        transcript=transcript or [],
        turns=turns or [],
        turn_count=len(turns or []),
    )


def turn_from_row(row: Row) -> TurnRecord | StartedTurn:
    """A turn row of ``TURN_SELECT``: its record, or the started turn while it is pending."""
    if row["status"] == PENDING:
        return started_from_row(row)
    spend = codec.decode_spend(row["spend"])
    return TurnRecord(
        id=row["id"],
        status=TurnStatus(row["status"]),
        models=codec.decode_models(row["models"]),
        steps=row["steps"],
        restarts=row["restarts"],
        discarded=codec.decode_discarded(row["discarded"]),
        usage=spend.usage if spend.usage is not None else Usage(row["input_tokens"], row["output_tokens"]),
        started_at=row["started_at"],
        ended_at=row["ended_at"],
        error=row["error"],
        cost=spend.cost,
        by_model=spend.by_model,
    )


def started_from_row(row: Row) -> StartedTurn:
    message: UserMessage | None = None
    if row["input"] is not None:
        decoded = codec.decode_message(row["input"])
        if not isinstance(decoded, UserMessage):
            raise StoreError(f"session {row['session']} turn {row['id']}: its input entry is not a user message")
        message = decoded
    return StartedTurn(
        id=row["id"],
        message=message,
        started_at=row["started_at"],
        cancel_requested=bool(row["cancel_requested"]),
        trace=codec.decode_trace(row["trace"]),
    )


def lease_from_row(session: str, replica: str, row: Row, *, watchers: bool = True) -> Lease:
    """A lease a claim or renewal wrote (``RETURNING fence, lease_expires``, and ``WATCHERS`` but
    for a renewal)."""
    words = row["watchers"] if watchers else None
    return Lease(
        session=session,
        replica=replica,
        token=row["fence"],
        expires_at=float(row["lease_expires"]),  # SQLite's RETURNING gives a whole number as an int
        watchers=tuple(words.split()) if words else (),
    )


# --------------------------------------------------------------------------- shared steps


def session_row(session_id: str, *, lock: bool = False) -> Op[Row | None]:
    """The session's row; with ``lock``, for a write that changes it (the writes of one session queue there)."""
    lock_clause = "{lock}" if lock else ""
    return (yield from fetch_one(f"SELECT {SESSION_COLUMNS} FROM sessions WHERE id = :id{lock_clause}", id=session_id))


def turn_row(session_id: str, turn_id: str) -> Op[Row | None]:
    return (
        yield from fetch_one(f"{TURN_SELECT} WHERE t.session = :session AND t.id = :id", session=session_id, id=turn_id)
    )


def check_fence(session: Row, lease: Lease | None, refusal: str) -> None:
    """The fence of a write (RFC 0009 §4): LeaseLost unless ``lease`` is None or the session's current lease.

    ``session`` was read under the lock a claim needs too (SQLite's write lock; PostgreSQL's row
    lock, ``{lock}``): no claim can come between this check and the write's commit.
    """
    if lease is None:
        return
    if lease.session != session["id"]:
        raise StoreError(f"{refusal}: the lease given is for session {lease.session}")
    if session["owner"] != lease.replica or session["fence"] != lease.token:
        raise LeaseLost(lease, refusal, holder=session["owner"], holder_token=session["fence"])


def fenced_turn_row(session_id: str, turn_id: str, refusal: str, lease: Lease | None) -> Op[Row]:
    """The turn's row (``TURN_COLUMNS``), whatever its status, if the session and turn exist and
    ``lease`` (if any) is current; else UnknownSession, LeaseLost or StoreError(``refusal``: why).
    Locks the session's row."""
    session = yield from session_row(session_id, lock=True)
    if session is None:
        raise UnknownSession(f"{refusal}: the session is unknown")
    check_fence(session, lease, refusal)
    # Its columns only: a write of the turn never reads its input message (the join copies it).
    turn = yield from fetch_one(
        f"SELECT {TURN_COLUMNS} FROM turns t WHERE t.session = :session AND t.id = :id", session=session_id, id=turn_id
    )
    if turn is None:
        raise StoreError(f"{refusal}: no such turn")
    return turn


def pending_turn_row(session_id: str, turn_id: str, refusal: str, lease: Lease | None) -> Op[Row]:
    """``fenced_turn_row``, and StoreError(``refusal``) unless the turn is pending."""
    turn = yield from fenced_turn_row(session_id, turn_id, refusal, lease)
    if turn["status"] != PENDING:
        raise codec.not_pending(refusal, turn["status"])
    return turn


def insert_entries(session_id: str, messages: Sequence[Message], *, last: int | None = None) -> Op[list[int]]:
    """Append ``messages`` as active entries after the session's highest seq; their seqs.

    ``last``: that highest seq when the caller knows it (else it is read). The caller holds the
    session's write lock, so no other transaction appends meanwhile. Each message is encoded just
    before its row is written, inside the caller's transaction.
    """
    if not messages:
        return []
    if last is None:
        row = yield from fetch_one(
            "SELECT COALESCE(MAX(seq), 0) AS last FROM entries WHERE session = :session", session=session_id
        )
        assert row is not None
        last = int(row["last"])
    rows = (
        {"session": session_id, "seq": last + offset, "turn": message.turn, "message": codec.encode_message(message)}
        for offset, message in enumerate(messages, start=1)
    )
    yield from execute_many(
        "INSERT INTO entries (session, seq, turn, active, message) VALUES (:session, :seq, :turn, {true}, :message)",
        rows,
    )
    return list(range(last + 1, last + 1 + len(messages)))


def prune_journal(session_id: str, turn_id: str) -> Op[int]:
    """Delete a turn's journal: it ended, so nothing will run it again. Inside the ending transaction."""
    return (
        yield from execute(
            "DELETE FROM journal WHERE session = :session AND turn = :turn", session=session_id, turn=turn_id
        )
    )


def read_session(session_id: str) -> Op[StoredSession | None]:
    row = yield from session_row(session_id)
    if row is None:
        return None
    entries = yield from fetch_all(
        "SELECT seq, message FROM entries WHERE session = :session AND active = {true} ORDER BY seq", session=session_id
    )
    transcript = [StoredEntry(entry["seq"], codec.decode_message(entry["message"])) for entry in entries]
    turns = yield from fetch_all(f"{TURN_SELECT} WHERE t.session = :session ORDER BY t.n", session=session_id)
    return session_from_row(row, transcript, [turn_from_row(turn) for turn in turns])
