"""The pool of children: placement, growth, spares, idle unload and retirement.

Sessions are rows; children are a pool of long-lived processes that host many sessions each. The
pool decides nothing itself — ``agentd.supervisor.placement`` does, over snapshots of the children
— it carries the decisions out: starts children, promotes spares, places sessions, unloads idle
ones and retires surplus children. When a child ends, the pool tells its ``PoolOwner`` which
sessions were loaded there and which had a turn in flight; what happens to them (re-run, blame,
quarantine) is the owner's business (``agentd.supervisor.runner``). See RFC 0006.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable, Mapping
from typing import Protocol

import anyio
import anyio.abc

from agentd import events
from agentd.config import SupervisorSettings
from agentd.obs import get_logger
from agentd.protocol import Close, Spawn
from agentd.supervisor.child import Child, FrameSink
from agentd.supervisor.placement import (
    ChildRole,
    ChildSnapshot,
    Placement,
    PoolPlan,
    PoolSize,
    counted_cpus,
    effective_children,
    place,
    plan_pool,
)

__all__ = ["Pool", "PoolOwner", "first_of", "pool_size"]

log = get_logger("supervisor")

SPAWN_BACKOFF_START = 0.5
#: Children failing to start in a row before readiness says so (one may fail for a passing reason).
START_FAILURES_UNREADY = 3
SPAWN_BACKOFF_MAX = 30.0
IDLE_CHECK_MAX = 30.0


class PoolOwner(FrameSink, Protocol):
    """What the pool needs from the supervisor: frames, swaps for new children, and session facts."""

    async def child_ready(self, child: Child) -> None:
        """A child became Ready (send it the newest generation if it changed while it started)."""

    async def child_lost(self, child: Child, loaded: set[str], in_flight: set[str], *, crashed: bool) -> None:
        """A child ended (``crashed``: a Ready child that was not asked to): ``loaded`` sessions are no
        longer loaded; ``in_flight`` ones lost their turn."""

    def idle_since(self, session_id: str) -> float | None:
        """Monotonic time the session's last turn ended, or None while it has one in flight."""

    def session_unloaded(self, session_id: str) -> None:
        """The pool unloaded an idle session (sent ``Close``)."""


def pool_size(settings: SupervisorSettings) -> PoolSize:
    """The ``[supervisor]`` pool keys as the decisions take them (RFC 0006 §2).

    ``children`` is kept as configured: that many active children stay up with no load (``0``:
    none, the spares only). It is also the spread — how many active children concurrent turns are
    spread over — where ``0`` means the CPU count. An empty child the pool grew for load is retired
    after ``idle_unload``, the same wait that unloads an idle session.
    """
    return PoolSize(
        children=settings.children,
        sessions_per_child=settings.sessions_per_child,
        max_children=settings.max_children,
        spare_children=settings.spare_children,
        spread=effective_children(settings.children),
        retire_after=settings.idle_unload,
    )


