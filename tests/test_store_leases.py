"""Leases and fencing in the store (RFC 0009 §3–§4), on both backends.

A "replica" here is a store of its own on the same database — a second SqliteStore on the same
file, a second PostgresStore (its own pool) on the same database — so two replicas race for real.
Expiry is waited for as the store sees it (``lease_of`` turns None), never guessed with a sleep.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import pytest

from agentd.budget import TurnStatus
from agentd.messages import AssistantMessage, SystemMessage, UserMessage
from agentd.records import JournalEntry, TurnRecord
from agentd.store import EVENTS, ORPHANS, TURNS, Lease, LeaseLost, Store, StoreError, UnknownSession
from tests.store_harness import Backend

pytestmark = pytest.mark.anyio

LONG = 600.0  # a lease that does not expire during a test
BRIEF = 0.001  # a lease that has expired by the time anyone looks
TIMEOUT = 30.0


@pytest.fixture
async def other(backend: Backend) -> AsyncIterator[Store]:
    """A second replica's store on the same database."""
    opened = await backend.open()
    try:
        yield opened
    finally:
        await opened.close()


async def new_session(store: Store, session_id: str = "s1", *, pending: str | None = None, at: float = 1.0) -> None:
    await store.create_session(
        session_id,
        assistant="triage",
        generation=1,
        model="echo-small",
        created_at=at,
        transcript=[SystemMessage(content="You route customers.")],
    )
    if pending is not None:
        await store.begin_turn(session_id, pending, UserMessage(content=f"{session_id} asks"), started_at=at)


def done(turn: str) -> TurnRecord:
    return TurnRecord(id=turn, status=TurnStatus.COMPLETED, started_at=1.0, ended_at=2.0)


def answer(turn: str, text: str = "ok") -> AssistantMessage:
    return AssistantMessage(content=text, turn=turn, model="echo-small", assistant="triage")


async def until(predicate: Callable[[], Awaitable[Any]], what: str) -> None:
    """Poll the store until ``predicate`` holds (an event the store reports), failing after TIMEOUT."""
    deadline = time.monotonic() + TIMEOUT
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await anyio.sleep(0.005)


async def expired(store: Store, session: str) -> None:
    async def gone() -> bool:
        return await store.lease_of(session) is None

    await until(gone, f"the lease of {session} to expire")


async def taken_over(store: Store, session: str, replica: str = "r1", by: str = "r2") -> tuple[Lease, Lease]:
    """``replica`` claims ``session`` briefly; once it expired, ``by`` claims it: both leases."""
    first = await store.claim(session, replica, BRIEF)
    assert first is not None
    await expired(store, session)
    second = await store.claim(session, by, LONG)
    assert second is not None
    return first, second


# --------------------------------------------------------------------------- claim, renew, release


async def test_a_claim_makes_a_replica_the_owner_and_others_wait(store: Store) -> None:
    await new_session(store)
    assert await store.lease_of("s1") is None  # nobody has ever held it
    lease = await store.claim("s1", "r1", LONG)
    assert lease is not None
    assert (lease.session, lease.replica, lease.token) == ("s1", "r1", 1)
    assert lease.expires_at > time.time() + LONG / 2
    assert await store.lease_of("s1") == lease
    assert await store.claim("s1", "r2", LONG) is None  # held and not expired
    again = await store.claim("s1", "r1", LONG)  # the holder extends it and keeps its token
    assert again is not None
    assert again.token == 1 and again.expires_at >= lease.expires_at


async def test_an_expired_lease_is_taken_with_a_larger_token(store: Store) -> None:
    await new_session(store)
    first, second = await taken_over(store, "s1")
    assert (first.token, second.token) == (1, 2)
    assert await store.lease_of("s1") == second
    assert await store.claim("s1", "r1", LONG) is None  # the old owner does not get it back


async def test_renew_extends_every_lease_a_replica_still_holds(store: Store) -> None:
    for name in ("a", "b", "c"):
        await new_session(store, name)
    held = {name: await store.claim(name, "r1", BRIEF) for name in ("a", "b")}
    assert await store.claim("c", "r2", LONG) is not None
    await expired(store, "a")
    await expired(store, "b")

    renewed = await store.renew("r1", LONG)  # expired, but nobody claimed them: still r1's
    assert set(renewed) == {"a", "b"}
    assert all(renewed[name].token == held[name].token for name in renewed)  # type: ignore[union-attr]
    assert await store.lease_of("a") == renewed["a"]

    _, taken = await taken_over(store, "a", replica="r1", by="r3")
    assert set(await store.renew("r1", LONG)) == {"b"}  # "a" was claimed by r3 meanwhile: lost
    assert await store.lease_of("a") == taken
    assert await store.renew("nobody", LONG) == {}


