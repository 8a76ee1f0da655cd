"""The ollama provider against a fake Ollama server over real HTTP on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import structlog

from agentd.budget import Usage
from agentd.config import Intelligence, intelligence_map, load_config
from agentd.events import LOG_INTEL_ERROR, LOG_INTEL_FAILOVER
from agentd.intel import build_provider
from agentd.intel.base import CompletionRequest, IntelError, IntelErrorKind
from agentd.intel.endpoints import BreakerPolicy, BreakerState, RetryPolicy
from agentd.intel.ollama import OllamaProvider
from agentd.messages import AssistantMessage, Message, SystemMessage, ToolCall, ToolResult, UserMessage
from agentd.tools import ToolSpec, resolve_tool
from tests.fakes import (
    FakeCall,
    FakeOllama,
    Reply,
    drop_mid_stream,
    malformed_chunk,
    raw,
    refused_url,
    stall,
    status,
    stream_error,
    truncated,
)

pytestmark = pytest.mark.anyio

FAST = RetryPolicy(rounds=3, backoff=0.01, max_backoff=0.02, jitter=0.0, max_wait=5.0)
CLOCK_TOOL = ToolSpec(
    name="clock",
    description="The time",
    parameters={"type": "object", "properties": {"offset_hours": {"type": "integer"}}},
)


class ManualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(*urls: str, model: str = "llama3", options: dict[str, Any] | None = None, **kwargs: Any) -> OllamaProvider:
    intelligence = Intelligence(provider="ollama", endpoints=urls, model=model, options=options or {})
    return OllamaProvider(intelligence, retry=kwargs.pop("retry", FAST), **kwargs)


@asynccontextmanager
async def opened(provider: OllamaProvider) -> AsyncIterator[OllamaProvider]:
    try:
        yield provider
    finally:
        await provider.aclose()


def ask(*messages: Message, tools: tuple[ToolSpec, ...] = (), deadline: float | None = None) -> CompletionRequest:
    return CompletionRequest(messages=list(messages) or [UserMessage(content="hi")], tools=tools, deadline=deadline)


async def fails(provider: OllamaProvider, request: CompletionRequest | None = None) -> IntelError:
    with pytest.raises(IntelError) as caught:
        await provider.complete(request or ask())
    return caught.value


# --------------------------------------------------------------------------- the happy paths


async def test_streaming_answer_with_thinking_tools_and_usage() -> None:
    reply = Reply(
        content="Let me check.",
        thinking="The user wants the time twice.",
        input_tokens=42,
        output_tokens=7,
        tool_calls=(FakeCall("clock", {"offset_hours": 1}), FakeCall("clock", {"offset_hours": 2})),
    )
    with FakeOllama(default=reply) as server:
        async with opened(make(server.url, options={"think": True, "temperature": 0.1, "num_ctx": 8192})) as provider:
            history: list[Message] = [
                SystemMessage(content="Be brief.", name="triage"),
                UserMessage(content="What time is it?", images=("iVBORw0KGgo=",), turn="t1"),
            ]
            completion = await provider.complete(ask(*history, tools=(CLOCK_TOOL,)))
    message = completion.message
    assert message.content == "Let me check." and message.thinking == "The user wants the time twice."
    assert [(c.name, c.arguments) for c in message.tool_calls] == [
        ("clock", {"offset_hours": 1}),
        ("clock", {"offset_hours": 2}),
    ]
    assert [c.id for c in message.tool_calls] == ["call_fake1_0", "call_fake1_1"]  # the server's ids are kept
    assert (message.turn, message.model, message.assistant) == (None, None, None)
    assert completion.usage == Usage(42, 7) and completion.model == "llama3"
    body = server.chat_requests[0].body
    assert body["stream"] is True and body["think"] is True and body["options"] == {"temperature": 0.1, "num_ctx": 8192}
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What time is it?", "images": ["iVBORw0KGgo="]},
    ]
    assert body["tools"][0]["function"]["name"] == "clock"
    assert server.models_served() == ["llama3"]
    assert server.chat_requests[0].headers["accept"] == "application/x-ndjson"


async def test_tool_round_trip_history_goes_out_with_names_and_ids() -> None:
    with FakeOllama(default=Reply(content="It is noon.")) as server:
        async with opened(make(server.url)) as provider:
            call = ToolCall(id="call_1_0", name="clock", arguments={})
            history: list[Message] = [
                UserMessage(content="time?"),
                AssistantMessage(content="", tool_calls=(call,), model="llama3", assistant="triage", turn="t1"),
                ToolResult(name="clock", content="12:00", call_id="call_1_0"),
            ]
            completion = await provider.complete(ask(*history))
    assert completion.message.content == "It is noon."
    sent = server.chat_requests[0].body["messages"]
    assert sent[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1_0", "function": {"index": 0, "name": "clock", "arguments": {}}}],
    }
    assert sent[2] == {"role": "tool", "content": "12:00", "tool_name": "clock", "tool_call_id": "call_1_0"}


async def test_non_stream_mode() -> None:
    reply = Reply(content="whole", thinking="quietly", tool_calls=(FakeCall("clock"),))
    with FakeOllama(default=reply) as server:
        async with opened(make(server.url, options={"stream": False})) as provider:
            completion = await provider.complete(ask())
    assert server.chat_requests[0].body["stream"] is False
    assert (completion.message.content, completion.message.thinking) == ("whole", "quietly")
    assert completion.message.tool_calls[0].name == "clock" and completion.usage == Usage(11, 5)


async def test_old_server_without_tool_call_ids_gets_generated_ids() -> None:
    reply = Reply(tool_calls=(FakeCall("clock"), FakeCall("clock", {"offset_hours": 3})))
    with FakeOllama(default=reply, with_ids=False) as server:
        async with opened(make(server.url)) as provider:
            first = await provider.complete(ask())
            again = await provider.complete(ask())
    ids = [c.id for c in first.message.tool_calls]
    assert ids == ["call_1_0", "call_1_1"]  # unique, and stable for the same history
    assert [c.id for c in again.message.tool_calls] == ids


async def test_think_tags_in_content_become_thinking() -> None:
    with FakeOllama(default=Reply(content="Paris.", thinking="capital of France", think_tags=True)) as server:
        async with opened(make(server.url)) as provider:
            completion = await provider.complete(ask())
    assert (completion.message.thinking, completion.message.content) == ("capital of France", "Paris.")


async def test_invalid_argument_json_becomes_an_argument_error() -> None:
    with FakeOllama(default=Reply(tool_calls=(FakeCall("clock", '{"offset_hours": '),))) as server:
        async with opened(make(server.url)) as provider:
            call = (await provider.complete(ask())).message.tool_calls[0]
    assert call.arguments == {} and call.arguments_error and '{"offset_hours": ' not in call.arguments_error


async def test_discovery_lists_models() -> None:
    with FakeOllama(models=("llama3:8b", "qwen3:4b")) as server:
        async with opened(make(refused_url(), server.url)) as provider:
            assert await provider.models() == ["llama3:8b", "qwen3:4b"]


async def test_build_provider_and_endpoint_with_api_suffix() -> None:
    with FakeOllama(default=Reply(content="ok")) as server:
        provider = build_provider(Intelligence(provider="ollama", endpoints=(server.url + "/api/",), model="m"))
        assert isinstance(provider, OllamaProvider)
        async with opened(provider):  # type: ignore[arg-type]
            assert (await provider.complete(ask())).message.content == "ok"


# --------------------------------------------------------------------------- faults that are retried


@pytest.mark.parametrize(
    "fault",
    [
        status(500, "boom"),
        status(503, "loading model", retry_after="0"),
        status(429, "slow down", retry_after="0"),
        drop_mid_stream(after=2),
        truncated(after=2),
        stream_error("model runner has unexpectedly stopped"),
    ],
    ids=["500", "503", "429", "dropped", "truncated", "mid-stream-error"],
)
async def test_retryable_faults_are_retried(fault: Any) -> None:
    with FakeOllama(default=Reply(content="recovered")) as server:
        server.script(fault)
        async with opened(make(server.url)) as provider:
            completion = await provider.complete(ask())
    assert completion.message.content == "recovered"
    assert [r.outcome for r in server.chat_requests] == [fault.kind, "reply"]


async def test_stall_past_the_read_timeout_is_retried() -> None:
    with FakeOllama(default=Reply(content="after the stall")) as server:
        server.script(stall(after=1))
        async with opened(make(server.url, options={"read_timeout": "300ms"})) as provider:
            completion = await provider.complete(ask())
        assert server.stalled.is_set()
    assert completion.message.content == "after the stall"
    assert len(server.chat_requests) == 2


async def test_retry_after_is_honoured_between_rounds() -> None:
    clock = ManualClock()
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        clock.now += seconds

    with FakeOllama(default=Reply(content="ok")) as server:
        server.script(status(429, "busy", retry_after="2"))
        async with opened(make(server.url, clock=clock, sleep=sleep)) as provider:
            assert (await provider.complete(ask())).message.content == "ok"
    assert waits == [2.0]  # waited for Retry-After, not the 10 ms backoff


async def test_retry_after_beyond_the_deadline_gives_up_at_once() -> None:
    with FakeOllama() as server:
        server.script(status(503, "busy", retry_after="120"))
        async with opened(make(server.url)) as provider:
            error = await fails(provider, ask(deadline=anyio.current_time() + 30))
    assert error.kind is IntelErrorKind.UNAVAILABLE and "busy" in str(error)
    assert len(server.chat_requests) == 1


async def test_retries_spent_is_unavailable() -> None:
    with FakeOllama(default=status(500, "always broken")) as server:
        async with opened(make(server.url)) as provider:
            error = await fails(provider)
            assert provider.endpoints.state(0) is BreakerState.OPEN  # 3 rounds = 3 failures
            assert len(server.chat_requests) == 3
            # Open, but the only endpoint: after each backoff the call probes it anyway (panic mode).
            again = await fails(provider, ask(deadline=anyio.current_time() + 1))
    assert error.kind is IntelErrorKind.UNAVAILABLE and "always broken" in str(error)
    assert again.kind is IntelErrorKind.UNAVAILABLE and "always broken" in str(again)
    assert [r.outcome for r in server.chat_requests] == ["status"] * 5  # rounds 2 and 3 probed it


async def test_an_open_breaker_does_not_block_the_only_endpoint_until_the_deadline() -> None:
    """RFC 0005 §4 with panic mode: the breaker's 60 s cooldown would outlast a 20 s deadline."""
    clock = ManualClock()
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        clock.now += seconds

    with FakeOllama(default=Reply(content="answered")) as server:
        server.script(*[truncated(after=2)] * 7)  # opens the breaker, then fails four probes: cooldown 60 s
        async with opened(make(server.url, clock=clock, sleep=sleep, retry=RetryPolicy(jitter=0.0))) as provider:
            first = await fails(provider, ask(deadline=clock.now + 20))
            second = await fails(provider, ask(deadline=clock.now + 20))
            third = await fails(provider, ask(deadline=clock.now + 20))
            assert provider.endpoints.health[0].cooldown == 60.0
            before = len(server.chat_requests)
            completion = await provider.complete(ask(deadline=clock.now + 20))
            assert provider.endpoints.state(0) is BreakerState.CLOSED
    assert all(e.kind is IntelErrorKind.UNAVAILABLE for e in (first, second, third))
    assert completion.message.content == "answered"  # never the truncated stream's partial text
    assert [r.outcome for r in server.chat_requests] == ["truncate"] * 7 + ["reply"]
    assert before == 7
    assert max(waits) == 1.0  # backoffs only (0.5 s, 1 s): no wait for a cooldown


