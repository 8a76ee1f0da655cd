"""The PostgreSQL store (RFC 0009): the same store on a database several replicas share.

psycopg 3 (async, on anyio's asyncio backend) through a ``psycopg_pool`` connection pool. It keeps
the rules of ``agentd.store.base``; what is PostgreSQL's own:

- Every call is one transaction on a pooled connection. Writes run at READ COMMITTED and begin by
  locking their session's row (``SELECT … FOR UPDATE``), so the writes of one session are
  serialized across replicas exactly as SQLite's single writer serializes them, and a fenced
  write's check holds until its commit. Reads that take several statements run in one
  REPEATABLE READ, READ ONLY snapshot.
- A call is shielded from its caller's cancellation (it completes or rolls back first) and is
  bounded in time: the server ends a statement after ``STATEMENT_TIMEOUT`` seconds and a
  transaction left idle that long; a connection is waited for at most ``POOL_TIMEOUT`` seconds;
  a call with no answer at all (a hung network) is abandoned after ``CALL_BOUND`` seconds.
- Errors: the server unreachable, a lost connection, a timeout, an I/O error or a full disk, a
  read-only server (a standby after a failover) and a deadlock are ``StoreUnavailable``
  (``full`` for disk full, SQLSTATE 53100); a refused statement is ``StoreError``. Opening the
  store is judged by ``open_failure_is_transient``: ``StoreUnavailable`` when trying again may
  succeed (the server not reachable or not accepting connections yet), ``StoreError`` when it
  cannot (the login refused, no such database, a newer schema, a failed migration).
- The password is given to libpq apart from the URL (never in it: the config refuses that), and
  is scrubbed from any error text; ``location`` is the URL without user, query or fragment
  (``agentd.redact.redact_database_url``).
- Lease times are by the database server's clock, so replicas' clocks need not agree.
- The driver's own log lines (``psycopg``, ``psycopg.pool``) are re-emitted as ``store.driver``.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeAlias, TypeVar

import anyio
import msgspec
import psycopg
from psycopg import conninfo as pg_conninfo
from psycopg.rows import DictRow, dict_row
from psycopg_pool import AsyncConnectionPool, PoolClosed, PoolTimeout

from agentd import events
from agentd.budget import TurnStatus, Usage
from agentd.messages import Message, UserMessage
from agentd.obs import get_logger
from agentd.records import PENDING, JournalEntry, SessionState, StartedTurn, TurnRecord
from agentd.redact import redact_database_url
from agentd.store import codec, migrations
from agentd.store.base import (
    NOTIFY_CHANNELS,
    ORPHANS,
    CommittedTurn,
    Lease,
    LeaseLost,
    ReplicaRow,
    Store,
    StoredEntry,
    StoredSession,
    StoreError,
    StoreUnavailable,
    UnknownSession,
)

__all__ = [
    "CALL_BOUND",
    "CONNECT_TIMEOUT",
    "POOL_SIZE",
    "POOL_TIMEOUT",
    "STATEMENT_TIMEOUT",
    "PostgresStore",
    "open_failure_is_transient",
]

T = TypeVar("T")
Conn: TypeAlias = psycopg.AsyncConnection[DictRow]
Row: TypeAlias = DictRow

#: Connections the pool keeps at most (one replica's concurrent store calls beyond that wait).
POOL_SIZE = 10
#: How long opening one connection may take (libpq ``connect_timeout``, unless the URL sets it).
CONNECT_TIMEOUT = 5
#: The first wait before listening again after the listening connection failed (then doubling).
LISTEN_RETRY_START = 0.1
#: How long a call waits for a free connection before the database counts as unavailable.
POOL_TIMEOUT = 5.0
#: The server ends a statement, and a transaction left idle, after this many seconds.
STATEMENT_TIMEOUT = 10.0
#: A call with no answer at all (a hung network) is abandoned after this many seconds.
CALL_BOUND = STATEMENT_TIMEOUT + 5.0
#: How long the migrations at start-up may take (an index on a large table takes a while).
MIGRATION_BOUND = 600.0
#: Serializes migrations of replicas that start together (``pg_advisory_xact_lock``; "agentd" in ASCII).
MIGRATION_LOCK = 0x616765_6E7464

#: SQLSTATE classes that mean the database failed, not the call: connection, resources,
#: operator intervention (a timeout, a shutdown), system (I/O), transaction rollback (deadlock), internal.
_UNAVAILABLE_CLASSES = ("08", "53", "57", "58", "40", "XX")
_READ_ONLY_TRANSACTION = "25006"  # e.g. connected to a standby after a failover
#: SQLSTATE classes of a failed open that trying again may cure: connection, insufficient resources
#: (too many connections, 53300), operator intervention (shutting down 57P01/57P02, starting up
#: 57P03), system (I/O) and transaction rollback (a deadlock); and a read-only server (25006), a
#: standby not promoted yet. Not XX (internal: a damaged database does not heal by waiting).
_TRANSIENT_OPEN_CLASSES = ("08", "53", "57", "58", "40")
#: What libpq or the server says when the connection itself is refused for good. A refusal during
#: the connection carries no SQLSTATE (libpq keeps it to itself), so its words are all there is;
#: lower case, matched anywhere in the message. Everything else that goes wrong while connecting
#: (refused, no route, a timeout, a name that does not resolve yet, a server starting up or
#: shutting down, too many clients) may pass.
_REFUSED_FOR_GOOD = (
    "authentication failed",  # 28P01 password, and ident/peer/ldap/pam/radius/cert (28000)
    "no pg_hba.conf entry",  # 28000
    "pg_hba.conf rejects",  # 28000
    "does not exist",  # 3D000 database, 28000 role, a root certificate file
    "is not permitted to log in",  # 28000
    "no password supplied",  # libpq: the server wants a password and none was given
    "permission denied",  # 42501: no CONNECT privilege on the database
    "certificate",  # TLS: a certificate that does not verify, or a file that is missing
    "server does not support ssl",  # sslmode=require against a server without TLS
    "invalid port number",  # the URL itself (libpq checks these when it connects)
    "invalid integer value",
    "invalid sslmode value",
    "unsupported frontend protocol",
)
_DISK_FULL = "53100"
_SNAPSHOT = "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"
#: The database server's clock in epoch seconds: every lease time is by it.
_NOW = "extract(epoch FROM clock_timestamp())::float8"
#: A claim's ``RETURNING`` column: the other replicas watching the claimed session (``Lease.watchers``).
_WATCHERS = (
    "ARRAY(SELECT w.replica FROM watches w WHERE w.session = sessions.id AND w.replica <> %(replica)s"
    f" AND w.until > {_NOW} ORDER BY w.replica) AS watchers"
)

_SESSION_COLUMNS = "id, assistant, state, generation, model, created_at, updated_at, owner, lease_expires, fence"
# A turn with its input message (for a pending turn, which has no record yet).
_TURN_SELECT = (
    "SELECT t.n, t.session, t.id, t.status, t.message_seq, t.models, t.steps, t.restarts, t.discarded,"
    " t.input_tokens, t.output_tokens, t.started_at, t.ended_at, t.error, t.cancel_requested,"
    " CASE WHEN t.status = 'pending' THEN e.message END AS input"
    " FROM turns t LEFT JOIN entries e ON e.session = t.session AND e.seq = t.message_seq"
)

log = get_logger("store")


class PostgresStore(Store):
    """The PostgreSQL store. Open with ``await PostgresStore.open(url, password=…)``."""

    def __init__(
        self,
        pool: AsyncConnectionPool[Conn],
        location: str,
        connect: Callable[[], Awaitable[Conn]],
        secret: str | None,
    ) -> None:
        """Wrap an open pool on a migrated database; use ``PostgresStore.open`` instead."""
        self._pool: AsyncConnectionPool[Conn] | None = pool
        self._location = location
        self._connect = connect  # a connection outside the pool, for when the pool has none
        self._secret = secret  # scrubbed from every error text
        self._listener: Conn | None = None  # LISTENs for released sessions with a pending turn
        self._notes: collections.deque[tuple[str, str]] = collections.deque()  # received, not yet returned
        # Since when (epoch seconds) no connection has listened, after one broke; and a gap that
        # ended, until the caller takes it (take_listen_gap).
        self._deaf_since: float | None = None
        self._heard_at: float | None = None  # when a wait on the listening connection last began well
        self._gap: float | None = None
        self._listen_retry = LISTEN_RETRY_START
        self.failure: str | None = None

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    async def open(
        cls, url: str, *, password: str | None = None, pool_size: int | None = None, pool_timeout: float | None = None
    ) -> PostgresStore:
        """Connect to the database at ``url``, bring its schema up to date, and open the pool.

        ``cannot open the store <url>: <reason>`` otherwise: StoreUnavailable when trying again
        may succeed — the server cannot be reached, does not answer, or is not accepting
        connections yet (``open_failure_is_transient``) — and StoreError when it cannot: the login
        is refused, the database does not exist, a migration fails, or the database was written
        by a newer agentd.
        """
        location = redact_database_url(url)
        secret = password or None
        pool_size = POOL_SIZE if pool_size is None else pool_size
        pool_timeout = POOL_TIMEOUT if pool_timeout is None else pool_timeout
        _route_driver_logs()
        kwargs = _connect_kwargs(url, secret)

        async def connect() -> Conn:
            return await psycopg.AsyncConnection.connect(url, **kwargs)

        try:
            with anyio.fail_after(CONNECT_TIMEOUT + 1):
                conn = await connect()
            try:
                with anyio.fail_after(MIGRATION_BOUND):
                    await _migrate(conn)
            finally:
                with anyio.CancelScope(shield=True):  # also when a SIGTERM cancels the start
                    await conn.close()
        except (psycopg.Error, StoreError, TimeoutError) as exc:
            raise _open_error(location, exc, secret) from None
        pool: AsyncConnectionPool[Conn] = AsyncConnectionPool(
            url,
            connection_class=psycopg.AsyncConnection[DictRow],
            kwargs=kwargs,
            min_size=1,
            max_size=pool_size,
            open=False,
            configure=_configure,
            check=AsyncConnectionPool.check_connection,
            timeout=pool_timeout,
            name="agentd-store",
        )
        try:
            await pool.open(wait=True, timeout=pool_timeout + CONNECT_TIMEOUT)
        except BaseException as exc:  # a failure, or a SIGTERM cancelling the start: no pool left running
            with anyio.CancelScope(shield=True):
                await pool.close()
            if isinstance(exc, PoolTimeout | psycopg.Error):
                raise _open_error(location, exc, secret) from None
            raise
        return cls(pool, location, connect, secret)

    async def close(self) -> None:
        """Close the pool after the calls already running have returned their connections. Idempotent."""
        pool, self._pool = self._pool, None
        listener, self._listener = self._listener, None
        if listener is not None:
            with anyio.CancelScope(shield=True):
                await listener.close()
        if pool is not None:
            with anyio.CancelScope(shield=True):
                await pool.close()

    @property
    def location(self) -> str:
        return self._location

    # ------------------------------------------------------------------ sessions

    async def create_session(
        self,
        session_id: str,
        *,
        assistant: str,
        generation: int,
        model: str,
        created_at: float,
        transcript: Sequence[Message] = (),
    ) -> StoredSession:
        where = f"session {session_id}"
        for message in transcript:
            codec.check_message(message, where)

        async def op(conn: Conn) -> StoredSession:
            inserted = await conn.execute(
                "INSERT INTO sessions (id, assistant, state, generation, model, created_at, updated_at)"
                " VALUES (%s, %s, 'idle', %s, %s, %s, %s) ON CONFLICT (id) DO NOTHING",
                (session_id, assistant, generation, model, created_at, created_at),
            )
            if inserted.rowcount == 0:
                raise StoreError(f"{where} already exists")
            await _insert_entries(conn, session_id, transcript)
            loaded = await _load_session(conn, session_id)
            assert loaded is not None
            return loaded

        return await self._write(f"create {where}", op)

    async def update_session(
        self,
        session_id: str,
        *,
        state: SessionState | None = None,
        generation: int | None = None,
        model: str | None = None,
        assistant: str | None = None,
        lease: Lease | None = None,
    ) -> None:
        where = f"session {session_id}"
        fields = codec.session_fields(where, state=state, generation=generation, model=model, assistant=assistant)
        now = time.time()

        async def op(conn: Conn) -> None:
            row = await _session_row(conn, session_id, lock=True)
            if row is None:
                raise UnknownSession(f"{where} is unknown")
            _check_fence(row, lease, f"cannot update {where}")
            assignments = "".join(f"{name} = %s, " for name in fields)
            await conn.execute(
                f"UPDATE sessions SET {assignments}updated_at = %s WHERE id = %s",
                (*fields.values(), now, session_id),
            )

        await self._write(f"update {where}", op)

    async def load_session(self, session_id: str) -> StoredSession | None:
        return await self._read(f"load session {session_id}", lambda conn: _load_session(conn, session_id))

    async def ended_turn(self, session_id: str, turn_id: str) -> tuple[TurnRecord, list[StoredEntry]] | None:
        async def op(conn: Conn) -> tuple[TurnRecord, list[StoredEntry]] | None:
            row = await _turn_row(conn, session_id, turn_id)
            record = _turn_from_row(row) if row is not None else None
            if not isinstance(record, TurnRecord):
                return None
            entries = await _fetchall(
                conn,
                "SELECT seq, message FROM entries WHERE session = %s AND turn = %s AND active ORDER BY seq",
                (session_id, turn_id),
            )
            return record, [StoredEntry(e["seq"], codec.decode_message(e["message"])) for e in entries]

        return await self._read(f"read turn {turn_id} of session {session_id}", op)

    async def session_summary(self, session_id: str) -> StoredSession | None:
        async def op(conn: Conn) -> StoredSession | None:
            row = await _session_row(conn, session_id)
            return None if row is None else _session_from_row(row)

        return await self._read(f"read session {session_id}", op)

    async def transcript(self, session_id: str, *, exclude_turn: str | None = None) -> list[Message]:
        async def op(conn: Conn) -> list[Message]:
            rows = await _fetchall(
                conn,
                "SELECT message FROM entries WHERE session = %s AND active AND (turn IS NULL OR turn != %s)"
                " ORDER BY seq",
                (session_id, exclude_turn or ""),
            )
            return [codec.decode_message(row["message"]) for row in rows]

        return await self._read(f"read transcript of session {session_id}", op)

    async def list_sessions(self, *, limit: int = 100, after: str | None = None) -> list[StoredSession]:
        async def op(conn: Conn) -> list[StoredSession]:
            start = 0
            if after is not None:
                row = await _fetchone(conn, "SELECT n FROM sessions WHERE id = %s", (after,))
                if row is None:
                    raise UnknownSession(f"no session {after!r} to page after")
                start = row["n"]
            rows = await _fetchall(
                conn,
                f"SELECT {_SESSION_COLUMNS}, (SELECT COUNT(*) FROM turns WHERE turns.session = sessions.id) AS turns"
                " FROM sessions WHERE n > %s ORDER BY n LIMIT %s",
                (start, limit),
            )
            return [msgspec.structs.replace(_session_from_row(row), turn_count=row["turns"]) for row in rows]

        return await self._read("list sessions", op)

    async def interrupted_turns(self) -> list[tuple[StoredSession, StartedTurn]]:
        async def op(conn: Conn) -> list[tuple[StoredSession, StartedTurn]]:
            turns = await _fetchall(conn, f"{_TURN_SELECT} WHERE t.status = %s ORDER BY t.started_at, t.n", (PENDING,))
            if not turns:
                return []
            sessions = {
                row["id"]: row
                for row in await _fetchall(
                    conn,
                    f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE id = ANY(%s) AND state != 'closed'",
                    ([turn["session"] for turn in turns],),
                )
            }
            return [
                (_session_from_row(sessions[turn["session"]]), _started_from_row(turn))
                for turn in turns
                if turn["session"] in sessions
            ]

        return await self._read("list interrupted turns", op)

    async def session_counts(self) -> dict[str, int]:
        async def op(conn: Conn) -> dict[str, int]:
            counts = dict.fromkeys(sorted(codec.SESSION_STATES), 0)
            rows = await _fetchall(conn, "SELECT state, COUNT(*) AS count FROM sessions GROUP BY state", ())
            counts.update({row["state"]: row["count"] for row in rows})
            return counts

        return await self._read("count sessions", op)

    async def open_sessions_by_assistant(self) -> dict[str, int]:
        async def op(conn: Conn) -> dict[str, int]:
            rows = await _fetchall(
                conn,
                "SELECT assistant, COUNT(*) AS count FROM sessions WHERE state != 'closed' GROUP BY assistant",
                (),
            )
            return {row["assistant"]: row["count"] for row in rows}

        return await self._read("count sessions by assistant", op)

    # ------------------------------------------------------------------ turns

    async def begin_turn(
        self,
        session_id: str,
        turn_id: str,
        message: UserMessage | None,
        started_at: float,
        *,
        durable: bool = True,
    ) -> int | None:
        where = f"session {session_id} turn {turn_id}"
        if message is not None:
            if not isinstance(message, UserMessage):
                raise StoreError(f"{where}: a turn's input must be a user message, not {type(message).__name__}")
            message = msgspec.structs.replace(message, turn=turn_id)

        async def op(conn: Conn) -> int | None:
            if not durable:  # the turn's commit flushes the WAL, and this record with it
                await conn.execute("SET LOCAL synchronous_commit = off")
            row = await _session_row(conn, session_id, lock=True)
            if row is None:
                raise UnknownSession(f"cannot begin {where}: the session is unknown")
            if row["state"] == "closed":
                raise StoreError(f"cannot begin {where}: the session is closed")
            pending = await _fetchone(
                conn, "SELECT id FROM turns WHERE session = %s AND status = %s", (session_id, PENDING)
            )
            if pending is not None:
                raise StoreError(f"cannot begin {where}: turn {pending['id']} is still pending")
            if await _turn_row(conn, session_id, turn_id) is not None:
                raise StoreError(f"cannot begin {where}: the session already has a turn with this id")
            seq = None if message is None else (await _insert_entries(conn, session_id, [message]))[0]
            await conn.execute(
                "INSERT INTO turns (session, id, status, message_seq, started_at) VALUES (%s, %s, %s, %s, %s)",
                (session_id, turn_id, PENDING, seq, started_at),
            )
            await conn.execute(
                "UPDATE sessions SET state = 'running', updated_at = %s WHERE id = %s", (started_at, session_id)
            )
            return seq

        return await self._write(f"begin {where}", op)

    async def commit_turn(
        self,
        session_id: str,
        record: TurnRecord,
        *,
        assistant: str,
        messages: Sequence[Message] = (),
        transcript: Sequence[Message] | None = None,
        model: str | None = None,
        lease: Lease | None = None,
    ) -> CommittedTurn:
        where = f"session {session_id} turn {record.id}"
        try:
            status = TurnStatus(record.status)
        except ValueError:
            raise StoreError(f"cannot commit {where}: unknown status {record.status!r}") from None
        new_messages = messages if transcript is None else transcript
        for message in new_messages:
            codec.check_message(message, where)

        columns = codec.ended_turn_columns(record, status)
        columns["error"] = _text(record.error)
        refusal = f"cannot commit {where}"

        async def op(conn: Conn) -> tuple[CommittedTurn, bool]:
            turn = await _fenced_turn_row(conn, session_id, record.id, refusal, lease)
            rewrite = transcript is not None
            if turn["status"] == PENDING:
                seqs = await _write_commit(conn, session_id, turn, columns, new_messages, rewrite, assistant, model)
            else:  # ended already: by this very commit, whose answer was lost with its connection?
                landed = await _landed_commit(conn, session_id, turn, columns, new_messages, rewrite)
                if landed is None:
                    raise codec.not_pending(refusal, turn["status"])
                seqs = landed
            stored = msgspec.structs.replace(record, status=status, started_at=turn["started_at"])
            return CommittedTurn(stored, seqs), turn["status"] != PENDING

        committed, recovered = await self._write(f"commit {where}", op)
        if recovered:
            log.warning(events.LOG_TURN_COMMIT_RECOVERED, session=session_id, turn=record.id, seqs=list(committed.seqs))
        return committed

    async def abandon_turn(
        self,
        session_id: str,
        turn_id: str,
        *,
        status: str,
        error: str | None,
        ended_at: float,
        lease: Lease | None = None,
    ) -> None:
        where = f"session {session_id} turn {turn_id}"
        if status not in codec.TURN_STATUSES:
            raise StoreError(
                f"cannot abandon {where}: unknown status {status!r} (expected one of {sorted(codec.TURN_STATUSES)})"
            )

        async def op(conn: Conn) -> None:
            turn = await _pending_turn_row(conn, session_id, turn_id, f"cannot abandon {where}", lease)
            await conn.execute(
                "UPDATE turns SET status = %s, error = %s, ended_at = %s WHERE n = %s",
                (status, _text(error), ended_at, turn["n"]),
            )
            await _prune_journal(conn, session_id, turn_id)
            await conn.execute(
                "UPDATE sessions SET updated_at = %s, state = CASE state WHEN 'running' THEN 'idle' ELSE state END"
                " WHERE id = %s",
                (ended_at, session_id),
            )

        await self._write(f"abandon {where}", op)

    async def pending_turn(self, session_id: str) -> StartedTurn | None:
        async def op(conn: Conn) -> StartedTurn | None:
            if await _session_row(conn, session_id) is None:
                raise UnknownSession(f"session {session_id} is unknown")
            row = await _fetchone(conn, f"{_TURN_SELECT} WHERE t.session = %s AND t.status = %s", (session_id, PENDING))
            return None if row is None else _started_from_row(row)

        return await self._read(f"pending turn of session {session_id}", op)

    async def request_cancel(self, session_id: str, turn_id: str) -> bool:
        async def op(conn: Conn) -> bool:
            updated = await conn.execute(
                "UPDATE turns SET cancel_requested = TRUE WHERE session = %s AND id = %s AND status = %s",
                (session_id, turn_id, PENDING),
            )
            return updated.rowcount == 1

        return await self._write(f"request the cancel of session {session_id} turn {turn_id}", op)

    # ------------------------------------------------------------------ the tool journal

    async def journal_start(
        self, session_id: str, turn_id: str, entry: JournalEntry, *, lease: Lease | None = None
    ) -> None:
        where = f"session {session_id} turn {turn_id} call {entry.seq}"
        arguments = _text(codec.encode_json(entry.arguments))
        now = time.time()

        async def op(conn: Conn) -> None:
            await _pending_turn_row(conn, session_id, turn_id, f"cannot journal {where}", lease)
            inserted = await conn.execute(
                "INSERT INTO journal (session, turn, seq, call, tool, arguments, started_at)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                (session_id, turn_id, entry.seq, _text(entry.call), _text(entry.tool), arguments, now),
            )
            if inserted.rowcount != 1:
                raise StoreError(f"cannot journal {where}: it is journaled already")

        await self._write(f"journal {where}", op)

    async def journal_finish(
        self, session_id: str, turn_id: str, seq: int, *, content: str, is_error: bool, lease: Lease | None = None
    ) -> None:
        where = f"session {session_id} turn {turn_id} call {seq}"
        now = time.time()

        async def op(conn: Conn) -> None:
            await _pending_turn_row(conn, session_id, turn_id, f"cannot journal the result of {where}", lease)
            updated = await conn.execute(
                "UPDATE journal SET finished_at = %s, content = %s, is_error = %s"
                " WHERE session = %s AND turn = %s AND seq = %s AND finished_at IS NULL",
                (now, _text(content), is_error, session_id, turn_id, seq),
            )
            if updated.rowcount != 1:
                raise StoreError(f"cannot journal the result of {where}: no such call is waiting for its result")

        await self._write(f"journal the result of {where}", op)

    async def journal_entries(self, session_id: str, turn_id: str) -> list[JournalEntry]:
        async def op(conn: Conn) -> list[JournalEntry]:
            rows = await _fetchall(
                conn,
                "SELECT seq, call, tool, arguments, finished_at, content, is_error FROM journal"
                " WHERE session = %s AND turn = %s ORDER BY seq",
                (session_id, turn_id),
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

        return await self._read(f"read the journal of session {session_id} turn {turn_id}", op)

    # ------------------------------------------------------------------ leases

    async def claim(self, session_id: str, replica: str, ttl: float, *, turn: str | None = None) -> Lease | None:
        what = f"cannot claim session {session_id}"
        codec.check_replica(replica, what)
        codec.check_ttl(ttl, what)

        async def op(conn: Conn) -> Lease | None:
            # One statement: it waits for the row's lock, then re-checks the conditions on the newest row.
            row = await _fetchone(
                conn,
                "UPDATE sessions SET owner = %(replica)s,"
                " fence = CASE WHEN owner = %(replica)s THEN fence ELSE fence + 1 END,"
                f" lease_expires = {_NOW} + %(ttl)s"
                " WHERE id = %(id)s AND state != 'closed'"
                f" AND (owner IS NULL OR owner = %(replica)s OR lease_expires <= {_NOW})"
                + (
                    ""
                    if turn is None
                    else " AND EXISTS (SELECT 1 FROM turns t WHERE t.session = %(id)s AND t.id = %(turn)s"
                    " AND t.status = %(pending)s)"
                )
                + f" RETURNING fence, lease_expires, {_WATCHERS}",
                {"replica": replica, "ttl": float(ttl), "id": session_id, "turn": turn, "pending": PENDING},
            )
            if row is not None:
                return Lease(
                    session=session_id,
                    replica=replica,
                    token=row["fence"],
                    expires_at=row["lease_expires"],
                    watchers=tuple(row["watchers"]),
                )
            current = await _session_row(conn, session_id)
            if current is None:
                raise UnknownSession(f"{what}: the session is unknown")
            if current["state"] == "closed":
                raise StoreError(f"{what}: the session is closed")
            return None  # another replica's lease has not expired, or the turn is no longer pending

        return await self._write(f"claim session {session_id}", op)

    async def renew(self, replica: str, ttl: float) -> dict[str, Lease]:
        what = f"cannot renew the leases of replica {replica}"
        codec.check_replica(replica, what)
        codec.check_ttl(ttl, what)

        async def op(conn: Conn) -> dict[str, Lease]:
            rows = await _fetchall(
                conn,
                f"UPDATE sessions SET lease_expires = {_NOW} + %s WHERE owner = %s RETURNING id, fence, lease_expires",
                (float(ttl), replica),
            )
            return {
                row["id"]: Lease(
                    session=row["id"], replica=replica, token=row["fence"], expires_at=row["lease_expires"]
                )
                for row in rows
            }

        return await self._write(f"renew the leases of replica {replica}", op)

    async def release(self, lease: Lease) -> bool:
        async def op(conn: Conn) -> bool:
            released = await conn.execute(
                "UPDATE sessions SET owner = NULL, lease_expires = NULL WHERE id = %s AND owner = %s AND fence = %s",
                (lease.session, lease.replica, lease.token),
            )
            if not released.rowcount and await _session_row(conn, lease.session) is None:
                raise UnknownSession(f"cannot release session {lease.session}: the session is unknown")
            if released.rowcount:  # a pending turn left behind (a drain): wake the other replicas' scans
                await conn.execute(
                    "SELECT pg_notify(%s, session) FROM turns WHERE session = %s AND status = %s",
                    (ORPHANS, lease.session, PENDING),
                )
            return bool(released.rowcount)

        return await self._write(f"release session {lease.session}", op)

    async def claim_orphaned(self, replica: str, ttl: float, *, limit: int = 100) -> list[Lease]:
        what = f"cannot claim orphaned sessions for replica {replica}"
        codec.check_replica(replica, what)
        codec.check_ttl(ttl, what)

        async def op(conn: Conn) -> list[Lease]:
            # The queue pattern: rows another replica's scan has locked are skipped, not waited for.
            rows = await _fetchall(
                conn,
                "WITH orphans AS ("
                " SELECT s.id, t.started_at, t.n FROM sessions s"
                " JOIN turns t ON t.session = s.id AND t.status = %(pending)s"
                " WHERE s.state != 'closed'"
                f" AND (s.owner IS NULL OR (s.owner != %(replica)s AND s.lease_expires <= {_NOW}))"
                " ORDER BY t.started_at, t.n LIMIT %(limit)s FOR UPDATE OF s SKIP LOCKED)"
                " UPDATE sessions SET owner = %(replica)s, fence = sessions.fence + 1,"
                f" lease_expires = {_NOW} + %(ttl)s"
                " FROM orphans WHERE sessions.id = orphans.id"
                " RETURNING sessions.id, sessions.fence, sessions.lease_expires, orphans.started_at, orphans.n,"
                f" {_WATCHERS}",
                {"pending": PENDING, "replica": replica, "limit": limit, "ttl": float(ttl)},
            )
            rows.sort(key=lambda row: (row["started_at"], row["n"]))
            return [
                Lease(
                    session=row["id"],
                    replica=replica,
                    token=row["fence"],
                    expires_at=row["lease_expires"],
                    watchers=tuple(row["watchers"]),
                )
                for row in rows
            ]

        return await self._write(f"claim orphaned sessions for replica {replica}", op)

    async def lease_of(self, session_id: str) -> Lease | None:
        async def op(conn: Conn) -> Lease | None:
            row = await _fetchone(
                conn, f"SELECT owner, fence, lease_expires, {_NOW} AS now FROM sessions WHERE id = %s", (session_id,)
            )
            if row is None:
                raise UnknownSession(f"session {session_id} is unknown")
            if row["owner"] is None or row["lease_expires"] <= row["now"]:
                return None
            return Lease(session=session_id, replica=row["owner"], token=row["fence"], expires_at=row["lease_expires"])

        return await self._read(f"read the lease of session {session_id}", op)

    async def notify(self, channel: str, payload: str) -> None:
        async def op(conn: Conn) -> None:
            await conn.execute("SELECT pg_notify(%s, %s)", (channel, payload))

        try:
            await self._write(f"notify {channel}", op)
        except StoreError as exc:
            log.debug("store.notify_failed", channel=channel, error=str(exc))

    async def notify_many(self, notes: Sequence[tuple[str, str]], *, fences: Sequence[Lease | None] = ()) -> str | None:
        rows = [
            {
                "channel": channel,
                "payload": payload,
                "session": fence.session if fence is not None else None,
                "owner": fence.replica if fence is not None else None,
                "token": fence.token if fence is not None else None,
            }
            for (channel, payload), fence in zip(notes, fences or [None] * len(notes), strict=True)
        ]

        # Fenced: sent unless another holder claimed the session since the fence's claim (every
        # such claim moves the token on). A release keeps the token: the last events of a turn that
        # ended, still queued when its lease was given up, are its run's and go out.
        async def op(conn: Conn) -> None:
            async with conn.cursor() as cursor:
                await cursor.executemany(
                    "SELECT pg_notify(%(channel)s, %(payload)s) WHERE %(session)s::text IS NULL OR EXISTS"
                    " (SELECT 1 FROM sessions WHERE id = %(session)s AND fence = %(token)s"
                    " AND (owner IS NULL OR owner = %(owner)s))",
                    rows,
                )

        if not notes:
            return None
        try:
            await self._write(f"notify {len(notes)} times", op)
        except StoreError as exc:
            return str(exc)
        return None

    async def next_notification(self, seconds: float) -> tuple[str, str] | None:
        """The next NOTIFY on ``NOTIFY_CHANNELS``, on a connection of its own outside the pool,
        waited for at most ``seconds``. A failed connection is dropped (the next call opens another)
        and the wait is then a plain sleep.

        Subscribing (connect + LISTEN) is not part of the wait: it is shielded and bounded by the
        connect timeout, so a short wait never leaves it half done — a connection opened but not
        kept, or notifications sent before the LISTEN missed by a caller that thinks it listens."""
        try:
            with anyio.CancelScope(shield=True):
                listener = await self._listener_connection()
        except (psycopg.Error, StoreError, OSError) as exc:
            await self._drop_listener(exc)
            await self._listen_backoff(seconds)
            return None
        if self._notes:
            return self._notes.popleft()
        self._heard_at = time.time()  # a gap found later may have begun any time after this
        with anyio.move_on_after(seconds):
            try:
                # Drained to the end, not left at the first: notifications that came in one packet
                # are yielded together, and a generator closed early would drop the rest.
                async for note in listener.notifies(timeout=seconds, stop_after=1):
                    self._notes.append((note.channel, note.payload))
                return self._notes.popleft() if self._notes else None
            except (psycopg.Error, StoreError, OSError) as exc:
                await self._drop_listener(exc)
            await self._listen_backoff(seconds)
        return None

    def take_listen_gap(self) -> float | None:
        """When (epoch seconds) the last gap in listening began, once listening again; None if
        there was none since the last call. Notifications sent during a gap were missed."""
        gap, self._gap = self._gap, None
        return gap

    async def _listen_backoff(self, seconds: float) -> None:
        """After a failure, listen again soon (0.1 s doubling up to ``seconds``): what is notified
        meanwhile is missed."""
        delay, self._listen_retry = self._listen_retry, min(self._listen_retry * 2, seconds)
        await anyio.sleep(min(delay, seconds))

    async def _drop_listener(self, exc: BaseException) -> None:
        log.debug("store.listen_failed", error=self._scrub(str(exc)))
        if self._deaf_since is None:
            self._deaf_since = self._heard_at if self._heard_at is not None else time.time()
        broken, self._listener = self._listener, None
        if broken is not None:
            with anyio.CancelScope(shield=True):
                await broken.close()

    async def _listener_connection(self) -> Conn:
        if self._listener is None:
            if self._pool is None:
                raise StoreError("the store is closed")
            conn = await self._own_connection("listen for notifications")
            await conn.set_autocommit(True)
            for channel in NOTIFY_CHANNELS:
                await conn.execute(f"LISTEN {channel}")
            self._listener = conn
            self._listen_retry = LISTEN_RETRY_START
            if self._deaf_since is not None:
                self._gap = self._gap if self._gap is not None else self._deaf_since
                self._deaf_since = None
        return self._listener

    # ------------------------------------------------------------------ the replica registry

    async def beat(self, replica: str, *, generation: int, sessions: int) -> ReplicaRow:
        codec.check_replica(replica, f"cannot record replica {replica}")

        async def op(conn: Conn) -> ReplicaRow:
            row = await _fetchone(
                conn,
                "INSERT INTO replicas (id, generation, sessions, seen_at)"
                f" VALUES (%(id)s, %(generation)s, %(sessions)s, {_NOW})"
                " ON CONFLICT (id) DO UPDATE SET generation = EXCLUDED.generation,"
                " sessions = EXCLUDED.sessions, seen_at = EXCLUDED.seen_at"
                " RETURNING id, generation, sessions, seen_at",
                {"id": replica, "generation": generation, "sessions": sessions},
            )
            assert row is not None
            return ReplicaRow(**row)

        return await self._write(f"record replica {replica}", op)

    async def live_replicas(self, max_age: float) -> list[ReplicaRow]:
        async def op(conn: Conn) -> list[ReplicaRow]:
            rows = await _fetchall(
                conn,
                f"SELECT id, generation, sessions, seen_at FROM replicas WHERE seen_at > {_NOW} - %s ORDER BY id",
                (float(max_age),),
            )
            return [ReplicaRow(**row) for row in rows]

        return await self._read("read the live replicas", op)

    async def watch(self, replica: str, sessions: Sequence[str], ttl: float) -> None:
        what = f"cannot record the watches of replica {replica}"
        codec.check_replica(replica, what)
        codec.check_ttl(ttl, what)

        async def op(conn: Conn) -> None:
            await conn.execute(
                "INSERT INTO watches (session, replica, until)"
                f" SELECT s, %(replica)s, {_NOW} + %(ttl)s FROM unnest(%(sessions)s::text[]) AS s"
                " ON CONFLICT (session, replica) DO UPDATE SET until = EXCLUDED.until",
                {"replica": replica, "ttl": float(ttl), "sessions": list(sessions)},
            )
            await conn.execute(f"DELETE FROM watches WHERE until <= {_NOW}")

        await self._write(what.replace("cannot ", ""), op)

    async def unwatch(self, replica: str, sessions: Sequence[str]) -> None:
        async def op(conn: Conn) -> None:
            await conn.execute(
                "DELETE FROM watches WHERE replica = %s AND session = ANY(%s::text[])", (replica, list(sessions))
            )

        await self._write(f"forget the watches of replica {replica}", op)

    # ------------------------------------------------------------------ plumbing

    async def _write(self, what: str, fn: Callable[[Conn], Awaitable[T]]) -> T:
        """Run ``fn`` in one READ COMMITTED transaction: committed if it returns, rolled back if it raises."""
        return await self._call(what, fn, snapshot=False)

    async def _read(self, what: str, fn: Callable[[Conn], Awaitable[T]]) -> T:
        """Run ``fn`` in one REPEATABLE READ, READ ONLY transaction (a consistent snapshot)."""
        return await self._call(what, fn, snapshot=True)

    async def _call(self, what: str, fn: Callable[[Conn], Awaitable[T]], *, snapshot: bool) -> T:
        """One store call: shielded from the caller's cancellation, bounded in time, errors as StoreErrors.

        ``failure`` follows the outcome: set when the database failed, cleared when it answered.
        """
        pool = self._pool
        if pool is None:
            raise StoreError(f"{what}: the store is closed")
        with anyio.CancelScope(shield=True):
            try:
                result = await self._transaction(pool, what, fn, snapshot)
            except StoreUnavailable as exc:
                self.failure = str(exc)
                raise
            except StoreError:
                self.failure = None
                raise
        self.failure = None
        return result

    async def _transaction(
        self, pool: AsyncConnectionPool[Conn], what: str, fn: Callable[[Conn], Awaitable[T]], snapshot: bool
    ) -> T:
        try:
            try:
                async with pool.connection() as conn:
                    return await _run(conn, what, fn, snapshot)
            except PoolTimeout:
                # No pooled connection in time: the server is down, or the pool is still backing off
                # from an outage that is over. A connection of the call's own tells which, and serves it.
                async with await self._own_connection(what) as conn:
                    await _configure(conn)
                    return await _run(conn, what, fn, snapshot)
        except PoolClosed:
            raise StoreError(f"{what}: the store is closed") from None
        except psycopg.Error as exc:
            raise _wrap(what, exc, self._secret) from exc
        except msgspec.MsgspecError as exc:
            raise StoreError(f"{what}: {type(exc).__name__}: {exc}") from exc

    async def _own_connection(self, what: str) -> Conn:
        """A new connection outside the pool, or StoreUnavailable saying why the database cannot be reached."""
        try:
            with anyio.fail_after(CONNECT_TIMEOUT + 1):
                return await self._connect()
        except (psycopg.Error, TimeoutError) as exc:
            reason = "no answer from the server" if isinstance(exc, TimeoutError) else _reason(exc)
            raise StoreUnavailable(self._scrub(f"{what}: cannot reach the database: {reason}")) from None

    def _scrub(self, text: str) -> str:
        return _scrub(text, self._secret)


# --------------------------------------------------------------------------- connections and errors


async def _run(conn: Conn, what: str, fn: Callable[[Conn], Awaitable[T]], snapshot: bool) -> T:
    """``fn`` in one transaction on ``conn``; a call with no answer within ``CALL_BOUND`` is abandoned."""
    with anyio.move_on_after(CALL_BOUND) as bound:
        async with conn.transaction():
            if snapshot:
                await conn.execute(_SNAPSHOT)
            result = await fn(conn)
    if bound.cancelled_caught:  # the connection is in an unknown state: it must not be used again
        await conn.close()
        raise StoreUnavailable(f"{what}: no answer from the database within {CALL_BOUND:g}s")
    return result


def _connect_kwargs(url: str, password: str | None) -> dict[str, Any]:
    """What every connection is opened with besides the URL: the password, a connect timeout, a name."""
    try:
        given = pg_conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        given = {}  # connecting will say what is wrong with it
    kwargs: dict[str, Any] = {"autocommit": True, "row_factory": dict_row}
    if "connect_timeout" not in given:
        kwargs["connect_timeout"] = CONNECT_TIMEOUT
    if "application_name" not in given:
        kwargs["application_name"] = "agentd"
    if password:
        kwargs["password"] = password
    return kwargs


async def _configure(conn: Conn) -> None:
    """Every pooled connection: the server bounds each statement and each idle transaction."""
    milliseconds = int(STATEMENT_TIMEOUT * 1000)
    await conn.execute(f"SET statement_timeout = {milliseconds}")
    await conn.execute(f"SET idle_in_transaction_session_timeout = {milliseconds}")


def open_failure_is_transient(exc: BaseException) -> bool:
    """Whether opening the store after ``exc`` may succeed when tried again (RFC 0009 §1).

    True while the server is not there yet: unreachable, silent (a timeout), not resolving, or
    refusing connections for now (starting up, shutting down, too many clients, a read-only
    standby) — a start-up before the database, a database restart, a failover. False when trying
    again cannot help: the login or the database refused for good, a URL libpq rejects, a
    migration that failed on a statement, a schema newer than this agentd (a StoreError).
    """
    if isinstance(exc, TimeoutError | PoolTimeout):
        return True
    if not isinstance(exc, psycopg.Error):
        return False
    if exc.sqlstate:  # a statement of the migrations, answered by the server
        return exc.sqlstate.startswith(_TRANSIENT_OPEN_CLASSES) or exc.sqlstate == _READ_ONLY_TRANSACTION
    if not isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        return False  # a ProgrammingError: a URL psycopg cannot parse
    text = _reason(exc).lower()
    return not any(words in text for words in _REFUSED_FOR_GOOD)


def _open_error(location: str, exc: BaseException, secret: str | None) -> StoreError:
    """``cannot open the store <location>: <reason>``, StoreUnavailable when trying again may help."""
    reason = "no answer from the server" if isinstance(exc, TimeoutError) else _reason(exc)
    text = _scrub(f"cannot open the store {location}: {reason}", secret)
    return StoreUnavailable(text) if open_failure_is_transient(exc) else StoreError(text)


def _reason(exc: BaseException) -> str:
    """The error's own words, on one line (libpq's messages span lines)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text


