"""Real providers through the real daemon: ``agentd run`` against the fake Ollama and OpenAI-compatible
servers on loopback (RFC 0005 §2–§6; RFC 0002 §4–§6; RFC 0007 §5).

The fake server's request log is the witness: it records which ``model`` each model call named,
so "which model served which step" is read from the server, not from agentd's own account (which
the tests then check against it). "Mid-turn" is an event: the fake holds its reply (``Reply(gate=…)``)
until the test has seen ``step.started`` and ``swap.parked``.
"""

from __future__ import annotations

import json
import secrets
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.child_harness import tool_log
from tests.daemon_harness import Daemon, EventStream, running_daemon, wait_until
from tests.fakes import (
    FakeCall,
    FakeOllama,
    FakeOpenAI,
    RecordedRequest,
    Reply,
    drop_mid_stream,
    raw,
    refused_url,
    status,
    stream_error,
)

pytestmark = pytest.mark.e2e

OLD, NEW = "qwen-old:4b", "llama-new:3b"


# --------------------------------------------------------------------------- configs and scripts


def ollama_config(
    model: str, endpoints: list[str], *, deadline: str = "60s", tools: tuple[str, ...] = ("clock",), options: str = ""
) -> str:
    return f"""
[intelligence]
provider = "ollama"
endpoints = {json.dumps(endpoints)}
model = "{model}"
options = {{ {options} }}

[limits]
deadline = "{deadline}"

[[assistants]]
name = "main"
system = "You are a test assistant."
first_message_mode = "assistant-waits-for-user"
tools = {json.dumps(list(tools))}
"""


def openai_config(endpoint: str, key_env: str, *, options: str = "temperature = 0.1") -> str:
    return f"""
[intelligence]
provider = "openai"
endpoints = ["{endpoint}"]
model = "gpt-fake-mini"
api_key_env = "{key_env}"
options = {{ {options} }}

[limits]
deadline = "60s"

[[assistants]]
name = "main"
system = "You are a test assistant."
first_message_mode = "assistant-waits-for-user"
tools = ["clock"]
"""


Responder = Callable[[RecordedRequest], Reply]


def tool_then_answer(tool: str, arguments: Callable[[RecordedRequest], dict[str, Any]] = lambda _: {}) -> Responder:
    """A fake model: asks for ``tool`` unless the last message is a tool result, then answers."""

    def respond(request: RecordedRequest) -> Reply:
        messages = request.body.get("messages", []) if isinstance(request.body, dict) else []
        if messages and messages[-1].get("role") == "tool":
            return Reply(content=f"final answer from {request.model}", input_tokens=29, output_tokens=3)
        return Reply(tool_calls=(FakeCall(tool, arguments(request)),), input_tokens=13, output_tokens=7)

    return respond


def record_model(request: RecordedRequest) -> dict[str, Any]:
    return {"label": f"{request.model}"}


def distinct_refused_urls(count: int) -> list[str]:
    urls: list[str] = []
    while len(urls) < count:
        url = refused_url()
        if url not in urls:
            urls.append(url)
    return urls


def assistant_models(daemon: Daemon, session: str, turn: str) -> list[str]:
    return [e["model"] for e in daemon.entries(session, turn) if e["role"] == "assistant"]


def start_turn(daemon: Daemon, session: str, text: str = "work") -> tuple[str, EventStream]:
    events = daemon.events(session)
    turn_id = daemon.send(session, text, wait=False)["turn_id"]
    return turn_id, events


@contextmanager
def released_at_exit(gate: threading.Event) -> Iterator[threading.Event]:
    """Never leave a held reply behind a failed assertion: released before the daemon is stopped
    (it would drain the held turn), so list it after the daemon in the ``with``."""
    try:
        yield gate
    finally:
        gate.set()


# --------------------------------------------------------------------------- 1. a turn against Ollama


