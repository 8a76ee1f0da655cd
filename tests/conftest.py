"""Shared test configuration: anyio's pytest plugin runs async tests on asyncio; the test PostgreSQL."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from agentd.store import Store
from tests import pg_harness
from tests.store_harness import Backend, PostgresBackend, SqliteBackend


def pytest_report_header() -> str:
    """Which PostgreSQL the store tests use, so a CI log says which one passed (tests/pg_harness.py)."""
    return f"postgresql: {pg_harness.describe()}"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def pg() -> Iterator[pg_harness.PgServer]:
    """The PostgreSQL server of this test session (tests/pg_harness.py): started once, removed at the end.

    A test that needs it fails when there is none — never a silent skip — unless
    ``AGENTD_TEST_SKIP_PG=1`` says to skip it.
    """
    if os.environ.get(pg_harness.ENV_SKIP) == "1":
        pytest.skip(f"{pg_harness.ENV_SKIP}=1: the PostgreSQL tests are skipped on purpose")
    try:
        server = pg_harness.pg_server()
        entered = server.__enter__()
    except pg_harness.NoPostgres as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield entered
    finally:
        server.__exit__(None, None, None)


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """One database per test, on each backend in turn: the store's one test-suite runs against both."""
    if request.param == "sqlite":
        yield SqliteBackend(tmp_path / "agentd.db")
        return
    server: pg_harness.PgServer = request.getfixturevalue("pg")
    with server.database() as url:
        yield PostgresBackend(url)


@pytest.fixture
async def store(backend: Backend) -> AsyncIterator[Store]:
    """A store opened on ``backend`` (each backend in turn), closed after the test."""
    opened = await backend.open()
    try:
        yield opened
    finally:
        await opened.close()