def _scrub(text: str, secret: str | None) -> str:
    """``text`` with the password replaced, should any message ever quote it."""
    return text.replace(secret, "***") if secret else text


def _wrap(what: str, exc: psycopg.Error, secret: str | None) -> StoreError:
    """A StoreError for a psycopg error: StoreUnavailable when the database failed, not the call."""
    sqlstate = exc.sqlstate or ""
    text = _scrub(f"{what}: {type(exc).__name__}: {_reason(exc)}", secret)
    unavailable = (
        isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError | psycopg.InternalError)
        or sqlstate.startswith(_UNAVAILABLE_CLASSES)
        or sqlstate == _READ_ONLY_TRANSACTION
    )
    if unavailable:
        return StoreUnavailable(text, full=sqlstate == _DISK_FULL)
    return StoreError(text)


class _DriverLogs(logging.Handler):
    """psycopg's log records as agentd's structured ``store.driver`` lines (not stray text on stderr)."""

    def emit(self, record: logging.LogRecord) -> None:
        log.warning("store.driver", logger=record.name, message=" ".join(record.getMessage().split()))


def _route_driver_logs() -> None:
    driver = logging.getLogger("psycopg")
    if not any(isinstance(handler, _DriverLogs) for handler in driver.handlers):
        driver.addHandler(_DriverLogs())
        driver.propagate = False
        driver.setLevel(logging.WARNING)  # a connection that failed, a query cancelled: not each checkout


