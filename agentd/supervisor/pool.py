"""The pool of children: placement, growth, spares, idle unload and retirement.

Sessions are rows; children are a pool of long-lived processes that host many sessions each. The
pool decides nothing itself — ``agentd.supervisor.placement`` does, over snapshots of the children
— it carries the decisions out: starts children, promotes spares, places sessions, unloads idle
ones and retires surplus children. When a child ends, the pool tells its ``PoolOwner`` which
sessions were loaded there and which had a turn in flight; what happens to them (re-run, blame,
quarantine) is the owner's business (``agentd.supervisor.turns``). See RFC 0006.

The pool is the one owner of where sessions are: each child's ``loaded`` and ``in_flight`` sets
are the pool's, edited only here (``acquire``, ``release``, ``unload``, ``turn_started``,
``turn_ended``); children and everyone else read them. It also owns sending one frame to every
child and collecting their acknowledgements (``broadcast``, a ``Fanout``).

Children are started through the launcher the pool is given (``agentd.supervisor.launcher``):
``python -P -m agentd.child`` processes by default, the child runtime as in-process tasks in tests.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable, Mapping, Set
from typing import Protocol

import anyio
import anyio.abc

from agentd import events
from agentd.config import SupervisorSettings
from agentd.obs import get_logger
from agentd.protocol import Close, Frame, Spawn, SwapIntel, SwapsApplied
from agentd.supervisor.child import Child, FrameSink
from agentd.supervisor.launcher import Launcher, ProcessLauncher
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

__all__ = ["Fanout", "Pool", "PoolOwner", "first_of", "pool_size"]

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
        launcher: Launcher | None = None,
    ) -> None:
        self._settings = settings
        self._spawn = spawn
        self._env = env
        self._owner = owner
        # Read at each start, so a test may swap it before the pool runs (in-process children).
        self.launcher: Launcher = launcher if launcher is not None else ProcessLauncher()
        self.children: dict[str, Child] = {}
        # The only writable handles on each child's sessions (child id → set); a Child holds views.
        self._loaded: dict[str, set[str]] = {}
        self._in_flight: dict[str, set[str]] = {}
        self._fanouts: list[Fanout] = []  # broadcasts some child has not acknowledged yet
        self._sink = _PoolSink(self, owner)
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
        self._room_changed()

    def _room_changed(self) -> None:
        """Wake the placements waiting for room: they decide again from the pool as it is now."""
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
        placements see the load at once), or gives the place back (``release``).
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
            self._loaded.get(child.id, set()).discard(session_id)
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
        self._loaded[child.id].add(session_id)
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
        self._loaded[child.id].discard(session_id)
        child.used_at = time.monotonic()  # its idle time, if that was its last session, starts now
        self.changed()
        if child.usable:
            await child.send(Close(session=session_id))

    def release(self, session_id: str, child: Child) -> None:
        """Give back ``session_id``'s place on ``child`` without a ``Close``: a reservation the turn
        no longer needs (cancelled, closed, or out of time while the child started), or an ``Open``
        the child refused. The child never hosted the session, so there is nothing to tell it."""
        loads = self._loaded.get(child.id)
        if loads is None or session_id not in loads:
            return
        loads.discard(session_id)
        child.used_at = time.monotonic()  # given back: its idle time starts now (RFC 0006 §4)
        self.changed()

    def turn_started(self, session_id: str, child: Child) -> None:
        """``session_id``'s turn was sent to ``child``: it is busy there (placement counts it)."""
        running = self._in_flight.get(child.id)
        if running is not None:  # None: the child is gone and its sets were handed to the owner
            running.add(session_id)

    def turn_ended(self, session_id: str, child: Child) -> None:
        """``session_id``'s turn on ``child`` ended, or the child went.

        The plan (``plan_pool``) reads a child's turns in flight only as "none left" (an empty child
        may retire) and a draining or quarantine child only when it empties, so the pool re-plans
        then, not after every turn (a pass looks at every child)."""
        running = self._in_flight.get(child.id)
        if running is not None:
            running.discard(session_id)
        child.used_at = time.monotonic()  # it ran a turn until now: its idle time starts now
        if not running or child.role in (ChildRole.DRAINING, ChildRole.QUARANTINE):
            self.changed()
        else:
            self._room_changed()

    # ------------------------------------------------------------------ broadcast

    async def broadcast(self, frame_for_child: Callable[[Child], SwapIntel]) -> Fanout:
        """Send a frame to every usable child at once; return once each send is done or failed.

        ``frame_for_child`` builds each child's frame (a reload's ``SwapIntel``, the same for all
        or not). The returned ``Fanout`` tells which children took the frame and which could not
        (gone, or hung: ``Child.send`` is bounded), and collects their acknowledgements as they
        arrive — a ``SwapAck`` of the frame's generation or a later one — until every child has
        acknowledged or gone (``Fanout.done``). Sends run concurrently: one slow child delays no
        other, and every ack is waited for by the caller only as long as it chooses.
        """
        children = [c for c in self.children.values() if c.usable]
        frames = {c.id: frame_for_child(c) for c in children}
        fanout = Fanout({child_id: frame.generation for child_id, frame in frames.items()})
        # Registered before anything is sent: a fast child's ack must find it.
        self._fanouts.append(fanout)

        async def send(child: Child) -> None:
            if await child.send(frames[child.id]):
                fanout.sent.append(child)
            else:
                fanout.unsent.append(child)
                fanout.forget(child.id)

        async with anyio.create_task_group() as tg:
            for child in children:
                tg.start_soon(send, child)
        self._settle_fanouts()
        return fanout

    def _acked(self, child: Child, generation: int) -> None:
        for fanout in self._fanouts:
            fanout.ack(child.id, generation)
        self._settle_fanouts()

    def _settle_fanouts(self) -> None:
        self._fanouts = [f for f in self._fanouts if not f.done.is_set()]

    # ------------------------------------------------------------------ children

    def _start(self, role: ChildRole) -> Child:
        assert self._tg is not None, "the pool is not running"
        child_id = f"c{next(self._ids)}"
        loaded, in_flight = self._loaded.setdefault(child_id, set()), self._in_flight.setdefault(child_id, set())
        child = Child(child_id, role, loaded=loaded, in_flight=in_flight)
        child.restarts = self._replacing.pop(0) if self._replacing else 0
        child.used_at = time.monotonic()
        self.children[child.id] = child
        self._tg.start_soon(self._run_child, child)
        return child

    async def _run_child(self, child: Child) -> None:
        try:
            await child.run(self.launcher, self._spawn, self._settings, self._env(), self._sink, self._on_ready)
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
        # Emptied, then forgotten: the child's views stay valid (and empty) for whoever still holds it.
        self._loaded.pop(child.id, set()).clear()
        self._in_flight.pop(child.id, set()).clear()
        for fanout in self._fanouts:
            fanout.forget(child.id)  # it will never acknowledge
        self._settle_fanouts()
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


