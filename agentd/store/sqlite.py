"""The SQLite store (RFC 0003 §3): the embedded default, one database file and no server.

``STATE_DIR/agentd.db`` through the stdlib ``sqlite3`` module, in WAL mode with
``synchronous=FULL``: once a store call that writes has returned, what it wrote survives a crash
of the process or of the machine — except a write its caller marks ``durable=False``
(``begin_turn`` of a message whose client waits for the turn's answer): it is in the database at
once, so it survives a crash of the process, and becomes durable against a crash of the machine
with the next durable commit (the WAL is one sequential file: syncing it syncs every earlier
write). Every store call is ``agentd.store.sqlstore.SqlStore``'s (its operations,
``agentd.store.operations``, are the PostgreSQL store's too); this module only runs them. What is
SQLite's own:

- Every database call runs in the store's worker thread, one at a time, on one connection, so
  the supervisor's event loop is never blocked by disk I/O (``agentd.store.worker``). A caller
  cancelled while its call runs does not tear the call: the transaction completes (or rolls
  back) before the cancellation is delivered.
- Writes are group-committed (``_write``): one transaction and one fsync for every write that
  arrived while the previous batch was being written, each in a savepoint of its own.
- The operations' SQL is rendered by ``dialect.SQLITE`` and run by ``drive`` on the connection
  (sync, in the worker thread). Leases work as on PostgreSQL (one daemon owns the state dir, so
  in practice one replica holds them all); their clock is this machine's ``time.time()``.
- Errors: ``_wrap`` — an I/O error, a full disk, a locked or damaged database are
  ``StoreUnavailable``; a refused statement is ``StoreError``.

The schema version lives in ``PRAGMA user_version``; ``agentd.store.migrations.SQLITE`` maps each
version to the statements that bring the database from the previous version to it.
"""

from __future__ import annotations

import sqlite3
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel
import msgspec

from agentd.store import migrations
from agentd.store.base import StoreError, StoreUnavailable
from agentd.store.dialect import CLOCK, SQLITE
from agentd.store.sansio import Kind, Op, Query, run
from agentd.store.sqlstore import SqlStore
from agentd.store.worker import Worker

__all__ = ["SqliteStore"]

T = TypeVar("T")


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


class SqliteStore(SqlStore):
    """The SQLite store. Open with ``await SqliteStore.open(path)``."""

    dialect = SQLITE

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        """Wrap an open, migrated connection; use ``SqliteStore.open`` instead."""
        self._conn: sqlite3.Connection | None = conn
        self._path = path
        self._worker = Worker(f"agentd-store {path.name}")
        # Set when the batch being written has ended (None: no batch is being written).
        self._batch_done: anyio.Event | None = None
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

        if self._worker.stopped:  # closed before
            return
        await self._worker.run(close)
        self._worker.stop()

    @property
    def path(self) -> Path:
        """The database file."""
        return self._path

    @property
    def location(self) -> str:
        return str(self._path)

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
        return await self._worker.run(call)

    async def _write(self, what: str, op: Op[T], *, durable: bool = True) -> T:
        """Run ``op`` in a write transaction: its writes are committed if it returns, undone if it raises.

        Group commit: writes that arrive while another batch is being written wait for it and then
        go together, in one transaction (one fsync), each inside a savepoint of its own, so one that
        fails leaves nothing behind and does not affect the others. A caller is answered only once
        its batch is durable. A batch of only ``durable=False`` writes is committed without a sync.
        """
        if self._conn is None:
            raise StoreError(f"{what}: the store is closed")
        write: _Write[T] = _Write(what, lambda conn: drive(conn, op), durable)
        self._queued.append(write)
        # Writes that arrive while a batch is being written wait for it to end (all woken at once,
        # not handed a lock one after another), then one of them writes everything queued.
        while not write.done:
            if self._batch_done is not None:
                await self._batch_done.wait()
                continue
            # One turn of the loop first: the writes made in this turn of it join this batch.
            await anyio.lowlevel.cancel_shielded_checkpoint()
            if self._batch_done is None and not write.done:
                await self._commit_queued()
        if write.error is not None:
            raise write.error
        return write.result  # type: ignore[return-value]  # set whenever error is None

    async def _commit_queued(self) -> None:
        """Write every queued write as one batch; each ends done, with its result or its error."""
        batch, self._queued = self._queued, []
        done = self._batch_done = anyio.Event()
        try:
            await self._run("write", lambda conn: _write_batch(conn, batch))
        except BaseException as exc:  # e.g. the store was closed meanwhile: nothing of the batch ran
            _fail_unwritten(batch, exc)  # so that no waiter of this batch waits for it again
            if not isinstance(exc, StoreError):
                raise
        finally:
            self._batch_done = None
            done.set()
        failed = [w.error for w in batch if isinstance(w.error, StoreUnavailable)]
        self.failure = str(failed[0]) if failed else None

    async def _read(self, what: str, op: Op[T]) -> T:
        """Run ``op`` in one read transaction (a consistent snapshot)."""
        return await self._run(what, lambda conn: _transaction(conn, lambda conn: drive(conn, op), "BEGIN"))


# --------------------------------------------------------------------------- worker-thread helpers


def drive(conn: sqlite3.Connection, op: Op[T]) -> T:
    """Run the operation ``op`` (``agentd.store.operations``) to its end on ``conn``, in the caller's
    transaction. Runs in the worker thread.

    The lease clock (``{now}``, bound as ``CLOCK``) is this machine's, read once: every statement
    of one call sees one time.
    """
    clock = time.time()
    render, execute = SQLITE.render, conn.execute  # looked up once: an answer is on every statement's path

    def answer(query: Query) -> Any:
        kind, sql, params, each = query
        rendered = render(sql)
        if kind is Kind.MANY:
            if rendered.clock:
                each = ({**one, CLOCK: clock} for one in each)
            conn.executemany(rendered.sql, each)
            return None
        cursor = execute(rendered.sql, {**params, CLOCK: clock} if rendered.clock else params)
        if kind is Kind.ONE:
            return cursor.fetchone()
        return cursor.fetchall() if kind is Kind.ALL else cursor.rowcount

    return run(op, answer)


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


def _fail_unwritten(batch: list[_Write[Any]], exc: BaseException) -> None:
    """Every write of ``batch`` that the batch did not get to: failed, because of ``exc``."""
    for queued in batch:
        if queued.done:
            continue
        if isinstance(exc, StoreUnavailable):
            queued.error = StoreUnavailable(f"{queued.what}: {exc}", full=exc.full)
        elif isinstance(exc, StoreError):
            queued.error = StoreError(f"{queued.what}: {exc}")
        else:
            queued.error = StoreError(f"{queued.what}: not written: {type(exc).__name__}: {exc}")
        queued.done = True


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