def test_a_turn_with_a_tool_step_against_ollama(tmp_path: Path) -> None:
    with (
        FakeOllama(default=tool_then_answer("clock")) as server,
        running_daemon(tmp_path, ollama_config(OLD, [server.url])) as daemon,
    ):
        session = daemon.new_session()
        result = daemon.send(session, "what time is it?")
        turn = result["turn"]
        assert turn["status"] == "completed", turn
        assert turn["steps"] == 2 and turn["models"] == [OLD]
        # Usage comes from prompt_eval_count / eval_count of both steps (13+29 in, 7+3 out); no
        # [[prices]] entry for the model: its cost is null, never 0 (RFC 0011 §2).
        assert turn["usage"] == {
            "input_tokens": 42,
            "output_tokens": 10,
            "cached_input_tokens": 0,
            "reasoning_tokens": 0,
            "requests": 2,
            "unreported": 0,
            "cost": None,
        }

        assert server.models_served() == [OLD, OLD]
        first, second = server.chat_requests
        assert first.body["stream"] is True
        assert [t["function"]["name"] for t in first.body["tools"]] == ["clock"]
        # The second request carries the clock's answer back as an Ollama tool message.
        tool_messages = [m for m in second.body["messages"] if m["role"] == "tool"]
        assert len(tool_messages) == 1 and tool_messages[0]["tool_name"] == "clock"
        assert tool_messages[0]["content"][:2] == "20"  # an ISO date from the real clock tool

        entries = daemon.entries(session, turn["id"])
        assert [e["role"] for e in entries] == ["user", "assistant", "tool", "assistant"]
        call_entry, tool_entry, answer = entries[1:]
        assert call_entry["tool_calls"][0]["name"] == "clock" and not tool_entry.get("is_error")
        assert answer["content"] == f"final answer from {OLD}"
        assert all(e["model"] == OLD for e in entries if e["role"] == "assistant")
        stored = daemon.turn(session, turn["id"])
        assert stored["usage"] == turn["usage"]
        assert daemon.session(session)["model"] == OLD


# --------------------------------------------------------------------------- 2, 3. mid-turn swaps against Ollama


def test_finish_on_old_mid_turn_swap_against_ollama(tmp_path: Path) -> None:
    gate = threading.Event()
    with (
        FakeOllama(default=tool_then_answer("record", record_model)) as server,
        running_daemon(tmp_path, ollama_config(OLD, [server.url], tools=("tests.tooling:record",))) as daemon,
        released_at_exit(gate),
    ):
        server.script(Reply(tool_calls=(FakeCall("record", {"label": "held-step-1"}),), gate=gate))
        session = daemon.new_session()
        turn_id, events = start_turn(daemon, session)
        events.wait("step.started", lambda d: d["turn"] == turn_id and d["step"] == 1)
        assert server.wait_for_received(1, timeout=60)
        daemon.write_config(ollama_config(NEW, [server.url], tools=("tests.tooling:record",)))
        daemon.signal(signal.SIGHUP)
        parked = events.wait("swap.parked", lambda d: d["model_to"] == NEW)
        assert parked["model_from"] == OLD and parked["turn"] == turn_id
        # The swap landed while step 1 was in flight: the server is still holding its reply.
        assert server.chat_requests[0].finished_at is None
        gate.set()
        done = events.wait("turn.done", lambda d: d["turn"] == turn_id)
        assert done["status"] == "completed" and done["restarts"] == 0

        # Every step of the in-flight turn went to the old model — as the server saw it.
        assert server.models_served() == [OLD, OLD]
        assert tool_log(tmp_path) == ["record held-step-1"]
        assert assistant_models(daemon, session, turn_id) == [OLD, OLD]

        second = daemon.send(session, "next")
        assert second["turn"]["status"] == "completed"
        assert server.models_served() == [OLD, OLD, NEW, NEW]
        assert assistant_models(daemon, session, second["turn"]["id"]) == [NEW, NEW]
        # The new model got the full transcript, the first turn included.
        history = server.chat_requests[2].body["messages"]
        assert [m["role"] for m in history] == ["system", "user", "assistant", "tool", "assistant", "user"]
        assert tool_log(tmp_path) == ["record held-step-1", f"record {NEW}"]
        assert daemon.session(session)["model"] == NEW


