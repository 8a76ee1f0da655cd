"""Swap decisions (RFC 0002): pure functions, no I/O.

The child loop asks these at its checkpoints; the supervisor uses ``classify_swap`` to decide
which sessions a reload affects. Keeping them here makes every rule testable on its own.
"""

from __future__ import annotations

from agentd.config import Intelligence, SwapPolicy
from agentd.protocol import SwapIntel, SwapKind

__all__ = ["classify_swap", "restart_due", "swap_target"]


def classify_swap(old: Intelligence, new: Intelligence) -> SwapKind | None:
    """``model`` when provider or model changes, ``repoint`` when only endpoints/options/key do, None when equal."""
    if (old.provider, old.model) != (new.provider, new.model):
        return SwapKind.MODEL
    if old != new:
        return SwapKind.REPOINT
    return None


def swap_target(parked: SwapIntel, assistant: str, current: Intelligence) -> Intelligence:
    """The intelligence ``assistant`` would run on after applying ``parked`` (unchanged if not named)."""
    return parked.intelligence.get(assistant, current)


def restart_due(
    parked: SwapIntel | None, assistant: str, current: Intelligence, restarts: int, max_restarts: int
) -> bool:
    """Whether the in-flight turn must stop starting work and re-run on a new model.

    Only a *model* swap under restart-turn restarts a turn, and only ``max_restarts`` times; a
    repoint, finish-on-old, or an exhausted restart allowance all let the turn finish on the old model.
    """
    if parked is None or parked.policy != SwapPolicy.RESTART_TURN or restarts >= max_restarts:
        return False
    return classify_swap(current, swap_target(parked, assistant, current)) is SwapKind.MODEL
