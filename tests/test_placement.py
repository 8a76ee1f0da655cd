"""Placement, pool size and crash blame as pure decisions (agentd/supervisor/placement.py, blame.py)."""

from __future__ import annotations

import pytest

from agentd.supervisor.blame import MAX_CRASHES, CrashVerdict, blame, quarantined, rerun_allowed
from agentd.supervisor.placement import (
    ChildRole,
    ChildSnapshot,
    Placement,
    PoolPlan,
    PoolSize,
    effective_children,
    place,
    plan_pool,
    usable_cpus,
)

SIZE = PoolSize(children=2, sessions_per_child=3, max_children=4, spare_children=1)


def child(
    id: str, role: ChildRole = ChildRole.ACTIVE, loaded: int = 0, in_flight: int = 0, idle_for: float = 0.0
) -> ChildSnapshot:
    return ChildSnapshot(id=id, role=role, loaded=loaded, in_flight=in_flight, idle_for=idle_for)


# --------------------------------------------------------------------------- children = 0


@pytest.mark.parametrize(
    ("affinity", "cpu_max", "v1", "expected"),
    [
        (64, "max 100000", None, 64),  # no quota: the CPUs it may run on
        (64, "200000 100000", None, 2),  # limits.cpu: 2 on a 64-CPU node
        (64, "150000 100000", None, 2),  # 1.5 CPUs: rounded up
        (64, "50000 100000", None, 1),
        (4, "800000 100000", None, 4),  # the affinity mask is smaller than the quota
        (64, None, ("300000", "100000"), 3),  # cgroup v1
        (64, None, ("-1", "100000"), 64),  # v1 without a quota
        (64, "garbage", None, 64),
        (64, "0 100000", None, 64),
    ],
)
def test_usable_cpus_honours_the_affinity_mask_and_the_cgroup_quota(
    affinity: int, cpu_max: str | None, v1: tuple[str, str] | None, expected: int
) -> None:
    assert usable_cpus(affinity, cpu_max, v1) == expected


def test_children_zero_is_the_cpu_count_but_at_least_two() -> None:
    assert effective_children(0, cpus=8) == 8
    assert effective_children(0, cpus=1) == 2
    assert effective_children(3, cpus=8) == 3


# --------------------------------------------------------------------------- place


def test_least_loaded_active_child_wins_then_fewest_in_flight_then_oldest_id() -> None:
    pool = [child("c2", loaded=2), child("c1", loaded=1, in_flight=1), child("c3", loaded=1)]
    assert place(pool, SIZE).child == "c3"
    assert place([child("c2", loaded=1), child("c1", loaded=1)], SIZE).child == "c1"


def test_spares_starting_and_draining_children_take_no_session_while_an_active_one_has_room() -> None:
    pool = [
        child("c1", loaded=2),
        child("s", ChildRole.SPARE),
        child("d", ChildRole.DRAINING),
        child("n", ChildRole.STARTING),
    ]
    assert place(pool, SIZE).child == "c1"


def test_every_active_child_full_promotes_a_spare() -> None:
    pool = [child("c1", loaded=3), child("c2", loaded=3), child("s2", ChildRole.SPARE), child("s1", ChildRole.SPARE)]
    assert place(pool, SIZE).promote == "s1"


def test_a_child_still_starting_is_promoted_before_another_is_started() -> None:
    pool = [child("c1", loaded=3), child("c2", loaded=3), child("n1", ChildRole.STARTING)]
    assert place(pool, SIZE).promote == "n1"
    assert place([*pool, child("s1", ChildRole.SPARE)], SIZE).promote == "s1"  # a ready spare first


def test_no_spare_spawns_until_max_children_then_waits() -> None:
    full = [child("c1", loaded=3), child("c2", loaded=3)]
    assert place(full, SIZE).spawn
    at_cap = [*full, child("c3", loaded=3), child("c4", loaded=3)]
    verdict = place(at_cap, SIZE)
    assert verdict.waits and not verdict.spawn


def test_quarantine_children_do_not_count_against_max_children() -> None:
    pool = [
        child("c1", loaded=3),
        child("c2", loaded=3),
        child("c3", loaded=3),
        child("q", ChildRole.QUARANTINE, loaded=1),
    ]
    assert place(pool, SIZE).spawn


def test_a_quarantined_session_gets_a_child_of_its_own_up_to_the_growth_cap() -> None:
    assert place([child("c1")], SIZE, quarantined=True).spawn
    quarantines = [child(f"q{i}", ChildRole.QUARANTINE, loaded=1) for i in range(SIZE.max_children)]
    crowded = place([child("c1"), *quarantines], SIZE, quarantined=True)
    assert not crowded.spawn and crowded.child == "c1"  # placed like any other session


def test_one_session_per_child_is_a_process_per_loaded_session() -> None:
    isolated = PoolSize(children=2, sessions_per_child=1, max_children=64, spare_children=1)
    assert place([child("c1", loaded=1), child("c2")], isolated).child == "c2"
    assert place([child("c1", loaded=1), child("c2", loaded=1)], isolated).spawn


# --------------------------------------------------------------------------- plan_pool