def test_restart_turn_mid_turn_swap_against_ollama(tmp_path: Path) -> None:
    gate = threading.Event()
    with (
        FakeOllama(default=tool_then_answer("record", record_model)) as server,
        running_daemon(
            tmp_path,
            ollama_config(OLD, [server.url], tools=("tests.tooling:record",)),
            args=["--model-swap", "restart-turn"],
        ) as daemon,
        released_at_exit(gate),
    ):
        server.script(Reply(tool_calls=(FakeCall("record", {"label": "discarded-step-1"}),), gate=gate))
        session = daemon.new_session()
        turn_id, events = start_turn(daemon, session)
        events.wait("step.started", lambda d: d["turn"] == turn_id and d["step"] == 1)
        assert server.wait_for_received(1, timeout=60)
        daemon.write_config(ollama_config(NEW, [server.url], tools=("tests.tooling:record",)))
        daemon.signal(signal.SIGHUP)
        events.wait("swap.parked", lambda d: d["model_to"] == NEW)
        assert server.chat_requests[0].finished_at is None
        gate.set()
        restarted = events.wait("turn.restarted", lambda d: d["turn"] == turn_id)
        assert restarted["model_from"] == OLD and restarted["model_to"] == NEW
        done = events.wait("turn.done", lambda d: d["turn"] == turn_id)
        assert done["status"] == "completed" and done["restarts"] == 1

        # The server saw: old-model step 1 (discarded), then the re-run on the new model.
        assert server.models_served() == [OLD, NEW, NEW]
        # The re-run starts from the pre-turn transcript: nothing of the discarded attempt is sent.
        rerun_history = server.chat_requests[1].body["messages"]
        assert [m["role"] for m in rerun_history] == ["system", "user"]
        # The discarded step's tool call never ran; only the re-run's did.
        assert tool_log(tmp_path) == [f"record {NEW}"]

        turn = daemon.turn(session, turn_id)
        assert turn["status"] == "completed" and turn["restarts"] == 1
        assert [d["model"] for d in turn["discarded"]] == [OLD]
        assert turn["discarded"][0]["usage"] == {
            "input_tokens": 11,
            "output_tokens": 5,
            "cached_input_tokens": 0,
            "reasoning_tokens": 0,
            "requests": 1,
            "unreported": 0,
            "cost": None,
        }
        assert turn["models"] == [NEW]
        assert assistant_models(daemon, session, turn_id) == [NEW, NEW]
        assert "discarded-step-1" not in json.dumps(daemon.session(session)["transcript"])


# --------------------------------------------------------------------------- 4. failover


def test_failover_to_the_second_endpoint_when_the_first_refuses(tmp_path: Path) -> None:
    [dead] = distinct_refused_urls(1)
    with (
        FakeOllama(default=tool_then_answer("clock")) as server,
        running_daemon(tmp_path, ollama_config(OLD, [dead, server.url])) as daemon,
    ):
        session = daemon.new_session()
        first = daemon.send(session, "hello")
        second = daemon.send(session, "again")
        for result in (first, second):
            assert result["turn"]["status"] == "completed", result["turn"]
            assert result["turn"]["models"] == [OLD]
        # Every model call was served by the second endpoint.
        assert server.models_served() == [OLD] * 4
        assert all(r.outcome == "reply" for r in server.chat_requests)
        failovers = daemon.wait_log("intel.failover")
        assert failovers[0]["from_endpoint"].startswith(dead) and failovers[0]["to_endpoint"].startswith(server.url)
        view = daemon.session(session)
        assert [t["status"] for t in view["turns"]] == ["completed", "completed"]
        assert [e["role"] for e in view["transcript"]].count("assistant") == 4


# --------------------------------------------------------------------------- 5. every endpoint down


def test_all_endpoints_down_makes_readiness_503_while_the_turn_waits(tmp_path: Path) -> None:
    dead = distinct_refused_urls(2)
    # A deadline far away: the readiness check never races it. The wait ends by a cancel.
    with running_daemon(tmp_path, ollama_config(OLD, dead, deadline="120s")) as daemon:
        assert daemon.api("GET", "/v1/ready").status_code == 200
        session = daemon.new_session()
        turn_id, events = start_turn(daemon, session)
        waiting = events.wait("intel.waiting", lambda d: d["turn"] == turn_id)
        assert waiting["model"] == OLD
        ready = daemon.api("GET", "/v1/ready")
        assert ready.status_code == 503, ready.text
        reasons = ready.json()["reasons"]
        assert any("endpoints down" in r and "main" in r for r in reasons), reasons
        daemon.json("POST", f"/v1/sessions/{session}/cancel", status=202)
        assert events.wait("turn.done", lambda d: d["turn"] == turn_id)["status"] == "cancelled"
        wait_until(lambda: daemon.api("GET", "/v1/ready").status_code == 200, "readiness to come back")


