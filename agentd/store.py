"""The supervisor's durable store (RFC 0003 §3): sessions, their transcripts and their turns.

SQLite through the stdlib ``sqlite3`` module, one database file (``STATE_DIR/agentd.db``) in WAL
mode with ``synchronous=FULL``: once a store call that writes has returned, what it wrote survives
a crash of the process or of the machine.

Rules the schema and the calls keep:

- A user message is stored (``begin_turn``) before it is delivered to a child; a turn's results
  are written by exactly one transaction (``commit_turn``). A failure inside that transaction
  leaves nothing of it behind and the turn still pending.
- While a turn is pending, its side-effecting tool calls are journaled (``journal_start`` before
  a call runs, ``journal_finish`` with its result; RFC 0008 §5) so that a re-run never runs one
  again. The transaction that ends the turn (commit or abandon) deletes its journal.
- Entries are never deleted. A transfer that rewrites history marks the old entries inactive and
  inserts the new transcript; a session's transcript is its active entries in ``seq`` order.
  ``seq`` is per session, increasing, never reused.
- Messages are stored as msgspec JSON of the ``agentd.messages.Message`` union and nothing else:
  no configuration, no environment, so no secret can reach the file.
- Every database call runs in a worker thread, one at a time, on one connection, so the
  supervisor's event loop is never blocked by disk I/O (``anyio.to_thread.run_sync`` with a
  ``CapacityLimiter(1)``). A caller cancelled while its call runs does not tear the call: the
  transaction completes (or rolls back) before the cancellation is delivered.

The schema version lives in ``PRAGMA user_version``; ``_MIGRATIONS`` maps each version to the
function that brings the database from the previous version to it.
"""

from __future__ import annotations

import sqlite3
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar, get_args

import anyio
import msgspec

from agentd.budget import TurnStatus, Usage
from agentd.messages import AssistantMessage, Message, SystemMessage, ToolResult, UserMessage
from agentd.records import PENDING, Discarded, JournalEntry, SessionState, StartedTurn, TurnRecord

__all__ = [
    "SCHEMA_VERSION",
    "CommittedTurn",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "StoredEntry",
    "StoredSession",
    "UnknownSession",
]

T = TypeVar("T")

#: The schema version this code writes; ``PRAGMA user_version`` of an up-to-date database.
SCHEMA_VERSION = 3

_SESSION_STATES: frozenset[str] = frozenset(get_args(SessionState))
_TURN_STATUSES: frozenset[str] = frozenset(status.value for status in TurnStatus)
_MESSAGE_TYPES = (UserMessage, AssistantMessage, SystemMessage, ToolResult)

_json_encoder = msgspec.json.Encoder()
_message_decoder = msgspec.json.Decoder(Message)
_discarded_decoder = msgspec.json.Decoder(tuple[Discarded, ...])
_models_decoder = msgspec.json.Decoder(tuple[str, ...])
_arguments_decoder = msgspec.json.Decoder(dict[str, Any])


class StoreError(Exception):
    """A store call that cannot be done; the message names the session and turn concerned."""


class StoreUnavailable(StoreError):
    """The database itself failed (I/O error, disk full, locked by another process): not the call's fault.

    ``full`` is set when the disk (or the database's size limit) is full.
    """

    def __init__(self, message: str, *, full: bool = False) -> None:
        super().__init__(message)
        self.full = full


class UnknownSession(StoreError):
    """A call named a session the store does not have."""


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


class StoredEntry(msgspec.Struct, frozen=True):
    """One transcript entry: its per-session sequence number and the message."""

    seq: int
    message: Message


class CommittedTurn(msgspec.Struct, frozen=True):
    """What ``commit_turn`` wrote: the turn's record as stored, and the seqs of the entries it added."""

    record: TurnRecord
    seqs: tuple[int, ...]


