"""The endpoint breaker and failover order (RFC 0005 §4), on an injected clock: no waiting."""

from __future__ import annotations

import random
from email.utils import formatdate

from hypothesis import given
from hypothesis import strategies as st

from agentd.intel.endpoints import (
    BreakerPolicy,
    BreakerState,
    Endpoints,
    RetryPolicy,
    backoff_delay,
    parse_retry_after,
)

URLS = ("http://primary:1", "http://secondary:2", "http://tertiary:3")


def fail(endpoints: Endpoints, index: int, now: float, times: int = 1) -> None:
    for _ in range(times):
        assert endpoints.pick(now, exclude=[i for i in range(len(endpoints.urls)) if i != index]) == index
        endpoints.failed(index, now)


def test_picks_the_lowest_usable_endpoint_and_skips_excluded() -> None:
    endpoints = Endpoints(URLS)
    assert endpoints.pick(0.0) == 0
    assert endpoints.pick(0.0, exclude={0}) == 1
    assert endpoints.pick(0.0, exclude={0, 1, 2}) is None


def test_opens_after_three_consecutive_failures_only() -> None:
    endpoints = Endpoints(URLS)
    fail(endpoints, 0, 0.0, times=2)
    endpoints.succeeded(0)  # a success resets the count
    fail(endpoints, 0, 0.0, times=2)
    assert endpoints.state(0) is BreakerState.CLOSED and endpoints.pick(0.0) == 0
    endpoints.failed(0, 0.0)
    assert endpoints.state(0) is BreakerState.OPEN
    assert endpoints.pick(1.0) == 1  # failed over while the primary cools down


def test_cooldown_half_open_single_probe_and_doubling_to_sixty() -> None:
    endpoints = Endpoints(URLS[:2])
    fail(endpoints, 0, 100.0, times=3)
    expected_cooldowns = [5.0, 10.0, 20.0, 40.0, 60.0, 60.0]
    opened = 100.0
    for cooldown in expected_cooldowns:
        assert endpoints.health[0].cooldown == cooldown
        assert endpoints.pick(opened + cooldown - 0.01) == 1  # still cooling down
        probe_at = opened + cooldown
        assert endpoints.pick(probe_at) == 0  # the one probe
        assert endpoints.state(0) is BreakerState.HALF_OPEN
        assert endpoints.pick(probe_at) == 1  # no second probe while the first is in flight
        endpoints.failed(0, probe_at)
        assert endpoints.state(0) is BreakerState.OPEN
        opened = probe_at
    probe_at = opened + 60.0
    assert endpoints.pick(probe_at) == 0
    endpoints.succeeded(0)
    assert endpoints.state(0) is BreakerState.CLOSED and endpoints.health[0].cooldown == 5.0
    assert endpoints.pick(probe_at) == 0  # sticky: traffic is back on the primary


def test_a_probe_without_verdict_is_released() -> None:
    endpoints = Endpoints(URLS[:1])
    fail(endpoints, 0, 0.0, times=3)
    assert endpoints.pick(5.0) == 0
    endpoints.released(0)  # cancelled mid-probe
    assert endpoints.state(0) is BreakerState.OPEN
    assert endpoints.pick(5.0) == 0  # may probe again at once


def test_retry_after_blocks_an_endpoint_until_then() -> None:
    endpoints = Endpoints(URLS[:2])
    assert endpoints.pick(0.0) == 0
    endpoints.failed(0, 0.0, retry_after=7.0)
    assert endpoints.pick(6.9) == 1
    assert endpoints.next_ready_at(exclude={1}) == 7.0
    assert endpoints.pick(7.0) == 0


def test_next_ready_at_covers_cooldowns_and_skips_probes() -> None:
    endpoints = Endpoints(URLS[:2])
    fail(endpoints, 0, 10.0, times=3)
    fail(endpoints, 1, 12.0, times=3)
    assert endpoints.next_ready_at() == 15.0
    assert endpoints.pick(15.0) == 0  # probing
    assert endpoints.next_ready_at() == 17.0