async def test_release_lets_another_replica_claim_at_once(store: Store) -> None:
    await new_session(store)
    lease = await store.claim("s1", "r1", LONG)
    assert lease is not None
    assert await store.release(lease) is True
    assert await store.lease_of("s1") is None
    assert await store.release(lease) is False  # no longer held: nothing changes
    taken = await store.claim("s1", "r2", LONG)
    assert taken is not None and taken.token == 2
    assert await store.release(lease) is False  # a stale lease releases nothing
    assert await store.lease_of("s1") == taken


async def test_lease_calls_name_what_is_wrong(store: Store) -> None:
    with pytest.raises(UnknownSession, match=r"^cannot claim session ghost: the session is unknown$"):
        await store.claim("ghost", "r1", LONG)
    with pytest.raises(UnknownSession, match=r"session ghost is unknown"):
        await store.lease_of("ghost")
    with pytest.raises(UnknownSession, match=r"cannot release session ghost: the session is unknown"):
        await store.release(Lease(session="ghost", replica="r1", token=1, expires_at=0.0))
    await new_session(store)
    with pytest.raises(StoreError, match=r"a lease time must be more than 0 and at most 604800 seconds, not 0"):
        await store.claim("s1", "r1", 0)
    with pytest.raises(StoreError, match=r"a lease time must be more than 0 .* not inf"):
        await store.renew("r1", float("inf"))
    with pytest.raises(StoreError, match=r"a replica id must be 1 to 253 ASCII .*, not ''"):
        await store.claim_orphaned("", LONG)
    await store.update_session("s1", state="closed")
    with pytest.raises(StoreError, match=r"^cannot claim session s1: the session is closed$"):
        await store.claim("s1", "r1", LONG)


# --------------------------------------------------------------------------- fencing


async def test_a_commit_with_a_lost_lease_is_refused_and_writes_nothing(store: Store, backend: Backend) -> None:
    await new_session(store, pending="t1")
    old, new = await taken_over(store, "s1")
    entries = backend.raw("SELECT * FROM entries ORDER BY seq")
    turns = backend.raw("SELECT * FROM turns ORDER BY n")

    with pytest.raises(LeaseLost) as lost:
        await store.commit_turn("s1", done("t1"), assistant="triage", messages=[answer("t1", "stale")], lease=old)
    assert str(lost.value) == (
        "cannot commit session s1 turn t1: replica r1 no longer holds the lease of session s1 (its token 1);"
        " replica r2 holds it now (token 2)"
    )
    assert (lost.value.holder, lost.value.holder_token, lost.value.lease) == ("r2", 2, old)
    assert backend.raw("SELECT * FROM entries ORDER BY seq") == entries
    assert backend.raw("SELECT * FROM turns ORDER BY n") == turns
    assert (await store.pending_turn("s1")) is not None

    committed = await store.commit_turn(
        "s1", done("t1"), assistant="triage", messages=[answer("t1", "fresh")], lease=new
    )
    assert committed.seqs == (3,)
    session = await store.load_session("s1")
    assert session is not None
    assert [getattr(e.message, "content", None) for e in session.transcript] == [
        "You route customers.",
        "s1 asks",
        "fresh",
    ]


async def test_a_commit_that_landed_is_recognised_only_while_its_lease_is_current(
    store: Store, backend: Backend
) -> None:
    """The retry of a commit whose answer was lost gets the committed turn while the lease holds;
    once another replica claimed the session it is LeaseLost like any fenced write, writing nothing."""
    await new_session(store, pending="t1")
    lease = await store.claim("s1", "r1", BRIEF)
    assert lease is not None
    arguments: dict[str, Any] = {"assistant": "triage", "messages": [answer("t1", "once")], "lease": lease}
    first = await store.commit_turn("s1", done("t1"), **arguments)
    assert first.seqs == (3,)
    assert await store.commit_turn("s1", done("t1"), **arguments) == first  # recognised: same lease

    await expired(store, "s1")
    assert await store.claim("s1", "r2", LONG) is not None
    entries = backend.raw("SELECT * FROM entries ORDER BY seq")
    turns = backend.raw("SELECT * FROM turns ORDER BY n")
    with pytest.raises(LeaseLost, match=r"^cannot commit session s1 turn t1: replica r1 no longer holds"):
        await store.commit_turn("s1", done("t1"), **arguments)
    assert backend.raw("SELECT * FROM entries ORDER BY seq") == entries
    assert backend.raw("SELECT * FROM turns ORDER BY n") == turns


