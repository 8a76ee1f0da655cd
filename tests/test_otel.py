"""OpenTelemetry GenAI traces (RFC 0011 §4), in process, over the SDK's in-memory exporter:
when tracing is on, the spans a turn makes, their names, kinds, parents, attributes and events;
what turns it on; and that off, nothing of OpenTelemetry is imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from agentd import otel
from agentd.budget import TurnStatus
from agentd.child.session import ChildSession
from agentd.child.spans import tool_done, turn_done, turn_parked
from agentd.child.turn import run_turn
from agentd.config import Intelligence, SwapPolicy, intelligence_map, parse_config
from agentd.intel.base import CompletionRequest
from agentd.intel.openai import OpenAIProvider
from agentd.messages import UserMessage
from agentd.otel_sdk import SdkTracing, header_secrets
from agentd.protocol import Event, Frame, SwapIntel
from agentd.redact import SECRETS
from agentd.store import Store
from agentd.tools import ToolOutcome, resolve_tools
from tests.daemon_harness import REPO
from tests.fakes import FakeOpenAI, Reply, refused_url
from tests.store_harness import Backend

pytestmark = pytest.mark.anyio

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
CLIENT_TRACE = int("0af7651916cd43dd8448eb211c80319c", 16)
CLIENT_SPAN = int("b7ad6b7169203331", 16)
CONFIG = """
[intelligence]
provider = "scripted"
model = "echo-small"

