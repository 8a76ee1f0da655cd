"""agentd.obs.LogLimiter: lines of one kind beyond the limit are counted, and the count reported."""

from __future__ import annotations

from agentd.obs import LogLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_lines_past_the_limit_are_dropped_and_counted_per_kind() -> None:
    clock = Clock()
    limiter = LogLimiter(limit=3, window=10.0, clock=clock)
    admitted = [limiter.admit("flood") for _ in range(10)]
    assert admitted == [True] * 3 + [False] * 7
    assert limiter.admit("other")  # another kind has a limit of its own
    assert limiter.due() == []  # the window has not ended: nothing to report yet
    clock.now = 10.0
    assert limiter.due() == [("flood", 7)]
    assert limiter.due() == []  # reported once


def test_a_new_window_reports_the_last_ones_drops_and_logs_again() -> None:
    clock = Clock()
    limiter = LogLimiter(limit=1, window=5.0, clock=clock)
    assert [limiter.admit("k") for _ in range(4)] == [True, False, False, False]
    clock.now = 5.0
    assert limiter.admit("k")  # a new window
    assert limiter.due() == [("k", 3)]


def test_everything_reports_windows_that_have_not_ended() -> None:
    limiter = LogLimiter(limit=2, window=60.0, clock=Clock())
    for _ in range(5):
        limiter.admit("k")
    assert limiter.due(everything=True) == [("k", 3)]
    assert limiter.admit("k")  # and starts afresh


def test_every_line_is_logged_or_counted() -> None:
    clock = Clock()
    limiter = LogLimiter(limit=7, window=1.0, clock=clock)
    logged = 0
    for i in range(1000):
        clock.now = i * 0.013
        logged += limiter.admit("k")
    dropped = sum(n for _, n in limiter.due(everything=True))
    assert logged + dropped == 1000 and logged <= 7 * 14