# --------------------------------------------------------------------------- faults that are not retried


@pytest.mark.parametrize(
    ("fault", "kind"),
    [
        (status(401, "unauthorized"), IntelErrorKind.AUTH),
        (status(403, "forbidden"), IntelErrorKind.AUTH),
        (status(404, 'model "llama3" not found, try pulling it first'), IntelErrorKind.REQUEST),
        (status(400, "invalid options"), IntelErrorKind.REQUEST),
        (malformed_chunk(after=1), IntelErrorKind.MALFORMED),
        (raw(200, b"<html>captive portal</html>", "text/html"), IntelErrorKind.MALFORMED),
    ],
    ids=["401", "403", "404", "400", "malformed-chunk", "html"],
)
async def test_request_auth_and_format_errors_are_not_failed_over(fault: Any, kind: IntelErrorKind) -> None:
    with FakeOllama() as primary, FakeOllama(default=Reply(content="never")) as secondary:
        primary.script(fault)
        async with opened(make(primary.url, secondary.url)) as provider:
            error = await fails(provider)
            assert provider.endpoints.state(0) is BreakerState.CLOSED
    assert error.kind is kind
    assert len(primary.chat_requests) == 1 and secondary.chat_requests == []
    if fault.kind == "status":
        assert fault.message in str(error)