[[assistants]]
name = "main"
system = "You help."
tools = ["clock"]
"""


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    previous = otel.install(SdkTracing({}, exporter=memory))
    try:
        yield memory
    finally:
        otel.install(previous)


@pytest.fixture
def capturing() -> Iterator[InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    previous = otel.install(SdkTracing({otel.CAPTURE_CONTENT: "true"}, exporter=memory))
    try:
        yield memory
    finally:
        otel.install(previous)


async def _turn(text: str, config_text: str = CONFIG, *, run: int = 1, park: SwapIntel | None = None) -> Any:
    config = parse_config(config_text)
    session: ChildSession | None = None

    async def send(sent: Frame) -> None:
        started = isinstance(sent, Event) and sent.name == "step.started"
        if started and park is not None and session is not None and session.parked is None:
            await session.park(park)
        await anyio.lowlevel.checkpoint()

    session = ChildSession(
        "s-1", "main", [], config, intelligence_map(config), config.limits, 4, SwapPolicy.RESTART_TURN, send
    )
    session.turn_run = run
    tools = resolve_tools(["clock"])
    # As the child runtime wraps each run of a turn (agentd.child.runtime).
    with otel.tracing().invoke_agent(
        assistant="main", session="s-1", turn="t-1", generation=4, run=run, carrier={"traceparent": TRACEPARENT}
    ) as span:
        done = await run_turn(session, "t-1", UserMessage(content=text, turn="t-1"), tools)
        turn_done(span, done.record)
    return done


def spans(exporter: InMemorySpanExporter) -> dict[str, list[ReadableSpan]]:
    found: dict[str, list[ReadableSpan]] = {}
    for span in exporter.get_finished_spans():
        found.setdefault(span.name, []).append(span)
    return found


async def test_a_turn_is_an_invoke_agent_span_with_chat_and_execute_tool_children(
    exporter: InMemorySpanExporter,
) -> None:
    done = await _turn("what time is it? use clock")
    assert done.record.status is TurnStatus.COMPLETED
    found = spans(exporter)
    (agent,) = found["invoke_agent main"]
    chats = found["chat echo-small"]
    (tool,) = found["execute_tool clock"]
    assert len(chats) == 2  # the step that called the clock, then the answer

    # One trace, the client's; the turn's span is a child of the client's span, the rest of the turn's.
    assert {s.context.trace_id for s in [agent, *chats, tool]} == {CLIENT_TRACE}
    assert agent.parent is not None and agent.parent.span_id == CLIENT_SPAN and agent.parent.is_remote
    assert all(s.parent is not None and s.parent.span_id == agent.context.span_id for s in [*chats, tool])
    assert (agent.kind, chats[0].kind, tool.kind) == (SpanKind.INTERNAL, SpanKind.CLIENT, SpanKind.INTERNAL)

    a = agent.attributes or {}
    assert a["gen_ai.operation.name"] == "invoke_agent" and a["gen_ai.agent.name"] == "main"
    assert a["gen_ai.conversation.id"] == "s-1"
    assert (a["agentd.turn.id"], a["agentd.generation"], a["agentd.turn.run"]) == ("t-1", 4, 1)
    assert a["agentd.turn.status"] == "completed" and "error.type" not in a
    assert a["gen_ai.usage.input_tokens"] == done.record.usage.input_tokens

    c = chats[1].attributes or {}
    assert c["gen_ai.operation.name"] == "chat" and c["gen_ai.provider.name"] == "scripted"
    assert c["gen_ai.request.model"] == "echo-small" and c["gen_ai.response.model"] == "echo-small"
    assert c["gen_ai.usage.input_tokens"] > 0 and c["gen_ai.usage.output_tokens"] > 0
    assert (c["agentd.turn.id"], c["agentd.generation"], c["agentd.turn.run"]) == ("t-1", 4, 1)
    assert sum((s.attributes or {})["gen_ai.usage.input_tokens"] for s in chats) == done.record.usage.input_tokens

    t = tool.attributes or {}
    assert t["gen_ai.operation.name"] == "execute_tool" and t["gen_ai.tool.name"] == "clock"
    assert t["gen_ai.tool.call.id"] == done.messages[0].tool_calls[0].id
    # Content is not captured unless asked for.
    for span in [agent, *chats, tool]:
        keys = set(span.attributes or {})
        assert not keys & {"gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.tool.call.arguments"}


async def test_a_turn_that_ends_badly_names_its_status_as_error_type(exporter: InMemorySpanExporter) -> None:
    done = await _turn("call tool no_such_tool")
    found = spans(exporter)
    (tool,) = found["execute_tool no_such_tool"]
    assert (tool.attributes or {})["error.type"] == "tool_error" and tool.status.status_code is StatusCode.ERROR
    assert done.record.status is TurnStatus.COMPLETED  # an error result still continues the turn
    looping = CONFIG.replace('model = "echo-small"', 'model = "echo-small"\noptions = { steps = 9, loop = true }')
    done = await _turn("go", looping)
    assert done.record.status is TurnStatus.LOOP_DETECTED
    agent = spans(exporter)["invoke_agent main"][-1]
    assert (agent.attributes or {})["error.type"] == "loop_detected" and agent.status.status_code is StatusCode.ERROR


def test_a_run_parked_for_approvals_ends_its_span_neither_completed_nor_failed(
    exporter: InMemorySpanExporter,
) -> None:
    with otel.tracing().invoke_agent(
        assistant="main", session="s-1", turn="t-1", generation=4, run=0, carrier={"traceparent": TRACEPARENT}
    ) as span:
        turn_parked(span, 2)
    (agent,) = spans(exporter)["invoke_agent main"]
    a = agent.attributes or {}
    assert (a["agentd.turn.status"], a["agentd.approvals"]) == ("awaiting_approval", 2)
    assert "error.type" not in a and agent.status.status_code is not StatusCode.ERROR


async def test_a_restart_turn_swap_is_a_span_event_and_the_rerun_counts(exporter: InMemorySpanExporter) -> None:
    new = parse_config(CONFIG.replace("echo-small", "echo-large"))
    frame = SwapIntel(
        generation=5, policy=SwapPolicy.RESTART_TURN, intelligence=intelligence_map(new), limits=new.limits
    )
    done = await _turn("use clock please", park=frame, run=2)
    assert done.record.restarts == 1
    (agent,) = spans(exporter)["invoke_agent main"]
    names = [event.name for event in agent.events]
    assert "swap.parked" in names and "turn.restarted" in names
    restarted = next(e for e in agent.events if e.name == "turn.restarted")
    assert (restarted.attributes or {})["agentd.model_to"] == "echo-large"
    assert (agent.attributes or {})["agentd.turn.run"] == 2
    assert {(s.attributes or {})["gen_ai.request.model"] for s in spans(exporter)["chat echo-small"]} == {"echo-small"}
    assert spans(exporter)["chat echo-large"]


async def test_content_is_captured_only_when_asked_and_never_with_a_secret(capturing: InMemorySpanExporter) -> None:
    SECRETS.add(["sk-span-secret-4242"])
    await _turn("my key is sk-span-secret-4242, use clock")
    found = spans(capturing)
    chat = found["chat echo-small"][0].attributes or {}
    inputs = json.loads(str(chat["gen_ai.input.messages"]))
    assert inputs[-1]["role"] == "user" and "use clock" in inputs[-1]["parts"][0]["content"]
    assert "gen_ai.output.messages" in chat
    tool = found["execute_tool clock"][0].attributes or {}
    assert "gen_ai.tool.call.result" in tool
    for span in capturing.get_finished_spans():
        for value in (span.attributes or {}).values():
            assert "sk-span-secret-4242" not in str(value)


def test_what_turns_tracing_on() -> None:
    assert not otel.configured({})
    assert otel.configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert otel.configured({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"})
    assert otel.configured({"OTEL_TRACES_EXPORTER": "console"})
    assert not otel.configured({"OTEL_TRACES_EXPORTER": "none"})
    assert not otel.configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"})
    assert otel.telemetry_environment({"OTEL_SERVICE_NAME": "x", "PATH": "/bin"}) == {}
    on = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SERVICE_NAME": "x", "PATH": "/bin"}
    assert otel.telemetry_environment(on) == {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SERVICE_NAME": "x"}


@pytest.mark.parametrize(
    ("headers", "carrier"),
    [
        ({"traceparent": TRACEPARENT}, {"traceparent": TRACEPARENT}),
        ({"traceparent": TRACEPARENT, "tracestate": "k=v"}, {"traceparent": TRACEPARENT, "tracestate": "k=v"}),
        ({"traceparent": "not-a-trace"}, {}),
        ({"traceparent": "00-00000000000000000000000000000000-b7ad6b7169203331-01"}, {}),  # invalid all-zero trace id
        ({"traceparent": "ff" + TRACEPARENT[2:]}, {}),  # version ff is forbidden
        ({"tracestate": "k=v"}, {}),
        ({}, {}),
    ],
)
def test_a_requests_trace_context_is_taken_only_when_well_formed(
    headers: dict[str, str], carrier: dict[str, str]
) -> None:
    assert otel.trace_carrier(headers) == carrier


def test_exporter_headers_are_secrets() -> None:
    found = header_secrets({"OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20tok-123,x-team=blue"})
    assert {"Bearer tok-123", "tok-123", "blue"} <= found


def test_with_tracing_off_nothing_of_opentelemetry_is_imported() -> None:
    """The supervisor's and the child's modules, imported as the daemon and a child import them:
    no ``opentelemetry`` module is loaded (a fresh interpreter, the OTEL variables unset)."""
    code = (
        "import sys, agentd.entry, agentd.supervisor.daemon, agentd.child.__main__, agentd.child.runtime, agentd.api\n"
        "import agentd.child.turn, agentd.intel.ollama, agentd.intel.openai\n"
        "from agentd import otel\n"
        "otel.setup({})\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


async def test_the_trace_context_is_stored_with_the_turn(backend: Backend) -> None:
    """A replica that resumes or adopts the turn reads the client's trace context back (RFC 0011 §4)."""
    store: Store = await backend.open()
    try:
        await store.create_session("s1", assistant="a", generation=1, model="m", created_at=1.0, transcript=[])
        await store.begin_turn("s1", "t1", UserMessage(content="hi"), 2.0, trace={"traceparent": TRACEPARENT})
        pending = await store.pending_turn("s1")
        assert pending is not None and pending.trace == {"traceparent": TRACEPARENT}
        ((_, interrupted),) = await store.interrupted_turns()
        assert interrupted.trace == {"traceparent": TRACEPARENT}
    finally:
        await store.close()