# --------------------------------------------------------------------------- migrations


async def _migrate(conn: Conn) -> None:
    """Bring the schema up to ``SCHEMA_VERSION``, one transaction per version, each under an advisory lock.

    Replicas that start together take turns: each step reads the version once it holds the lock,
    so every migration runs once, and a migration that fails leaves the version before it.
    """
    newest = migrations.SCHEMA_VERSION
    while True:
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            await conn.execute(
                "CREATE TABLE IF NOT EXISTS agentd_schema"
                " (version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)"
            )
            current = await _schema_version(conn)
            if current > newest:
                raise StoreError(f"it has schema version {current}; this agentd knows versions up to {newest}")
            if current == newest:
                return
            statements = migrations.POSTGRES.get(current + 1)
            if statements is None:
                raise StoreError(f"no migration to schema version {current + 1}")
            for statement in statements:
                await conn.execute(statement)
            await conn.execute(f"INSERT INTO agentd_schema (version, applied_at) VALUES (%s, {_NOW})", (current + 1,))


async def _schema_version(conn: Conn) -> int:
    row = await _fetchone(conn, "SELECT COALESCE(MAX(version), 0) AS version FROM agentd_schema", ())
    assert row is not None
    return int(row["version"])


# --------------------------------------------------------------------------- queries