async def test_non_stream_malformed_body() -> None:
    with FakeOllama() as server:
        server.script(malformed_chunk())
        async with opened(make(server.url, options={"stream": False})) as provider:
            assert (await fails(provider)).kind is IntelErrorKind.MALFORMED


# --------------------------------------------------------------------------- failover


async def test_fails_over_when_the_primary_refuses_connections() -> None:
    with FakeOllama(default=Reply(content="from the secondary")) as secondary, structlog.testing.capture_logs() as logs:
        async with opened(make(refused_url(), secondary.url)) as provider:
            completion = await provider.complete(ask())
    assert completion.message.content == "from the secondary"
    failovers = [e for e in logs if e["event"] == LOG_INTEL_FAILOVER]
    assert len(failovers) == 1 and failovers[0]["to_endpoint"] == secondary.url
    errors = [e for e in logs if e["event"] == LOG_INTEL_ERROR]
    assert errors and "connection refused" in errors[0]["error"]


async def test_breaker_opens_then_probes_and_sticks_to_the_lowest_healthy() -> None:
    clock = ManualClock()
    with (
        FakeOllama(default=Reply(content="primary")) as primary,
        FakeOllama(default=Reply(content="secondary")) as secondary,
    ):
        primary.script(status(500), status(500), status(500), status(500))
        async with opened(make(primary.url, secondary.url, clock=clock)) as provider:
            for _ in range(3):  # each call: primary fails, secondary answers
                assert (await provider.complete(ask())).message.content == "secondary"
            assert provider.endpoints.state(0) is BreakerState.OPEN
            assert (await provider.complete(ask())).message.content == "secondary"
            assert len(primary.chat_requests) == 3  # skipped while open
            clock.now += 5.0  # cooldown over: one probe, which fails → cooldown doubles
            assert (await provider.complete(ask())).message.content == "secondary"
            assert len(primary.chat_requests) == 4 and provider.endpoints.health[0].cooldown == 10.0
            clock.now += 9.0
            assert (await provider.complete(ask())).message.content == "secondary"
            assert len(primary.chat_requests) == 4
            clock.now += 1.0  # probe succeeds: back on the primary, and it stays there
            assert (await provider.complete(ask())).message.content == "primary"
            assert (await provider.complete(ask())).message.content == "primary"
            assert provider.endpoints.state(0) is BreakerState.CLOSED
    assert primary.models_served() == ["llama3"] * 6