def test_an_empty_pool_starts_its_children_and_spares() -> None:
    assert plan_pool([], SIZE) == PoolPlan(spawn=3)


def test_children_being_started_are_not_started_twice() -> None:
    pool = [child("n1", ChildRole.STARTING), child("n2", ChildRole.STARTING), child("n3", ChildRole.STARTING)]
    assert plan_pool(pool, SIZE) == PoolPlan()


def test_a_lost_active_child_is_replaced_by_a_spare_and_the_spare_by_a_new_child() -> None:
    pool = [child("c1", loaded=1), child("s1", ChildRole.SPARE)]
    assert plan_pool(pool, SIZE) == PoolPlan(spawn=1, promote=("s1",))


def test_growth_never_passes_max_children() -> None:
    pool = [child(f"c{i}", loaded=3) for i in range(4)]
    assert plan_pool(pool, SIZE) == PoolPlan()


def test_a_shrink_retires_empty_children_and_keeps_those_with_sessions() -> None:
    smaller = PoolSize(children=1, sessions_per_child=3, max_children=4, spare_children=0)
    pool = [child("c1", loaded=2), child("c2", loaded=1, in_flight=1), child("c3"), child("s1", ChildRole.SPARE)]
    plan = plan_pool(pool, smaller)
    assert set(plan.retire) == {"c3", "s1"}
    assert plan.drain == () and plan.spawn == 0


def test_lowering_max_children_drains_the_least_loaded_children_with_sessions() -> None:
    capped = PoolSize(children=1, sessions_per_child=3, max_children=1, spare_children=0)
    pool = [child("c1", loaded=2), child("c2", loaded=1, in_flight=1), child("c3", loaded=3)]
    plan = plan_pool(pool, capped)
    assert plan.drain == ("c2", "c1") and plan.retire == ()


def test_a_draining_child_is_retired_once_empty() -> None:
    pool = [
        child("c1"),
        child("c2"),
        child("s1", ChildRole.SPARE),
        child("d", ChildRole.DRAINING),
        child("d2", ChildRole.DRAINING, loaded=1),
    ]
    assert plan_pool(pool, SIZE).retire == ("d",)


def test_an_empty_quarantine_child_is_retired() -> None:
    pool = [
        child("c1"),
        child("c2"),
        child("s1", ChildRole.SPARE),
        child("q1", ChildRole.QUARANTINE),
        child("q2", ChildRole.QUARANTINE, loaded=1),
    ]
    assert plan_pool(pool, SIZE).retire == ("q1",)


def test_surplus_spares_are_retired() -> None:
    pool = [child("c1"), child("c2"), child("s1", ChildRole.SPARE), child("s2", ChildRole.SPARE)]
    assert plan_pool(pool, SIZE).retire == ("s2",)


# --------------------------------------------------------------------------- blame


def test_first_crash_reruns_second_within_the_window_quarantines() -> None:
    first = blame((), now=100.0)
    assert first.verdict is CrashVerdict.RERUN and first.crashes == (100.0,)
    second = blame(first.crashes, now=130.0)
    assert second.verdict is CrashVerdict.QUARANTINE


def test_crashes_older_than_the_window_are_forgotten() -> None:
    assert blame((10.0,), now=100.0).verdict is CrashVerdict.RERUN


def test_more_than_max_crashes_in_the_window_fails_the_session() -> None:
    crashes: tuple[float, ...] = ()
    verdicts = []
    for i in range(MAX_CRASHES + 1):
        result = blame(crashes, now=float(i))
        crashes = result.crashes
        verdicts.append(result.verdict)
    assert verdicts[:2] == [CrashVerdict.RERUN, CrashVerdict.QUARANTINE]
    assert verdicts[MAX_CRASHES - 1] is CrashVerdict.QUARANTINE
    assert verdicts[MAX_CRASHES] is CrashVerdict.FAIL


def test_a_rerun_starts_only_inside_the_turns_first_deadline() -> None:
    assert rerun_allowed(started_at=1000.0, deadline=120.0, now=1119.0)
    assert not rerun_allowed(started_at=1000.0, deadline=120.0, now=1120.0)


def test_ids_are_ordered_by_age_not_as_strings() -> None:
    assert place([child("c10"), child("c9")], SIZE).child == "c9"


def test_children_already_draining_are_not_drained_again() -> None:
    capped = PoolSize(children=1, sessions_per_child=3, max_children=2, spare_children=0)
    busy = [child(f"c{i}", loaded=1, in_flight=1) for i in range(1, 5)]
    first = plan_pool(busy, capped)
    assert first.drain == ("c1", "c2")
    after = [child(c.id, ChildRole.DRAINING if c.id in first.drain else ChildRole.ACTIVE, 1, 1) for c in busy]
    assert plan_pool(after, capped).drain == ()


def test_growth_is_capped_at_max_children_but_never_below_children() -> None:
    odd = PoolSize(children=3, sessions_per_child=1, max_children=2, spare_children=0)
    full = [child(f"c{i}", loaded=1) for i in range(1, 3)]
    assert place(full, odd).spawn  # 2 < max(2, 3)
    assert not place([*full, child("c3", loaded=1)], odd).spawn


