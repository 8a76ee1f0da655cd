"""The supervisor's durable store (RFC 0003 §3): sessions, their transcripts and their turns."""

from agentd.store.sqlite import (
    SCHEMA_VERSION,
    CommittedTurn,
    Store,
    StoredEntry,
    StoredSession,
    StoreError,
    StoreUnavailable,
    UnknownSession,
)

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
