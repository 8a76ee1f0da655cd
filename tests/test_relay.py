"""The pure parts of the cross-replica event relay (``agentd.supervisor.relay``): who watches
where, and events in and out of notification payloads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentd.budget import TurnStatus
from agentd.records import TurnRecord
from agentd.store import EVENTS, TURNS, Lease
from agentd.supervisor.relay import (
    MAX_PAYLOAD,
    EventRelay,
    Reassembler,
    RelayedEvent,
    RemoteWatchers,
    decode_watch,
    encode_event,
    encode_watch,
    relay_fence,
)
from agentd.supervisor.session import SessionRuntime

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def test_a_watch_lasts_its_ttl_unless_refreshed() -> None:
    watchers = RemoteWatchers(ttl=10.0)
    assert watchers.note("r1", ["s1", "s2"], now=0.0) == ["s1", "s2"]
    assert watchers.note("r2", ["s1"], now=1.0) == []  # already watched (by r1): nothing new to start
    assert watchers.watched("s1", 9.0) and watchers.watched("s2", 9.0)
    assert not watchers.watched("s2", 10.5)  # r1 never refreshed s2
    assert watchers.watched("s1", 10.5)  # r2's watch of s1 lasts until 11
    watchers.note("r1", ["s2"], now=10.5)
    assert watchers.watched("s2", 20.0)
    watchers.prune(now=15.0)
    assert len(watchers) == 1  # s1 expired for both, s2 refreshed


def test_a_watch_expired_counts_as_new_when_heard_again() -> None:
    watchers = RemoteWatchers(ttl=1.0)
    watchers.note("r1", ["s1"], now=0.0)
    assert watchers.note("r1", ["s1"], now=5.0) == ["s1"]


def test_forgetting_one_replica_keeps_the_others() -> None:
    watchers = RemoteWatchers(ttl=10.0)
    watchers.note("r1", ["s1"], now=0.0)
    watchers.note("r2", ["s1"], now=0.0)
    watchers.forget("r1", ["s1", "unknown"])
    assert watchers.watched("s1", 1.0)
    watchers.forget("r2", ["s1"])
    assert not watchers.watched("s1", 1.0) and len(watchers) == 0


def test_watch_notices_split_to_fit_and_read_back() -> None:
    sessions = [f"ses_{index:026d}" for index in range(1000)]
    payloads = encode_watch("replica-1", True, sessions)
    assert len(payloads) > 1 and all(len(p.encode()) <= MAX_PAYLOAD for p in payloads)
    notices = [decode_watch(p) for p in payloads]
    assert all(n is not None and n.replica == "replica-1" and n.watching for n in notices)
    assert [s for n in notices if n is not None for s in n.sessions] == sessions
    [stop] = encode_watch("replica-1", False, ["ses_1"])
    assert decode_watch(stop) == ("replica-1", False, ["ses_1"])
    assert encode_watch("replica-1", True, []) == []


@pytest.mark.parametrize("payload", ["", "r1", "r1 + ", "r1 x s1", "r1 s1 s2"])
def test_what_is_not_a_watch_notice_is_ignored(payload: str) -> None:
    assert decode_watch(payload) is None


@given(
    turn=st.none() | st.text(min_size=1, max_size=20),
    name=st.sampled_from(["step.done", "tool.call", "swap.applied"]),
    data=st.dictionaries(st.text(max_size=10), json_values, max_size=6),
    padding=st.integers(0, 30_000),
)
def test_an_event_of_any_size_and_text_goes_through_payloads_that_fit(
    turn: str | None, name: str, data: dict[str, Any], padding: int
) -> None:
    data = {**data, "content": "é✓\x00" * (padding // 3)}
    payloads = encode_event("r1", 7, "ses_1", turn, name, data)
    assert all(len(p.encode()) <= MAX_PAYLOAD and p.isascii() for p in payloads)
    reassembler = Reassembler()
    results = [reassembler.feed(p) for p in payloads]
    assert results[:-1] == [None] * (len(payloads) - 1)
    assert results[-1] == RelayedEvent("r1", 7, "ses_1", turn, name, data)
    assert reassembler.missed == 0


def test_events_of_several_senders_interleave() -> None:
    big = {"content": "x" * (3 * MAX_PAYLOAD)}
    one = encode_event("r1", 1, "s", "t1", "step.done", big)
    two = encode_event("r2", 1, "s", "t2", "step.done", big)
    reassembler = Reassembler()
    done = [e for pair in zip(one, two, strict=True) for p in pair if (e := reassembler.feed(p)) is not None]
    assert [(e.origin, e.turn) for e in done] == [("r1", "t1"), ("r2", "t2")]


def test_lost_notifications_are_counted_not_mistaken() -> None:
    reassembler = Reassembler()
    first = encode_event("r1", 1, "s", "t", "step.done", {"content": "x" * (2 * MAX_PAYLOAD)})
    assert reassembler.feed(first[0]) is None
    # The rest of event 1 and all of events 2 and 3 never came; event 4 is whole.
    [fourth] = encode_event("r1", 4, "s", "t", "tool.call", {"id": "c1"})
    assert reassembler.feed(fourth) == RelayedEvent("r1", 4, "s", "t", "tool.call", {"id": "c1"})
    assert reassembler.missed == 3  # event 1 cut short, 2 and 3 skipped
    assert reassembler.feed(first[1]) is None  # a stray part is not taken for an event
    [restarted] = encode_event("r1", 1, "s", "t", "tool.call", {})
    assert reassembler.feed(restarted) is not None  # the sender restarted under its id: no gap


@pytest.mark.parametrize("payload", ["", "r1 1 0 1", "r1 x 0 1 {}", "r1 1 0 1 [1]", "r1 1 0 1 {", 'r1 1 0 1 {"s":1}'])
def test_what_is_not_an_event_is_ignored(payload: str) -> None:
    assert Reassembler().feed(payload) is None


class _RecordingStore:
    """Records what is sent; ``fail`` makes the next batch fail (the database refused it)."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[str, str]]] = []
        self.fail = False
        self.crash = False
        self.gate = anyio.Event()

    async def notify_many(self, notes: Sequence[tuple[str, str]], *, fences: Sequence[object] = ()) -> str | None:
        await self.gate.wait()
        self.batches.append(list(notes))
        if self.fail:
            self.fail = False
            return "the database is down"
        if self.crash:
            self.crash = False
            raise RuntimeError("a bug in the store")
        return None