async def _fetchone(conn: Conn, query: str, params: Sequence[Any] | dict[str, Any]) -> Row | None:
    cursor = await conn.execute(query, params)
    return await cursor.fetchone()


async def _fetchall(conn: Conn, query: str, params: Sequence[Any] | dict[str, Any]) -> list[Row]:
    cursor = await conn.execute(query, params)
    return await cursor.fetchall()


def _text(value: str | None) -> str | None:
    """Free text for a TEXT column: PostgreSQL refuses the NUL character, which a model's error can hold."""
    return None if value is None else value.replace("\x00", "\ufffd")


async def _insert_entries(conn: Conn, session_id: str, messages: Sequence[Message]) -> list[int]:
    """Append ``messages`` as active entries after the session's highest seq; their seqs.

    The caller holds the session's row lock, so no other transaction appends meanwhile.
    """
    if not messages:
        return []
    row = await _fetchone(conn, "SELECT COALESCE(MAX(seq), 0) AS last FROM entries WHERE session = %s", (session_id,))
    assert row is not None
    last = int(row["last"])
    rows = [
        (session_id, last + offset, message.turn, codec.encode_message(message))
        for offset, message in enumerate(messages, start=1)
    ]
    async with conn.cursor() as cursor:
        await cursor.executemany(
            "INSERT INTO entries (session, seq, turn, active, message) VALUES (%s, %s, %s, true, %s)", rows
        )
    return [seq for _, seq, _, _ in rows]