class StoredSession(msgspec.Struct, frozen=True, kw_only=True):
    """A session as stored. ``transcript`` and ``turns`` are empty in ``list_sessions`` results.

    ``turns`` are in start order: a ``TurnRecord`` for each turn that ended, a ``StartedTurn``
    for the one still pending (at most one).
    """

    id: str
    assistant: str
    state: SessionState
    generation: int
    model: str
    created_at: float
    updated_at: float
    transcript: list[StoredEntry] = []
    turns: list[TurnRecord | StartedTurn] = []
    turn_count: int = 0  # how many turns the session has had (filled in summaries too)


# --------------------------------------------------------------------------- schema


def _migrate_v1(conn: sqlite3.Connection) -> None:
    """Version 1: sessions, entries (the transcripts, append-only) and turns."""
    conn.execute(
        """
        CREATE TABLE sessions (
            id          TEXT PRIMARY KEY,
            assistant   TEXT NOT NULL,
            state       TEXT NOT NULL CHECK (state IN ('idle', 'running', 'failed', 'closed')),
            generation  INTEGER NOT NULL,
            model       TEXT NOT NULL,
            created_at  REAL NOT NULL,
            updated_at  REAL NOT NULL
        )
        """
    )
    conn.execute(
        """
        CREATE TABLE entries (
            session  TEXT NOT NULL REFERENCES sessions (id),
            seq      INTEGER NOT NULL CHECK (seq > 0),
            turn     TEXT,
            active   INTEGER NOT NULL CHECK (active IN (0, 1)),
            message  TEXT NOT NULL,
            PRIMARY KEY (session, seq)
        )
        """
    )
    conn.execute("CREATE INDEX entries_active ON entries (session, seq) WHERE active = 1")
    conn.execute(
        """
        CREATE TABLE turns (
            n              INTEGER PRIMARY KEY,
            session        TEXT NOT NULL REFERENCES sessions (id),
            id             TEXT NOT NULL,
            status         TEXT NOT NULL,
            message_seq    INTEGER,
            models         TEXT NOT NULL DEFAULT '[]',
            steps          INTEGER NOT NULL DEFAULT 0,
            restarts       INTEGER NOT NULL DEFAULT 0,
            discarded      TEXT NOT NULL DEFAULT '[]',
            input_tokens   INTEGER NOT NULL DEFAULT 0,
            output_tokens  INTEGER NOT NULL DEFAULT 0,
            started_at     REAL NOT NULL,
            ended_at       REAL,
            error          TEXT,
            UNIQUE (session, id),
            FOREIGN KEY (session, message_seq) REFERENCES entries (session, seq)
        )
        """
    )
    # The database itself refuses a second pending turn in one session.
    conn.execute("CREATE UNIQUE INDEX turns_one_pending ON turns (session) WHERE status = 'pending'")


def _migrate_v2(conn: sqlite3.Connection) -> None:
    """Version 2: sessions are rows loaded on demand; counting and paging them must not scan turns.

    ``sessions_state`` serves the status counts and the per-assistant counts of a reload; paging
    uses the rowid (creation order). Turns are counted per session through ``UNIQUE (session, id)``.
    """
    conn.execute("CREATE INDEX sessions_state ON sessions (state, assistant)")


def _migrate_v3(conn: sqlite3.Connection) -> None:
    """Version 3: the tool journal (RFC 0008 §5) — side-effecting calls of pending turns.

    A row is written before the call runs (``finished_at`` NULL) and completed with its result
    when it returns; the rows of a turn are deleted by the transaction that ends the turn. Plain
    SQL types and a composite key, so the same table works in PostgreSQL.
    """
    conn.execute(
        """
        CREATE TABLE journal (
            session      TEXT NOT NULL,
            turn         TEXT NOT NULL,
            seq          INTEGER NOT NULL CHECK (seq > 0),
            call         TEXT NOT NULL,
            tool         TEXT NOT NULL,
            arguments    TEXT NOT NULL,
            started_at   REAL NOT NULL,
            finished_at  REAL,
            content      TEXT,
            is_error     INTEGER NOT NULL DEFAULT 0 CHECK (is_error IN (0, 1)),
            PRIMARY KEY (session, turn, seq),
            FOREIGN KEY (session, turn) REFERENCES turns (session, id)
        )
        """
    )