async def test_every_fenced_write_refuses_a_stale_token(store: Store) -> None:
    await new_session(store, pending="t1")
    old, _ = await taken_over(store, "s1")
    with pytest.raises(LeaseLost, match=r"^cannot abandon session s1 turn t1: replica r1 no longer holds"):
        await store.abandon_turn("s1", "t1", status="cancelled", error=None, ended_at=3.0, lease=old)
    with pytest.raises(LeaseLost, match=r"^cannot update session s1: replica r1 no longer holds"):
        await store.update_session("s1", generation=9, lease=old)
    entry = JournalEntry(seq=1, call="call_1", tool="refund", arguments={"amount": 5})
    with pytest.raises(LeaseLost, match=r"^cannot journal session s1 turn t1 call 1: replica r1 no longer holds"):
        await store.journal_start("s1", "t1", entry, lease=old)
    assert await store.journal_entries("s1", "t1") == []
    session = await store.load_session("s1")
    assert session is not None and session.generation == 1 and session.state == "running"
    # Unfenced writes (any replica may accept a message or close a session) are not affected.
    await store.update_session("s1", generation=2)


async def test_a_released_lease_fences_too(store: Store) -> None:
    await new_session(store, pending="t1")
    lease = await store.claim("s1", "r1", LONG)
    assert lease is not None
    assert await store.release(lease)
    with pytest.raises(LeaseLost, match=r"replica r1 no longer holds the lease .*; no replica holds it now$"):
        await store.commit_turn("s1", done("t1"), assistant="triage", lease=lease)


async def test_an_expired_lease_nobody_claimed_still_writes(store: Store) -> None:
    """Expiry makes a session claimable; only a claim by another replica takes the writes away (RFC 0009 §4)."""
    await new_session(store, pending="t1")
    lease = await store.claim("s1", "r1", BRIEF)
    assert lease is not None
    await expired(store, "s1")
    committed = await store.commit_turn("s1", done("t1"), assistant="triage", messages=[answer("t1")], lease=lease)
    assert committed.seqs == (3,)


async def test_a_lease_of_another_session_is_refused(store: Store) -> None:
    await new_session(store, "a", pending="t1")
    await new_session(store, "b")
    lease = await store.claim("b", "r1", LONG)
    assert lease is not None
    with pytest.raises(StoreError, match=r"^cannot commit session a turn t1: the lease given is for session b$"):
        await store.commit_turn("a", done("t1"), assistant="triage", lease=lease)


# --------------------------------------------------------------------------- failover: claim_orphaned


async def test_claim_orphaned_takes_pending_turns_of_dead_or_absent_owners_oldest_first(store: Store) -> None:
    await new_session(store, "idle")  # no pending turn: nobody needs to own it
    await new_session(store, "closed", pending="t1", at=1.0)
    await store.update_session("closed", state="closed")
    await new_session(store, "live", pending="t1", at=2.0)  # its owner is alive
    assert await store.claim("live", "r1", LONG) is not None
    await new_session(store, "mine", pending="t1", at=3.0)  # the scanning replica's own
    assert await store.claim("mine", "r2", BRIEF) is not None
    await new_session(store, "dead", pending="t1", at=5.0)  # its owner stopped renewing
    assert await store.claim("dead", "r1", BRIEF) is not None
    await new_session(store, "unowned", pending="t1", at=4.0)  # stored by a replica that died before claiming
    await expired(store, "dead")
    await expired(store, "mine")

    claimed = await store.claim_orphaned("r2", LONG)
    assert [(lease.session, lease.token) for lease in claimed] == [("unowned", 1), ("dead", 2)]
    assert all(lease.replica == "r2" and lease.expires_at > time.time() for lease in claimed)
    assert await store.lease_of("dead") == claimed[1]
    # r2's own expired lease was left to r2 (renew keeps it); any other replica may take it over.
    assert [(lease.session, lease.token) for lease in await store.claim_orphaned("r3", LONG)] == [("mine", 2)]
    assert await store.claim_orphaned("r4", LONG) == []  # nothing left for anyone


