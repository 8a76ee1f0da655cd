"""The PostgreSQL store (RFC 0009): the same store on a database several replicas share.

psycopg 3 (async, on anyio's asyncio backend) through a ``psycopg_pool`` connection pool. Every
store call is ``agentd.store.sqlstore.SqlStore``'s (its operations, ``agentd.store.operations``,
are the SQLite store's too); this module runs them (``drive``, the SQL rendered by
``dialect.POSTGRES``: row locks, the server's clock, ``SKIP LOCKED``) and has LISTEN/NOTIFY. What
is PostgreSQL's own:

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
from agentd.obs import get_logger
from agentd.redact import redact_database_url
from agentd.store import migrations
from agentd.store.base import NOTIFY_CHANNELS, Lease, StoreError, StoreUnavailable
from agentd.store.dialect import POSTGRES
from agentd.store.sansio import Kind, Op, Query, run_async
from agentd.store.sqlstore import SqlStore

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
log = get_logger("store")


class PostgresStore(SqlStore):
    """The PostgreSQL store. Open with ``await PostgresStore.open(url, password=…)``."""

    dialect = POSTGRES

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

    # ------------------------------------------------------------------ notifications (LISTEN/NOTIFY)

    async def notify(self, channel: str, payload: str) -> None:
        def op() -> Op[None]:
            yield Query(Kind.RUN, "SELECT pg_notify(:channel, :payload)", {"channel": channel, "payload": payload})

        try:
            await self._write(f"notify {channel}", op())
        except StoreError as exc:
            log.debug(events.LOG_STORE_NOTIFY_FAILED, channel=channel, error=str(exc))

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
        def op() -> Op[None]:
            yield Query(
                Kind.MANY,
                "SELECT pg_notify(:channel, :payload) WHERE :session::text IS NULL OR EXISTS"
                " (SELECT 1 FROM sessions WHERE id = :session AND fence = :token"
                " AND (owner IS NULL OR owner = :owner))",
                {},
                rows,
            )

        if not notes:
            return None
        try:
            await self._write(f"notify {len(notes)} times", op())
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
        log.debug(events.LOG_STORE_LISTEN_FAILED, error=self._scrub(str(exc)))
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

    # ------------------------------------------------------------------ plumbing

    async def _write(self, what: str, op: Op[T], *, durable: bool = True) -> T:
        """Run ``op`` in one READ COMMITTED transaction: committed if it returns, rolled back if it raises.

        ``durable`` is SQLite's business (its group commit); here a write that need not be synced
        says so itself (``Dialect.relaxed_commit``, ``begin_turn``).
        """
        return await self._call(what, op, snapshot=False)

    async def _read(self, what: str, op: Op[T]) -> T:
        """Run ``op`` in one REPEATABLE READ, READ ONLY transaction (a consistent snapshot)."""
        return await self._call(what, op, snapshot=True)

    async def _call(self, what: str, op: Op[T], *, snapshot: bool) -> T:
        """One store call: shielded from the caller's cancellation, bounded in time, errors as StoreErrors.

        ``failure`` follows the outcome: set when the database failed, cleared when it answered.
        """
        pool = self._pool
        if pool is None:
            raise StoreError(f"{what}: the store is closed")
        with anyio.CancelScope(shield=True):
            try:
                result = await self._transaction(pool, what, op, snapshot)
            except StoreUnavailable as exc:
                self.failure = str(exc)
                raise
            except StoreError:
                self.failure = None
                raise
        self.failure = None
        return result

    async def _transaction(self, pool: AsyncConnectionPool[Conn], what: str, op: Op[T], snapshot: bool) -> T:
        try:
            try:
                async with pool.connection() as conn:
                    return await _run(conn, what, op, snapshot)
            except PoolTimeout:
                # No pooled connection in time: the server is down, or the pool is still backing off
                # from an outage that is over. A connection of the call's own tells which, and serves it.
                async with await self._own_connection(what) as conn:
                    await _configure(conn)
                    return await _run(conn, what, op, snapshot)
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


async def _run(conn: Conn, what: str, op: Op[T], snapshot: bool) -> T:
    """``op`` in one transaction on ``conn``; a call with no answer within ``CALL_BOUND`` is abandoned."""
    with anyio.move_on_after(CALL_BOUND) as bound:
        async with conn.transaction():
            if snapshot:
                await conn.execute(_SNAPSHOT)
            result = await drive(conn, op)
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
        log.warning(events.LOG_STORE_DRIVER, logger=record.name, message=" ".join(record.getMessage().split()))


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
            cursor = await conn.execute("SELECT COALESCE(MAX(version), 0) AS version FROM agentd_schema")
            row = await cursor.fetchone()
            current = int(row["version"]) if row is not None else 0
            if current > newest:
                raise StoreError(f"it has schema version {current}; this agentd knows versions up to {newest}")
            if current == newest:
                return
            statements = migrations.POSTGRES.get(current + 1)
            if statements is None:
                raise StoreError(f"no migration to schema version {current + 1}")
            for statement in statements:
                await conn.execute(statement)
            applied = POSTGRES.render("INSERT INTO agentd_schema (version, applied_at) VALUES (:version, {now})")
            await conn.execute(applied.sql, {"version": current + 1})


# --------------------------------------------------------------------------- the driver


async def drive(conn: Conn, op: Op[T]) -> T:
    """Run the operation ``op`` (``agentd.store.operations``) to its end on ``conn``, in the caller's transaction."""

    async def answer(query: Query) -> Any:
        sql = POSTGRES.render(query.sql).sql
        if query.kind is Kind.MANY:
            async with conn.cursor() as cursor:
                await cursor.executemany(sql, query.each)
            return None
        result = await conn.execute(sql, query.params)
        if query.kind is Kind.ONE:
            return await result.fetchone()
        return await result.fetchall() if query.kind is Kind.ALL else result.rowcount

    return await run_async(op, answer)
