"""Endpoint health: ordered failover with a circuit breaker per endpoint (RFC 0005 §4). Pure.

Every method takes ``now`` (seconds on any monotonic clock), so the rules are tested without
waiting. The rules:

- An endpoint's breaker opens after ``failure_threshold`` (3) consecutive failures. While open it
  is skipped for its cooldown (5 s, doubling after each failed probe, at most 60 s).
- When the cooldown has passed, exactly one call may probe it (half-open). The probe's success
  closes the breaker and resets the cooldown; its failure reopens it with a doubled cooldown.
- ``Retry-After`` from an endpoint makes it unusable until then, breaker or not.
- Calls go to the lowest-indexed usable endpoint ("sticky to the lowest healthy"): traffic returns
  to the primary as soon as its probe succeeds.
- Within one call, an endpoint that failed is not tried again until every other has been
  (``exclude``); the caller decides how many rounds to make and how long to back off between them.
- Panic mode (``pick(..., panic=True)``): when no endpoint is usable because every candidate's
  breaker is open, the breakers choose *which* endpoint to probe, not *whether*: the open one whose
  cooldown ends first is probed anyway. A cooldown exists to send traffic elsewhere; with nowhere
  else to go it would only make a call wait for the turn's deadline on an endpoint that may well
  answer (one failing half of its attempts opens its breaker often). The caller backs off before
  a panic probe, so a dead endpoint still sees at most one probe per backoff. ``Retry-After`` is
  the server's own word and still holds in panic mode.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Collection, Sequence

import msgspec

__all__ = [
    "BreakerPolicy",
    "BreakerState",
    "EndpointHealth",
    "Endpoints",
    "RetryPolicy",
    "backoff_delay",
    "parse_retry_after",
]


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"  # one probe is in flight


class BreakerPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """When a breaker opens and how long it stays open."""

    failure_threshold: int = 3
    cooldown: float = 5.0
    max_cooldown: float = 60.0


class RetryPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """How hard one ``complete()`` tries before reporting the model unavailable.

    A round tries every usable endpoint once, in order. Between rounds the call sleeps with
    exponential backoff and jitter, or until the earliest ``Retry-After`` if that is later, but never
    past the request deadline and never longer than ``max_wait`` (beyond that the call gives up and
    the loop, which owns the turn deadline, waits and calls again).
    """

    rounds: int = 3
    backoff: float = 0.5
    max_backoff: float = 8.0
    jitter: float = 0.25  # ± this fraction of the delay, so many sessions do not retry in step
    max_wait: float = 30.0


class EndpointHealth(msgspec.Struct, frozen=True, kw_only=True):
    """One endpoint's breaker."""

    state: BreakerState = BreakerState.CLOSED
    failures: int = 0  # consecutive
    opened_at: float = 0.0
    cooldown: float = 5.0
    not_before: float = 0.0  # from Retry-After

    def usable(self, now: float) -> bool:
        """Whether a call may go to this endpoint now (an open one only once its cooldown passed)."""
        if now < self.not_before:
            return False
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            return now >= self.opened_at + self.cooldown
        return False  # half-open: its one probe is in flight

    def ready_at(self, *, panic: bool = False) -> float:
        """The earliest time this endpoint may be usable again (ignores a probe in flight).

        With ``panic`` the breaker's cooldown does not count (only ``Retry-After`` does): the
        earliest time a panic probe may go to it.
        """
        reopen = self.opened_at + self.cooldown if self.state is BreakerState.OPEN and not panic else 0.0
        return max(self.not_before, reopen)


def _started(health: EndpointHealth) -> EndpointHealth:
    if health.state is BreakerState.OPEN:
        return msgspec.structs.replace(health, state=BreakerState.HALF_OPEN)
    return health


def _succeeded(health: EndpointHealth, policy: BreakerPolicy) -> EndpointHealth:
    return EndpointHealth(cooldown=policy.cooldown, not_before=health.not_before)


