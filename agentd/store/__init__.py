"""The supervisor's durable store (RFC 0003 §3, RFC 0009): sessions, transcripts, turns and leases.

``Store`` is the interface (``agentd.store.base``); ``open_store`` opens the backend the config's
``[store] url`` names: SQLite in the state dir (the default, ``agentd.store.sqlite``) or
PostgreSQL (``agentd.store.postgres``, which needs the ``agentd[postgres]`` extra).

The calls are written once for both: ``sqlstore`` (the ``Store`` they share: argument checks),
``operations`` (each call's queries and rules, as generators apart from I/O), ``sansio`` (their
protocol, row decoding, shared steps), ``dialect`` (how each backend spells the SQL); a backend
module keeps only its connection, transactions and errors (and PostgreSQL's LISTEN/NOTIFY).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from agentd.config import StoreSettings
from agentd.redact import redact_database_url
from agentd.store.base import (
    CANCELS,
    CLOSES,
    EVENTS,
    NOTIFY_CHANNELS,
    ORPHANS,
    TURNS,
    WATCHES,
    AlreadyDecided,
    CommittedTurn,
    IdempotencyRecord,
    Lease,
    LeaseLost,
    ParkResult,
    ReloadRow,
    ReplicaRow,
    SpendRow,
    Store,
    StoredEntry,
    StoredSession,
    StoreError,
    StoreUnavailable,
    UnknownApproval,
    UnknownSession,
)
from agentd.store.migrations import SCHEMA_VERSION
from agentd.store.sqlite import SqliteStore

__all__ = [
    "CANCELS",
    "CLOSES",
    "EVENTS",
    "NOTIFY_CHANNELS",
    "ORPHANS",
    "SCHEMA_VERSION",
    "SQLITE_FILE",
    "TURNS",
    "WATCHES",
    "AlreadyDecided",
    "CommittedTurn",
    "IdempotencyRecord",
    "Lease",
    "LeaseLost",
    "ParkResult",
    "ReloadRow",
    "ReplicaRow",
    "SpendRow",
    "SqliteStore",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "StoredEntry",
    "StoredSession",
    "UnknownApproval",
    "UnknownSession",
    "open_store",
    "store_location",
]


#: The SQLite store's file in the state dir.
SQLITE_FILE = "agentd.db"


async def open_store(settings: StoreSettings, state_dir: Path, environ: Mapping[str, str] | None = None) -> Store:
    """Open the store ``[store]`` names (RFC 0009 §1): SQLite in ``state_dir``, or PostgreSQL at ``settings.url``.

    The PostgreSQL password is the value of the env var named by ``settings.password_env`` (unset
    or empty: none, and libpq's own means apply, such as a ``.pgpass`` file). When it cannot be
    opened: ``cannot open the store <where>: <reason>`` — a StoreUnavailable when trying again
    may succeed (a PostgreSQL server not reachable or not accepting connections yet: the daemon
    waits for it), a StoreError when it cannot (a login refused, no such database, a newer
    schema, a failed migration, PostgreSQL asked for without its driver, the ``agentd[postgres]``
    extra; every SQLite failure: nothing but the operator can fix a file).
    """
    if not settings.url:
        return await SqliteStore.open(state_dir / SQLITE_FILE)
    try:
        from agentd.store.postgres import PostgresStore
    except ImportError as exc:
        raise StoreError(
            f"cannot open the store {redact_database_url(settings.url)}: PostgreSQL needs psycopg and psycopg-pool,"
            f" the optional dependencies of agentd[postgres] ({exc})"
        ) from None
    env = os.environ if environ is None else environ
    password = env.get(settings.password_env) if settings.password_env else None
    try:
        return await PostgresStore.open(settings.url, password=password or None)
    except StoreError as exc:
        if password or not settings.password_env or "password" not in str(exc):
            raise
        hint = f"{exc} (no password was given: {settings.password_env}, named by [store] password_env, is not set)"
        raise type(exc)(hint) from None  # still StoreUnavailable or StoreError: whether to wait for it


def store_location(settings: StoreSettings, state_dir: Path) -> str:
    """Where the store ``[store]`` names is, as messages and logs name it before it is open: the
    SQLite file, or the PostgreSQL URL without user, password, query or fragment."""
    return redact_database_url(settings.url) if settings.url else str(state_dir / SQLITE_FILE)