async def test_claim_orphaned_stops_at_the_limit(store: Store) -> None:
    for index in range(5):
        await new_session(store, f"s{index}", pending="t1", at=float(index))
    first = await store.claim_orphaned("r1", LONG, limit=2)
    rest = await store.claim_orphaned("r1", LONG, limit=10)
    assert [lease.session for lease in first] == ["s0", "s1"]
    assert [lease.session for lease in rest] == ["s2", "s3", "s4"]


async def test_two_replicas_scanning_at_once_get_disjoint_sets(store: Store, other: Store) -> None:
    sessions = [f"s{index:02d}" for index in range(40)]
    for index, session in enumerate(sessions):
        await new_session(store, session, pending="t1", at=float(index))
    got: dict[str, list[str]] = {"r1": [], "r2": []}

    async def scan(replica_store: Store, replica: str) -> None:
        while claimed := await replica_store.claim_orphaned(replica, LONG, limit=3):
            got[replica] += [lease.session for lease in claimed]

    async with anyio.create_task_group() as tg:
        tg.start_soon(scan, store, "r1")
        tg.start_soon(scan, other, "r2")
    assert not set(got["r1"]) & set(got["r2"])
    assert sorted(got["r1"] + got["r2"]) == sessions
    owners = {session: (await store.lease_of(session)) for session in sessions}
    assert all(lease is not None and session in got[lease.replica] for session, lease in owners.items())


async def test_two_replicas_claiming_the_same_sessions_at_once_get_one_owner_each(store: Store, other: Store) -> None:
    sessions = [f"s{index}" for index in range(10)]
    for session in sessions:
        await new_session(store, session)
    won: dict[str, list[str]] = {"r1": [], "r2": []}

    async def claim_all(replica_store: Store, replica: str) -> None:
        for session in sessions:
            if await replica_store.claim(session, replica, LONG) is not None:
                won[replica].append(session)

    async with anyio.create_task_group() as tg:
        tg.start_soon(claim_all, store, "r1")
        tg.start_soon(claim_all, other, "r2")
    assert sorted(won["r1"] + won["r2"]) == sessions
    assert not set(won["r1"]) & set(won["r2"])
    for session in sessions:
        lease = await other.lease_of(session)
        assert lease is not None and lease.token == 1 and session in won[lease.replica]


async def test_two_replicas_beginning_a_turn_in_one_session_at_once_store_one(store: Store, other: Store) -> None:
    await new_session(store)
    outcomes: dict[str, object] = {}

    async def begin(replica_store: Store, turn: str) -> None:
        try:
            outcomes[turn] = await replica_store.begin_turn("s1", turn, UserMessage(content=turn), started_at=2.0)
        except StoreError as exc:
            outcomes[turn] = exc

    async with anyio.create_task_group() as tg:
        tg.start_soon(begin, store, "ta")
        tg.start_soon(begin, other, "tb")
    stored = [turn for turn, outcome in outcomes.items() if isinstance(outcome, int)]
    refused = [outcome for outcome in outcomes.values() if isinstance(outcome, StoreError)]
    assert len(stored) == 1 and len(refused) == 1, outcomes
    assert f"turn {stored[0]} is still pending" in str(refused[0])
    pending = await store.pending_turn("s1")
    assert pending is not None and pending.id == stored[0]
    assert [m.content for m in await store.transcript("s1") if isinstance(m, UserMessage)] == [stored[0]]


# --------------------------------------------------------------------------- the replica registry


async def test_a_replica_beats_and_is_listed_while_it_is_live(store: Store, other: Store) -> None:
    assert await store.live_replicas(LONG) == []
    first = await store.beat("r1", generation=1, sessions=0)
    assert (first.id, first.generation, first.sessions) == ("r1", 1, 0)
    assert abs(first.seen_at - time.time()) < LONG  # the store's clock, near this one
    await other.beat("r2", generation=3, sessions=2)
    again = await store.beat("r1", generation=2, sessions=5)  # a beat replaces the row
    assert again.seen_at >= first.seen_at
    live = await other.live_replicas(LONG)
    assert [(r.id, r.generation, r.sessions) for r in live] == [("r1", 2, 5), ("r2", 3, 2)]


