"""Per-turn budgets (agentd.budget): steps, tokens, deadline, loop detection, usage arithmetic."""

from __future__ import annotations

import pytest

from agentd.budget import LOOP_THRESHOLD, TurnBudget, TurnStatus, Usage, call_key
from agentd.config import Limits


def budget(**limits: float) -> TurnBudget:
    return TurnBudget(Limits(**limits), started_at=1000.0)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- usage


def test_usage_addition_and_total() -> None:
    assert Usage(1, 2) + Usage(10, 20) == Usage(11, 22)
    assert Usage(1, 2) + Usage() == Usage(1, 2)
    assert Usage(3, 4).total == 7
    assert Usage() == Usage(input_tokens=0, output_tokens=0)


def test_usage_addition_does_not_mutate() -> None:
    a = Usage(1, 1)
    _ = a + Usage(5, 5)
    assert a == Usage(1, 1)


# --------------------------------------------------------------------------- steps


def test_steps_allowed_up_to_max_steps() -> None:
    b = budget(max_steps=3)
    for _ in range(3):
        assert b.before_step() is None
        assert b.after_step(Usage(1, 1)) is None
    assert b.steps == 3
    assert b.before_step() is TurnStatus.EXHAUSTED_STEPS


def test_default_max_steps_is_eight() -> None:
    b = budget()
    for _ in range(8):
        assert b.before_step() is None
        b.after_step(Usage())
    assert b.before_step() is TurnStatus.EXHAUSTED_STEPS


# --------------------------------------------------------------------------- tokens


def test_usage_accumulates_over_steps() -> None:
    b = budget()
    b.after_step(Usage(10, 5))
    b.after_step(Usage(20, 7))
    assert b.usage == Usage(30, 12)


def test_tokens_exhausted_when_total_exceeds_max_tokens() -> None:
    b = budget(max_tokens=100)
    assert b.after_step(Usage(60, 30)) is None  # 90
    assert b.after_step(Usage(5, 5)) is None  # exactly 100: within budget
    assert b.after_step(Usage(1, 0)) is TurnStatus.EXHAUSTED_TOKENS  # 101


def test_zero_max_tokens_means_unlimited() -> None:
    b = budget(max_tokens=0)
    assert b.after_step(Usage(10**9, 10**9)) is None


# --------------------------------------------------------------------------- deadline


def test_deadline_is_the_start_plus_the_limit() -> None:
    b = budget(deadline=30.0)
    assert b.deadline_at == 1030.0


# --------------------------------------------------------------------------- loop detection


def test_loop_detected_on_the_fourth_identical_call() -> None:
    assert LOOP_THRESHOLD == 4
    b = budget()
    for _ in range(3):
        assert b.before_tool("clock", {"offset_hours": 1}) is None
    assert b.before_tool("clock", {"offset_hours": 1}) is TurnStatus.LOOP_DETECTED


def test_loop_detection_ignores_key_order() -> None:
    b = budget()
    assert b.before_tool("search", {"q": "x", "limit": 3}) is None
    assert b.before_tool("search", {"limit": 3, "q": "x"}) is None
    assert b.before_tool("search", {"q": "x", "limit": 3}) is None
    assert b.before_tool("search", {"limit": 3, "q": "x"}) is TurnStatus.LOOP_DETECTED


def test_loop_detection_ignores_nested_key_order() -> None:
    assert call_key("f", {"a": {"x": 1, "y": 2}, "b": 0}) == call_key("f", {"b": 0, "a": {"y": 2, "x": 1}})


@pytest.mark.parametrize(
    ("other_name", "other_args"),
    [("clock", {"offset_hours": 2}), ("calendar", {"offset_hours": 1}), ("clock", {})],
)
def test_different_calls_are_counted_separately(other_name: str, other_args: dict[str, int]) -> None:
    b = budget()
    for _ in range(3):
        assert b.before_tool("clock", {"offset_hours": 1}) is None
        assert b.before_tool(other_name, other_args) is None
    assert b.before_tool(other_name, other_args) is TurnStatus.LOOP_DETECTED


def test_call_key_distinguishes_name_and_arguments() -> None:
    assert call_key("a", {"x": 1}) != call_key("b", {"x": 1})
    assert call_key("a", {"x": 1}) != call_key("a", {"x": "1"})
    assert call_key("a", {"x": 1}) != call_key("a", {"x": 1, "y": None})


def test_a_fresh_budget_starts_over() -> None:
    """A restarted turn gets a fresh budget: steps, usage and call counts reset."""
    old = budget(max_steps=1)
    old.after_step(Usage(5, 5))
    for _ in range(3):
        old.before_tool("clock", {})
    new = budget(max_steps=1)
    assert new.before_step() is None
    assert new.usage == Usage()
    assert new.before_tool("clock", {}) is None
