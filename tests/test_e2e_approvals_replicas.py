"""Approvals across replicas on one PostgreSQL database (RFC 0012 §4), end to end: a decision wins
once whichever replica it is made on, and a pending approval outlives the replica that stored it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.daemon_harness import wait_until
from tests.pg_harness import PgServer
from tests.test_e2e_replicas import kill_replica, replicas

pytestmark = pytest.mark.e2e

APPROVED = """
[[assistants]]
name = "tooled"
first_message_mode = "assistant-waits-for-user"
tools = ["tests.tooling:record"]
require_approval = ["tests.tooling:record"]
"""


def records(log: Path) -> int:
    return sum(1 for line in log.read_text().splitlines() if line.startswith("record")) if log.exists() else 0


def test_racing_decisions_on_two_replicas_one_wins_and_the_call_runs_once(tmp_path: Path, pg: PgServer) -> None:
    log = tmp_path / "tools.log"
    with replicas(tmp_path, pg, 2, more=APPROVED, env={"AGENTD_TEST_TOOL_LOG": str(log)}) as (started, _hold):
        a, b = started
        session = a.new_session("tooled")
        remote = b.events(session)  # a subscriber on the replica that does not run the turn
        answer = a.send(session, "record please")
        turn, [approval] = answer["turn"]["id"], answer["approvals"]
        assert remote.wait("approval.requested")["approval"] == approval["id"]
        assert b.json("GET", f"/v1/approvals/{approval['id']}", status=200)["status"] == "pending"
        answers: list[httpx.Response] = []
        barrier = threading.Barrier(2)

        def decide(daemon: Any, decision: str) -> None:
            barrier.wait()
            answers.append(daemon.api("POST", f"/v1/approvals/{approval['id']}", {"decision": decision}))

        threads = [threading.Thread(target=decide, args=args) for args in ((a, "approve"), (b, "reject"))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        codes = sorted(r.status_code for r in answers)
        assert codes == [200, 409], [r.text for r in answers]
        [lost] = [r for r in answers if r.status_code == 409]
        assert lost.json()["error"]["code"] == "already_decided"
        [won] = [r.json() for r in answers if r.status_code == 200]
        assert remote.wait("approval.decided")["status"] == won["status"]
        record = a.turn(session, turn)
        assert record["status"] == "completed"
        assert records(log) == (1 if won["status"] == "approved" else 0)


def test_a_pending_approval_outlives_its_replica_and_any_replica_resumes_the_turn(tmp_path: Path, pg: PgServer) -> None:
    log = tmp_path / "tools.log"
    with replicas(tmp_path, pg, 2, more=APPROVED, env={"AGENTD_TEST_TOOL_LOG": str(log)}) as (started, _hold):
        a, b = started
        session = a.new_session("tooled")
        answer = a.send(session, "record please")
        turn, [approval] = answer["turn"]["id"], answer["approvals"]
        kill_replica(a)
        assert b.json("GET", f"/v1/approvals?session={session}&status=pending", status=200)[0]["id"] == approval["id"]
        assert b.session(session)["state"] == "awaiting_approval"
        assert b.json("POST", f"/v1/approvals/{approval['id']}", {"decision": "approve"}, status=200)
        assert b.turn(session, turn)["status"] == "completed"
        wait_until(lambda: records(log) == 1, "the approved call to run once")
        assert records(log) == 1


def test_a_replica_killed_right_after_an_approve_its_turn_is_adopted_and_the_call_runs_once(
    tmp_path: Path, pg: PgServer
) -> None:
    log = tmp_path / "tools.log"
    with replicas(tmp_path, pg, 2, more=APPROVED, env={"AGENTD_TEST_TOOL_LOG": str(log)}) as (started, _hold):
        a, b = started
        session = a.new_session("tooled")
        answer = a.send(session, "record please")
        turn, [approval] = answer["turn"]["id"], answer["approvals"]
        assert a.json("POST", f"/v1/approvals/{approval['id']}", {"decision": "approve"}, status=200)
        kill_replica(a)  # right after the approve: a had claimed the session to resume the turn
        record = b.turn(session, turn)
        assert record["status"] == "completed", record
        [result] = [e for e in b.entries(session, turn) if e["role"] == "tool"]
        # Exactly once — unless the kill cut the call while it ran: then at most once, and said so.
        assert records(log) == 1 or (result.get("outcome_unknown") is True and records(log) == 0)