@pytest.mark.anyio
async def test_the_relay_sends_in_the_order_queued_and_flush_waits_for_it() -> None:
    store = _RecordingStore()
    relay = EventRelay(store, "r1")
    async with anyio.create_task_group() as tg:
        tg.start_soon(relay.run)
        relay.send_event(EVENTS, "s1", "t1", "step.done", {"step": 0})
        relay.send_event(EVENTS, "s1", "t1", "step.done", {"step": 0})  # equal events stay two
        relay.send(TURNS, "s1 t1 r1")
        assert not await relay.flush(0.05)  # the database has not answered yet
        store.fail = True
        store.gate.set()
        assert await relay.flush(5.0)
        relay.send(TURNS, "s1 t2 r1")
        assert await relay.flush(5.0)
        tg.cancel_scope.cancel()
    sent = [note for batch in store.batches for note in batch]
    assert [channel for channel, _ in sent] == [EVENTS, EVENTS, TURNS, TURNS]
    first, second = (Reassembler().feed(payload) for _, payload in sent[:2])
    assert first is not None and second is not None and (first.seq, second.seq) == (1, 2)
    assert sent[2:] == [(TURNS, "s1 t1 r1"), (TURNS, "s1 t2 r1")]


@pytest.mark.anyio
async def test_a_store_call_that_raises_does_not_end_the_relay() -> None:
    store = _RecordingStore()
    store.gate.set()
    store.crash = True
    relay = EventRelay(store, "r1")
    async with anyio.create_task_group() as tg:
        tg.start_soon(relay.run)
        relay.send(TURNS, "s1 t1 r1")
        assert await relay.flush(5.0)
        relay.send(TURNS, "s1 t2 r1")
        assert await relay.flush(5.0)
        tg.cancel_scope.cancel()
    assert [batch[0][1] for batch in store.batches] == ["s1 t1 r1", "s1 t2 r1"]


def test_only_the_run_that_holds_the_turn_here_relays_its_events() -> None:
    """Fenced like a commit (RFC 0009 §7): an event of a turn that no longer runs here comes from a
    run whose lease was found lost; one of the running turn goes out under its lease."""
    held = Lease(session="s1", replica="r1/0123abcd", token=3, expires_at=10.0)
    assert relay_fence("t1", "t1", held) == (True, held)
    assert relay_fence("t1", None, held) == (False, None)  # the lease was lost: the turn left
    assert relay_fence("t1", "t2", held) == (False, None)  # a stale run of an earlier turn
    assert relay_fence(None, None, None) == (True, None)  # the session's own (a swap while idle)


@pytest.mark.anyio
async def test_the_relay_hands_each_event_its_fence() -> None:
    store = _FencedStore()
    relay = EventRelay(store, "r1")
    held = Lease(session="s1", replica="r1", token=3, expires_at=10.0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(relay.run)
        relay.send_event(EVENTS, "s1", "t1", "step.done", {"step": 0}, fence=held)
        relay.send(TURNS, "s1 t1 r1")
        assert await relay.flush(5.0)
        tg.cancel_scope.cancel()
    assert store.fences == [held, None]


class _FencedStore:
    def __init__(self) -> None:
        self.fences: list[Lease | None] = []

    async def notify_many(self, notes: Sequence[tuple[str, str]], *, fences: Sequence[Lease | None] = ()) -> str | None:
        self.fences.extend(fences)
        return None


def test_a_subscriber_gets_no_event_of_a_turn_after_its_turn_done() -> None:
    runtime = SessionRuntime("s1", "main", "idle", 1, "m")
    stream = runtime.subscribe()
    record = TurnRecord(id="t1", status=TurnStatus.COMPLETED, models=("m",), steps=1, started_at=1.0, ended_at=2.0)
    runtime.publish("step.done", "t1", {"step": 0})
    runtime.publish_turn_done(record, [])
    runtime.publish("step.done", "t1", {"step": 0})  # a superseded run's, relayed late
    runtime.publish("turn.started", "t2", {})
    got = []
    with stream:
        while True:
            try:
                got.append(stream.receive_nowait())
            except anyio.WouldBlock:
                break
    runtime.close_subscribers()
    assert [(name, data["turn"]) for name, data in got] == [
        ("step.done", "t1"),
        ("turn.done", "t1"),
        ("turn.started", "t2"),
    ]
