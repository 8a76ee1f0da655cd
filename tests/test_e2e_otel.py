"""OpenTelemetry traces end to end (RFC 0011 §4): a real ``agentd run`` configured by the standard
``OTEL_*`` variables exports to a loopback OTLP/HTTP receiver that decodes the protobuf; and,
unconfigured, its children import nothing of OpenTelemetry.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_harness import Daemon, running_daemon, wait_until
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.e2e

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
SECRET = "otel-secret-77"

CONFIG = """
[intelligence]
provider = "scripted"
model = "echo-small"

[[assistants]]
name = "main"
system = "You help."
first_message_mode = "assistant-waits-for-user"
tools = ["clock", "tests.tooling:env_names", "tests.tooling:loaded_modules"]
"""


def post(daemon: Daemon, session: str, text: str, headers: dict[str, str] | None = None) -> Any:
    assert daemon.client is not None
    response = daemon.client.post(
        f"/v1/sessions/{session}/messages", json={"content": text, "wait": True}, headers=headers or {}
    )
    assert response.status_code == 200, response.text
    return response.json()


def turn_spans(receiver: OtlpReceiver, turn_id: str) -> list[ReceivedSpan]:
    with receiver.lock:
        return [s for s in receiver.spans if s.attributes.get("agentd.turn.id") == turn_id]


def test_a_turn_is_traced_under_the_clients_traceparent(tmp_path: Path) -> None:
    with OtlpReceiver() as receiver:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer%20{SECRET}",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
            "OTEL_SERVICE_NAME": "agentd-e2e",
            "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "true",
        }
        with running_daemon(tmp_path, CONFIG, env=env) as daemon:
            session = daemon.new_session("main")
            text = f"my token is {SECRET}; what time is it? use clock, and call tool env_names"
            result = post(daemon, session, text, {"traceparent": TRACEPARENT})
            turn_id = result["turn"]["id"]
            wait_until(
                lambda: any(s.name == "invoke_agent main" for s in turn_spans(receiver, turn_id)), "the turn's span"
            )
            spans = turn_spans(receiver, turn_id)
            names = sorted(s.name for s in spans)
            assert names == [
                "chat echo-small",
                "chat echo-small",
                "execute_tool clock",
                "execute_tool env_names",
                "invoke_agent main",
            ]
            (agent,) = [s for s in spans if s.name == "invoke_agent main"]
            chats = [s for s in spans if s.name.startswith("chat ")]
            tools = [s for s in spans if s.name.startswith("execute_tool ")]

            # The client's trace, across the supervisor/child boundary: the turn's span is a child of
            # the client's span, the model and tool calls children of the turn's.
            assert {s.trace_id for s in spans} == {TRACE_ID}
            assert agent.parent_span_id == CLIENT_SPAN
            assert all(s.parent_span_id == agent.span_id for s in chats + tools)
            assert (agent.kind, {s.kind for s in chats}, {s.kind for s in tools}) == (
                "internal",
                {"client"},
                {"internal"},
            )
            assert agent.service == "agentd-e2e"

            assert agent.attributes["gen_ai.operation.name"] == "invoke_agent"
            assert agent.attributes["gen_ai.conversation.id"] == session
            assert agent.attributes["gen_ai.agent.name"] == "main"
            assert agent.attributes["agentd.turn.run"] == 0 and agent.attributes["agentd.generation"] == 1
            assert agent.attributes["gen_ai.usage.input_tokens"] == result["turn"]["usage"]["input_tokens"]
            for chat in chats:
                assert chat.attributes["gen_ai.provider.name"] == "scripted"
                assert chat.attributes["gen_ai.request.model"] == "echo-small"
                assert chat.attributes["gen_ai.usage.output_tokens"] > 0
                assert "gen_ai.input.messages" in chat.attributes  # the capture variable is set
            clock = next(s for s in tools if s.name == "execute_tool clock")
            assert clock.attributes["gen_ai.tool.name"] == "clock" and clock.attributes["gen_ai.tool.call.id"]

            # The exporter's headers reached the receiver — and nothing else: not the child's
            # environment (its tools see no OTEL_* credentials), not a span (the captured user
            # message quoting the secret is scrubbed).
            assert any(h.get("authorization") == f"Bearer {SECRET}" for h in receiver.headers)
            env_result = next(s for s in tools if s.name == "execute_tool env_names")
            assert "OTEL_EXPORTER_OTLP_HEADERS" not in str(env_result.attributes.get("gen_ai.tool.call.result"))
            assert not any(SECRET.encode() in body for body in receiver.bodies)

            # A request without a traceparent starts a trace of its own.
            second = post(daemon, session, "hello again")["turn"]["id"]
            wait_until(
                lambda: any(s.name == "invoke_agent main" for s in turn_spans(receiver, second)), "the second turn"
            )
            (fresh,) = [s for s in turn_spans(receiver, second) if s.name == "invoke_agent main"]
            assert fresh.trace_id != TRACE_ID and fresh.parent_span_id == ""


def test_without_opentelemetry_configured_a_child_imports_none_of_it(tmp_path: Path) -> None:
    with running_daemon(tmp_path, CONFIG) as daemon:
        session = daemon.new_session("main")
        result = daemon.send(session, 'call tool loaded_modules {"prefix": "opentelemetry"}')
        (answer,) = [m for m in result["messages"] if m["role"] == "tool"]
        assert json.loads(answer["content"]) == []
        # Tracing off, the supervisor keeps no trace context: a traceparent is ignored, not stored.
        assert daemon.client is not None
        traced = daemon.client.post(
            f"/v1/sessions/{session}/messages", json={"content": "hi"}, headers={"traceparent": TRACEPARENT}
        )
        assert traced.status_code == 200
        with contextlib.closing(sqlite3.connect(daemon.state_dir / "agentd.db")) as db:
            stored = db.execute("SELECT trace FROM turns WHERE id = ?", (traced.json()["turn"]["id"],)).fetchall()
        assert stored == [(None,)]