class Fanout:
    """One broadcast (``Pool.broadcast``): which children took the frame, and their acknowledgements.

    ``done`` is set once no child is left to wait for: each has acknowledged (``acked``) or is gone
    or could not be sent the frame (``missed``). ``complete`` says whether every child that was sent
    the frame acknowledged it.
    """

    def __init__(self, generations: Mapping[str, int]) -> None:
        self.started = time.monotonic()
        self.generation = max(generations.values(), default=0)
        self.sent: list[Child] = []  # took the frame
        self.unsent: list[Child] = []  # gone or hung when it was sent
        self.acked: dict[str, float] = {}  # child id → seconds from the start to its ack
        self.missed: set[str] = set()  # child ids that will never acknowledge (gone, unsent)
        self._waiting = dict(generations)  # child id → the generation its ack must reach
        self.done = anyio.Event()
        self.finished_at: float | None = None
        if not self._waiting:
            self._finish()

    @property
    def waiting(self) -> Set[str]:
        """The child ids whose acknowledgement has not come."""
        return self._waiting.keys()

    @property
    def complete(self) -> bool:
        """Done, and every child it was sent to acknowledged it."""
        return self.done.is_set() and not self.missed

    @property
    def seconds(self) -> float | None:
        """How long the fan-out took to be done, once it is."""
        return None if self.finished_at is None else self.finished_at - self.started

    def ack(self, child_id: str, generation: int) -> None:
        """``child_id`` acknowledged ``generation``: that acknowledges this frame if it is the same
        generation or a later one (frames reach a child in order)."""
        wanted = self._waiting.get(child_id)
        if wanted is None or generation < wanted:
            return
        del self._waiting[child_id]
        self.acked[child_id] = time.monotonic() - self.started
        if not self._waiting:
            self._finish()

    def forget(self, child_id: str) -> None:
        """``child_id`` will never acknowledge (it is gone, or the frame could not be sent)."""
        if self._waiting.pop(child_id, None) is None:
            return
        self.missed.add(child_id)
        if not self._waiting:
            self._finish()

    def _finish(self) -> None:
        self.finished_at = time.monotonic()
        self.done.set()


class _PoolSink:
    """What the pool's children send, on its way to the owner: the pool sees acks first (``Fanout``)."""

    def __init__(self, pool: Pool, owner: FrameSink) -> None:
        self._pool = pool
        self._owner = owner

    async def session_frame(self, child: Child, frame: Frame) -> None:
        await self._owner.session_frame(child, frame)

    def swap_acked(self, child: Child, generation: int) -> None:
        self._pool._acked(child, generation)
        self._owner.swap_acked(child, generation)

    def swaps_applied(self, child: Child, frame: SwapsApplied) -> None:
        self._owner.swaps_applied(child, frame)