def test_all_endpoints_down_ends_intel_unavailable_and_the_session_stays_usable(tmp_path: Path) -> None:
    dead = distinct_refused_urls(2)
    # The deadline counts from when the turn was accepted (loading the session included): 3 s leaves
    # room for the first refused attempts, so the turn is waiting for intelligence when it ends.
    with running_daemon(tmp_path, ollama_config(OLD, dead, deadline="3s")) as daemon:
        session = daemon.new_session()
        turn_id, events = start_turn(daemon, session)
        done = events.wait("turn.done", lambda d: d["turn"] == turn_id)
        assert done["status"] == "intel_unavailable"
        assert daemon.turn(session, turn_id)["status"] == "intel_unavailable"
        wait_until(lambda: daemon.api("GET", "/v1/ready").status_code == 200, "readiness to come back")
        assert daemon.process is not None and daemon.process.poll() is None
        assert daemon.session(session)["state"] == "idle"

        with FakeOllama(default=Reply(content="back online")) as server:
            daemon.write_config(ollama_config(OLD, [server.url], deadline="30s"))
            reload = daemon.json("POST", "/v1/reload", status=200)
            assert reload["applied"] is True and reload["swapped_sessions"] == [session]
            events.wait("swap.applied", lambda d: d["kind"] == "repoint")
            result = daemon.send(session, "are you there?")
            assert result["turn"]["status"] == "completed", result["turn"]
            assert result["messages"][-1]["content"] == "back online"
            assert result["messages"][-1]["model"] == OLD
            assert server.models_served() == [OLD]
            # The failed turn's user message is part of the history the live endpoint was given.
            assert [m["content"] for m in server.chat_requests[0].body["messages"] if m["role"] == "user"] == [
                "work",
                "are you there?",
            ]


def test_a_repoint_while_waiting_on_dead_endpoints_completes_the_same_turn(tmp_path: Path) -> None:
    dead = distinct_refused_urls(2)
    with (
        FakeOllama(default=tool_then_answer("clock")) as server,
        running_daemon(tmp_path, ollama_config(OLD, dead, deadline="45s")) as daemon,
    ):
        session = daemon.new_session()
        turn_id, events = start_turn(daemon, session)
        events.wait("intel.waiting", lambda d: d["turn"] == turn_id)
        assert daemon.api("GET", "/v1/ready").status_code == 503
        daemon.write_config(ollama_config(OLD, [server.url], deadline="45s"))
        daemon.signal(signal.SIGHUP)
        events.wait("swap.parked", lambda d: d["turn"] == turn_id and d["model_to"] == OLD)
        applied = events.wait("swap.applied", lambda d: d["turn"] == turn_id)
        assert applied["kind"] == "repoint"
        events.wait("intel.recovered", lambda d: d["turn"] == turn_id)
        done = events.wait("turn.done", lambda d: d["turn"] == turn_id)
        assert done["status"] == "completed", done
        assert done["restarts"] == 0 and done["models"] == [OLD]
        assert server.models_served() == [OLD, OLD]
        assert assistant_models(daemon, session, turn_id) == [OLD, OLD]
        assert daemon.api("GET", "/v1/ready").status_code == 200


# --------------------------------------------------------------------------- 6. secrets


def echo_in_stream_error(request: RecordedRequest) -> Any:
    return stream_error(f"upstream crashed while serving {request.headers.get('authorization', '')}")


def echo_in_malformed_chunk(request: RecordedRequest) -> Any:
    auth = request.headers.get("authorization", "").encode()
    return raw(200, b'data: {"choices": [ broken ' + auth + b"\n\n", "text/event-stream")


