"""Where a session runs and how big the pool is: pure decisions over snapshots of the children.

The pool (``agentd.supervisor.pool``) owns the processes; this module only decides. Every function
takes frozen snapshots and settings and returns a verdict, so the rules are unit-tested without a
process (``tests/test_placement.py``). The rules, from rfcs/0006-pool.md:

- A child is *active* (it takes new sessions), *spare* (started and ready, held back so that a new
  or replacement child never costs a cold start on a request's path), *starting*, *draining*
  (takes nothing new; retired once its turns end) or *quarantine* (hosts exactly one session
  that was in flight during repeated crashes).
- A session is placed on the least-loaded active child with room (``sessions_per_child``); when
  every active child is full, a spare is promoted (or a child that is starting to become one);
  when there is none, a child is started, up to ``max_children``; beyond that the session waits
  for room. While every active child runs a turn and there are fewer than the *spread* (the CPU
  count by default), a ready spare is promoted rather than the session queued behind busy ones:
  the pool grows with concurrent load, never with a cold start on a request's path.
- The pool keeps ``children`` active children (none by default: what load needs) and
  ``spare_children`` spares, never more than ``max_children`` processes besides quarantine
  children; surplus spares are retired at once, an empty active child above ``children`` once it
  has hosted nothing for ``retire_after`` (``idle_unload``), so the idle footprint does not depend
  on the machine's size.
"""

from __future__ import annotations

import enum
import functools
import os
from collections.abc import Sequence

import msgspec

__all__ = [
    "ChildRole",
    "ChildSnapshot",
    "Placement",
    "PoolPlan",
    "PoolSize",
    "counted_cpus",
    "effective_children",
    "growth_cap",
    "place",
    "plan_pool",
]


class ChildRole(enum.StrEnum):
    """What the pool uses a child for (see the module docstring)."""

    STARTING = "starting"
    SPARE = "spare"
    ACTIVE = "active"
    DRAINING = "draining"
    QUARANTINE = "quarantine"


class ChildSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """One child as a decision sees it: its role, how many sessions it hosts and runs turns for, and
    for how long it has hosted nothing (``idle_for`` seconds; 0 while it hosts a session)."""

    id: str
    role: ChildRole
    loaded: int = 0
    in_flight: int = 0
    idle_for: float = 0.0


class PoolSize(msgspec.Struct, frozen=True, kw_only=True):
    """The ``[supervisor]`` pool settings as the decisions take them (see ``pool_size`` in pool.py).

    ``children``: active children kept even with no load (0: none, only the spares).
    ``spread``: the most active children the pool spreads concurrent turns over by promoting spares
    (0: ``children``); ``children = 0`` in the config makes it the CPU count (``effective_children``).
    ``retire_after``: seconds an empty active child above ``children`` is kept before it is retired.
    """

    children: int
    sessions_per_child: int
    max_children: int
    spare_children: int
    spread: int = 0
    retire_after: float = 0.0

    @property
    def spread_cap(self) -> int:
        """The most active children concurrent turns are spread over (``spread``, else ``children``)."""
        return self.spread or self.children


def effective_children(configured: int, cpus: int | None = None) -> int:
    """The spread for ``children = configured``: ``0`` means the number of CPUs this process may use
    (``usable_cpus``), never fewer than 2, so two concurrent turns never share a child while a spare
    is ready."""
    if configured > 0:
        return configured
    return max(2, cpus if cpus is not None else _cpu_count())


def counted_cpus() -> int:
    """The CPUs this process may use, as ``children = 0`` counts them (``usable_cpus``; read once)."""
    return _cpu_count()


@functools.cache
def _cpu_count() -> int:
    # Read once: the pool asks on every placement, and the machine does not change under it.
    return usable_cpus(_affinity(), _read("/sys/fs/cgroup/cpu.max"), _cgroup_v1_quota())