def test_custom_policy() -> None:
    endpoints = Endpoints(URLS[:1], BreakerPolicy(failure_threshold=1, cooldown=1.0, max_cooldown=2.0))
    fail(endpoints, 0, 0.0)
    assert endpoints.state(0) is BreakerState.OPEN and endpoints.pick(0.5) is None
    assert endpoints.pick(1.0) == 0
    endpoints.failed(0, 1.0)
    assert endpoints.health[0].cooldown == 2.0


@given(
    st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["ok", "fail", "release"]), st.floats(0, 30)), max_size=60)
)
def test_invariants_under_any_history(events: list[tuple[int, str, float]]) -> None:
    endpoints = Endpoints(URLS)
    now = 0.0
    for index, outcome, step in events:
        now += step
        picked = endpoints.pick(now, exclude=[i for i in range(3) if i != index])
        if picked is None:
            continue
        if outcome == "ok":
            endpoints.succeeded(picked)
        elif outcome == "fail":
            endpoints.failed(picked, now)
        else:
            assert outcome == "release"
            endpoints.released(picked)
        for health in endpoints.health:
            assert 5.0 <= health.cooldown <= 60.0
            assert health.state is not BreakerState.HALF_OPEN  # every probe got a verdict
            if health.state is BreakerState.OPEN:
                assert health.failures >= 3
    # The lowest usable endpoint is always the one picked.
    usable = [i for i, h in enumerate(endpoints.health) if h.usable(now)]
    assert endpoints.pick(now) == (usable[0] if usable else None)


def test_backoff_grows_caps_and_jitters() -> None:
    policy = RetryPolicy(backoff=0.5, max_backoff=4.0, jitter=0.25)
    rng = random.Random(1)
    for round_index, base in enumerate([0.5, 1.0, 2.0, 4.0, 4.0]):
        delay = backoff_delay(round_index, policy, rng)
        assert base * 0.75 <= delay <= base * 1.25
    assert backoff_delay(0, RetryPolicy(backoff=1.0, jitter=0.0)) == 1.0


def test_parse_retry_after() -> None:
    assert parse_retry_after("3", 0.0) == 3.0
    assert parse_retry_after(" 1.5 ", 0.0) == 1.5
    assert parse_retry_after(None, 0.0) is None
    assert parse_retry_after("soon", 0.0) is None
    assert parse_retry_after("-4", 0.0) == 0.0
    wall = 1_800_000_000.0
    assert parse_retry_after(formatdate(wall + 30, usegmt=True), wall) == 30.0
    assert parse_retry_after(formatdate(wall - 30, usegmt=True), wall) == 0.0


# --------------------------------------------------------------------------- panic mode


def open_with_cooldown(endpoints: Endpoints, index: int, now: float, probes_failed: int) -> None:
    """Open ``index``'s breaker at ``now`` and fail ``probes_failed`` probes right after (cooldown doubles each)."""
    fail(endpoints, index, now, times=3)
    for _ in range(probes_failed):
        assert endpoints.pick(now, exclude=[i for i in range(len(endpoints.urls)) if i != index], panic=True) == index
        endpoints.failed(index, now)


def test_panic_probes_the_only_endpoint_although_its_breaker_is_open() -> None:
    endpoints = Endpoints(URLS[:1])
    open_with_cooldown(endpoints, 0, 0.0, probes_failed=4)
    assert endpoints.health[0].cooldown == 60.0  # usable again only at t=60
    assert endpoints.pick(1.0) is None  # the breaker alone blocks it
    assert endpoints.pick(1.0, panic=True) == 0  # with nowhere else to go, it is probed all the same
    assert endpoints.state(0) is BreakerState.HALF_OPEN
    assert endpoints.pick(1.0, panic=True) is None  # one probe at a time
    endpoints.succeeded(0)
    assert endpoints.state(0) is BreakerState.CLOSED and endpoints.health[0].cooldown == 5.0