async def test_fresh_provider_means_fresh_health() -> None:
    clock = ManualClock()
    url = refused_url()
    async with opened(
        make(url, clock=clock, breaker=BreakerPolicy(failure_threshold=1), retry=RetryPolicy(rounds=1))
    ) as provider:
        await fails(provider)
        assert provider.endpoints.state(0) is BreakerState.OPEN
    async with opened(make(url, clock=clock)) as rebuilt:  # a swap builds a new provider
        assert rebuilt.endpoints.state(0) is BreakerState.CLOSED


# --------------------------------------------------------------------------- deadlines and requests


async def test_deadline_ends_a_stalled_call_and_counts_against_the_endpoint() -> None:
    with FakeOllama() as server, FakeOllama(default=Reply(content="secondary")) as secondary:
        server.script(stall(after=1), stall(after=1), stall(after=1))
        async with opened(make(server.url, secondary.url)) as provider:
            for expected_failures in (1, 2):
                error = await fails(provider, ask(deadline=anyio.current_time() + 0.2))
                assert error.kind is IntelErrorKind.UNAVAILABLE and "deadline" in str(error)
                assert provider.endpoints.health[0].failures == expected_failures
            await fails(provider, ask(deadline=anyio.current_time() + 0.2))
            assert provider.endpoints.state(0) is BreakerState.OPEN  # a stall longer than the deadline, three times
            assert (await provider.complete(ask(deadline=anyio.current_time() + 10))).message.content == "secondary"


