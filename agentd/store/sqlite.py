"""The SQLite store (RFC 0003 §3): the embedded default, one database file and no server.

``STATE_DIR/agentd.db`` through the stdlib ``sqlite3`` module, in WAL mode with
``synchronous=FULL``: once a store call that writes has returned, what it wrote survives a crash
of the process or of the machine — except a write its caller marks ``durable=False``
(``begin_turn`` of a message whose client waits for the turn's answer): it is in the database at
once, so it survives a crash of the process, and becomes durable against a crash of the machine
with the next durable commit (the WAL is one sequential file: syncing it syncs every earlier
write). It keeps the rules of ``agentd.store.base``; what is SQLite's own:

- Every database call runs in a worker thread, one at a time, on one connection, so the
  supervisor's event loop is never blocked by disk I/O (``anyio.to_thread.run_sync`` with a
  ``CapacityLimiter(1)``). A caller cancelled while its call runs does not tear the call: the
  transaction completes (or rolls back) before the cancellation is delivered.
- Writes are group-committed (``_write``): one transaction and one fsync for every write that
  arrived while the previous batch was being written, each in a savepoint of its own.
- Leases work as on PostgreSQL (one daemon owns the state dir, so in practice one replica holds
  them all); their clock is this machine's ``time.time()``.

The schema version lives in ``PRAGMA user_version``; ``agentd.store.migrations.SQLITE`` maps each
version to the statements that bring the database from the previous version to it.
"""

from __future__ import annotations

import sqlite3
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

import anyio
import msgspec