async def _session_row(conn: Conn, session_id: str, *, lock: bool = False) -> Row | None:
    """The session's row; with ``lock``, locked until the transaction ends (the writes of one session queue here)."""
    query = f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE id = %s" + (" FOR UPDATE" if lock else "")
    return await _fetchone(conn, query, (session_id,))


async def _turn_row(conn: Conn, session_id: str, turn_id: str) -> Row | None:
    return await _fetchone(conn, f"{_TURN_SELECT} WHERE t.session = %s AND t.id = %s", (session_id, turn_id))


async def _prune_journal(conn: Conn, session_id: str, turn_id: str) -> None:
    """Delete a turn's journal: it ended, so nothing will run it again. Inside the ending transaction."""
    await conn.execute("DELETE FROM journal WHERE session = %s AND turn = %s", (session_id, turn_id))


async def _fenced_turn_row(conn: Conn, session_id: str, turn_id: str, refusal: str, lease: Lease | None) -> Row:
    """The turn's row, whatever its status, if the session and turn exist and ``lease`` (if any) is
    current; else UnknownSession, LeaseLost or StoreError(``refusal``: why). Locks the session's row."""
    session = await _session_row(conn, session_id, lock=True)
    if session is None:
        raise UnknownSession(f"{refusal}: the session is unknown")
    _check_fence(session, lease, refusal)
    turn = await _turn_row(conn, session_id, turn_id)
    if turn is None:
        raise StoreError(f"{refusal}: no such turn")
    return turn


