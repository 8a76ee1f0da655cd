"""The replica's id, timings and lease decisions (RFC 0009 §7): pure functions."""

from __future__ import annotations

import pytest

from agentd.store import Lease, ReplicaRow
from agentd.store.codec import LEASE_HOLDER, valid_replica_id
from agentd.supervisor.replica import (
    ENV_REPLICA_ID,
    RenewVerdict,
    heartbeat_interval,
    judge_renewal,
    lease_holder,
    live_twin,
    loaded_copy_is_current,
    new_incarnation,
    registry_max_age,
    replica_id,
    replica_name,
    replica_views,
    rivals,
    scan_interval,
)


def test_the_replica_id_is_the_env_var_when_set() -> None:
    assert replica_id({ENV_REPLICA_ID: " pod-7 "}, hostname="h", pid=1) == "pod-7"


@pytest.mark.parametrize("bad", ["pod 1", "pod\t1", "é-pod", "-pod", "x" * 254, "a/b"])
def test_a_replica_id_that_cannot_travel_in_notifications_is_refused(bad: str) -> None:
    """Relay payloads are space-separated ASCII (RFC 0009 §7): such an id would relay nothing."""
    with pytest.raises(ValueError, match=f"{ENV_REPLICA_ID} must be 1 to 253 ASCII"):
        replica_id({ENV_REPLICA_ID: bad})


def test_a_hostname_is_made_a_usable_replica_id() -> None:
    made = replica_id({}, hostname="my host.é", pid=5)
    assert made.startswith("my-host.--5-") and valid_replica_id(made)
    assert replica_id({ENV_REPLICA_ID: " pod-7.web_1:x@y "}) == "pod-7.web_1:x@y"


def test_the_default_replica_id_is_host_pid_and_random() -> None:
    first = replica_id({}, hostname="web-1", pid=42)
    second = replica_id({ENV_REPLICA_ID: ""}, hostname="web-1", pid=42)
    assert first.startswith("web-1-42-") and second.startswith("web-1-42-")
    assert len(first) == len("web-1-42-") + 4
    assert replica_id({}, hostname="", pid=3).startswith("agentd-3-")


def test_timings_are_fractions_of_the_lease() -> None:
    assert heartbeat_interval(9.0) == 3.0
    assert scan_interval(9.0) == 4.5
    assert registry_max_age(2.0) == 6.0
    assert heartbeat_interval(2.0) < scan_interval(2.0) < 2.0 < registry_max_age(2.0)


def test_a_loaded_copy_is_current_only_if_no_other_replica_claimed_in_between() -> None:
    assert loaded_copy_is_current(4, 4)  # an extension of the same lease
    assert loaded_copy_is_current(4, 5)  # released, then claimed again by this replica
    assert not loaded_copy_is_current(4, 6)  # another replica held it in between
    assert not loaded_copy_is_current(None, 1)  # never held here


def lease(token: int, expires_at: float = 10.0) -> Lease:
    return Lease(session="s1", replica="r1", token=token, expires_at=expires_at)


def test_a_renewed_lease_with_the_same_token_is_kept() -> None:
    asked = lease(3)
    assert judge_renewal(asked, asked, lease(3, 20.0), same_turn=True) is RenewVerdict.RENEWED


def test_a_lease_that_changed_while_the_renew_ran_is_not_judged() -> None:
    asked = lease(3)
    # The turn ended (released) and the next one claimed again meanwhile: the renew's answer is stale.
    assert judge_renewal(asked, lease(4), None, same_turn=False) is RenewVerdict.CHANGED
    assert judge_renewal(asked, None, None, same_turn=True) is RenewVerdict.CHANGED


def test_a_missing_lease_is_lost_only_while_its_turn_runs_here() -> None:
    asked = lease(3)
    assert judge_renewal(asked, asked, None, same_turn=True) is RenewVerdict.LOST
    assert judge_renewal(asked, asked, lease(5), same_turn=True) is RenewVerdict.LOST  # another token
    assert judge_renewal(asked, asked, None, same_turn=False) is RenewVerdict.IDLE


def row(holder: str, seen_at: float, generation: int = 1) -> ReplicaRow:
    return ReplicaRow(id=holder, generation=generation, sessions=0, seen_at=seen_at)


def test_a_process_is_a_holder_of_its_replica_id() -> None:
    first, second = new_incarnation(), new_incarnation()
    assert first != second and len(first) == 8
    holder = lease_holder("pod-0", first)
    assert holder == f"pod-0/{first}" and replica_name(holder) == "pod-0"
    assert LEASE_HOLDER.fullmatch(holder) and not valid_replica_id(holder)  # the env var cannot name one
    assert replica_name("r1") == "r1"  # a holder with no incarnation (an older replica) is its id


def test_a_rival_is_another_holder_of_the_same_id() -> None:
    rows = [row("pod-0/aaaaaaaa", 5.0), row("pod-0/bbbbbbbb", 6.0), row("pod-1/cccccccc", 7.0)]
    assert rivals(rows, "pod-0/bbbbbbbb") == {"pod-0/aaaaaaaa": 5.0}
    assert rivals(rows, "pod-2/dddddddd") == {}


def test_a_rival_that_beats_again_is_a_live_twin_one_that_does_not_is_the_dead_predecessor() -> None:
    me = "pod-0/bbbbbbbb"
    before = {"pod-0/aaaaaaaa": 5.0}
    assert live_twin(before, [row("pod-0/aaaaaaaa", 5.0), row(me, 6.0)], me) is None  # silent so far
    assert live_twin(before, [row("pod-0/aaaaaaaa", 5.5)], me) == "pod-0/aaaaaaaa"  # it beat: alive
    assert live_twin(before, [row("pod-0/cccccccc", 6.0)], me) == "pod-0/cccccccc"  # a third one started
    assert live_twin(before, [], me) is None  # aged out: dead


def test_operators_see_one_row_per_replica_id_the_newest() -> None:
    rows = [row("pod-1/cccccccc", 7.0), row("pod-0/aaaaaaaa", 5.0, generation=1), row("pod-0/bbbbbbbb", 6.0, 2)]
    assert replica_views(rows) == [row("pod-0", 6.0, 2), row("pod-1", 7.0)]
