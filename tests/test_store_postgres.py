"""What is PostgreSQL's own in the store (RFC 0009 §1, §5): the password, the server failing, locks, errors.

Everything else the store does is tested on both backends by tests/test_store.py and
tests/test_store_leases.py. These tests use the suite's PostgreSQL (tests/pg_harness.py); the one
that stops its server starts a server of its own.
"""

from __future__ import annotations

import secrets
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import psycopg
import pytest
from psycopg_pool import PoolTimeout
from structlog.testing import capture_logs

from agentd import events
from agentd.budget import TurnStatus
from agentd.config import StoreSettings
from agentd.messages import AssistantMessage, UserMessage
from agentd.records import TurnRecord
from agentd.store import CommittedTurn, Store, StoreError, StoreUnavailable, migrations, open_store, postgres
from agentd.store.postgres import PostgresStore
from tests import pg_harness, pg_proxy
from tests.pg_harness import Cluster, PgServer

pytestmark = pytest.mark.anyio

PASSWORD_ENV = "AGENTD_TEST_STORE_PASSWORD"


@pytest.fixture
def database(pg: PgServer) -> Any:
    with pg.database() as url:
        yield url


@pytest.fixture
async def store(database: str) -> AsyncIterator[PostgresStore]:
    opened = await PostgresStore.open(database)
    try:
        yield opened
    finally:
        await opened.close()


async def new_session(store: Store, session_id: str = "s1", pending: str | None = "t1") -> None:
    await store.create_session(session_id, assistant="triage", generation=1, model="echo-small", created_at=1.0)
    if pending is not None:
        await store.begin_turn(session_id, pending, UserMessage(content="hello"), started_at=1.0)


def done(turn: str) -> TurnRecord:
    return TurnRecord(id=turn, status=TurnStatus.COMPLETED, started_at=1.0, ended_at=2.0)


def every_text(logs: list[dict[str, Any]]) -> str:
    return "\n".join(repr(entry) for entry in logs)


# --------------------------------------------------------------------------- the password


async def test_the_password_comes_from_the_env_var_named_by_password_env(pg: PgServer, tmp_path: Path) -> None:
    secret = f"pw-{secrets.token_hex(8)}"
    with pg.role(secret) as role, pg.database(owner=role) as url:
        assert secret not in url
        settings = StoreSettings(url=url, password_env=PASSWORD_ENV)
        store = await open_store(settings, tmp_path, environ={PASSWORD_ENV: secret})
        try:
            await new_session(store)
            assert (await store.session_counts())["running"] == 1
            assert secret not in store.location and role not in store.location  # no user, no query
        finally:
            await store.close()


async def test_a_wrong_password_is_refused_without_being_shown(pg: PgServer, tmp_path: Path) -> None:
    secret = f"pw-{secrets.token_hex(8)}"
    wrong = f"wrong-{secrets.token_hex(8)}"
    with pg.role(secret) as role, pg.database(owner=role) as url:
        settings = StoreSettings(url=url, password_env=PASSWORD_ENV)
        with capture_logs() as logs, pytest.raises(StoreError) as refused:
            await open_store(settings, tmp_path, environ={PASSWORD_ENV: wrong})
        assert type(refused.value) is StoreError  # for good: waiting cannot help
        message = str(refused.value)
        assert message.startswith("cannot open the store postgresql:///agentd_test_"), message
        assert f"(host {pg.cluster.root})" in message if pg.cluster else True
        assert f'password authentication failed for user "{role}"' in message, message
        assert wrong not in message and secret not in message
        assert wrong not in every_text(logs)

        with pytest.raises(StoreError) as missing:
            await open_store(settings, tmp_path, environ={})
        assert type(missing.value) is StoreError
        assert f"no password was given: {PASSWORD_ENV}, named by [store] password_env, is not set" in str(missing.value)