async def test_a_caller_cancelling_a_probe_gives_no_verdict() -> None:
    clock = ManualClock()
    with FakeOllama() as server:
        server.script(status(500), status(500), status(500), stall(after=1))
        async with opened(make(server.url, clock=clock, retry=RetryPolicy(rounds=1))) as provider:
            for _ in range(3):
                await fails(provider)
            clock.now += 5.0
            async with anyio.create_task_group() as group:
                group.start_soon(provider.complete, ask())
                await anyio.to_thread.run_sync(server.stalled.wait, 10.0)
                assert provider.endpoints.state(0) is BreakerState.HALF_OPEN
                group.cancel_scope.cancel()
            assert provider.endpoints.state(0) is BreakerState.OPEN and provider.endpoints.health[0].cooldown == 5.0


async def test_a_deadline_already_passed_sends_nothing() -> None:
    with FakeOllama() as server:
        async with opened(make(server.url)) as provider:
            error = await fails(provider, ask(deadline=anyio.current_time() - 1))
    assert error.kind is IntelErrorKind.UNAVAILABLE and server.chat_requests == []


async def test_invalid_history_and_options_are_request_errors() -> None:
    async with opened(make("http://127.0.0.1:9")) as provider:
        empty = await fails(provider, CompletionRequest(messages=[]))
        assert empty.kind is IntelErrorKind.REQUEST and "empty history" in str(empty)
        blank = await fails(provider, ask(UserMessage(content="")))
        assert blank.kind is IntelErrorKind.REQUEST and "message 0" in str(blank)
    async with opened(make("http://127.0.0.1:9", options={"read_timeout": "soon"})) as provider:
        assert "read_timeout" in str(await fails(provider))


async def test_bearer_key_is_sent_when_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTD_TEST_OLLAMA_KEY", "ollama-secret-value")
    with FakeOllama() as server:
        intelligence = Intelligence(
            provider="ollama", endpoints=(server.url,), model="m", api_key_env="AGENTD_TEST_OLLAMA_KEY"
        )
        async with opened(OllamaProvider(intelligence)) as provider:
            await provider.complete(ask())
            assert "ollama-secret-value" not in repr(provider)
    assert server.chat_requests[0].headers["authorization"] == "Bearer ollama-secret-value"


async def test_connections_are_reused_across_steps() -> None:
    with FakeOllama(default=Reply(content="ok", pieces=8)) as server:
        async with opened(make(server.url)) as provider:
            for _ in range(4):
                await provider.complete(ask())
    assert server.stats.connections == 1


async def test_the_ollama_example_config_works_against_the_fake() -> None:
    config = load_config(Path(__file__).parent.parent / "examples" / "ollama.toml")
    with FakeOllama(default=Reply(content="Hello from the example.")) as server:
        for name, intelligence in intelligence_map(config).items():
            local = msgspec.structs.replace(intelligence, endpoints=(server.url,))
            provider = build_provider(local)
            assert isinstance(provider, OllamaProvider)
            async with opened(provider):
                completion = await provider.complete(
                    ask(tools=tuple(resolve_tool(ref).spec for ref in config.assistant(name).tools))
                )
            assert completion.message.content == "Hello from the example."
    assert server.models_served() == ["qwen3:4b", "llama3.2:3b"]
    first, second = (r.body for r in server.chat_requests)
    assert (first["think"], second["think"]) == (True, False)
    assert "read_timeout" not in first["options"] and first["options"]["num_ctx"] == 8192


async def test_discovery_errors_have_kinds() -> None:
    with FakeOllama() as server:
        async with opened(make(server.url)) as provider:
            server.models_body = lambda: ["not", "a", "tag", "list"]  # type: ignore[method-assign]
            assert (await fails_models(provider)).kind is IntelErrorKind.MALFORMED
    async with opened(make(refused_url(), retry=RetryPolicy(rounds=1))) as provider:
        assert (await fails_models(provider)).kind is IntelErrorKind.UNAVAILABLE


async def fails_models(provider: OllamaProvider) -> IntelError:
    with pytest.raises(IntelError) as caught:
        await provider.models()
    return caught.value
