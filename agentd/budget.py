"""Per-turn budgets (RFC 0007 §4, §6): steps, tokens, deadline, loop detection, and the turn statuses.

Pure bookkeeping: the child loop asks the budget before each step and tool call and tells it what
was spent. Time is passed in, never read here, so every rule is testable without a clock.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from agentd.config import Limits

__all__ = ["LOOP_THRESHOLD", "TurnBudget", "TurnStatus", "Usage", "call_key"]

# The 4th identical tool call in one turn is a loop.
LOOP_THRESHOLD = 4


class TurnStatus(enum.StrEnum):
    """How a turn ended."""

    COMPLETED = "completed"
    TRANSFERRED = "transferred"
    EXHAUSTED_STEPS = "exhausted_steps"
    EXHAUSTED_TOKENS = "exhausted_tokens"
    DEADLINE = "deadline"
    LOOP_DETECTED = "loop_detected"
    CANCELLED = "cancelled"
    INTEL_UNAVAILABLE = "intel_unavailable"
    FAILED = "failed"


class Usage(msgspec.Struct, frozen=True, gc=False):  # ints only: no cycle, not GC-tracked
    """What model calls spent, as their servers reported it (every count always present, on the
    wire and in the API; RFC 0011 §1).

    ``cached_input_tokens`` and ``reasoning_tokens`` are parts of ``input_tokens`` and
    ``output_tokens`` (as servers count them), never added to them. ``requests`` counts model
    calls that answered; ``unreported`` those of them whose server reported no usage at all
    (their tokens are unknown, never guessed: they count 0 here).
    """

    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    reasoning_tokens: int = 0
    requests: int = 0
    unreported: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.input_tokens + other.input_tokens,
            self.output_tokens + other.output_tokens,
            self.cached_input_tokens + other.cached_input_tokens,
            self.reasoning_tokens + other.reasoning_tokens,
            self.requests + other.requests,
            self.unreported + other.unreported,
        )

    @property
    def total(self) -> int:
        return self.input_tokens + self.output_tokens


def call_key(name: str, arguments: dict[str, Any]) -> str:
    """A canonical identity for a tool call: same name and same arguments (key order ignored)."""
    return name + ":" + msgspec.json.encode(arguments, order="sorted").decode()


class TurnBudget:
    """What one turn attempt may still spend. A restarted turn gets a fresh budget."""

    def __init__(self, limits: Limits, started_at: float) -> None:
        self.limits = limits
        self.deadline_at = started_at + limits.deadline
        self.steps = 0
        self.usage = Usage()
        self._calls: dict[str, int] = {}

    def before_step(self) -> TurnStatus | None:
        """The status that forbids another model call, or None when one may start."""
        if self.steps >= self.limits.max_steps:
            return TurnStatus.EXHAUSTED_STEPS
        return None

    def after_step(self, usage: Usage) -> TurnStatus | None:
        """Record a finished model call; the status that ends the turn now, if any."""
        self.steps += 1
        self.usage = self.usage + usage
        if self.limits.max_tokens and self.usage.total > self.limits.max_tokens:
            return TurnStatus.EXHAUSTED_TOKENS
        return None

    def before_tool(self, name: str, arguments: dict[str, Any]) -> TurnStatus | None:
        """Count a tool call; LOOP_DETECTED on the 4th identical one (which must not run)."""
        key = call_key(name, arguments)
        self._calls[key] = self._calls.get(key, 0) + 1
        if self._calls[key] >= LOOP_THRESHOLD:
            return TurnStatus.LOOP_DETECTED
        return None
