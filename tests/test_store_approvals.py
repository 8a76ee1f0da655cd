"""The store's approvals (RFC 0012 §4), against both backends (the ``store`` fixture): stored with
the parked run, decided exactly once under a race, expired, kept or cancelled by a re-run, ended
with their turn; a turn that awaits approval is neither interrupted nor orphaned."""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest

from agentd.approvals import ApprovalRequest, ApprovalStatus, ParkedRun
from agentd.budget import TurnStatus
from agentd.config import Intelligence
from agentd.messages import AssistantMessage, SystemMessage, ToolCall, UserMessage
from agentd.store import AlreadyDecided, Store, StoreError, UnknownApproval

pytestmark = pytest.mark.anyio

SCHEMA = {"type": "object", "properties": {"label": {"type": "string"}}}


async def waiting_turn(store: Store, session: str = "s1", turn: str = "t1", labels: tuple[str, ...] = ("a",)) -> Any:
    await store.create_session(
        session,
        assistant="triage",
        generation=1,
        model="echo-small",
        created_at=1000.0,
        transcript=[SystemMessage(content="You route customers.", name="triage")],
    )
    await store.begin_turn(session, turn, UserMessage(content="record please", turn=turn), started_at=time.time())
    calls = tuple(ToolCall(id=f"c{i}", name="record", arguments={"label": label}) for i, label in enumerate(labels))
    run = ParkedRun(
        messages=[AssistantMessage(content="", tool_calls=calls, turn=turn)],
        steps=1,
        elapsed=0.5,
        intelligence=Intelligence(model="echo-small"),
        calls=tuple(c.id for c in calls),
    )
    requests = [
        (f"ap_{turn}_{c.id}", ApprovalRequest(call_id=c.id, tool="record", arguments=c.arguments, parameters=SCHEMA))
        for c in calls
    ]
    return await store.park_turn(session, turn, run, requests, expires_at=None)


async def test_stored_then_decided_exactly_once_under_a_race(store: Store) -> None:
    parked = await waiting_turn(store)
    [approval] = parked.approvals
    assert parked.new == [approval.id] and approval.status is ApprovalStatus.PENDING
    assert await store.awaiting_turn("s1") == "t1"
    assert await store.awaiting_sessions(["s1", "nope"]) == {"s1"}
    assert await store.interrupted_turns() == []  # nothing re-runs it while it waits
    assert await store.claim_orphaned("r2", 30.0) == []
    assert await store.pending_approvals() == 1

    results: list[Any] = []

    async def decide(status: str) -> None:
        try:
            results.append(await store.decide_approval(approval.id, status, reason=status, arguments=None))
        except AlreadyDecided as exc:
            results.append(exc)

    async with anyio.create_task_group() as tg:
        for status in ("approved", "rejected", "approved", "rejected"):
            tg.start_soon(decide, status)
    won = [r for r in results if isinstance(r, tuple)]
    assert len(won) == 1 and sum(isinstance(r, AlreadyDecided) for r in results) == 3
    decided, ready = won[0]
    assert ready and decided.status.value == decided.reason
    assert await store.awaiting_turn("s1") is None
    assert await store.awaiting_sessions(["s1"]) == set()
    [(session, started)] = await store.interrupted_turns()  # a restart now runs it
    assert (session.id, started.id) == ("s1", "t1")
    found = await store.parked_run("s1", "t1")
    assert found is not None and found[0].calls == ("c0",) and found[1][0].status is decided.status
    with pytest.raises(UnknownApproval):
        await store.decide_approval("ap_nope", "approved", reason=None, arguments=None)


async def test_edited_arguments_are_stored_and_the_turn_waits_for_every_call(store: Store) -> None:
    parked = await waiting_turn(store, labels=("a", "b"))
    first, second = parked.approvals
    decided, ready = await store.decide_approval(first.id, "approved", reason=None, arguments={"label": "x"})
    assert decided.arguments == {"label": "x"} and not ready
    _, ready = await store.decide_approval(second.id, "rejected", reason="no", arguments=None)
    assert ready
    page = await store.list_approvals(session="s1", limit=1)
    assert [a.id for a in page] == [first.id]
    assert [a.id for a in await store.list_approvals(after=first.id)] == [second.id]
    assert [a.id for a in await store.list_approvals(status="rejected")] == [second.id]


async def test_expiry_decides_once_and_frees_the_turn(store: Store) -> None:
    await waiting_turn(store)
    [approval] = await store.list_approvals(status="pending")
    assert await store.next_expiry() is None  # parked with no expiry ("0s" = never)
    await store.create_session(
        "s2", assistant="triage", generation=1, model="echo-small", created_at=1.0, transcript=[]
    )
    await store.begin_turn("s2", "t2", UserMessage(content="x", turn="t2"), started_at=time.time())
    run = ParkedRun(messages=[], calls=("c9",))
    request = ApprovalRequest(call_id="c9", tool="record", arguments={})
    await store.park_turn("s2", "t2", run, [("ap_soon", request)], expires_at=time.time() - 1)
    assert await store.next_expiry() is not None
    expired, ready = await store.expire_approvals(time.time())
    assert [a.id for a in expired] == ["ap_soon"] and ready == [("s2", "t2")]
    assert expired[0].status is ApprovalStatus.EXPIRED and expired[0].reason
    assert await store.expire_approvals(time.time()) == ([], [])
    assert (await store.get_approval(approval.id)).status is ApprovalStatus.PENDING  # type: ignore[union-attr]


async def test_a_rerun_keeps_an_approval_it_asks_for_again_and_cancels_the_others(store: Store) -> None:
    parked = await waiting_turn(store, labels=("a", "b"))
    kept, dropped = parked.approvals
    assert await store.unpark_for_swap("triage", "echo-large") == [("s1", "t1")]
    assert await store.awaiting_turn("s1") is None  # the re-run may run now
    assert await store.parked_run("s1", "t1") is None
    run = ParkedRun(messages=[], calls=("n0",))
    again = ApprovalRequest(call_id="n0", tool="record", arguments={"label": "a"})
    result = await store.park_turn("s1", "t1", run, [("ap_new", again)], expires_at=None)
    assert [a.id for a in result.approvals] == [kept.id] and result.new == []
    assert result.approvals[0].call_id == "n0" and result.approvals[0].status is ApprovalStatus.PENDING
    assert [a.id for a in result.cancelled] == [dropped.id]
    assert result.cancelled[0].status is ApprovalStatus.CANCELLED and "restart-turn" in str(result.cancelled[0].reason)


async def test_ending_the_turn_cancels_its_pending_approvals(store: Store) -> None:
    parked = await waiting_turn(store)
    await store.abandon_turn("s1", "t1", status=TurnStatus.CANCELLED.value, error="closed", ended_at=time.time())
    approval = await store.get_approval(parked.approvals[0].id)
    assert approval is not None and approval.status is ApprovalStatus.CANCELLED and "closed" in str(approval.reason)
    assert await store.parked_run("s1", "t1") is None
    with pytest.raises(StoreError):
        await store.decide_approval(approval.id, "approved", reason=None, arguments=None)