#: version -> the migration that brings a database at version-1 to it (each runs in one transaction).
_MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {1: _migrate_v1, 2: _migrate_v2, 3: _migrate_v3}


# --------------------------------------------------------------------------- encoding


def _encode_message(message: Message) -> str:
    """The stored form of one message: msgspec JSON of the ``Message`` union (tag ``role``)."""
    return _json_encoder.encode(message).decode()


def _decode_message(text: str) -> Message:
    return _message_decoder.decode(text)


def _check_message(message: object, where: str) -> None:
    if not isinstance(message, _MESSAGE_TYPES):
        raise StoreError(f"{where}: not a transcript message: {type(message).__name__}")


# --------------------------------------------------------------------------- store


class Store:
    """The durable store of the supervisor. Open with ``await Store.open(path)``."""

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        """Wrap an open, migrated connection; use ``Store.open`` instead."""
        self._conn: sqlite3.Connection | None = conn
        self._path = path
        self._limiter = anyio.CapacityLimiter(1)
        self._batch_lock = anyio.Lock()
        # Why the last batch of writes failed because of the database itself (None: it worked).
        self.failure: str | None = None
        self._queued: list[_Write[Any]] = []

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    async def open(cls, path: Path) -> Store:
        """Open (creating if needed) the database at ``path`` and bring its schema up to date.

        StoreError if the file cannot be opened, WAL cannot be enabled, or the database was
        written by a newer agentd (a schema version this code does not know).
        """
        path = Path(path)
        try:
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
        """Store a new session in state ``idle`` with its initial transcript (e.g. the opener).

        StoreError if a session with this id exists.
        """
        where = f"session {session_id}"
        for message in transcript:
            _check_message(message, where)

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
    ) -> None:
        """Set the given fields of a session (the others are kept); ``updated_at`` becomes now.

        StoreError if the session is unknown or ``state`` is not a session state.
        """
        where = f"session {session_id}"
        if state is not None and state not in _SESSION_STATES:
            raise StoreError(f"{where}: unknown state {state!r} (expected one of {sorted(_SESSION_STATES)})")
        fields: dict[str, Any] = {
            name: value
            for name, value in (
                ("state", state),
                ("generation", generation),
                ("model", model),
                ("assistant", assistant),
            )
            if value is not None
        }
        now = time.time()

        def op(conn: sqlite3.Connection) -> None:
            if _session_row(conn, session_id) is None:
                raise StoreError(f"{where} is unknown")
            assignments = ", ".join(f"{name} = ?" for name in fields)
            conn.execute(
                f"UPDATE sessions SET {assignments}{', ' if assignments else ''}updated_at = ? WHERE id = ?",
                (*fields.values(), now, session_id),
            )

        await self._write(f"update {where}", op)

    async def load_session(self, session_id: str) -> StoredSession | None:
        """The session with its active transcript and all its turns, or None if unknown."""
        return await self._read(f"load session {session_id}", lambda conn: _load_session(conn, session_id))

    async def session_summary(self, session_id: str) -> StoredSession | None:
        """The session's row only (no transcript, no turns; ``turn_count`` 0), or None if unknown."""

        def op(conn: sqlite3.Connection) -> StoredSession | None:
            row = _session_row(conn, session_id)
            return None if row is None else _session_from_row(row)

        return await self._read(f"read session {session_id}", op)

    async def transcript(self, session_id: str, *, exclude_turn: str | None = None) -> list[Message]:
        """The session's active transcript in order; ``exclude_turn``'s entries left out (its input re-runs)."""

        def op(conn: sqlite3.Connection) -> list[Message]:
            rows = conn.execute(
                "SELECT message FROM entries WHERE session = ? AND active = 1 AND (turn IS NULL OR turn != ?)"
                " ORDER BY seq",
                (session_id, exclude_turn or ""),
            )
            return [_decode_message(text) for (text,) in rows]

        return await self._read(f"read transcript of session {session_id}", op)

    async def list_sessions(self, *, limit: int = 100, after: str | None = None) -> list[StoredSession]:
        """One page of sessions (closed ones included) in creation order, newest last; transcript/turns empty.

        ``after`` is the id of the last session of the previous page. StoreError if it is unknown.
        """

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
        """Every pending turn of a session that is not closed, oldest first: what a restart resumes."""

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
        """How many sessions are in each state (``idle``, ``running``, ``failed``, ``closed``)."""

        def op(conn: sqlite3.Connection) -> dict[str, int]:
            counts = dict.fromkeys(sorted(_SESSION_STATES), 0)
            counts.update(conn.execute("SELECT state, COUNT(*) FROM sessions GROUP BY state").fetchall())
            return counts

        return await self._read("count sessions", op)

    async def open_sessions_by_assistant(self) -> dict[str, int]:
        """How many sessions that are not closed are on each assistant."""

        def op(conn: sqlite3.Connection) -> dict[str, int]:
            return dict(
                conn.execute(
                    "SELECT assistant, COUNT(*) FROM sessions WHERE state != 'closed' GROUP BY assistant"
                ).fetchall()
            )

        return await self._read("count sessions by assistant", op)

    # ------------------------------------------------------------------ turns

    async def begin_turn(
        self, session_id: str, turn_id: str, message: UserMessage | None, started_at: float
    ) -> int | None:
        """Start a turn in one transaction: store its user message, a ``pending`` turn row, state ``running``.

        The message is stored with its ``turn`` field set to ``turn_id``. Returns the message's
        seq, or None for an opener turn (``message`` None). StoreError if the session is unknown
        or closed, already has a pending turn, or already had a turn with this id.
        """
        where = f"session {session_id} turn {turn_id}"
        if message is not None:
            if not isinstance(message, UserMessage):
                raise StoreError(f"{where}: a turn's input must be a user message, not {type(message).__name__}")
            message = msgspec.structs.replace(message, turn=turn_id)

        def op(conn: sqlite3.Connection) -> int | None:
            row = _session_row(conn, session_id)
            if row is None:
                raise StoreError(f"cannot begin {where}: the session is unknown")
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
    ) -> CommittedTurn:
        """Write a finished turn in one transaction — the only write for its results.

        Appends ``messages`` as active entries or, when ``transcript`` is given (a transfer
        rewrote history), marks every active entry inactive and inserts ``transcript`` as the new
        active transcript. Sets the turn's status, models, steps, restarts, discarded, usage,
        ended_at and error from ``record``, and the session's ``assistant``, state (``idle``
        unless ``closed``), updated_at, and — when a transfer changed the assistant — ``model``.
        ``record.started_at`` is not written: a turn started when ``begin_turn`` stored it, and
        the returned record carries that time.

        StoreError if the session or turn is unknown or the turn is not pending (a duplicate
        commit writes nothing). If anything fails, nothing of the turn is written.
        """
        where = f"session {session_id} turn {record.id}"
        try:
            status = TurnStatus(record.status)
        except ValueError:
            raise StoreError(f"cannot commit {where}: unknown status {record.status!r}") from None
        new_messages = messages if transcript is None else transcript
        for message in new_messages:
            _check_message(message, where)

        def op(conn: sqlite3.Connection) -> CommittedTurn:
            turn = _pending_turn_row(conn, session_id, record.id, f"cannot commit {where}")
            if transcript is not None:
                conn.execute("UPDATE entries SET active = 0 WHERE session = ? AND active = 1", (session_id,))
            seqs = _insert_entries(conn, session_id, new_messages)
            conn.execute(
                "UPDATE turns SET status = ?, models = ?, steps = ?, restarts = ?, discarded = ?,"
                " input_tokens = ?, output_tokens = ?, ended_at = ?, error = ? WHERE n = ?",
                (
                    status.value,
                    _json_encoder.encode(record.models).decode(),
                    record.steps,
                    record.restarts,
                    _json_encoder.encode(record.discarded).decode(),
                    record.usage.input_tokens,
                    record.usage.output_tokens,
                    record.ended_at,
                    record.error,
                    turn["n"],
                ),
            )
            conn.execute(
                "UPDATE sessions SET assistant = ?, updated_at = ?, model = COALESCE(?, model),"
                " state = CASE state WHEN 'closed' THEN 'closed' ELSE 'idle' END WHERE id = ?",
                (assistant, record.ended_at, model, session_id),
            )
            _prune_journal(conn, session_id, record.id)
            stored = msgspec.structs.replace(record, status=status, started_at=turn["started_at"])
            return CommittedTurn(stored, tuple(seqs))

        return await self._write(f"commit {where}", op)

    async def abandon_turn(
        self, session_id: str, turn_id: str, *, status: str, error: str | None, ended_at: float
    ) -> None:
        """End a pending turn without results (e.g. its session was closed); its user message stays.

        ``status`` must be a TurnStatus value. A ``running`` session becomes ``idle``; a
        ``failed`` or ``closed`` one keeps its state. StoreError if the turn is unknown or not
        pending.
        """
        where = f"session {session_id} turn {turn_id}"
        if status not in _TURN_STATUSES:
            raise StoreError(
                f"cannot abandon {where}: unknown status {status!r} (expected one of {sorted(_TURN_STATUSES)})"
            )

        def op(conn: sqlite3.Connection) -> None:
            turn = _pending_turn_row(conn, session_id, turn_id, f"cannot abandon {where}")
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
        """The session's pending turn (with its user message), or None. StoreError if the session is unknown."""

        def op(conn: sqlite3.Connection) -> StartedTurn | None:
            if _session_row(conn, session_id) is None:
                raise StoreError(f"session {session_id} is unknown")
            row = conn.execute(
                f"SELECT {_TURN_COLUMNS} FROM turns WHERE session = ? AND status = ?", (session_id, PENDING)
            ).fetchone()
            return None if row is None else _started_from_row(conn, row)

        return await self._read(f"pending turn of session {session_id}", op)

    # ------------------------------------------------------------------ the tool journal

    async def journal_start(self, session_id: str, turn_id: str, entry: JournalEntry) -> None:
        """Journal that a side-effecting call is about to run (``entry``'s result fields are ignored).

        Durable when this returns: only then may the tool run. StoreError if the turn is not
        pending or the turn already journaled ``entry.seq`` (a call is journaled once).
        """
        where = f"session {session_id} turn {turn_id} call {entry.seq}"
        arguments = _json_encoder.encode(entry.arguments).decode()
        now = time.time()

        def op(conn: sqlite3.Connection) -> None:
            _pending_turn_row(conn, session_id, turn_id, f"cannot journal {where}")
            try:
                conn.execute(
                    "INSERT INTO journal (session, turn, seq, call, tool, arguments, started_at)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (session_id, turn_id, entry.seq, entry.call, entry.tool, arguments, now),
                )
            except sqlite3.IntegrityError:
                raise StoreError(f"cannot journal {where}: it is journaled already") from None

        await self._write(f"journal {where}", op)

    async def journal_finish(self, session_id: str, turn_id: str, seq: int, *, content: str, is_error: bool) -> None:
        """Journal the result of the call journaled as ``seq``. StoreError if there is no such started call."""
        where = f"session {session_id} turn {turn_id} call {seq}"
        now = time.time()

        def op(conn: sqlite3.Connection) -> None:
            updated = conn.execute(
                "UPDATE journal SET finished_at = ?, content = ?, is_error = ?"
                " WHERE session = ? AND turn = ? AND seq = ? AND finished_at IS NULL",
                (now, content, int(is_error), session_id, turn_id, seq),
            ).rowcount
            if updated != 1:
                raise StoreError(f"cannot journal the result of {where}: no such call is waiting for its result")

        await self._write(f"journal the result of {where}", op)

    async def journal_entries(self, session_id: str, turn_id: str) -> list[JournalEntry]:
        """The journaled calls of a turn in order (empty once the turn has ended)."""

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
                    arguments=_arguments_decoder.decode(row["arguments"]),
                    finished=row["finished_at"] is not None,
                    content=row["content"] or "",
                    is_error=bool(row["is_error"]),
                )
                for row in rows
            ]

        return await self._read(f"read the journal of session {session_id} turn {turn_id}", op)

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

    async def _write(self, what: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn`` in a write transaction: its writes are committed if it returns, undone if it raises.

        Group commit: writes that arrive while another batch is being written wait for it and then
        go together, in one transaction (one fsync), each inside a savepoint of its own, so one that
        fails leaves nothing behind and does not affect the others. A caller is answered only once
        its batch is durable.
        """
        if self._conn is None:
            raise StoreError(f"{what}: the store is closed")
        write: _Write[T] = _Write(what, fn)
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


def _migrate(conn: sqlite3.Connection, path: Path) -> None:
    """Bring the schema from its ``user_version`` to ``SCHEMA_VERSION``, one transaction per step."""
    current = conn.execute("PRAGMA user_version").fetchone()[0]
    if current > SCHEMA_VERSION:
        raise StoreError(f"it has schema version {current}; this agentd knows versions up to {SCHEMA_VERSION}")
    for version in range(current + 1, SCHEMA_VERSION + 1):
        migration = _MIGRATIONS.get(version)
        if migration is None:
            raise StoreError(f"no migration to schema version {version}")

        def step(
            conn: sqlite3.Connection,
            migration: Callable[[sqlite3.Connection], None] = migration,
            version: int = version,
        ) -> None:
            migration(conn)
            conn.execute(f"PRAGMA user_version = {int(version)}")

        _transaction(conn, step, "BEGIN IMMEDIATE")


class _Write(Generic[T]):
    """One queued write of a group commit, and its outcome."""

    __slots__ = ("done", "error", "fn", "result", "what")

    def __init__(self, what: str, fn: Callable[[sqlite3.Connection], T]) -> None:
        self.what, self.fn = what, fn
        self.done = False
        self.result: T | None = None
        self.error: StoreError | None = None


def _write_batch(conn: sqlite3.Connection, batch: list[_Write[Any]]) -> None:
    """Run every write of ``batch`` in one transaction, each in its own savepoint. Runs in the worker thread."""
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
            (session_id, seq, message.turn, _encode_message(message)),
        )
        seqs.append(seq)
    return seqs


def _prune_journal(conn: sqlite3.Connection, session_id: str, turn_id: str) -> None:
    """Delete a turn's journal: it ended, so nothing will run it again. Inside the ending transaction."""
    conn.execute("DELETE FROM journal WHERE session = ? AND turn = ?", (session_id, turn_id))


_SESSION_COLUMNS = "id, assistant, state, generation, model, created_at, updated_at"
_TURN_COLUMNS = (
    "n, session, id, status, message_seq, models, steps, restarts, discarded,"
    " input_tokens, output_tokens, started_at, ended_at, error"
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


def _pending_turn_row(conn: sqlite3.Connection, session_id: str, turn_id: str, refusal: str) -> sqlite3.Row:
    """The turn's row if the session and turn exist and the turn is pending; else StoreError(``refusal``: why)."""
    if _session_row(conn, session_id) is None:
        raise StoreError(f"{refusal}: the session is unknown")
    turn = _turn_row(conn, session_id, turn_id)
    if turn is None:
        raise StoreError(f"{refusal}: no such turn")
    if turn["status"] != PENDING:
        raise StoreError(f"{refusal}: the turn is not pending (status {turn['status']})")
    return turn


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
        models=_models_decoder.decode(row["models"]),
        steps=row["steps"],
        restarts=row["restarts"],
        discarded=_discarded_decoder.decode(row["discarded"]),
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
        decoded = _decode_message(text)
        if not isinstance(decoded, UserMessage):
            raise StoreError(f"session {row['session']} turn {row['id']}: its input entry is not a user message")
        message = decoded
    return StartedTurn(id=row["id"], message=message, started_at=row["started_at"])


def _load_session(conn: sqlite3.Connection, session_id: str) -> StoredSession | None:
    row = _session_row(conn, session_id)
    if row is None:
        return None
    transcript = [
        StoredEntry(seq, _decode_message(text))
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