def usable_cpus(affinity: int | None, cpu_max: str | None, v1_quota: tuple[str, str] | None = None) -> int:
    """The CPUs this process may use: those it may run on (its affinity mask, else every CPU),
    capped by its cgroup's CPU quota rounded up (a Kubernetes ``limits.cpu``: cgroup v2
    ``cpu.max`` "<quota> <period>", or v1 ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us``);
    never fewer than 1. A container on a large node must not start a child per node CPU."""
    cpus = affinity or os.cpu_count() or 1
    quota = _quota_cpus(*cpu_max.split()[:2]) if cpu_max and len(cpu_max.split()) >= 2 else None
    if quota is None and v1_quota is not None:
        quota = _quota_cpus(*v1_quota)
    return max(1, min(cpus, quota) if quota is not None else cpus)


def _quota_cpus(quota: str, period: str) -> int | None:
    """CPUs a quota of ``quota`` µs per ``period`` µs allows, rounded up; None when unlimited or unreadable."""
    try:
        allowed, every = int(quota), int(period)
    except ValueError:  # "max": no quota
        return None
    if allowed <= 0 or every <= 0:  # v1 says -1 for no quota
        return None
    return -(-allowed // every)


def _affinity() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as handle:
            return handle.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _cgroup_v1_quota() -> tuple[str, str] | None:
    quota, period = _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), _read("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
    return (quota, period) if quota is not None and period is not None else None


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """Where to load a session: on ``child``; or promote ``promote`` (a spare); or ``spawn`` one; or wait."""

    child: str | None = None
    promote: str | None = None
    spawn: bool = False

    @property
    def waits(self) -> bool:
        """No room anywhere and the pool is at ``max_children``: the session waits for a child to free up."""
        return self.child is None and self.promote is None and not self.spawn


def _age(child: ChildSnapshot) -> tuple[int, str]:
    """Ids are ``c1, c2, …``: shorter is older, so ``c9`` comes before ``c10``."""
    return len(child.id), child.id


def growth_cap(size: PoolSize) -> int:
    """How many children (quarantine ones aside) the pool may run: ``max_children``, never below ``children``."""
    return max(size.max_children, size.children)


def _counted(children: Sequence[ChildSnapshot]) -> int:
    """Processes that count against ``max_children`` (quarantine children are extra, by design)."""
    return sum(1 for c in children if c.role is not ChildRole.QUARANTINE)


def place(children: Sequence[ChildSnapshot], size: PoolSize, *, quarantined: bool = False) -> Placement:
    """Choose the child a session is loaded on (it stays there while it is active: sticky).

    Least loaded first (fewest sessions, then fewest turns in flight, then the oldest id, so the
    choice is deterministic). A quarantined session gets a child of its own — while there are
    fewer quarantine children than the pool may grow to, so crashes that blame many sessions at
    once (an OOM kill of a busy child) cannot multiply the processes without bound; beyond that it
    is placed like any other session.
    """
    quarantine = sum(1 for c in children if c.role is ChildRole.QUARANTINE)
    if quarantined and quarantine < growth_cap(size):
        return Placement(spawn=True)
    active = [c for c in children if c.role is ChildRole.ACTIVE]
    room = [c for c in active if c.loaded < size.sessions_per_child]
    spares = sorted((c for c in children if c.role is ChildRole.SPARE), key=_age)
    # Growth with load: while every active child runs a turn, a ready spare takes the session
    # instead (up to the spread, the CPU count by default), so concurrent turns use the cores.
    # Only a Ready spare: a cold start would cost the request more than sharing a busy child
    # (turns are concurrent tasks there), and the promoted spare is replaced in the background.
    if room and spares and len(active) < size.spread_cap and all(c.in_flight for c in active):
        return Placement(promote=spares[0].id)
    if room:
        best = min(room, key=lambda c: (c.loaded, c.in_flight, _age(c)))
        return Placement(child=best.id)
    # A ready spare first; else a child still starting (it was going to be a spare): waiting for
    # it beats starting one more.
    starting = sorted((c for c in children if c.role is ChildRole.STARTING), key=_age)
    if spares or starting:
        return Placement(promote=(spares or starting)[0].id)
    if _counted(children) < growth_cap(size):
        return Placement(spawn=True)
    return Placement()


class PoolPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What the pool should do now: start ``spawn`` children, promote spares, drain or retire some.

    ``drain``: stop placing sessions there; unload its idle sessions, let its turns end.
    ``retire``: an empty child to shut down now.
    """

    spawn: int = 0
    promote: tuple[str, ...] = ()
    drain: tuple[str, ...] = ()
    retire: tuple[str, ...] = ()


def plan_pool(children: Sequence[ChildSnapshot], size: PoolSize) -> PoolPlan:
    """Bring the pool towards ``children`` active plus ``spare_children`` spares, within ``max_children``.

    - Too few active children (at start, after a crash, after ``children`` grew): promote spares,
      then start children for the rest. With ``children = 0`` there are none to keep: at start
      only the spares are started, and load grows the pool (``place``).
    - Too few spares: start more, if ``max_children`` allows.
    - Too many: surplus spares are retired at once; an empty active child beyond ``children`` once
      it has hosted nothing for ``retire_after`` (a child the pool grew for load leaves once idle
      unloads have emptied it and it stayed empty that long: a burst that comes back soon finds
      it still there). A child with a loaded session or a turn in flight is never retired. Above ``max_children`` (a
      reload lowered it) the least-loaded children are drained: they take nothing new, their idle
      sessions are unloaded, and they are retired once their turns have ended, so a shrink never
      cuts a turn.
    - A draining or quarantine child that is empty is retired.
    """
    active = [c for c in children if c.role is ChildRole.ACTIVE]
    spares = sorted((c for c in children if c.role is ChildRole.SPARE), key=_age)
    starting = sum(1 for c in children if c.role is ChildRole.STARTING)
    counted = _counted(children)
    cap = growth_cap(size)

    promote: list[str] = []
    missing_active = size.children - len(active)
    while missing_active > 0 and spares:
        promote.append(spares.pop(0).id)
        missing_active -= 1
    # Children being started become spares (or active, by promotion) once Ready: count them once.
    wanted_new = max(0, missing_active) + size.spare_children - len(spares) - starting
    spawn = max(0, min(wanted_new, cap - counted))

    # An empty draining child has nothing left to finish; an empty quarantine child has no one left
    # to isolate (its session was unloaded, closed, or failed).
    retire = [
        c.id
        for c in children
        if c.role in (ChildRole.DRAINING, ChildRole.QUARANTINE) and c.loaded == 0 and c.in_flight == 0
    ]
    surplus_spares = len(spares) - size.spare_children
    if surplus_spares > 0:
        retire += [c.id for c in spares[-surplus_spares:]]
    # Active children beyond ``children`` exist because load grew the pool: they stay while they
    # host sessions and are retired once idle unloads have emptied them and they stayed empty for
    # ``retire_after`` (what load needs is what is loaded or running; the spares are kept apart).
    by_load = sorted(active, key=lambda c: (c.loaded, c.in_flight, _age(c)))
    empty = [c.id for c in by_load if c.loaded == 0 and c.in_flight == 0 and c.idle_for >= size.retire_after]
    retire += empty[: max(0, len(active) - size.children)]
    # Above max_children (a reload lowered it): the least-loaded loaded children drain.
    # Children already draining are on their way out: they do not count against the cap again.
    staying = counted - len(retire) - sum(1 for c in children if c.role is ChildRole.DRAINING and c.id not in retire)
    drain = [c.id for c in by_load if c.id not in retire][: max(0, staying - cap)]
    return PoolPlan(spawn=spawn, promote=tuple(promote), drain=tuple(drain), retire=tuple(retire))