async def _pending_turn_row(conn: Conn, session_id: str, turn_id: str, refusal: str, lease: Lease | None) -> Row:
    """``_fenced_turn_row``, and StoreError(``refusal``) unless the turn is pending."""
    turn = await _fenced_turn_row(conn, session_id, turn_id, refusal, lease)
    if turn["status"] != PENDING:
        raise codec.not_pending(refusal, turn["status"])
    return turn


async def _write_commit(
    conn: Conn,
    session_id: str,
    turn: Row,
    columns: dict[str, Any],
    messages: Sequence[Message],
    rewrite: bool,
    assistant: str,
    model: str | None,
) -> tuple[int, ...]:
    """Write a pending turn's results in the caller's transaction: its entries (``rewrite``: as the
    new active transcript), its row, its session's assistant, model and state; delete its journal."""
    if rewrite:
        await conn.execute("UPDATE entries SET active = false WHERE session = %s AND active", (session_id,))
    seqs = await _insert_entries(conn, session_id, messages)
    assignments = ", ".join(f"{name} = %s" for name in columns)
    await conn.execute(f"UPDATE turns SET {assignments} WHERE n = %s", (*columns.values(), turn["n"]))
    await conn.execute(
        "UPDATE sessions SET assistant = %s, updated_at = %s, model = COALESCE(%s, model),"
        " state = CASE state WHEN 'closed' THEN 'closed' ELSE 'idle' END WHERE id = %s",
        (assistant, columns["ended_at"], model, session_id),
    )
    await _prune_journal(conn, session_id, turn["id"])
    return tuple(seqs)