def test_the_api_key_appears_nowhere(tmp_path: Path) -> None:
    key = "sk-test-" + secrets.token_hex(20)
    bearer = f"Bearer {key}"
    needles = [key, bearer, key[8:28]]  # the key, the header, and a long piece of its random part
    with (
        FakeOpenAI(api_key=key, default=tool_then_answer("clock")) as server,
        running_daemon(
            tmp_path, openai_config(f"{server.url}/v1", "AGENTD_TEST_KEY"), env={"AGENTD_TEST_KEY": key}
        ) as daemon,
    ):
        responses: list[str] = []

        def api(method: str, path: str, body: Any = None, expect: int = 200) -> Any:
            response = daemon.api(method, path, body)
            responses.append(f"{response.status_code} {response.headers} {response.text}")
            assert response.status_code == expect, f"{method} {path} → {response.status_code}: {response.text}"
            return response.json() if "json" in response.headers.get("content-type", "") else response.text

        session = api("POST", "/v1/sessions", {}, expect=201)["id"]
        events = daemon.events(session)

        def turn(expected: str, *script: Any) -> dict[str, Any]:
            server.script(*script)
            result = api("POST", f"/v1/sessions/{session}/messages", {"content": "go", "wait": True})
            assert result["turn"]["status"] == expected, result["turn"]
            events.wait("turn.done", lambda d: d["turn"] == result["turn"]["id"])
            return result

        # Retryable faults, each echoing the key, then an answer: the turns complete.
        turn(
            "completed",
            status(500, "boom", echo_auth=True),
            status(503, "busy", retry_after="1", echo_auth=True),
            Reply(content="after 500 and 503"),
        )
        turn("completed", status(429, "slow down", retry_after="0", echo_auth=True), Reply(content="after 429"))
        turn("completed", drop_mid_stream(after=2), echo_in_stream_error, Reply(content="after a dropped stream"))
        # Errors that are not failed over end the turn: their texts would be the likeliest place to leak.
        failed = [
            turn("failed", echo_in_malformed_chunk),
            turn("failed", status(401, "Incorrect API key provided", echo_auth=True)),
            turn("failed", status(400, "bad request", echo_auth=True)),
        ]
        assert all(f["turn"]["error"] for f in failed)
        assert "401" in failed[1]["turn"]["error"]
        # A successful turn with a tool step; then a reload (a repoint: new options) and one more.
        assert turn("completed")["turn"]["steps"] == 2
        daemon.write_config(openai_config(f"{server.url}/v1", "AGENTD_TEST_KEY", options="temperature = 0.2"))
        reload = api("POST", "/v1/reload")
        assert reload["applied"] is True and reload["swapped_sessions"] == [session]
        assert turn("completed")["turn"]["steps"] == 2

        # The key went out (so the checks below are not vacuous) — and only in the Authorization header.
        chat = server.chat_requests
        assert chat and all(r.headers.get("authorization") == bearer for r in chat)
        assert not any(key in json.dumps(r.body) for r in chat)
        kinds = {r.outcome for r in chat}
        assert {"status", "drop", "stream_error", "raw", "reply"} <= kinds, kinds

        for path in ("/v1/status", "/v1/sessions", f"/v1/sessions/{session}", "/v1/ready", "/v1/health", "/metrics"):
            api("GET", path)
        cli = daemon.run_cli("status")
        assert cli.returncode == 0, cli.stderr
        responses.append(cli.stdout + cli.stderr)
        while not events.events.empty():
            events.seen.append(events.events.get_nowait())
        assert len([n for n, _ in events.seen if n == "turn.done"]) == 8
        responses.extend(f"{name} {json.dumps(data)}" for name, data in events.seen)

        def state_bytes() -> dict[str, bytes]:
            return {str(p): p.read_bytes() for p in daemon.state_dir.rglob("*") if p.is_file() and not p.is_socket()}

        running_state = state_bytes()
        assert any(name.endswith("agentd.db") for name in running_state), running_state.keys()
        assert any(name.endswith("-wal") for name in running_state), running_state.keys()
        assert daemon.stop() == 0

    log = daemon.log_path.read_bytes()
    stopped_state = state_bytes()
    places: dict[str, bytes] = {
        "daemon log": log,
        **{f"API/SSE #{i}": r.encode() for i, r in enumerate(responses)},
        **{f"while running: {k}": v for k, v in running_state.items()},
        **{f"after stop: {k}": v for k, v in stopped_state.items()},
    }
    leaks = [(where, needle) for where, data in places.items() for needle in needles if needle.encode() in data]
    assert not leaks, f"the API key leaked into: {sorted({w for w, _ in leaks})}"
    # The search was not vacuous: the servers' echoing error texts did reach the log and the API
    # (minus the key), and the children's own lines are in the log searched.
    assert b"(you sent: Bearer " in log and b"upstream crashed while serving Bearer " in log
    assert any("(you sent: Bearer " in r for r in responses)
    assert b'"child_component": "child"' in log