def _failed(health: EndpointHealth, now: float, policy: BreakerPolicy, retry_after: float | None) -> EndpointHealth:
    failures = health.failures + 1
    not_before = max(health.not_before, now + retry_after) if retry_after else health.not_before
    if health.state is BreakerState.HALF_OPEN:
        cooldown = min(health.cooldown * 2, policy.max_cooldown)
        return EndpointHealth(
            state=BreakerState.OPEN, failures=failures, opened_at=now, cooldown=cooldown, not_before=not_before
        )
    if failures >= policy.failure_threshold:
        return EndpointHealth(
            state=BreakerState.OPEN, failures=failures, opened_at=now, cooldown=policy.cooldown, not_before=not_before
        )
    return msgspec.structs.replace(health, failures=failures, not_before=not_before)


def _released(health: EndpointHealth) -> EndpointHealth:
    # A probe that ended without a verdict (cancelled, deadline): open again, usable at once.
    if health.state is BreakerState.HALF_OPEN:
        return msgspec.structs.replace(health, state=BreakerState.OPEN)
    return health


class Endpoints:
    """The ordered endpoint list of one provider and each endpoint's health."""

    def __init__(self, urls: Sequence[str], policy: BreakerPolicy | None = None) -> None:
        if not urls:
            raise ValueError("at least one endpoint is required")
        self.urls = tuple(urls)
        self.policy = policy or BreakerPolicy()
        self.health = [EndpointHealth(cooldown=self.policy.cooldown) for _ in self.urls]

    def pick(self, now: float, exclude: Collection[int] = (), *, panic: bool = False) -> int | None:
        """The lowest-indexed usable endpoint not in ``exclude``, marked as in use (an open one
        becomes half-open: its probe); None when there is none.

        With ``panic``, when none is usable, the open endpoint outside ``exclude`` whose cooldown
        ends first (the lowest-indexed on a tie) is probed all the same, unless ``Retry-After``
        holds it (see the module docstring). An endpoint already being probed is never picked.
        """
        for index, health in enumerate(self.health):
            if index not in exclude and health.usable(now):
                self.health[index] = _started(health)
                return index
        if not panic:
            return None
        open_now = [
            (health.ready_at(), index)
            for index, health in enumerate(self.health)
            if index not in exclude and health.state is BreakerState.OPEN and now >= health.not_before
        ]
        if not open_now:
            return None
        _, index = min(open_now)
        self.health[index] = _started(self.health[index])
        return index

    def succeeded(self, index: int) -> None:
        """The endpoint answered (any answer that proves it is up): close its breaker."""
        self.health[index] = _succeeded(self.health[index], self.policy)

    def failed(self, index: int, now: float, retry_after: float | None = None) -> None:
        """The endpoint failed (connect error, 5xx, 429, broken stream, timeout)."""
        self.health[index] = _failed(self.health[index], now, self.policy, retry_after)

    def released(self, index: int) -> None:
        """The call on this endpoint ended without a verdict (cancelled or out of time)."""
        self.health[index] = _released(self.health[index])

    def next_ready_at(self, exclude: Collection[int] = (), *, panic: bool = False) -> float | None:
        """The earliest time an endpoint outside ``exclude`` that is not being probed becomes usable
        (with ``panic``: may be picked by ``pick(..., panic=True)``, cooldowns not counted)."""
        times = [
            health.ready_at(panic=panic)
            for index, health in enumerate(self.health)
            if index not in exclude and health.state is not BreakerState.HALF_OPEN
        ]
        return min(times) if times else None

    def state(self, index: int) -> BreakerState:
        """The breaker state of endpoint ``index``."""
        return self.health[index].state


def backoff_delay(round_index: int, policy: RetryPolicy, rng: random.Random | None = None) -> float:
    """The pause after failed round ``round_index`` (0-based): exponential, capped, jittered."""
    base = min(policy.backoff * (2.0**round_index), policy.max_backoff)  # float: int**int is typed Any
    spread = base * policy.jitter
    return max(0.0, base + (rng or random).uniform(-spread, spread))


def parse_retry_after(value: str | None, wall_now: float) -> float | None:
    """A ``Retry-After`` header (delay-seconds or an HTTP-date) → seconds from now, or None."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        from email.utils import parsedate_to_datetime

        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        seconds = when.timestamp() - wall_now
    if seconds != seconds or seconds < 0:  # NaN, or a date in the past
        return 0.0 if seconds == seconds else None
    return seconds