async def test_a_password_changed_under_a_running_store_is_unavailable_and_never_shown(
    pg: PgServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(postgres, "POOL_TIMEOUT", 0.5)  # how long a call waits for the pool to reconnect
    secret = f"pw-{secrets.token_hex(8)}"
    with pg.role(secret) as role, pg.database(owner=role) as url:
        store = await open_store(StoreSettings(url=url, password_env=PASSWORD_ENV), tmp_path, {PASSWORD_ENV: secret})
        try:
            await new_session(store)
            with capture_logs() as logs:
                pg.execute(f"ALTER ROLE {role} PASSWORD 'something-else'")
                pg.execute(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'")
                with pytest.raises(StoreUnavailable) as unavailable:
                    await store.load_session("s1")
            message = str(unavailable.value)
            assert message.startswith("load session s1: cannot reach the database: "), message
            assert "password authentication failed" in message
            assert secret not in message
            assert store.failure is not None and secret not in store.failure
            assert secret not in every_text(logs)
        finally:
            await store.close()


# --------------------------------------------------------------------------- the server failing


async def test_an_unreachable_server_is_one_clear_error_at_open() -> None:
    with pytest.raises(StoreUnavailable) as refused:  # it may be there later: the daemon waits for it
        await PostgresStore.open("postgresql://alice@127.0.0.1:1/agentd")
    message = str(refused.value)
    assert message.startswith("cannot open the store postgresql://127.0.0.1:1/agentd: "), message
    assert "alice" not in message.partition(": ")[0]  # the user is not part of where
    assert "Connection refused" in message or "connection failed" in message, message


async def test_a_server_that_goes_down_is_unavailable_and_readiness_comes_back_with_it(pg: PgServer) -> None:
    bindir = pg_harness.find_bindir()
    if bindir is None:  # only when AGENTD_TEST_PG_URL names a server and no binaries are installed
        pytest.skip("stopping a server needs PostgreSQL's binaries (initdb, pg_ctl); only a URL was given")
    cluster = Cluster(bindir).init().start()
    try:
        store = await PostgresStore.open(cluster.url(), pool_timeout=0.5)
        try:
            await new_session(store, pending=None)
            assert store.failure is None
            cluster.stop(
                "fast"
            )  # an immediate stop would lose the last commits: the suite runs with synchronous_commit off
            with pytest.raises(StoreUnavailable, match=r"^begin session s1 turn t1: cannot reach the database: "):
                await store.begin_turn("s1", "t1", UserMessage(content="anyone?"), started_at=2.0)
            assert store.failure is not None and store.failure.startswith("begin session s1 turn t1: ")
            with pytest.raises(StoreUnavailable):
                await store.session_counts()  # reads see it too

            cluster.start()
            assert await store.begin_turn("s1", "t1", UserMessage(content="anyone?"), started_at=2.0) == 1
            assert store.failure is None
            assert (await store.pending_turn("s1")) is not None
        finally:
            await store.close()
    finally:
        cluster.remove()


async def test_a_statement_the_server_times_out_is_unavailable(database: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(postgres, "STATEMENT_TIMEOUT", 0.2)
    store = await PostgresStore.open(database)
    try:
        await new_session(store)
        async with await psycopg.AsyncConnection.connect(database) as blocker:
            await blocker.execute("SELECT 1 FROM sessions WHERE id = 's1' FOR UPDATE")  # held until the end
            with pytest.raises(
                StoreUnavailable, match=r"^commit session s1 turn t1: QueryCanceled: .*statement timeout"
            ):
                await store.commit_turn("s1", done("t1"), assistant="triage")
        assert (await store.pending_turn("s1")) is not None  # nothing of it was written
    finally:
        await store.close()


# --------------------------------------------------------------------------- a connection lost with COMMIT in flight


def rows(database: str, query: str) -> list[tuple[Any, ...]]:
    """``query`` on the database directly (not through the proxy)."""
    with psycopg.connect(database) as conn:
        return conn.execute(query).fetchall()


async def test_a_commit_whose_answer_was_lost_with_the_connection_is_recognised_by_its_retry(database: str) -> None:
    """The connection is lost once the server committed and before the store heard (RFC 0003 §3):
    the store cannot know; its retry finds the results stored and returns them, writing nothing twice."""
    messages = [AssistantMessage(content="hi", turn="t1"), AssistantMessage(content="again", turn="t1")]
    async with pg_proxy.serving(database) as proxy:
        store = await PostgresStore.open(proxy.url(database))
        try:
            await new_session(store)
            lease = await store.claim("s1", "r1", 600.0)
            arguments: dict[str, Any] = {"assistant": "triage", "messages": messages, "lease": lease}
            proxy.arm(pg_proxy.TURN_COMMIT, pg_proxy.Cut.AFTER_REPLY)
            with pytest.raises(StoreUnavailable, match=r"^commit session s1 turn t1: "):
                await store.commit_turn("s1", done("t1"), **arguments)
            assert proxy.cut.is_set()
            assert rows(database, "SELECT status FROM turns WHERE id = 't1'") == [("completed",)]  # it landed

            with capture_logs() as logs:
                committed = await store.commit_turn("s1", done("t1"), **arguments)
        finally:
            await store.close()

    assert committed == CommittedTurn(msgspec.structs.replace(done("t1"), started_at=1.0), (2, 3))
    assert rows(database, "SELECT seq, message::json->>'content' FROM entries ORDER BY seq") == [
        (1, "hello"),
        (2, "hi"),
        (3, "again"),
    ]
    [recovered] = [entry for entry in logs if entry["event"] == events.LOG_TURN_COMMIT_RECOVERED]
    assert (recovered["session"], recovered["turn"], recovered["seqs"]) == ("s1", "t1", [2, 3])


async def test_a_commit_lost_before_it_reached_the_server_is_written_by_its_retry(database: str) -> None:
    messages = [AssistantMessage(content="hi", turn="t1")]
    async with pg_proxy.serving(database) as proxy:
        store = await PostgresStore.open(proxy.url(database))
        try:
            await new_session(store)
            proxy.arm(pg_proxy.TURN_COMMIT, pg_proxy.Cut.BEFORE_COMMIT)
            with pytest.raises(StoreUnavailable, match=r"^commit session s1 turn t1: "):
                await store.commit_turn("s1", done("t1"), assistant="triage", messages=messages)
            assert proxy.cut.is_set()
            assert rows(database, "SELECT status FROM turns WHERE id = 't1'") == [("pending",)]  # rolled back

            with capture_logs() as logs:
                committed = await store.commit_turn("s1", done("t1"), assistant="triage", messages=messages)
        finally:
            await store.close()

    assert committed.seqs == (2,)
    assert rows(database, "SELECT seq FROM entries ORDER BY seq") == [(1,), (2,)]
    assert not [entry for entry in logs if entry["event"] == events.LOG_TURN_COMMIT_RECOVERED]


# --------------------------------------------------------------------------- locks: waiting without blocking


async def test_a_call_waiting_for_a_lock_does_not_block_the_event_loop(store: PostgresStore, database: str) -> None:
    await new_session(store)
    log: list[str] = []
    async with await psycopg.AsyncConnection.connect(database) as blocker:
        await blocker.execute("SELECT 1 FROM sessions WHERE id = 's1' FOR UPDATE")
        committed = anyio.Event()

        async def commit() -> None:
            await store.commit_turn("s1", done("t1"), assistant="triage", messages=[AssistantMessage(content="ok")])
            log.append("commit returned")
            committed.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(commit)
            for index in range(5):  # the loop runs while the commit waits for the row
                log.append(f"tick {index}")
                await anyio.lowlevel.checkpoint()
            assert not committed.is_set()
            await blocker.rollback()  # releases the row
            with anyio.fail_after(30):
                await committed.wait()
    assert log == [*(f"tick {i}" for i in range(5)), "commit returned"]


async def test_the_failover_scan_skips_a_locked_session_instead_of_waiting(store: PostgresStore, database: str) -> None:
    """``FOR UPDATE SKIP LOCKED``: a session another transaction holds is left out, not waited for."""
    for session in ("a", "b", "c"):
        await new_session(store, session)
    async with await psycopg.AsyncConnection.connect(database) as blocker:
        await blocker.execute("SELECT 1 FROM sessions WHERE id = 'b' FOR UPDATE")
        began = time.monotonic()
        claimed = await store.claim_orphaned("r1", 60.0)
        assert time.monotonic() - began < postgres.STATEMENT_TIMEOUT  # it did not wait for b's lock
        assert sorted(lease.session for lease in claimed) == ["a", "c"]
    assert [lease.session for lease in await store.claim_orphaned("r1", 60.0)] == ["b"]


# --------------------------------------------------------------------------- errors and opening


@pytest.mark.parametrize(
    ("error", "unavailable", "full"),
    [
        (psycopg.errors.DiskFull("could not extend file"), True, True),
        (psycopg.errors.AdminShutdown("terminating connection"), True, False),
        (psycopg.errors.QueryCanceled("canceling statement due to statement timeout"), True, False),
        (psycopg.errors.ReadOnlySqlTransaction("cannot execute INSERT in a read-only transaction"), True, False),
        (psycopg.errors.DeadlockDetected("deadlock detected"), True, False),
        (psycopg.OperationalError("connection failed: server closed the connection"), True, False),
        (psycopg.errors.UniqueViolation("duplicate key value"), False, False),
        (psycopg.errors.UndefinedColumn('column "x" does not exist'), False, False),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, Exception) else str(value),
)
def test_postgres_errors_map_to_the_store_errors(error: psycopg.Error, unavailable: bool, full: bool) -> None:
    wrapped = postgres._wrap("commit session s1 turn t1", error, "hunter2")
    assert isinstance(wrapped, StoreUnavailable) is unavailable
    assert isinstance(wrapped, StoreError)
    assert getattr(wrapped, "full", False) is full
    assert str(wrapped).startswith(f"commit session s1 turn t1: {type(error).__name__}: ")


# --------------------------------------------------------------------------- opening: wait, or give up?

#: How libpq and psycopg word a failed connection (they give no SQLSTATE for it), and the server's
#: refusals within it, as this libpq prints them (tests/test_e2e_postgres.py meets several live).
AT = 'connection failed: connection to server at "db.internal" (10.0.0.5), port 5432 failed: '
TRANSIENT_OPEN_FAILURES = [
    psycopg.OperationalError(
        AT + "Connection refused\n\tIs the server running on that host and accepting TCP/IP connections?"
    ),
    psycopg.OperationalError(AT + "No route to host"),
    psycopg.OperationalError("failed to resolve host 'db.agentd.svc': [Errno -2] Name or service not known"),
    psycopg.errors.ConnectionTimeout("connection timeout expired"),
    psycopg.OperationalError(AT + "FATAL:  the database system is starting up"),
    psycopg.OperationalError(AT + "FATAL:  the database system is shutting down"),
    psycopg.OperationalError(AT + "FATAL:  the database system is in recovery mode"),
    psycopg.OperationalError(AT + "FATAL:  sorry, too many clients already"),
    psycopg.OperationalError(
        AT + "FATAL:  remaining connection slots are reserved for roles with the SUPERUSER attribute"
    ),
    psycopg.OperationalError(
        'connection is bad: connection to server on socket "/run/postgresql/.s.PGSQL.5432" failed: No such file or directory'
    ),
    psycopg.OperationalError("consuming input failed: server closed the connection unexpectedly"),
    psycopg.InterfaceError("the connection is lost"),
    # Answered by the server to a statement of the migrations: by SQLSTATE.
    psycopg.errors.CannotConnectNow("the database system is starting up"),
    psycopg.errors.AdminShutdown("terminating connection due to administrator command"),
    psycopg.errors.TooManyConnections('too many connections for role "agentd"'),
    psycopg.errors.ReadOnlySqlTransaction("cannot execute CREATE TABLE in a read-only transaction"),
    psycopg.errors.DeadlockDetected("deadlock detected"),
    TimeoutError(),
    PoolTimeout("pool initialization incomplete after 10.0 sec"),
]
PERMANENT_OPEN_FAILURES = [
    psycopg.OperationalError(AT + 'FATAL:  password authentication failed for user "agentd"'),
    psycopg.OperationalError(AT + "fe_sendauth: no password supplied"),
    psycopg.OperationalError(AT + 'FATAL:  database "agentd" does not exist'),
    psycopg.OperationalError(AT + 'FATAL:  role "agentd" does not exist'),
    psycopg.OperationalError(AT + 'FATAL:  no pg_hba.conf entry for host "10.1.2.3", user "agentd", database "agentd"'),
    psycopg.OperationalError(AT + 'FATAL:  role "agentd" is not permitted to log in'),
    psycopg.OperationalError(AT + 'FATAL:  permission denied for database "agentd"'),
    psycopg.OperationalError(AT + "SSL error: certificate verify failed"),
    psycopg.OperationalError('root certificate file "/etc/agentd-pg-ca/ca.crt" does not exist'),
    psycopg.OperationalError('connection is bad: invalid port number: "99999"'),
    # One address refused, the other refused the login: the server is there, and says no.
    psycopg.OperationalError(
        "Multiple connection attempts failed. All failures were:\n- host: '::1': Connection refused\n"
        "- host: '127.0.0.1': FATAL:  password authentication failed for user \"agentd\""
    ),
    psycopg.ProgrammingError('invalid URI query parameter: "bogus"'),
    psycopg.errors.InsufficientPrivilege("permission denied for schema public"),  # a migration refused
    psycopg.errors.DataCorrupted("invalid page in block 0 of relation base/16384/16385"),
    StoreError("it has schema version 9; this agentd knows versions up to 6"),
]


def _described(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())[-60:]}"


@pytest.mark.parametrize("error", TRANSIENT_OPEN_FAILURES, ids=_described)
def test_an_open_that_may_succeed_later_is_transient(error: BaseException) -> None:
    assert postgres.open_failure_is_transient(error)
    wrapped = postgres._open_error("postgresql://db.internal:5432/agentd", error, "hunter2")
    assert isinstance(wrapped, StoreUnavailable)
    assert str(wrapped).startswith("cannot open the store postgresql://db.internal:5432/agentd: ")


@pytest.mark.parametrize("error", PERMANENT_OPEN_FAILURES, ids=_described)
def test_an_open_refused_for_good_is_permanent(error: BaseException) -> None:
    assert not postgres.open_failure_is_transient(error)
    wrapped = postgres._open_error("postgresql://db.internal:5432/agentd", error, "hunter2")
    assert type(wrapped) is StoreError


def test_an_open_error_quoting_the_password_is_scrubbed() -> None:
    wrapped = postgres._open_error("postgresql://db/agentd", psycopg.OperationalError("no: hunter2"), "hunter2")
    assert str(wrapped) == "cannot open the store postgresql://db/agentd: no: ***"


def test_an_error_quoting_the_password_is_scrubbed() -> None:
    wrapped = postgres._wrap("open", psycopg.OperationalError("it was hunter2, no?"), "hunter2")
    assert str(wrapped) == "open: OperationalError: it was ***, no?"


async def test_postgres_needs_its_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "agentd.store.postgres", None)  # as if psycopg were not installed
    with pytest.raises(
        StoreError, match=r"^cannot open the store postgresql://db:5432/agentd: PostgreSQL needs psycopg"
    ):
        await open_store(StoreSettings(url="postgresql://me@db:5432/agentd"), tmp_path, {})


async def test_an_empty_url_is_sqlite_in_the_state_dir(tmp_path: Path) -> None:
    store = await open_store(StoreSettings(), tmp_path, {})
    try:
        assert store.location == str(tmp_path / "agentd.db")
    finally:
        await store.close()


async def test_replicas_opening_a_new_database_together_migrate_it_once(database: str) -> None:
    stores: list[PostgresStore] = []

    async def open_one() -> None:
        stores.append(await PostgresStore.open(database))

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(open_one)
    try:
        versions = [row[0] for row in pg_rows(database, "SELECT version FROM agentd_schema ORDER BY version")]
        assert versions == list(range(1, migrations.SCHEMA_VERSION + 1))
        await new_session(stores[0])
        assert (await stores[2].session_counts())["running"] == 1
    finally:
        for store in stores:
            await store.close()


def pg_rows(url: str, query: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(query).fetchall()  # type: ignore[arg-type]
