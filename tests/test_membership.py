"""Replica membership over a real store, without processes: the failover scan's races with this
replica's own acceptance of a turn (RFC 0009 §7)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agentd.config import PolicyChoice, SwapPolicy, parse_config
from agentd.messages import UserMessage
from agentd.store.sqlite import SqliteStore
from agentd.supervisor.membership import ReplicatedMembership
from agentd.supervisor.options import DaemonOptions
from agentd.supervisor.running import Running
from agentd.supervisor.session import PendingTurn, SessionRuntime, SessionTable

pytestmark = pytest.mark.anyio

LEASE = 2.0

CONFIG = """
[intelligence]
provider = "scripted"
model = "m1"

[[assistants]]
name = "main"
tools = []
"""


async def test_a_scan_that_claims_a_turn_accepted_here_leaves_the_lease_to_that_turn(tmp_path: Path) -> None:
    """The scan claims a session between this replica's ``begin_turn`` and its ``claim`` (the
    session was released by its previous turn, so its new pending turn looks orphaned). Its own
    claim then gets that same lease (a holder's claim keeps the token); the scan must leave it,
    or the turn runs under a lease nobody holds and its commit is refused (503 lease_lost)."""
    store = await SqliteStore.open(tmp_path / "agentd.db")
    try:
        running = Running(DaemonOptions(), parse_config(CONFIG), PolicyChoice(SwapPolicy.FINISH_ON_OLD, "default"))
        sessions = SessionTable(running)
        membership = ReplicatedMembership(store, running, sessions)
        await store.create_session("s1", assistant="main", generation=1, model="m1", created_at=time.time())
        runtime = sessions.add(SessionRuntime("s1", "main", "idle", 1, "m1"))
        message = UserMessage(content="hello", turn="t1")
        turn = PendingTurn(id="t1", message=message, started_at=time.time(), fresh=True)
        runtime.reserve(turn)
        await store.begin_turn("s1", "t1", message, turn.started_at)

        [scanned] = await store.claim_orphaned(membership.replica, LEASE)  # the scan, first
        accepted = await store.claim("s1", membership.replica, LEASE, turn="t1")  # then acceptance
        assert accepted is not None and accepted.token == scanned.token
        await membership._adopt_orphan(scanned)  # the scan goes on with what it claimed

        held = await store.lease_of("s1")
        assert held is not None, "the scan released the lease the accepted turn runs under"
        assert (held.replica, held.token) == (membership.replica, accepted.token)
    finally:
        await store.close()
