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
from agentd.config import Price
from agentd.messages import UserMessage

__all__ = [
    "PENDING",
    "Cost",
    "Discarded",
    "JournalEntry",
    "ModelSpend",
    "SessionState",
    "StartedTurn",
    "TurnRecord",
]

# ``awaiting_approval``: its turn waits for approvals (RFC 0012); never stored as a row's state.
SessionState = Literal["idle", "running", "awaiting_approval", "failed", "closed"]

#: The status of a turn that has started and has not ended (never a TurnStatus: no turn ends pending).
PENDING: Final = "pending"


class Cost(msgspec.Struct, frozen=True, gc=False):  # strings only: not GC-tracked
    """What tokens cost: ``amount`` the exact decimal (a string, never a float, never rounded)."""

    amount: str
    currency: str


class ModelSpend(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a turn spent on one model while one assistant ran it (RFC 0011 §2).

    ``price`` is the ``[[prices]]`` entry that applied when the turn ended (None: the model has
    none, and ``cost`` is None too); the supervisor sets both, the child reports the usage only.
    """

    assistant: str
    model: str
    usage: Usage = Usage()
    price: Price | None = None
    cost: Cost | None = None


class Discarded(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A turn attempt thrown away by restart-turn: the model it ran on, its steps, why, what it
    spent, and what that cost (None: unpriced, or not priced yet)."""

    model: str
    steps: int
    reason: str
    usage: Usage = Usage()
    cost: Cost | None = None


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
    # What ``usage`` cost, fixed when the turn ended (None: some of it has no price), and the
    # spend per assistant and model it sums, discarded attempts included (RFC 0011 §2).
    cost: Cost | None = None
    by_model: tuple[ModelSpend, ...] = ()


class StartedTurn(msgspec.Struct, frozen=True, kw_only=True):
    """A turn that has started and not ended: its input is stored, its outcome is not.

    ``message`` is None for an opener turn (the assistant speaks first).
    """

    id: str
    message: UserMessage | None
    started_at: float
    cancel_requested: bool = False  # asked on another replica: end it cancelled, do not run it
    trace: dict[str, str] = {}  # the W3C trace context of the request that began it (RFC 0011 §4)


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