async def test_a_replica_that_stopped_beating_is_not_live(store: Store) -> None:
    await store.beat("r1", generation=1, sessions=0)

    async def gone() -> bool:
        return not await store.live_replicas(BRIEF)

    await until(gone, "replica r1 to be too old")
    assert [r.id for r in await store.live_replicas(LONG)] == ["r1"]  # kept, only ignored


async def test_a_beat_needs_a_replica_id(store: Store) -> None:
    with pytest.raises(StoreError, match="a replica id must be 1 to 253 ASCII"):
        await store.beat("", generation=1, sessions=0)


async def test_a_release_that_leaves_a_pending_turn_notifies_the_other_replicas(
    backend: Backend, store: Store, other: Store
) -> None:
    await new_session(store, pending="t1")
    with anyio.fail_after(TIMEOUT):
        assert await other.next_notification(0.01) is None  # nothing notified: None after its time
    if backend.name == "sqlite":
        await store.notify(TURNS, "s1 t1 r1")  # one daemon owns a SQLite store: nobody to tell
        return
    lease = await store.claim("s1", "r1", LONG)
    assert lease is not None
    heard: list[tuple[str, str] | None] = []

    async def listen() -> None:
        heard.append(await other.next_notification(LONG))
        heard.append(await other.next_notification(LONG))

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(listen)
            await anyio.wait_all_tasks_blocked()  # it listens (its LISTEN was set up by the first wait)
            assert await store.release(lease)
            await store.notify(TURNS, "s1 t0 r1")
    assert heard == [(ORPHANS, "s1"), (TURNS, "s1 t0 r1")]
    assert [held.session for held in await other.claim_orphaned("r2", LONG)] == ["s1"]


async def test_a_fenced_notification_goes_out_only_while_its_lease_is_current(
    backend: Backend, store: Store, other: Store
) -> None:
    """Relayed events are fenced like commits (RFC 0009 §7): once another holder claimed the
    session, what the old holder's run still says is not sent; an unfenced note always is."""
    await new_session(store, pending="t1")
    old = await store.claim("s1", "r1/0123abcd", BRIEF)  # a holder: a replica id and its incarnation
    assert old is not None and old.replica == "r1/0123abcd"
    if backend.name == "sqlite":  # one daemon owns a SQLite store: nobody to tell, nothing sent
        assert await store.notify_many([(EVENTS, "e1")], fences=[old]) is None
        return
    with anyio.fail_after(TIMEOUT):
        assert await other.next_notification(0.01) is None  # it listens from now on
    heard: list[tuple[str, str] | None] = []

    async def listen() -> None:
        heard.append(await other.next_notification(LONG))
        heard.append(await other.next_notification(LONG))

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(listen)
            await anyio.wait_all_tasks_blocked()
            assert await store.notify_many([(EVENTS, "while held")], fences=[old]) is None
            new = await other.claim("s1", "r1/4567cdef", LONG)  # the same replica id, restarted
            assert new is not None and new.token == old.token + 1
            assert (
                await store.notify_many(
                    [(EVENTS, "stale"), (TURNS, "s1 t1 r1"), (EVENTS, "fresh")], fences=[old, None, new]
                )
                is None
            )
    assert heard == [(EVENTS, "while held"), (TURNS, "s1 t1 r1")]
    assert await other.next_notification(0.5) == (EVENTS, "fresh")


async def test_a_restarted_holder_of_the_same_replica_id_does_not_renew_the_dead_ones_leases(
    store: Store, other: Store
) -> None:
    await new_session(store, pending="t1")
    dead = await store.claim("s1", "pod-0/0123abcd", BRIEF)
    assert dead is not None
    await anyio.sleep(0.01)  # the brief lease has expired by the store's clock (millisecond resolution)
    assert await other.renew("pod-0/4567cdef", LONG) == {}
    [adopted] = await other.claim_orphaned("pod-0/4567cdef", LONG)
    assert adopted.session == "s1" and adopted.token == dead.token + 1


# ---------------------------------------------------------------------------- watches (RFC 0009 §7)