async def _landed_commit(
    conn: Conn, session_id: str, turn: Row, columns: dict[str, Any], messages: Sequence[Message], rewrite: bool
) -> tuple[int, ...] | None:
    """The seqs an earlier commit of these very results wrote, or None if the turn ended otherwise
    (``codec.landed_commit_seqs``). Reads only; the caller holds the session's row lock."""
    first = await _first_commit_seq(conn, session_id, turn, rewrite)
    rows = []
    if first is not None:
        rows = await _fetchall(
            conn,
            "SELECT e.seq, e.active, e.message, EXISTS (SELECT 1 FROM turns t WHERE t.session = e.session"
            " AND t.message_seq = e.seq) AS input FROM entries e WHERE e.session = %s AND e.seq >= %s"
            " ORDER BY e.seq LIMIT %s",
            (session_id, first, len(messages) + 1),
        )
    entries = [codec.EntryRow(row["seq"], bool(row["active"]), row["message"], bool(row["input"])) for row in rows]
    encoded = [codec.encode_message(message) for message in messages]
    return codec.landed_commit_seqs(turn, columns, entries, encoded)


async def _first_commit_seq(conn: Conn, session_id: str, turn: Row, rewrite: bool) -> int | None:
    """Where the commit that ended ``turn`` started writing entries (None: no entry says where).

    While a turn is pending nothing else writes the session's entries, so its commit wrote right
    after its input message. An opener turn has none: its commit wrote the first entry tagged with
    the turn or, when it rewrote the transcript, the first entry that is still active. A wrong
    guess only makes ``codec.landed_commit_seqs`` find other entries, and refuse.
    """
    if turn["message_seq"] is not None:
        return int(turn["message_seq"]) + 1
    where = "active" if rewrite else "turn = %s"
    params: tuple[Any, ...] = (session_id,) if rewrite else (session_id, turn["id"])
    row = await _fetchone(conn, f"SELECT MIN(seq) AS first FROM entries WHERE session = %s AND {where}", params)
    return None if row is None or row["first"] is None else int(row["first"])


