"""What the daemon's operations refuse with: domain errors, with no transport in them.

Each error carries a stable ``code`` (what a client branches on), a clear ``message``, and the
turn it is about when one was accepted (a client that gets one may find that turn in the store).
The HTTP API (``agentd.api``) alone says which status each kind is answered with, through one
table; another error shape over the same errors (the OpenAI-compatible routes) maps them again.
"""

from __future__ import annotations

from typing import ClassVar

from agentd.store import StoreError, StoreUnavailable

__all__ = [
    "BadInput",
    "Conflict",
    "Draining",
    "KeyInUse",
    "KeyReused",
    "NotEnded",
    "NotFound",
    "ServiceError",
    "StoreDown",
    "StoreFull",
    "TooLarge",
    "TurnRefused",
    "Unavailable",
    "store_failure",
]


class ServiceError(Exception):
    """A request that cannot be served: a stable ``code``, a ``message``, and the ``turn`` if one was accepted."""

    #: The code when none is given.
    default_code: ClassVar[str] = "error"

    def __init__(self, message: str, *, code: str | None = None, turn: str | None = None) -> None:
        self.code = code or self.default_code
        self.message = message
        self.turn = turn
        super().__init__(message)


class BadInput(ServiceError):
    """The request itself is wrong (a body, a parameter, a name): asking again the same way fails again."""

    default_code = "invalid_body"


class NotFound(ServiceError):
    """No such session (or none open)."""

    default_code = "not_found"


class Conflict(ServiceError):
    """The session's state refuses it now: a turn is running, or none is."""

    default_code = "conflict"


class TurnRefused(Conflict):
    """The store refused to begin the turn (not for a failure of the database)."""

    default_code = "turn_refused"


class KeyInUse(Conflict):
    """The request's ``Idempotency-Key`` is being answered now (RFC 0010 §2): ask again later, the same way."""

    default_code = "idempotency_in_progress"


class KeyReused(ServiceError):
    """The request's ``Idempotency-Key`` was first sent with another request (RFC 0010 §2)."""

    default_code = "idempotency_key_reused"


class TooLarge(ServiceError):
    """A request body over its limit."""

    default_code = "too_large"


class Unavailable(ServiceError):
    """Not now: nothing was done, or the turn named has not ended; asking again later may succeed."""

    default_code = "unavailable"


class Draining(Unavailable):
    """The daemon is shutting down and accepts no new work."""

    default_code = "draining"


class StoreDown(Unavailable):
    """The store failed (the database, the disk): nothing was stored, or what was is named."""

    default_code = "store_unavailable"


class NotEnded(Unavailable):
    """The accepted turn has no result to answer with yet (cut by a shutdown, run elsewhere, taken over)."""

    default_code = "turn_cut"


class StoreFull(ServiceError):
    """The store's disk is full: nothing was stored (or the turn named is kept and retried)."""

    default_code = "store_full"


def store_failure(exc: StoreError) -> ServiceError:
    """A store failure as an operation answers it: the disk is full, or the store cannot be written
    (the database is down, the disk failed); either way nothing was stored."""
    if isinstance(exc, StoreUnavailable) and exc.full:
        return StoreFull(f"the store is full; nothing was stored: {exc}")
    return StoreDown(f"the store cannot be written; nothing was stored: {exc}")