async def test_a_claim_lists_the_other_replicas_watching_the_session(store: Store, other: Store) -> None:
    await new_session(store, "s1")
    await new_session(store, "s2", at=2.0)
    await other.watch("r2", ["s1"], LONG)
    await other.watch("r3", ["s1", "s2"], LONG)
    await store.watch("r1", ["s1"], LONG)  # the claimer's own subscribers are not "elsewhere"
    lease = await store.claim("s1", "r1", LONG)
    assert lease is not None and lease.watchers == ("r2", "r3")
    await other.unwatch("r3", ["s1"])
    await store.release(lease)
    again = await store.claim("s1", "r1", LONG)
    assert again is not None and again.watchers == ("r2",)
    renewed = await store.renew("r1", LONG)
    assert renewed["s1"].token == again.token  # a renewal says nothing of watchers: they were noted at the claim


async def test_a_watch_that_expired_is_not_listed_and_is_deleted(store: Store, other: Store) -> None:
    await new_session(store, "s1", pending="t1")
    await other.watch("r2", ["s1"], BRIEF)
    await other.watch("r3", ["s1"], LONG)

    async def r2_expired() -> bool:
        lease = await store.claim("s1", "r1", LONG)
        assert lease is not None
        await store.release(lease)
        return lease.watchers == ("r3",)

    await until(r2_expired, "r2's watch to expire")
    await other.watch("r3", [], LONG)  # any watch call deletes expired rows
    [orphan] = await store.claim_orphaned("r4", LONG)  # released with a pending turn: an orphan
    assert orphan.session == "s1" and orphan.watchers == ("r3",)


async def test_watch_refuses_what_is_not_a_replica_or_a_lease_time(store: Store) -> None:
    with pytest.raises(StoreError):
        await store.watch("", ["s1"], LONG)
    with pytest.raises(StoreError):
        await store.watch("r1", ["s1"], -1.0)


async def test_a_claim_for_a_turn_another_replica_already_ran_is_refused(store: Store, other: Store) -> None:
    """The receiver stored the turn (``begin_turn``) but another replica's failover scan took it
    before the receiver's claim, ran it, committed it and released the session: the receiver's
    late claim for that turn must fail, or the turn (and its tools) runs a second time."""
    await new_session(store, "s1", pending="t1")
    [adopted] = await other.claim_orphaned("r2", LONG)  # the scan, between begin_turn and the claim
    await other.commit_turn("s1", done("t1"), assistant="triage", messages=[answer("t1")], lease=adopted)
    assert await other.release(adopted)
    assert await store.claim("s1", "r1", LONG, turn="t1") is None  # ended elsewhere: nothing to run
    assert await store.lease_of("s1") is None  # and the claim took nothing
    await store.begin_turn("s1", "t2", UserMessage(content="again"), started_at=3.0)
    lease = await store.claim("s1", "r1", LONG, turn="t2")  # a turn still pending is claimed as before
    assert lease is not None and lease.token == adopted.token + 1
    assert await store.claim("s1", "r1", LONG) is not None  # without a turn: as before


async def test_a_fenced_notification_of_a_run_that_released_its_lease_still_goes_out(
    backend: Backend, store: Store, other: Store
) -> None:
    """A turn's last events are queued to the relay before its end, but the relay sends them
    asynchronously while the turn's end releases the lease (``TurnRunner._finish``: release, then
    flush). Nobody else claimed the session since: the run was never superseded, and its events
    must reach the remote subscribers (a healthy owner's stream must stay whole)."""
    await new_session(store)
    lease = await store.claim("s1", "r1/0123abcd", LONG)
    assert lease is not None
    if backend.name == "sqlite":  # one daemon owns a SQLite store: nobody to tell, nothing sent
        assert await store.release(lease)
        assert await store.notify_many([(EVENTS, "last step.done")], fences=[lease]) is None
        return
    with anyio.fail_after(TIMEOUT):
        assert await other.next_notification(0.01) is None  # it listens from now on
    assert await store.release(lease)  # the turn ended; its step.done still sits in the relay's queue
    assert await store.notify_many([(EVENTS, "last step.done")], fences=[lease]) is None
    with anyio.fail_after(TIMEOUT):
        assert await other.next_notification(5.0) == (EVENTS, "last step.done")
