"""The store's backends as the store tests see them: open a store, and read its database behind its back.

Every store test that is not about one backend's own files runs once per backend (the
``backend`` fixture in tests/conftest.py): SQLite in a temp dir, and PostgreSQL in a fresh
database of the test server (tests/pg_harness.py). ``raw`` reads the database directly, with
``?`` placeholders on both.
"""

from __future__ import annotations

import abc
import sqlite3
from pathlib import Path
from typing import Any

import psycopg

from agentd.store import SqliteStore, Store, migrations
from agentd.store.postgres import PostgresStore

__all__ = ["Backend", "PostgresBackend", "SqliteBackend"]


class Backend(abc.ABC):
    """One database, and how to open a store on it and look inside it."""

    name: str
    #: The backend's migrations (agentd.store.migrations.SQLITE or .POSTGRES), for tests that patch them.
    migrations: dict[int, tuple[str, ...]]

    @abc.abstractmethod
    async def open(self) -> Store:
        """A store on this database (migrated to the current schema)."""

    @abc.abstractmethod
    def raw(self, query: str, *args: Any) -> list[tuple[Any, ...]]:
        """Run ``query`` on the database directly, bypassing the store; its rows (none for a statement)."""

    @abc.abstractmethod
    def schema_version(self) -> int:
        """The schema version the database records."""

    @abc.abstractmethod
    def set_schema_version(self, version: int) -> None:
        """Record ``version`` as the database's schema version (as an older or newer agentd would have)."""

    @abc.abstractmethod
    def columns(self, table: str) -> list[str]:
        """The table's column names."""

    @abc.abstractmethod
    def indexes(self) -> set[str]:
        """The names of the database's indexes."""

    def create_schema(self, version: int) -> None:
        """Create the schema as it was at ``version`` (an older agentd's database)."""
        for step in range(1, version + 1):
            for statement in self.migrations[step]:
                self.raw(statement)
        self.set_schema_version(version)


class SqliteBackend(Backend):
    name = "sqlite"
    migrations = migrations.SQLITE

    def __init__(self, path: Path) -> None:
        self.path = path

    async def open(self) -> Store:
        return await SqliteStore.open(self.path)

    def raw(self, query: str, *args: Any) -> list[tuple[Any, ...]]:
        conn = sqlite3.connect(self.path, isolation_level=None)
        try:
            return conn.execute(query, args).fetchall()
        finally:
            conn.close()

    def schema_version(self) -> int:
        return int(self.raw("PRAGMA user_version")[0][0])

    def set_schema_version(self, version: int) -> None:
        self.raw(f"PRAGMA user_version = {int(version)}")

    def columns(self, table: str) -> list[str]:
        return [row[1] for row in self.raw(f"PRAGMA table_info({table})")]

    def indexes(self) -> set[str]:
        return {name for (name,) in self.raw("SELECT name FROM sqlite_master WHERE type = 'index'")}


class PostgresBackend(Backend):
    name = "postgres"
    migrations = migrations.POSTGRES

    def __init__(self, url: str) -> None:
        self.url = url

    async def open(self) -> Store:
        return await PostgresStore.open(self.url)

    def raw(self, query: str, *args: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.url, autocommit=True) as conn:
            cursor = conn.execute(query.replace("?", "%s"), args)
            return cursor.fetchall() if cursor.description is not None else []

    def schema_version(self) -> int:
        return int(self.raw("SELECT COALESCE(MAX(version), 0) FROM agentd_schema")[0][0])

    def set_schema_version(self, version: int) -> None:
        self.raw(
            "CREATE TABLE IF NOT EXISTS agentd_schema (version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)"
        )
        self.raw("DELETE FROM agentd_schema")
        self.raw("INSERT INTO agentd_schema (version, applied_at) VALUES (?, 0)", version)

    def columns(self, table: str) -> list[str]:
        rows = self.raw(
            "SELECT column_name FROM information_schema.columns"
            " WHERE table_schema = current_schema() AND table_name = ? ORDER BY ordinal_position",
            table,
        )
        return [name for (name,) in rows]

    def indexes(self) -> set[str]:
        return {name for (name,) in self.raw("SELECT indexname FROM pg_indexes WHERE schemaname = current_schema()")}