async def test_an_endpoint_failover_is_an_event_on_the_model_calls_span(exporter: InMemorySpanExporter) -> None:
    with FakeOpenAI(default=Reply(content="ok")) as server:
        dead = refused_url()
        intelligence = Intelligence(provider="openai", endpoints=(dead + "/v1", server.url + "/v1"), model="gpt-test")
        provider = OpenAIProvider(intelligence)
        try:
            with otel.tracing().chat(provider="openai", model="gpt-test", turn="t-1", generation=1, run=1):
                await provider.complete(CompletionRequest(messages=[UserMessage(content="hi")]))
        finally:
            await provider.aclose()
    (chat,) = spans(exporter)["chat gpt-test"]
    (event,) = [e for e in chat.events if e.name == "agentd.endpoint.failover"]
    assert (event.attributes or {})["agentd.endpoint.to"] == server.url + "/v1"


def test_a_replayed_tool_call_is_an_event_on_its_span(exporter: InMemorySpanExporter) -> None:
    with otel.tracing().execute_tool(tool="refund", call_id="c1", turn="t-1", generation=1, run=2) as span:
        tool_done(span, {"amount": 5}, ToolOutcome("refunded"), "replayed", capture=False)
    (tool,) = spans(exporter)["execute_tool refund"]
    assert [(e.name, dict(e.attributes or {})) for e in tool.events] == [
        ("agentd.tool.replayed", {"agentd.tool.how": "replayed"})
    ]
    assert "error.type" not in (tool.attributes or {}) and (tool.attributes or {})["agentd.turn.run"] == 2


def test_traces_asked_for_without_the_extra_installed_are_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    assert otel.tracing_unavailable(asked) is None  # installed here (the test extra)
    assert otel.tracing_unavailable({}) is None
    monkeypatch.setattr(otel.importlib.util, "find_spec", lambda name: None)
    message = otel.tracing_unavailable(asked)
    assert message is not None and "OTEL_EXPORTER_OTLP_ENDPOINT" in message and "agentd[otel]" in message


async def test_a_transfer_is_a_span_event_and_the_opener_a_model_call_of_the_destination(
    exporter: InMemorySpanExporter,
) -> None:
    config = (
        CONFIG
        + """
[[assistants.transfers]]
to = "billing"

[[assistants]]
name = "billing"
system = "You bill."
first_message_mode = "assistant-speaks-first-with-model-generated-message"
"""
    )
    done = await _turn("please transfer me to billing", config)
    assert done.record.status is TurnStatus.TRANSFERRED
    (agent,) = spans(exporter)["invoke_agent main"]
    (transfer,) = [e for e in agent.events if e.name == "transfer"]
    assert (transfer.attributes or {})["agentd.to"] == "billing"
    assert (transfer.attributes or {})["agentd.from"] == "main"
    # The generated opener is a model call too, its spend on the destination assistant.
    assert len(spans(exporter)["chat echo-small"]) == 2
    assert {part.assistant for part in done.record.by_model} == {"main", "billing"}