class Pool:
    """Every child of the supervisor, and the sessions loaded on each."""

    def __init__(
        self,
        *,
        settings: Callable[[], SupervisorSettings],
        spawn: Callable[[str], Spawn],
        env: Callable[[], Mapping[str, str]],
        owner: PoolOwner,
    ) -> None:
        self._settings = settings
        self._spawn = spawn
        self._env = env
        self._owner = owner
        self.children: dict[str, Child] = {}
        self._replacing: list[int] = []  # restart counts carried to the children that replace crashed ones
        self._ids = itertools.count(1)
        self._tg: anyio.abc.TaskGroup | None = None
        self._changed = anyio.Event()  # wakes the maintenance loop
        self._room = anyio.Event()  # wakes placements waiting for room
        self._spawn_failures = 0
        self._start_error: str | None = None  # the last child's reason for not becoming Ready
        self._stopping = False
        self._last_idle_scan = -math.inf  # when the idle scan last ran (monotonic)
        self._retired: set[str] = set()  # children the plan retired, being stopped

    # ------------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Keep the pool at its planned size and unload idle sessions, until cancelled."""
        size = pool_size(self._settings())
        log.info(
            events.LOG_POOL_STARTED,
            cpus=counted_cpus(),
            children=size.children,
            spread=size.spread_cap,
            spare_children=size.spare_children,
            max_children=size.max_children,
        )
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            while not self._stopping:
                await self._maintain()
                self._changed = anyio.Event()
                # Until the next idle scan is due, or a change wakes us: a reload of the pool keys
                # is one (``changed``), and the due time is computed again from the running
                # ``idle_unload`` on every pass, so lowering it applies at once.
                with anyio.move_on_after(max(0.0, self._idle_scan_due() - time.monotonic())):
                    await self._changed.wait()
            tg.cancel_scope.cancel()

    def changed(self) -> None:
        """Something the plan depends on changed (a child's load, the settings): re-plan soon."""
        self._changed.set()
        self._room.set()
        self._room = anyio.Event()

    async def stop(self, grace: float) -> None:
        """Stop every child with the kill ladder (running turns get ``grace``), concurrently."""
        self._stopping = True
        self.changed()
        async with anyio.create_task_group() as tg:
            for child in list(self.children.values()):
                tg.start_soon(child.stop, grace)

    # ------------------------------------------------------------------ placement

    async def acquire(self, session_id: str, *, quarantined: bool = False) -> Child | None:
        """The child ``session_id`` is (or is now) loaded on, once Ready; None if the pool is stopping.

        Sticky: a session already loaded stays where it is. The caller opens the session on a child
        that did not host it (``Child.loaded`` is reserved here, synchronously, so concurrent
        placements see the load at once).
        """
        while not self._stopping:
            child = self.where(session_id)
            if child is None:
                child = await self._place(session_id, quarantined)
                if child is None:
                    continue
            if not child.ready.is_set():
                await first_of(child.ready, child.gone)
            if child.usable:
                return child
            child.loaded.discard(session_id)
        return None

    def where(self, session_id: str) -> Child | None:
        """The live child the session is loaded on, if any."""
        for child in self.children.values():
            if session_id in child.loaded and not child.gone.is_set():
                return child
        return None

    def _snapshots(self) -> list[ChildSnapshot]:
        """The live children as the decisions see them; a child hosting anything is in use now."""
        now = time.monotonic()
        snapshots = []
        for child in self.children.values():
            if child.gone.is_set():
                continue
            if child.loaded or child.in_flight:
                child.used_at = now
            snapshots.append(child.snapshot(idle_for=now - child.used_at))
        return snapshots

    def _verdict(self, quarantined: bool) -> Placement:
        return place(self._snapshots(), pool_size(self._settings()), quarantined=quarantined)

    async def _place(self, session_id: str, quarantined: bool) -> Child | None:
        verdict = self._verdict(quarantined)
        if verdict.spawn and self._spawn_failures:
            # Children keep failing to start: back off, then decide again from what the pool is
            # now (others waiting meanwhile may have started one), so the cap always holds.
            await self._spawn_backoff()
            verdict = self._verdict(quarantined)
        if verdict.child is not None:
            child = self.children[verdict.child]
        elif verdict.promote is not None:
            child = self.children[verdict.promote]
            child.role = ChildRole.ACTIVE
            self.changed()  # a spare was used: start a new one
        elif verdict.spawn:
            if self._stopping:
                return None
            child = self._start(ChildRole.QUARANTINE if quarantined else ChildRole.ACTIVE)
        else:
            # Every child is full and the pool is at max_children: make room by unloading the
            # session idle for longest (it costs nothing to load again), else wait for room.
            room = self._room
            if not await self._evict_longest_idle():
                await room.wait()
            return None
        child.loaded.add(session_id)
        child.used_at = time.monotonic()
        return child

    async def unload(self, session_id: str) -> None:
        """Forget where a session is loaded; its child is told ``Close`` if it is still up.

        The Close is sent before this returns, so it precedes any later ``Open`` of the session on
        the same child (the channel keeps frames in order).
        """
        child = self.where(session_id)
        if child is None:
            return
        child.loaded.discard(session_id)
        child.used_at = time.monotonic()  # its idle time, if that was its last session, starts now
        self.changed()
        if child.usable:
            await child.send(Close(session=session_id))

    # ------------------------------------------------------------------ children

    def _start(self, role: ChildRole) -> Child:
        assert self._tg is not None, "the pool is not running"
        child = Child(f"c{next(self._ids)}", role)
        child.restarts = self._replacing.pop(0) if self._replacing else 0
        child.used_at = time.monotonic()
        self.children[child.id] = child
        self._tg.start_soon(self._run_child, child)
        return child

    async def _run_child(self, child: Child) -> None:
        try:
            await child.run(self._spawn, self._settings, self._env(), self._owner, self._on_ready)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_gone(child)

    async def _on_ready(self, child: Child) -> None:
        self._spawn_failures = 0
        if child.role is ChildRole.STARTING:
            child.role = ChildRole.SPARE
        await self._owner.child_ready(child)
        self.changed()

    async def _on_gone(self, child: Child) -> None:
        self.children.pop(child.id, None)
        self._retired.discard(child.id)
        # A crash: a child that was Ready ended without being asked to. One that never became Ready
        # failed to start (counted apart, for the spawn backoff).
        crashed = child.ready.is_set() and child._stopping is None and not self._stopping
        if not child.ready.is_set():
            self._spawn_failures += 1
            self._start_error = child.start_error or f"it exited with status {child.exit_code}"
        elif crashed:  # counted by the owner (agentd_child_crashes_total); the replacement carries it
            self._replacing.append(child.restarts + 1)
        loaded, in_flight = set(child.loaded), set(child.in_flight)
        child.loaded.clear()
        child.in_flight.clear()
        self.changed()
        await self._owner.child_lost(child, loaded, in_flight, crashed=crashed)

    @property
    def start_failure(self) -> str | None:
        """Why children cannot start, once several in a row have failed to (for readiness); else None."""
        if self._spawn_failures < START_FAILURES_UNREADY:
            return None
        return f"{self._spawn_failures} children in a row failed to start; the last: {self._start_error}"

    async def _spawn_backoff(self) -> None:
        """Children that keep failing to start are retried with backoff (0.5 s doubling to 30 s)."""
        if self._spawn_failures:
            delay = min(SPAWN_BACKOFF_START * 2 ** (self._spawn_failures - 1), SPAWN_BACKOFF_MAX)
            await anyio.sleep(delay * random.uniform(0.5, 1.0))

    def _plan(self) -> PoolPlan:
        return plan_pool(self._snapshots(), pool_size(self._settings()))

    async def _maintain(self) -> None:
        """One pass: carry out the plan, then unload sessions idle for longer than ``idle_unload``."""
        plan = self._plan()
        if plan.spawn and self._spawn_failures:
            await self._spawn_backoff()
            plan = self._plan()  # decided again after the wait: placements may have started children
        for child_id in plan.promote:
            self.children[child_id].role = ChildRole.ACTIVE
        for child_id in plan.drain:
            self.children[child_id].role = ChildRole.DRAINING
        now = time.monotonic()
        for child_id in plan.retire:
            if child_id in self._retired:
                continue  # already on its way out: one stop, one log line
            self._retired.add(child_id)
            child = self.children[child_id]
            log.info(
                events.LOG_CHILD_RETIRED,
                child=child.id,
                pid=child.pid,
                role=str(child.role),
                idle=round(now - child.used_at, 3),
            )
            child.role = ChildRole.DRAINING
            assert self._tg is not None
            self._tg.start_soon(child.stop, self._settings().stop_grace)
        if plan.spawn:
            for _ in range(plan.spawn):
                if not self._stopping:
                    self._start(ChildRole.STARTING)
        # The idle scan visits every loaded session: at most once per interval (a turn's end wakes
        # this loop, and per-turn work must not grow with the number of loaded sessions), but at
        # once while a child drains.
        now = time.monotonic()
        if now >= self._idle_scan_due() or any(c.role is ChildRole.DRAINING for c in self.children.values()):
            self._last_idle_scan = now
            await self._unload_idle()

    async def _unload_idle(self) -> None:
        idle_unload = self._settings().idle_unload
        now = time.monotonic()
        for child in list(self.children.values()):
            draining = child.role is ChildRole.DRAINING
            for session_id in list(child.loaded):
                since = self._owner.idle_since(session_id)
                if since is not None and (draining or now - since >= idle_unload):
                    await self.unload(session_id)
                    self._owner.session_unloaded(session_id)

    async def _evict_longest_idle(self) -> bool:
        """Unload the loaded session that has been idle longest; False when every loaded one is running."""
        idle = [
            (since, session_id)
            for child in self.children.values()
            if child.role is ChildRole.ACTIVE and not child.gone.is_set()
            for session_id in child.loaded
            if (since := self._owner.idle_since(session_id)) is not None
        ]
        if not idle:
            return False
        _, session_id = min(idle)
        await self.unload(session_id)
        self._owner.session_unloaded(session_id)
        return True

    def _idle_scan_due(self) -> float:
        """When the next idle scan is due: from the last scan, at the interval the running settings give
        (not one fixed when the scan ran, which would keep a reload's lower ``idle_unload`` waiting)."""
        return self._last_idle_scan + self._idle_check_interval()

    def _idle_check_interval(self) -> float:
        idle_unload = self._settings().idle_unload
        return max(0.05, min(IDLE_CHECK_MAX, idle_unload / 4 if math.isfinite(idle_unload) else IDLE_CHECK_MAX))


async def first_of(*waitables: anyio.Event) -> None:
    """Wait until any of the events is set."""
    async with anyio.create_task_group() as tg:
        for event in waitables:

            async def wait(event: anyio.Event = event) -> None:
                await event.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(wait)
