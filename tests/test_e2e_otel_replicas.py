"""Traces across replicas (RFC 0011 §4, RFC 0009 §6): a turn adopted after its replica died still
joins the client's trace, because the trace context is stored with the turn; the adoption is a
span event. Two real ``agentd run`` replicas on the suite's PostgreSQL, exporting to a loopback
OTLP/HTTP receiver that decodes the protobuf.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.daemon_harness import wait_until
from tests.otlp_receiver import OtlpReceiver
from tests.pg_harness import PgServer
from tests.test_e2e_replicas import kill_replica, replicas

pytestmark = pytest.mark.e2e

TRACE_ID = "5bf92f3577b34da6a3ce929d0e0e4737"
CLIENT_SPAN = "10f067aa0ba902b8"


def test_a_turn_adopted_after_a_failover_stays_in_the_clients_trace(tmp_path: Path, pg: PgServer) -> None:
    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50"}
        with replicas(tmp_path, pg, 2, env=env) as (started, hold):
            a, b = started
            session = a.new_session("held")
            assert a.client is not None
            accepted = a.client.post(
                f"/v1/sessions/{session}/messages",
                json={"content": "hold this", "wait": False},
                headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"},
            )
            assert accepted.status_code == 202, accepted.text
            turn = accepted.json()["turn_id"]
            a.wait_log("session.loaded", lambda r: r.get("session") == session)  # held on a's child
            kill_replica(a)
            wait_until(lambda: b.log_events("session.adopted"), "b to adopt the session")
            hold.touch()
            assert b.turn(session, turn)["status"] == "completed"

            def adopted_span() -> list[object]:
                return [
                    s
                    for s in receiver.named("invoke_agent held")
                    if s.attributes.get("agentd.turn.id") == turn
                    and "agentd.turn.resumed" in [name for name, _ in s.events]
                ]

            # The killed replica's child may still export the span of its cut run (it ends when it
            # finds its supervisor gone); every span of the turn is in the client's trace either way.
            (agent,) = wait_until(adopted_span, "the adopted turn's span")
            others = [s for s in receiver.named("invoke_agent held") if s.attributes.get("agentd.turn.id") == turn]
            assert all(s.trace_id == TRACE_ID for s in others)
            assert agent.trace_id == TRACE_ID and agent.parent_span_id == CLIENT_SPAN
            assert "agentd.turn.resumed" in [name for name, _ in agent.events]
            assert agent.attributes["agentd.turn.status"] == "completed"
            chats = [s for s in receiver.named("chat echo-small") if s.attributes.get("agentd.turn.id") == turn]
            # Every model call of the turn is in the client's trace; the adopted run's under its own span
            # (the killed replica's child may have finished its cut run's call too, under that run's span).
            assert all(c.trace_id == TRACE_ID for c in chats)
            assert [c for c in chats if c.parent_span_id == agent.span_id]