from agentd import events
from agentd.budget import TurnStatus, Usage
from agentd.messages import Message, UserMessage
from agentd.obs import get_logger
from agentd.records import PENDING, JournalEntry, SessionState, StartedTurn, TurnRecord
from agentd.store import codec, migrations
from agentd.store.base import (
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

__all__ = ["SqliteStore"]

T = TypeVar("T")

log = get_logger("store")


def _wrap(what: str, exc: BaseException) -> StoreError:
    """A StoreError for an exception raised inside a store call: StoreUnavailable when the database failed."""
    if isinstance(exc, StoreError):
        return exc
    text = f"{what}: {type(exc).__name__}: {exc}"
    if isinstance(exc, sqlite3.OperationalError | sqlite3.DatabaseError) and not isinstance(
        exc, sqlite3.IntegrityError | sqlite3.ProgrammingError | sqlite3.InterfaceError
    ):
        return StoreUnavailable(text, full="full" in str(exc).lower())
    return StoreError(text)


# --------------------------------------------------------------------------- store


class SqliteStore(Store):
    """The SQLite store. Open with ``await SqliteStore.open(path)``."""

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        """Wrap an open, migrated connection; use ``SqliteStore.open`` instead."""
        self._conn: sqlite3.Connection | None = conn
        self._path = path
        self._limiter = anyio.CapacityLimiter(1)
        self._batch_lock = anyio.Lock()
        # Why the last batch of writes failed because of the database itself (None: it worked).
        self.failure: str | None = None
        self._queued: list[_Write[Any]] = []

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    async def open(cls, path: Path) -> SqliteStore:
        """Open (creating if needed) the database at ``path`` and bring its schema up to date.

        StoreError if the file cannot be opened, WAL cannot be enabled, or the database was
        written by a newer agentd (a schema version this code does not know).
        """
        path = Path(path)
        try:
            # The thread runs to its end anyway; shielded, a cancelled start (SIGTERM) still gets
            # the store, to close it, instead of leaving the connection behind.
            with anyio.CancelScope(shield=True):
                conn = await anyio.to_thread.run_sync(_connect, path)
        except (sqlite3.Error, OSError) as exc:  # _connect names the store itself; this is a last resort
            raise StoreError(f"cannot open the store {path}: {exc}") from exc
        return cls(conn, path)

    async def close(self) -> None:
        """Close the database after calls already running have finished. Idempotent."""

        def close() -> None:
            conn, self._conn = self._conn, None  # calls queued behind this one get "the store is closed"
            if conn is not None:
                conn.close()

        await anyio.to_thread.run_sync(close, limiter=self._limiter)

    @property
    def path(self) -> Path:
        """The database file."""
        return self._path

    @property
    def location(self) -> str:
        return str(self._path)

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

        def op(conn: sqlite3.Connection) -> StoredSession:
            if _session_row(conn, session_id) is not None:
                raise StoreError(f"{where} already exists")
            conn.execute(
                "INSERT INTO sessions (id, assistant, state, generation, model, created_at, updated_at)"
                " VALUES (?, ?, 'idle', ?, ?, ?, ?)",
                (session_id, assistant, generation, model, created_at, created_at),
            )
            _insert_entries(conn, session_id, transcript)
            loaded = _load_session(conn, session_id)
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

        def op(conn: sqlite3.Connection) -> None:
            row = _session_row(conn, session_id)
            if row is None:
                raise UnknownSession(f"{where} is unknown")
            _check_fence(row, lease, f"cannot update {where}")
            assignments = ", ".join(f"{name} = ?" for name in fields)
            conn.execute(
                f"UPDATE sessions SET {assignments}{', ' if assignments else ''}updated_at = ? WHERE id = ?",
                (*fields.values(), now, session_id),
            )

        await self._write(f"update {where}", op)

    async def load_session(self, session_id: str) -> StoredSession | None:
        return await self._read(f"load session {session_id}", lambda conn: _load_session(conn, session_id))

    async def ended_turn(self, session_id: str, turn_id: str) -> tuple[TurnRecord, list[StoredEntry]] | None:
        def op(conn: sqlite3.Connection) -> tuple[TurnRecord, list[StoredEntry]] | None:
            row = conn.execute(
                f"SELECT {_TURN_COLUMNS} FROM turns WHERE session = ? AND id = ?", (session_id, turn_id)
            ).fetchone()
            record = _turn_from_row(conn, row) if row is not None else None
            if not isinstance(record, TurnRecord):
                return None
            entries = conn.execute(
                "SELECT seq, message FROM entries WHERE session = ? AND turn = ? AND active = 1 ORDER BY seq",
                (session_id, turn_id),
            )
            return record, [StoredEntry(seq, codec.decode_message(text)) for seq, text in entries]

        return await self._read(f"read turn {turn_id} of session {session_id}", op)

    async def session_summary(self, session_id: str) -> StoredSession | None:
        def op(conn: sqlite3.Connection) -> StoredSession | None:
            row = _session_row(conn, session_id)
            return None if row is None else _session_from_row(row)

        return await self._read(f"read session {session_id}", op)

    async def transcript(self, session_id: str, *, exclude_turn: str | None = None) -> list[Message]:
        def op(conn: sqlite3.Connection) -> list[Message]:
            rows = conn.execute(
                "SELECT message FROM entries WHERE session = ? AND active = 1 AND (turn IS NULL OR turn != ?)"
                " ORDER BY seq",
                (session_id, exclude_turn or ""),
            )
            return [codec.decode_message(text) for (text,) in rows]

        return await self._read(f"read transcript of session {session_id}", op)

    async def list_sessions(self, *, limit: int = 100, after: str | None = None) -> list[StoredSession]:
        def op(conn: sqlite3.Connection) -> list[StoredSession]:
            start = 0
            if after is not None:
                row = conn.execute("SELECT rowid FROM sessions WHERE id = ?", (after,)).fetchone()
                if row is None:
                    raise UnknownSession(f"no session {after!r} to page after")
                start = row[0]
            rows = conn.execute(
                f"SELECT {_SESSION_COLUMNS}, (SELECT COUNT(*) FROM turns WHERE turns.session = sessions.id) AS turns"
                " FROM sessions WHERE rowid > ? ORDER BY rowid LIMIT ?",
                (start, limit),
            ).fetchall()
            return [msgspec.structs.replace(_session_from_row(row), turn_count=row["turns"]) for row in rows]

        return await self._read("list sessions", op)

    async def interrupted_turns(self) -> list[tuple[StoredSession, StartedTurn]]:
        def op(conn: sqlite3.Connection) -> list[tuple[StoredSession, StartedTurn]]:
            found = []
            for turn in conn.execute(
                f"SELECT {_TURN_COLUMNS} FROM turns WHERE status = ? ORDER BY started_at", (PENDING,)
            ).fetchall():
                row = _session_row(conn, turn["session"])
                if row is not None and row["state"] != "closed":
                    found.append((_session_from_row(row), _started_from_row(conn, turn)))
            return found

        return await self._read("list interrupted turns", op)

    async def session_counts(self) -> dict[str, int]:
        def op(conn: sqlite3.Connection) -> dict[str, int]:
            counts = dict.fromkeys(sorted(codec.SESSION_STATES), 0)
            counts.update(conn.execute("SELECT state, COUNT(*) FROM sessions GROUP BY state").fetchall())
            return counts

        return await self._read("count sessions", op)

    async def open_sessions_by_assistant(self) -> dict[str, int]:
        def op(conn: sqlite3.Connection) -> dict[str, int]:
            return dict(
                conn.execute(
                    "SELECT assistant, COUNT(*) FROM sessions WHERE state != 'closed' GROUP BY assistant"
                ).fetchall()
            )

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

        def op(conn: sqlite3.Connection) -> int | None:
            row = _session_row(conn, session_id)
            if row is None:
                raise UnknownSession(f"cannot begin {where}: the session is unknown")
            if row["state"] == "closed":
                raise StoreError(f"cannot begin {where}: the session is closed")
            pending = conn.execute(
                "SELECT id FROM turns WHERE session = ? AND status = ?", (session_id, PENDING)
            ).fetchone()
            if pending is not None:
                raise StoreError(f"cannot begin {where}: turn {pending[0]} is still pending")
            if _turn_row(conn, session_id, turn_id) is not None:
                raise StoreError(f"cannot begin {where}: the session already has a turn with this id")
            seq = None if message is None else _insert_entries(conn, session_id, [message])[0]
            conn.execute(
                "INSERT INTO turns (session, id, status, message_seq, started_at) VALUES (?, ?, ?, ?, ?)",
                (session_id, turn_id, PENDING, seq, started_at),
            )
            conn.execute("UPDATE sessions SET state = 'running', updated_at = ? WHERE id = ?", (started_at, session_id))
            return seq

        return await self._write(f"begin {where}", op, durable=durable)

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
        refusal = f"cannot commit {where}"

        def op(conn: sqlite3.Connection) -> tuple[CommittedTurn, bool]:
            turn = _fenced_turn_row(conn, session_id, record.id, refusal, lease)
            rewrite = transcript is not None
            if turn["status"] == PENDING:
                seqs = _write_commit(conn, session_id, turn, columns, new_messages, rewrite, assistant, model)
            else:  # ended already: by this very commit, whose answer was lost with its connection?
                landed = _landed_commit(conn, session_id, turn, columns, new_messages, rewrite)
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

        def op(conn: sqlite3.Connection) -> None:
            turn = _pending_turn_row(conn, session_id, turn_id, f"cannot abandon {where}", lease)
            conn.execute(
                "UPDATE turns SET status = ?, error = ?, ended_at = ? WHERE n = ?", (status, error, ended_at, turn["n"])
            )
            _prune_journal(conn, session_id, turn_id)
            conn.execute(
                "UPDATE sessions SET updated_at = ?, state = CASE state WHEN 'running' THEN 'idle' ELSE state END"
                " WHERE id = ?",
                (ended_at, session_id),
            )

        await self._write(f"abandon {where}", op)

    async def pending_turn(self, session_id: str) -> StartedTurn | None:
        def op(conn: sqlite3.Connection) -> StartedTurn | None:
            if _session_row(conn, session_id) is None:
                raise UnknownSession(f"session {session_id} is unknown")
            row = conn.execute(
                f"SELECT {_TURN_COLUMNS} FROM turns WHERE session = ? AND status = ?", (session_id, PENDING)
            ).fetchone()
            return None if row is None else _started_from_row(conn, row)

        return await self._read(f"pending turn of session {session_id}", op)

    async def request_cancel(self, session_id: str, turn_id: str) -> bool:
        def op(conn: sqlite3.Connection) -> bool:
            return (
                conn.execute(
                    "UPDATE turns SET cancel_requested = 1 WHERE session = ? AND id = ? AND status = ?",
                    (session_id, turn_id, PENDING),
                ).rowcount
                == 1
            )

        return await self._write(f"request the cancel of session {session_id} turn {turn_id}", op)

    # ------------------------------------------------------------------ the tool journal

    async def journal_start(
        self, session_id: str, turn_id: str, entry: JournalEntry, *, lease: Lease | None = None
    ) -> None:
        where = f"session {session_id} turn {turn_id} call {entry.seq}"
        arguments = codec.encode_json(entry.arguments)
        now = time.time()

        def op(conn: sqlite3.Connection) -> None:
            _pending_turn_row(conn, session_id, turn_id, f"cannot journal {where}", lease)
            try:
                conn.execute(
                    "INSERT INTO journal (session, turn, seq, call, tool, arguments, started_at)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (session_id, turn_id, entry.seq, entry.call, entry.tool, arguments, now),
                )
            except sqlite3.IntegrityError:
                raise StoreError(f"cannot journal {where}: it is journaled already") from None

        await self._write(f"journal {where}", op)

    async def journal_finish(
        self, session_id: str, turn_id: str, seq: int, *, content: str, is_error: bool, lease: Lease | None = None
    ) -> None:
        where = f"session {session_id} turn {turn_id} call {seq}"
        now = time.time()

        def op(conn: sqlite3.Connection) -> None:
            _pending_turn_row(conn, session_id, turn_id, f"cannot journal the result of {where}", lease)
            updated = conn.execute(
                "UPDATE journal SET finished_at = ?, content = ?, is_error = ?"
                " WHERE session = ? AND turn = ? AND seq = ? AND finished_at IS NULL",
                (now, content, int(is_error), session_id, turn_id, seq),
            ).rowcount
            if updated != 1:
                raise StoreError(f"cannot journal the result of {where}: no such call is waiting for its result")

        await self._write(f"journal the result of {where}", op)

    async def journal_entries(self, session_id: str, turn_id: str) -> list[JournalEntry]:
        def op(conn: sqlite3.Connection) -> list[JournalEntry]:
            rows = conn.execute(
                "SELECT seq, call, tool, arguments, finished_at, content, is_error FROM journal"
                " WHERE session = ? AND turn = ? ORDER BY seq",
                (session_id, turn_id),
            ).fetchall()
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

        def op(conn: sqlite3.Connection) -> Lease | None:
            row = _session_row(conn, session_id)
            if row is None:
                raise UnknownSession(f"{what}: the session is unknown")
            if row["state"] == "closed":
                raise StoreError(f"{what}: the session is closed")
            now = time.time()
            if row["owner"] == replica:
                token = row["fence"]
            elif row["owner"] is None or row["lease_expires"] <= now:
                token = row["fence"] + 1
            else:
                return None
            if (
                turn is not None
                and not conn.execute(
                    "SELECT 1 FROM turns WHERE session = ? AND id = ? AND status = ?", (session_id, turn, PENDING)
                ).fetchone()
            ):
                return None  # ended meanwhile (another replica ran it): nothing to claim it for
            conn.execute(
                "UPDATE sessions SET owner = ?, lease_expires = ?, fence = ? WHERE id = ?",
                (replica, now + ttl, token, session_id),
            )
            watchers = _watchers(conn, session_id, replica, now)
            return Lease(session=session_id, replica=replica, token=token, expires_at=now + ttl, watchers=watchers)

        return await self._write(f"claim session {session_id}", op)

    async def renew(self, replica: str, ttl: float) -> dict[str, Lease]:
        what = f"cannot renew the leases of replica {replica}"
        codec.check_replica(replica, what)
        codec.check_ttl(ttl, what)

        def op(conn: sqlite3.Connection) -> dict[str, Lease]:
            expires = time.time() + ttl
            conn.execute("UPDATE sessions SET lease_expires = ? WHERE owner = ?", (expires, replica))
            rows = conn.execute("SELECT id, fence FROM sessions WHERE owner = ?", (replica,)).fetchall()
            return {
                session: Lease(session=session, replica=replica, token=token, expires_at=expires)
                for session, token in rows
            }

        return await self._write(f"renew the leases of replica {replica}", op)

    async def release(self, lease: Lease) -> bool:
        def op(conn: sqlite3.Connection) -> bool:
            released = conn.execute(
                "UPDATE sessions SET owner = NULL, lease_expires = NULL WHERE id = ? AND owner = ? AND fence = ?",
                (lease.session, lease.replica, lease.token),
            ).rowcount
            if not released and _session_row(conn, lease.session) is None:
                raise UnknownSession(f"cannot release session {lease.session}: the session is unknown")
            return bool(released)

        return await self._write(f"release session {lease.session}", op)

    async def claim_orphaned(self, replica: str, ttl: float, *, limit: int = 100) -> list[Lease]:
        what = f"cannot claim orphaned sessions for replica {replica}"
        codec.check_replica(replica, what)
        codec.check_ttl(ttl, what)

        def op(conn: sqlite3.Connection) -> list[Lease]:
            now = time.time()
            rows = conn.execute(
                "SELECT s.id, s.fence FROM sessions s JOIN turns t ON t.session = s.id AND t.status = ?"
                " WHERE s.state != 'closed' AND (s.owner IS NULL OR (s.owner != ? AND s.lease_expires <= ?))"
                " ORDER BY t.started_at, t.n LIMIT ?",
                (PENDING, replica, now, limit),
            ).fetchall()
            leases = [
                Lease(
                    session=session,
                    replica=replica,
                    token=fence + 1,
                    expires_at=now + ttl,
                    watchers=_watchers(conn, session, replica, now),
                )
                for session, fence in rows
            ]
            conn.executemany(
                "UPDATE sessions SET owner = ?, lease_expires = ?, fence = ? WHERE id = ?",
                [(replica, lease.expires_at, lease.token, lease.session) for lease in leases],
            )
            return leases

        return await self._write(f"claim orphaned sessions for replica {replica}", op)

    async def lease_of(self, session_id: str) -> Lease | None:
        def op(conn: sqlite3.Connection) -> Lease | None:
            row = _session_row(conn, session_id)
            if row is None:
                raise UnknownSession(f"session {session_id} is unknown")
            if row["owner"] is None or row["lease_expires"] <= time.time():
                return None
            return Lease(session=session_id, replica=row["owner"], token=row["fence"], expires_at=row["lease_expires"])

        return await self._read(f"read the lease of session {session_id}", op)

    # ------------------------------------------------------------------ the replica registry

    async def beat(self, replica: str, *, generation: int, sessions: int) -> ReplicaRow:
        codec.check_replica(replica, f"cannot record replica {replica}")

        def op(conn: sqlite3.Connection) -> ReplicaRow:
            row = ReplicaRow(id=replica, generation=generation, sessions=sessions, seen_at=time.time())
            conn.execute(
                "INSERT INTO replicas (id, generation, sessions, seen_at) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (id) DO UPDATE SET generation = excluded.generation,"
                " sessions = excluded.sessions, seen_at = excluded.seen_at",
                (row.id, row.generation, row.sessions, row.seen_at),
            )
            return row

        return await self._write(f"record replica {replica}", op, durable=False)

    async def watch(self, replica: str, sessions: Sequence[str], ttl: float) -> None:
        what = f"cannot record the watches of replica {replica}"
        codec.check_replica(replica, what)
        codec.check_ttl(ttl, what)

        def op(conn: sqlite3.Connection) -> None:
            now = time.time()
            conn.executemany(
                "INSERT INTO watches (session, replica, until) VALUES (?, ?, ?)"
                " ON CONFLICT (session, replica) DO UPDATE SET until = excluded.until",
                [(session, replica, now + ttl) for session in sessions],
            )
            conn.execute("DELETE FROM watches WHERE until <= ?", (now,))

        await self._write(what.replace("cannot ", ""), op, durable=False)

    async def unwatch(self, replica: str, sessions: Sequence[str]) -> None:
        def op(conn: sqlite3.Connection) -> None:
            conn.executemany(
                "DELETE FROM watches WHERE replica = ? AND session = ?", [(replica, session) for session in sessions]
            )

        await self._write(f"forget the watches of replica {replica}", op, durable=False)

    async def live_replicas(self, max_age: float) -> list[ReplicaRow]:
        def op(conn: sqlite3.Connection) -> list[ReplicaRow]:
            rows = conn.execute(
                "SELECT id, generation, sessions, seen_at FROM replicas WHERE seen_at > ? ORDER BY id",
                (time.time() - max_age,),
            ).fetchall()
            return [
                ReplicaRow(id=r["id"], generation=r["generation"], sessions=r["sessions"], seen_at=r["seen_at"])
                for r in rows
            ]

        return await self._read("read the live replicas", op)

    # ------------------------------------------------------------------ plumbing

    async def _run(self, what: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn`` on the connection in the store's worker thread, one call at a time."""

        def call() -> T:
            conn = self._conn
            if conn is None:
                raise StoreError(f"{what}: the store is closed")
            try:
                return fn(conn)
            except (sqlite3.Error, msgspec.MsgspecError) as exc:
                raise _wrap(what, exc) from exc

        if self._conn is None:
            raise StoreError(f"{what}: the store is closed")
        return await anyio.to_thread.run_sync(call, limiter=self._limiter)

    async def _write(self, what: str, fn: Callable[[sqlite3.Connection], T], *, durable: bool = True) -> T:
        """Run ``fn`` in a write transaction: its writes are committed if it returns, undone if it raises.

        Group commit: writes that arrive while another batch is being written wait for it and then
        go together, in one transaction (one fsync), each inside a savepoint of its own, so one that
        fails leaves nothing behind and does not affect the others. A caller is answered only once
        its batch is durable. A batch of only ``durable=False`` writes is committed without a sync.
        """
        if self._conn is None:
            raise StoreError(f"{what}: the store is closed")
        write: _Write[T] = _Write(what, fn, durable)
        self._queued.append(write)
        async with self._batch_lock:
            if not write.done:  # not yet taken by the batch before ours
                batch, self._queued = self._queued, []
                try:
                    await self._run("write", lambda conn: _write_batch(conn, batch))
                except StoreError as exc:  # e.g. the store was closed meanwhile: nothing of the batch ran
                    for queued in batch:
                        if not queued.done:
                            queued.error = (
                                StoreUnavailable(f"{queued.what}: {exc}", full=exc.full)
                                if isinstance(exc, StoreUnavailable)
                                else StoreError(f"{queued.what}: {exc}")
                            )
                            queued.done = True
                failed = [w.error for w in batch if isinstance(w.error, StoreUnavailable)]
                self.failure = str(failed[0]) if failed else None
        if write.error is not None:
            raise write.error
        return write.result  # type: ignore[return-value]  # set whenever error is None

    async def _read(self, what: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn`` in one read transaction (a consistent snapshot)."""
        return await self._run(what, lambda conn: _transaction(conn, fn, "BEGIN"))


# --------------------------------------------------------------------------- worker-thread helpers


def _connect(path: Path) -> sqlite3.Connection:
    """Open the connection, set the pragmas, run pending migrations. Runs in a worker thread.

    Every failure is one StoreError, ``cannot open the store <path>: <reason>`` — a file that is
    not SQLite, is corrupt or truncated (SQLite finds a file shorter than its header says, and a
    damaged header or schema, when the schema is read here), is not a regular file, or is empty
    where a store must have been (``_check_store_file``). Damage deeper in the file is found by
    the call that reads it: checking every page here would make start-up grow with the store.

    A new database file is created readable by its owner only (SQLite gives the -wal and -shm
    files the same permissions): transcripts are private.
    """
    try:
        _check_store_file(path)
        path.touch(mode=0o600, exist_ok=True)
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        try:
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA busy_timeout = 5000")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StoreError(f"WAL journal mode unavailable (got {mode!r})")
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute("PRAGMA foreign_keys = ON")
            _migrate(conn, path)
            _check_tables(conn)
        except BaseException:
            conn.close()
            raise
    except (StoreError, sqlite3.Error, OSError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise StoreError(f"cannot open the store {path}: {reason}") from exc
    return conn


def _check_store_file(path: Path) -> None:
    """Refuse a database file SQLite would open but that cannot be the store agentd wrote.

    SQLite treats a missing or 0-byte file as a new, empty database. agentd's own store is never
    like that once it has been used: setting WAL mode writes the 4 KiB header before the first
    ``-wal``/``-shm`` file is created, and a clean close removes both. So the rule is:

    - missing or 0 bytes with no ``-wal`` and no ``-shm`` next to it: a new store (a first start,
      a start that died before its first write, or an operator's ``touch``);
    - missing or 0 bytes *with* a ``-wal`` or ``-shm`` next to it: refused. The database file was
      truncated, replaced or removed while its log stayed; opening it would silently start an
      empty store (or replay a log onto nothing) and every session would be gone;
    - anything but a regular file: refused with what it is (SQLite would say "unable to open").
    """
    try:
        info = path.stat()
    except FileNotFoundError:
        state = "missing"
    else:
        if not stat.S_ISREG(info.st_mode):
            kind = "a directory" if stat.S_ISDIR(info.st_mode) else "a FIFO" if stat.S_ISFIFO(info.st_mode) else None
            raise StoreError(f"not a regular file (it is {kind})" if kind else "not a regular file")
        if info.st_size:
            return
        state = "empty (0 bytes)"
    for suffix in ("-wal", "-shm"):
        companion = path.with_name(path.name + suffix)
        try:
            companion_size = companion.stat().st_size
        except FileNotFoundError:
            continue
        raise StoreError(
            f"the database file is {state} but {companion.name} ({companion_size} bytes) is next to it: "
            "the store's data was lost or moved; restore the database file, or move "
            f"{path.name}, {path.name}-wal and {path.name}-shm away to start an empty store"
        )


#: The tables every schema version from 4 on has: a database claiming the version without them was
#: not written by agentd (or was damaged), and every call would fail on it.
_TABLES = frozenset({"sessions", "entries", "turns", "journal"})


def _check_tables(conn: sqlite3.Connection) -> None:
    present = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    missing = sorted(_TABLES - present)
    if missing:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        raise StoreError(f"it says schema version {version} but has no table {', '.join(missing)}")


def _migrate(conn: sqlite3.Connection, path: Path) -> None:
    """Bring the schema from its ``user_version`` to ``SCHEMA_VERSION``, one transaction per step."""
    newest = migrations.SCHEMA_VERSION
    current = conn.execute("PRAGMA user_version").fetchone()[0]
    if current > newest:
        raise StoreError(f"it has schema version {current}; this agentd knows versions up to {newest}")
    for version in range(current + 1, newest + 1):
        statements = migrations.SQLITE.get(version)
        if statements is None:
            raise StoreError(f"no migration to schema version {version}")

        def step(conn: sqlite3.Connection, statements: tuple[str, ...] = statements, version: int = version) -> None:
            for statement in statements:
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {int(version)}")

        _transaction(conn, step, "BEGIN IMMEDIATE")


class _Write(Generic[T]):
    """One queued write of a group commit, and its outcome."""

    __slots__ = ("done", "durable", "error", "fn", "result", "what")

    def __init__(self, what: str, fn: Callable[[sqlite3.Connection], T], durable: bool = True) -> None:
        self.what, self.fn, self.durable = what, fn, durable
        self.done = False
        self.result: T | None = None
        self.error: StoreError | None = None


def _write_batch(conn: sqlite3.Connection, batch: list[_Write[Any]]) -> None:
    """Run every write of ``batch`` in one transaction, each in its own savepoint. Runs in the worker thread."""
    # Per batch, outside the transaction: a FULL commit syncs the WAL, and with it every NORMAL
    # commit before it.
    conn.execute("PRAGMA synchronous = FULL" if any(w.durable for w in batch) else "PRAGMA synchronous = NORMAL")
    try:
        conn.execute("BEGIN IMMEDIATE")
        for write in batch:
            conn.execute("SAVEPOINT one_write")
            try:
                write.result = write.fn(conn)
            except (StoreError, sqlite3.Error, msgspec.MsgspecError) as exc:
                conn.execute("ROLLBACK TO one_write")
                write.error = _wrap(write.what, exc)
            conn.execute("RELEASE one_write")
        conn.execute("COMMIT")
    except BaseException as exc:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        for write in batch:  # nothing of the batch is durable: every caller hears so
            write.result, write.error = None, _wrap(f"{write.what}: commit failed", exc)
            write.done = True
        if not isinstance(exc, (sqlite3.Error, StoreError)):
            raise
        return
    for write in batch:
        write.done = True


def _transaction(conn: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T], begin: str) -> T:
    conn.execute(begin)
    try:
        result = fn(conn)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return result


def _insert_entries(conn: sqlite3.Connection, session_id: str, messages: Sequence[Message]) -> list[int]:
    """Append ``messages`` as active entries after the session's highest seq; their seqs.

    Each message is encoded just before its row is written, inside the caller's transaction.
    """
    last = conn.execute("SELECT COALESCE(MAX(seq), 0) FROM entries WHERE session = ?", (session_id,)).fetchone()[0]
    seqs: list[int] = []
    for offset, message in enumerate(messages, start=1):
        seq = last + offset
        conn.execute(
            "INSERT INTO entries (session, seq, turn, active, message) VALUES (?, ?, ?, 1, ?)",
            (session_id, seq, message.turn, codec.encode_message(message)),
        )
        seqs.append(seq)
    return seqs


_SESSION_COLUMNS = "id, assistant, state, generation, model, created_at, updated_at, owner, lease_expires, fence"
_TURN_COLUMNS = (
    "n, session, id, status, message_seq, models, steps, restarts, discarded,"
    " input_tokens, output_tokens, started_at, ended_at, error, cancel_requested"
)


def _session_row(conn: sqlite3.Connection, session_id: str) -> sqlite3.Row | None:
    row: sqlite3.Row | None = conn.execute(
        f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE id = ?", (session_id,)
    ).fetchone()
    return row


def _turn_row(conn: sqlite3.Connection, session_id: str, turn_id: str) -> sqlite3.Row | None:
    row: sqlite3.Row | None = conn.execute(
        f"SELECT {_TURN_COLUMNS} FROM turns WHERE session = ? AND id = ?", (session_id, turn_id)
    ).fetchone()
    return row


def _fenced_turn_row(
    conn: sqlite3.Connection, session_id: str, turn_id: str, refusal: str, lease: Lease | None
) -> sqlite3.Row:
    """The turn's row, whatever its status, if the session and turn exist and ``lease`` (if any) is
    current; else UnknownSession, LeaseLost or StoreError(``refusal``: why)."""
    session = _session_row(conn, session_id)
    if session is None:
        raise UnknownSession(f"{refusal}: the session is unknown")
    _check_fence(session, lease, refusal)
    turn = _turn_row(conn, session_id, turn_id)
    if turn is None:
        raise StoreError(f"{refusal}: no such turn")
    return turn


def _pending_turn_row(
    conn: sqlite3.Connection, session_id: str, turn_id: str, refusal: str, lease: Lease | None
) -> sqlite3.Row:
    """``_fenced_turn_row``, and StoreError(``refusal``) unless the turn is pending."""
    turn = _fenced_turn_row(conn, session_id, turn_id, refusal, lease)
    if turn["status"] != PENDING:
        raise codec.not_pending(refusal, turn["status"])
    return turn


def _write_commit(
    conn: sqlite3.Connection,
    session_id: str,
    turn: sqlite3.Row,
    columns: dict[str, Any],
    messages: Sequence[Message],
    rewrite: bool,
    assistant: str,
    model: str | None,
) -> tuple[int, ...]:
    """Write a pending turn's results in the caller's transaction: its entries (``rewrite``: as the
    new active transcript), its row, its session's assistant, model and state; delete its journal."""
    if rewrite:
        conn.execute("UPDATE entries SET active = 0 WHERE session = ? AND active = 1", (session_id,))
    seqs = _insert_entries(conn, session_id, messages)
    assignments = ", ".join(f"{name} = ?" for name in columns)
    conn.execute(f"UPDATE turns SET {assignments} WHERE n = ?", (*columns.values(), turn["n"]))
    conn.execute(
        "UPDATE sessions SET assistant = ?, updated_at = ?, model = COALESCE(?, model),"
        " state = CASE state WHEN 'closed' THEN 'closed' ELSE 'idle' END WHERE id = ?",
        (assistant, columns["ended_at"], model, session_id),
    )
    _prune_journal(conn, session_id, turn["id"])
    return tuple(seqs)


def _landed_commit(
    conn: sqlite3.Connection,
    session_id: str,
    turn: sqlite3.Row,
    columns: dict[str, Any],
    messages: Sequence[Message],
    rewrite: bool,
) -> tuple[int, ...] | None:
    """The seqs an earlier commit of these very results wrote, or None if the turn ended otherwise
    (``codec.landed_commit_seqs``). Reads only."""
    first = _first_commit_seq(conn, session_id, turn, rewrite)
    rows: list[tuple[int, int, str, int]] = []
    if first is not None:
        rows = conn.execute(
            "SELECT e.seq, e.active, e.message, EXISTS (SELECT 1 FROM turns t WHERE t.session = e.session"
            " AND t.message_seq = e.seq) FROM entries e WHERE e.session = ? AND e.seq >= ?"
            " ORDER BY e.seq LIMIT ?",
            (session_id, first, len(messages) + 1),
        ).fetchall()
    entries = [codec.EntryRow(seq, bool(active), text, bool(is_input)) for seq, active, text, is_input in rows]
    stored = {name: turn[name] for name in turn.keys()}  # noqa: SIM118 - a Row is not a Mapping
    encoded = [codec.encode_message(message) for message in messages]
    return codec.landed_commit_seqs(stored, columns, entries, encoded)


def _first_commit_seq(conn: sqlite3.Connection, session_id: str, turn: sqlite3.Row, rewrite: bool) -> int | None:
    """Where the commit that ended ``turn`` started writing entries (None: no entry says where).

    While a turn is pending nothing else writes the session's entries, so its commit wrote right
    after its input message. An opener turn has none: its commit wrote the first entry tagged with
    the turn or, when it rewrote the transcript, the first entry that is still active. A wrong
    guess only makes ``codec.landed_commit_seqs`` find other entries, and refuse.
    """
    if turn["message_seq"] is not None:
        return int(turn["message_seq"]) + 1
    where = "active = 1" if rewrite else "turn = ?"
    params: tuple[Any, ...] = (session_id,) if rewrite else (session_id, turn["id"])
    first = conn.execute(f"SELECT MIN(seq) FROM entries WHERE session = ? AND {where}", params).fetchone()[0]
    return None if first is None else int(first)


def _prune_journal(conn: sqlite3.Connection, session_id: str, turn_id: str) -> None:
    """Delete a turn's journal: it ended, so nothing will run it again. Inside the ending transaction."""
    conn.execute("DELETE FROM journal WHERE session = ? AND turn = ?", (session_id, turn_id))


def _check_fence(session: sqlite3.Row, lease: Lease | None, refusal: str) -> None:
    """The fence of a write (RFC 0009 §4): LeaseLost unless ``lease`` is None or the session's current lease.

    Runs inside the write's transaction, which holds the database's write lock: no claim can come
    between this check and the write's commit.
    """
    if lease is None:
        return
    if lease.session != session["id"]:
        raise StoreError(f"{refusal}: the lease given is for session {lease.session}")
    if session["owner"] != lease.replica or session["fence"] != lease.token:
        raise LeaseLost(lease, refusal, holder=session["owner"], holder_token=session["fence"])


def _session_from_row(
    row: sqlite3.Row, transcript: list[StoredEntry] | None = None, turns: list[TurnRecord | StartedTurn] | None = None
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


def _turn_from_row(conn: sqlite3.Connection, row: sqlite3.Row) -> TurnRecord | StartedTurn:
    if row["status"] == PENDING:
        return _started_from_row(conn, row)
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


def _started_from_row(conn: sqlite3.Connection, row: sqlite3.Row) -> StartedTurn:
    message: UserMessage | None = None
    if row["message_seq"] is not None:
        text = conn.execute(
            "SELECT message FROM entries WHERE session = ? AND seq = ?", (row["session"], row["message_seq"])
        ).fetchone()[0]
        decoded = codec.decode_message(text)
        if not isinstance(decoded, UserMessage):
            raise StoreError(f"session {row['session']} turn {row['id']}: its input entry is not a user message")
        message = decoded
    return StartedTurn(
        id=row["id"], message=message, started_at=row["started_at"], cancel_requested=bool(row["cancel_requested"])
    )


def _load_session(conn: sqlite3.Connection, session_id: str) -> StoredSession | None:
    row = _session_row(conn, session_id)
    if row is None:
        return None
    transcript = [
        StoredEntry(seq, codec.decode_message(text))
        for seq, text in conn.execute(
            "SELECT seq, message FROM entries WHERE session = ? AND active = 1 ORDER BY seq", (session_id,)
        )
    ]
    turns = [
        _turn_from_row(conn, turn)
        for turn in conn.execute(
            f"SELECT {_TURN_COLUMNS} FROM turns WHERE session = ? ORDER BY n", (session_id,)
        ).fetchall()
    ]
    return _session_from_row(row, transcript, turns)


def _watchers(conn: sqlite3.Connection, session_id: str, replica: str, now: float) -> tuple[str, ...]:
    """The replicas other than ``replica`` watching the session now (``Lease.watchers``)."""
    rows = conn.execute(
        "SELECT replica FROM watches WHERE session = ? AND replica != ? AND until > ? ORDER BY replica",
        (session_id, replica, now),
    ).fetchall()
    return tuple(row[0] for row in rows)