def test_a_failed_panic_probe_reopens_like_any_probe() -> None:
    endpoints = Endpoints(URLS[:1])
    open_with_cooldown(endpoints, 0, 0.0, probes_failed=0)
    assert endpoints.pick(1.0, panic=True) == 0
    endpoints.failed(0, 1.0)
    assert endpoints.state(0) is BreakerState.OPEN and endpoints.health[0].cooldown == 10.0
    assert endpoints.pick(1.5) is None and endpoints.pick(1.5, panic=True) == 0  # still probed after the next backoff


def test_panic_probes_the_open_endpoint_that_becomes_ready_first() -> None:
    endpoints = Endpoints(URLS)
    open_with_cooldown(endpoints, 0, 0.0, probes_failed=2)  # ready at 20
    open_with_cooldown(endpoints, 1, 0.0, probes_failed=0)  # ready at 5
    open_with_cooldown(endpoints, 2, 0.0, probes_failed=1)  # ready at 10
    assert endpoints.pick(1.0) is None
    assert endpoints.pick(1.0, panic=True) == 1
    assert endpoints.pick(1.0, exclude={1}, panic=True) == 2  # 1 is being probed (and excluded)
    assert endpoints.pick(1.0, panic=True) == 0  # 1 and 2 are being probed: the last one left


def test_panic_prefers_a_usable_endpoint_and_ties_go_to_the_lowest() -> None:
    endpoints = Endpoints(URLS)
    open_with_cooldown(endpoints, 0, 0.0, probes_failed=0)
    assert endpoints.pick(1.0, panic=True) == 1  # not panicking: the secondary is closed
    endpoints.released(1)
    open_with_cooldown(endpoints, 2, 0.0, probes_failed=0)
    assert endpoints.pick(1.0, exclude={1}, panic=True) == 0  # 0 and 2 open since t=0: the lower one


def test_panic_still_honours_retry_after() -> None:
    endpoints = Endpoints(URLS[:2])
    fail(endpoints, 0, 0.0, times=2)
    assert endpoints.pick(0.0, exclude={1}) == 0
    endpoints.failed(0, 0.0, retry_after=30.0)  # opens, and the server asked for 30 s
    open_with_cooldown(endpoints, 1, 0.0, probes_failed=1)  # cooldown 10 s
    assert endpoints.pick(1.0, panic=True) == 1  # 0 is held by Retry-After, 1 only by its breaker
    endpoints.failed(1, 1.0, retry_after=2.0)
    assert endpoints.pick(2.0, panic=True) is None  # both held by the servers themselves
    assert endpoints.next_ready_at(panic=True) == 3.0  # what a caller waits for before its next round
    assert endpoints.next_ready_at() == 21.0  # without panic: 1's cooldown (20 s from t=1)
    assert endpoints.pick(3.0, panic=True) == 1


@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.sampled_from(["ok", "fail", "retry-after", "release"]), st.floats(0, 30)),
        max_size=60,
    )
)
def test_a_panic_pick_finds_nothing_only_when_every_endpoint_is_probed_or_held_by_retry_after(
    events: list[tuple[int, str, float]],
) -> None:
    endpoints = Endpoints(URLS)
    now = 0.0
    for index, outcome, step in events:
        now += step
        picked = endpoints.pick(now, exclude=[i for i in range(3) if i != index], panic=True)
        if picked is None:
            assert endpoints.health[index].not_before > now  # only Retry-After can hold a lone endpoint
            continue
        if outcome == "ok":
            endpoints.succeeded(picked)
        elif outcome in ("fail", "retry-after"):
            endpoints.failed(picked, now, retry_after=5.0 if outcome == "retry-after" else None)
        else:
            endpoints.released(picked)
    usable = [i for i, h in enumerate(endpoints.health) if h.usable(now)]
    open_now = sorted(
        (h.ready_at(), i)
        for i, h in enumerate(endpoints.health)
        if h.state is BreakerState.OPEN and now >= h.not_before
    )
    expected = usable[0] if usable else (open_now[0][1] if open_now else None)
    assert endpoints.pick(now, panic=True) == expected