def test_quarantine_lapses_once_the_crashes_leave_the_window() -> None:
    assert quarantined((10.0, 20.0), now=30.0)
    assert not quarantined((10.0, 20.0), now=75.0)  # the first crash is older than 60 s
    assert not quarantined((20.0,), now=30.0)


# --------------------------------------------------------------------------- lean by default: children = 0

#: The defaults on a 32-CPU host: nothing kept beyond the spare, turns spread over up to 32 children,
#: an empty child the pool grew for load retired after idle_unload (600 s).
LEAN = PoolSize(children=0, sessions_per_child=1000, max_children=64, spare_children=1, spread=32, retire_after=600.0)


def test_children_zero_spreads_over_the_cpus_and_keeps_none_warm() -> None:
    assert effective_children(0, cpus=32) == 32
    assert LEAN.spread_cap == 32
    assert SIZE.spread_cap == SIZE.children == 2  # an explicit children is both what is kept and the spread


@pytest.mark.parametrize("cpus", [1, 2, 32, 4096])
def test_a_lean_pool_starts_only_its_spares_whatever_the_cpu_count(cpus: int) -> None:
    size = PoolSize(
        children=0, sessions_per_child=1000, max_children=64, spare_children=1, spread=effective_children(0, cpus=cpus)
    )
    assert plan_pool([], size) == PoolPlan(spawn=1)
    assert plan_pool([child("c1", ChildRole.SPARE)], size) == PoolPlan()
    assert plan_pool([], PoolSize(children=0, sessions_per_child=1000, max_children=64, spare_children=3)).spawn == 3


def test_a_lean_pools_first_session_takes_the_ready_spare_which_is_replaced() -> None:
    spare = [child("c1", ChildRole.SPARE)]
    assert place(spare, LEAN).promote == "c1"
    promoted = [child("c1", loaded=1)]
    assert plan_pool(promoted, LEAN) == PoolPlan(spawn=1)


def test_a_session_joins_an_active_child_that_runs_no_turn_rather_than_a_spare() -> None:
    pool = [child("c1", loaded=5), child("c2", ChildRole.SPARE)]
    assert place(pool, LEAN).child == "c1"


def test_while_every_active_child_runs_a_turn_a_ready_spare_takes_the_session_up_to_the_spread() -> None:
    busy = [child("c1", loaded=5, in_flight=1), child("c2", loaded=3, in_flight=2), child("c3", ChildRole.SPARE)]
    assert place(busy, LEAN).promote == "c3"
    # One active child without a turn: the spare stays warm, the least-loaded active child takes it.
    assert place([*busy[:1], child("c4", loaded=9), busy[2]], LEAN) == Placement(child="c1")
    # At the spread, the least-loaded busy child takes it.
    narrow = PoolSize(children=0, sessions_per_child=1000, max_children=64, spare_children=1, spread=2)
    assert place(busy, narrow).child == "c2"


def test_spreading_never_waits_for_a_cold_start() -> None:
    busy = [child("c1", loaded=5, in_flight=1)]
    assert place(busy, LEAN).child == "c1"  # no spare: share the busy child, start nothing
    assert place([*busy, child("c2", ChildRole.STARTING)], LEAN).child == "c1"  # not one still starting


def test_an_empty_child_the_pool_grew_for_is_retired_only_after_idle_unload() -> None:
    grown = [child("c1", loaded=2), child("c2", idle_for=599.0), child("c3", ChildRole.SPARE)]
    assert plan_pool(grown, LEAN) == PoolPlan()
    idle = [child("c1", loaded=2), child("c2", idle_for=600.0), child("c3", ChildRole.SPARE)]
    assert plan_pool(idle, LEAN) == PoolPlan(retire=("c2",))


def test_a_lean_pool_shrinks_back_to_its_spares_when_idle() -> None:
    idle = [child(f"c{i}", idle_for=900.0) for i in range(1, 9)] + [child("c9", ChildRole.SPARE)]
    assert set(plan_pool(idle, LEAN).retire) == {f"c{i}" for i in range(1, 9)}
    assert plan_pool(idle, LEAN).spawn == 0


def test_a_child_with_a_loaded_session_or_a_turn_in_flight_is_never_retired_for_idleness() -> None:
    pool = [
        child("c1", loaded=1, idle_for=10_000.0),  # idle_for is the pool's view; a loaded child is in use
        child("c2", in_flight=1, idle_for=10_000.0),
        child("c3", ChildRole.SPARE),
    ]
    assert plan_pool(pool, LEAN).retire == ()


def test_an_explicit_children_is_kept_however_long_idle() -> None:
    kept = PoolSize(children=2, sessions_per_child=1000, max_children=64, spare_children=1, retire_after=600.0)
    pool = [child("c1", idle_for=10_000.0), child("c2", idle_for=10_000.0), child("c3", idle_for=10_000.0)]
    assert plan_pool([*pool, child("s", ChildRole.SPARE)], kept).retire == ("c1",)
    assert plan_pool([], kept) == PoolPlan(spawn=3)  # old configs start what they always started
