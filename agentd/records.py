"""The records of sessions and turns: the one definition the child, the store and the API share.

A finished turn is a ``TurnRecord``: the child sends it inside ``TurnDone``, the store commits it
and gives it back, the API renders it (``agentd.views.turn_view``). A turn that has started and
not ended is a ``StartedTurn`` (status ``pending``). ``SessionState`` is here rather than in the
views so the store can check states without depending on the HTTP bodies.

Dependencies point one way: this module needs only ``agentd.budget`` and ``agentd.messages``;
``agentd.protocol``, ``agentd.store`` and ``agentd.views`` import it, never the reverse.
"""

from __future__ import annotations

from typing import Any, Final, Literal

import msgspec

from agentd.budget import TurnStatus, Usage
from agentd.messages import UserMessage

__all__ = ["PENDING", "Discarded", "JournalEntry", "SessionState", "StartedTurn", "TurnRecord"]

# ``awaiting_approval``: its turn waits for approvals (RFC 0011); never stored as a row's state.
SessionState = Literal["idle", "running", "awaiting_approval", "failed", "closed"]

#: The status of a turn that has started and has not ended (never a TurnStatus: no turn ends pending).
PENDING: Final = "pending"


class Discarded(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A turn attempt thrown away by restart-turn: the model it ran on, its steps, why, what it spent."""

    model: str
    steps: int
    reason: str
    usage: Usage = Usage()


class TurnRecord(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A finished turn: how it ended, on which models, and what it spent (discarded attempts included).

    ``started_at`` and ``ended_at`` are epoch seconds. In a committed record ``started_at`` is when
    the supervisor accepted the turn; in a ``TurnDone`` it is when the child started running it.
    """

    id: str
    status: TurnStatus
    models: tuple[str, ...] = ()
    steps: int = 0
    restarts: int = 0
    discarded: tuple[Discarded, ...] = ()
    usage: Usage = Usage()
    started_at: float
    ended_at: float
    error: str | None = None


class StartedTurn(msgspec.Struct, frozen=True, kw_only=True):
    """A turn that has started and not ended: its input is stored, its outcome is not.

    ``message`` is None for an opener turn (the assistant speaks first).
    """

    id: str
    message: UserMessage | None
    started_at: float
    cancel_requested: bool = False  # asked on another replica: end it cancelled, do not run it


class JournalEntry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One side-effecting tool call of a pending turn, as the tool journal holds it (RFC 0008 §5).

    ``seq`` orders the turn's calls (unique per turn across its runs); ``tool`` is the name the
    model called; ``call`` the model's call id. ``finished`` is False for a call that started and
    has no recorded result: its outcome is unknown. ``content``/``is_error`` are its result.
    """

    seq: int
    call: str
    tool: str
    arguments: dict[str, Any] = {}
    finished: bool = False
    content: str = ""
    is_error: bool = False