def _check_fence(session: Row, lease: Lease | None, refusal: str) -> None:
    """The fence of a write (RFC 0009 §4): LeaseLost unless ``lease`` is None or the session's current lease.

    ``session`` was read with its row lock, which a claim needs too: no claim can come between
    this check and the write's commit.
    """
    if lease is None:
        return
    if lease.session != session["id"]:
        raise StoreError(f"{refusal}: the lease given is for session {lease.session}")
    if session["owner"] != lease.replica or session["fence"] != lease.token:
        raise LeaseLost(lease, refusal, holder=session["owner"], holder_token=session["fence"])


def _session_from_row(
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


def _turn_from_row(row: Row) -> TurnRecord | StartedTurn:
    if row["status"] == PENDING:
        return _started_from_row(row)
    return TurnRecord(
        id=row["id"],
        status=TurnStatus(row["status"]),
        models=codec.decode_models(row["models"]),
        steps=row["steps"],
        restarts=row["restarts"],
        discarded=codec.decode_discarded(row["discarded"]),
        usage=Usage(row["input_tokens"], row["output_tokens"]),
        started_at=row["started_at"],
        ended_at=row["ended_at"],
        error=row["error"],
    )


def _started_from_row(row: Row) -> StartedTurn:
    message: UserMessage | None = None
    if row["input"] is not None:
        decoded = codec.decode_message(row["input"])
        if not isinstance(decoded, UserMessage):
            raise StoreError(f"session {row['session']} turn {row['id']}: its input entry is not a user message")
        message = decoded
    return StartedTurn(
        id=row["id"], message=message, started_at=row["started_at"], cancel_requested=bool(row["cancel_requested"])
    )


async def _load_session(conn: Conn, session_id: str) -> StoredSession | None:
    row = await _session_row(conn, session_id)
    if row is None:
        return None
    entries = await _fetchall(
        conn, "SELECT seq, message FROM entries WHERE session = %s AND active ORDER BY seq", (session_id,)
    )
    transcript = [StoredEntry(entry["seq"], codec.decode_message(entry["message"])) for entry in entries]
    turns = [
        _turn_from_row(turn)
        for turn in await _fetchall(conn, f"{_TURN_SELECT} WHERE t.session = %s ORDER BY t.n", (session_id,))
    ]
    return _session_from_row(row, transcript, turns)
