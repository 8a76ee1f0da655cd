"""The CLI and its HTTP client, without the real daemon.

- ``check-config``, ``run --help``, the model-swap check and "no daemon" run as real subprocesses
  (``python -m agentd``), the way users run them.
- The client is driven against a test double of the API's routes: a small Starlette app served by
  uvicorn on a real unix socket (and a TCP one for the bearer token). The double stands in for
  the server only to check the client's parsing and error mapping; the real daemon's end-to-end
  tests live elsewhere.
- The SSE parser is checked on awkward input, including every way of chunking it.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import types
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from agentd import cli
from agentd.client import AgentdClient, ClientError, DaemonNotRunning, SSEEvent, SSEParser, iter_sse
from agentd.config import ConfigError
from agentd.views import (
    Accepted,
    ChildView,
    CreateSession,
    Entry,
    MessageResult,
    PolicyView,
    PostMessage,
    ReloadResult,
    SessionCounts,
    StatusView,
)

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = REPO / "agentd" / "quickstart.toml"
RUN_TWINS = [
    "AGENTD_CONFIG",
    "AGENTD_STATE_DIR",
    "AGENTD_MODEL_SWAP",
    "AGENTD_LISTEN",
    "AGENTD_WATCH_CONFIG",
    "AGENTD_LOG_FORMAT",
    "AGENTD_LOG_LEVEL",
]


# =========================================================================== helpers


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without any AGENTD_* setting (so the host cannot leak in)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def agentd(
    *args: str, cwd: Path, env: dict[str, str] | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m agentd ARGS`` as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "agentd", *args],
        cwd=cwd,
        env=env or clean_env(),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(autouse=True)
def _no_agentd_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("AGENTD_"):
            monkeypatch.delenv(name)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: unix socket paths are limited to ~107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="agentd-cli-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# =========================================================================== check-config (subprocess)


def test_check_config_valid_quickstart(tmp_path: Path) -> None:
    shutil.copy(QUICKSTART, tmp_path / "agentd.toml")
    result = agentd("check-config", "agentd.toml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summary = result.stdout.strip()
    assert len(summary.splitlines()) == 1
    for piece in ("valid", "triage", "echo-small", "billing", "echo-large", "finish-on-old"):
        assert piece in summary


BAD_CONFIG = textwrap.dedent(
    """
    model_swap = "sometimes"

    [limits]
    deadline = "soon"
    colour = "blue"

    [[assistants]]
    name = "triage"
    tools = ["clock", "nosuch_tool"]

    [[assistants.transfers]]
    to = "billing"
    mode = "teleport"
    """
)


def test_check_config_reports_every_error_with_its_path(tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text(BAD_CONFIG)
    result = agentd("check-config", "bad.toml", cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stdout.splitlines()
    expected_paths = [
        "model_swap",
        "limits.deadline",
        "limits.colour",
        "assistants[0].transfers[0].mode",
        "assistants[0].tools",
    ]
    for path in expected_paths:
        assert any(line.startswith(f"{path}: ") for line in lines), (path, result.stdout)
    assert "'finish-on-old', 'restart-turn'" in result.stdout  # accepted values are named
    assert "nosuch_tool" in result.stdout
    assert result.stderr.startswith("agentd: bad.toml")


def test_check_config_json_shape(tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text(BAD_CONFIG)
    result = agentd("check-config", "bad.toml", "--json", cwd=tmp_path)
    assert result.returncode == 2
    body = msgspec.json.decode(result.stdout)
    assert body["valid"] is False
    assert all(set(error) == {"path", "message"} for error in body["errors"])
    assert {e["path"] for e in body["errors"]} >= {
        "model_swap",
        "limits.deadline",
        "limits.colour",
        "assistants[0].tools",
    }

    shutil.copy(QUICKSTART, tmp_path / "good.toml")
    good = agentd("check-config", "good.toml", "--json", cwd=tmp_path)
    assert good.returncode == 0
    body = msgspec.json.decode(good.stdout)
    assert body["valid"] is True and body["errors"] == []
    assert [a["model"] for a in body["assistants"]] == ["echo-small", "echo-large"]


def test_check_config_bad_tool_reference_alone(tmp_path: Path) -> None:
    """A file that passes the schema still fails when a tool cannot be resolved."""
    (tmp_path / "tools.toml").write_text(
        textwrap.dedent(
            """
            [[assistants]]
            name = "a"
            tools = ["clock"]

            [[assistants]]
            name = "b"
            tools = ["no_such_module_xyz:fn", "mytools:missing", "mytools:ok"]
            """
        )
    )
    # A module on PYTHONPATH: resolvable the way a child resolves it.
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "mytools.py").write_text("def ok(x: int = 0) -> str:\n    return str(x)\n")
    env = clean_env(PYTHONPATH=os.pathsep.join([str(REPO), str(tmp_path / "lib")]))  # no empty entry (= cwd)
    result = agentd("check-config", "tools.toml", "--json", cwd=tmp_path, env=env)
    assert result.returncode == 2
    errors = msgspec.json.decode(result.stdout)["errors"]
    assert [e["path"] for e in errors] == ["assistants[1].tools", "assistants[1].tools"]
    assert "no_such_module_xyz" in errors[0]["message"]
    assert "missing" in errors[1]["message"]


def test_check_config_resolves_tools_as_a_child_does_not_from_the_working_directory(tmp_path: Path) -> None:
    """Children run ``python -P`` (RFC 0006 §9): a module that is only in the working directory is
    not importable by them, so check-config (and the daemon) refuse it too."""
    (tmp_path / "cwdtools.py").write_text("def ok() -> str:\n    return 'ok'\n")
    (tmp_path / "tools.toml").write_text('[[assistants]]\nname = "a"\ntools = ["cwdtools:ok"]\n')
    env = clean_env(PYTHONPATH=str(REPO))
    result = agentd("check-config", "tools.toml", "--json", cwd=tmp_path, env=env)
    assert result.returncode == 2, result.stdout
    [error] = msgspec.json.decode(result.stdout)["errors"]
    assert error["path"] == "assistants[0].tools" and "cannot import module 'cwdtools'" in error["message"]
    on_path = clean_env(PYTHONPATH=os.pathsep.join([str(REPO), str(tmp_path)]))
    assert agentd("check-config", "tools.toml", cwd=tmp_path, env=on_path).returncode == 0


def test_check_config_missing_file(tmp_path: Path) -> None:
    result = agentd("check-config", "nope.toml", cwd=tmp_path)
    assert result.returncode == 2
    assert "cannot read config file" in result.stdout
    assert "nope.toml" in result.stderr


# =========================================================================== run (flags, env twins)


def test_run_help_lists_every_env_twin(tmp_path: Path) -> None:
    result = agentd("run", "--help", cwd=tmp_path)
    assert result.returncode == 0
    for name in [*RUN_TWINS, "AGENTD_API_TOKEN"]:
        assert name in result.stdout, name
    for flag in (
        "--config",
        "--state-dir",
        "--model-swap",
        "--listen",
        "--watch-config",
        "--log-format",
        "--log-level",
    ):
        assert flag in result.stdout


def test_client_help_lists_env_twins(tmp_path: Path) -> None:
    result = agentd("status", "--help", cwd=tmp_path)
    assert result.returncode == 0
    for name in ("AGENTD_STATE_DIR", "AGENTD_URL", "AGENTD_API_TOKEN"):
        assert name in result.stdout


def test_bad_model_swap_flag_exits_2_naming_accepted_values(tmp_path: Path) -> None:
    result = agentd("run", "--model-swap", "sometimes", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("agentd: --model-swap: invalid value 'sometimes'")
    assert "finish-on-old" in result.stderr and "restart-turn" in result.stderr


def test_bad_model_swap_env_exits_2(tmp_path: Path) -> None:
    result = agentd("run", cwd=tmp_path, env=clean_env(AGENTD_MODEL_SWAP="nah"))
    assert result.returncode == 2
    assert "AGENTD_MODEL_SWAP" in result.stderr and "restart-turn" in result.stderr


def _run_args(*argv: str) -> Any:
    return cli.build_parser().parse_args(["run", *argv])


def test_run_options_flag_beats_env_and_env_fills_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    env = {
        "AGENTD_CONFIG": "env.toml",
        "AGENTD_STATE_DIR": "env-state",
        "AGENTD_MODEL_SWAP": "restart-turn",
        "AGENTD_LISTEN": "127.0.0.1:9000",
        "AGENTD_API_TOKEN": "t",
        "AGENTD_WATCH_CONFIG": "yes",
        "AGENTD_LOG_FORMAT": "json",
        "AGENTD_LOG_LEVEL": "DEBUG",
    }
    from_env = cli.run_options(_run_args(), env)
    assert from_env.config_path == tmp_path / "env.toml"
    assert from_env.state_dir == Path("env-state")
    assert from_env.model_swap_flag is None  # the env twin is the daemon's precedence rule's to read
    assert from_env.listen == "127.0.0.1:9000"
    assert from_env.watch_config is True
    assert (from_env.log_format, from_env.log_level) == ("json", "debug")

    flags = cli.run_options(
        _run_args(
            "--config",
            "flag.toml",
            "--state-dir",
            "flag-state",
            "--model-swap",
            "finish-on-old",
            "--listen",
            "0.0.0.0:8080",
            "--log-format",
            "console",
            "--log-level",
            "warning",
        ),
        env,
    )
    assert flags.config_path == tmp_path / "flag.toml"
    assert flags.state_dir == Path("flag-state")
    assert flags.model_swap_flag == "finish-on-old"
    assert flags.listen == "0.0.0.0:8080"
    assert (flags.log_format, flags.log_level) == ("console", "warning")


def test_run_options_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    bare = cli.run_options(_run_args(), {})
    assert bare.config_path is None  # the built-in quickstart
    assert bare.state_dir is None  # the daemon falls back to [server] state_dir, else ./.agentd
    assert (bare.model_swap_flag, bare.listen, bare.watch_config, bare.log_format, bare.log_level) == (
        None,
        None,
        False,
        "auto",
        "info",
    )
    (tmp_path / "agentd.toml").write_text("")
    assert cli.run_options(_run_args(), {}).config_path == tmp_path / "agentd.toml"


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        ((), {"AGENTD_WATCH_CONFIG": "maybe"}, "AGENTD_WATCH_CONFIG"),
        ((), {"AGENTD_LOG_LEVEL": "loud"}, "AGENTD_LOG_LEVEL"),
        (("--log-level", "loud"), {}, "--log-level"),
        ((), {"AGENTD_LOG_FORMAT": "xml"}, "AGENTD_LOG_FORMAT"),
        (("--listen", "nowhere"), {"AGENTD_API_TOKEN": "t"}, "--listen"),
        (("--listen", "127.0.0.1:8080"), {}, "AGENTD_API_TOKEN"),
    ],
)
def test_run_options_usage_errors(argv: tuple[str, ...], env: dict[str, str], needle: str) -> None:
    with pytest.raises(cli.UsageError, match=needle):
        cli.run_options(_run_args(*argv), env)


def test_run_calls_run_daemon_with_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``agentd run`` imports run_daemon lazily and returns its exit code."""
    monkeypatch.chdir(tmp_path)
    seen: list[Any] = []
    fake = types.ModuleType("agentd.supervisor.daemon")

    def run_daemon(options: Any) -> int:
        seen.append(options)
        return 7

    fake.run_daemon = run_daemon  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "agentd.supervisor.daemon", fake)
    monkeypatch.setenv("AGENTD_MODEL_SWAP", "restart-turn")
    assert cli.main(["run", "--state-dir", "s", "--watch-config"]) == 7
    (options,) = seen
    assert options.state_dir == Path("s") and options.watch_config is True and options.model_swap_flag is None


def test_run_reports_config_error_from_daemon(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = types.ModuleType("agentd.supervisor.daemon")

    def run_daemon(options: Any) -> int:
        from agentd.config import ConfigIssue

        raise ConfigError([ConfigIssue("limits.deadline", "bad"), ConfigIssue("model_swap", "worse")], "x.toml")

    fake.run_daemon = run_daemon  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "agentd.supervisor.daemon", fake)
    assert cli.main(["run"]) == 2
    err = capsys.readouterr().err
    assert "x.toml: limits.deadline: bad" in err and "x.toml: model_swap: worse" in err


# =========================================================================== no daemon


@pytest.mark.parametrize("argv", [["status"], ["reload"], ["send", "hello"], ["chat"]])
def test_client_commands_without_daemon_exit_1(tmp_path: Path, argv: list[str]) -> None:
    result = agentd(*argv, "--state-dir", "st", cwd=tmp_path, stdin="")
    assert result.returncode == 1
    assert result.stderr.strip() == "agentd is not running: no socket at st/agentd.sock (start it with `agentd run`)"
    assert result.stdout == ""


def test_default_state_dir_and_env_twin(tmp_path: Path) -> None:
    default = agentd("status", cwd=tmp_path)
    assert default.returncode == 1 and "no socket at .agentd/agentd.sock" in default.stderr
    via_env = agentd("status", cwd=tmp_path, env=clean_env(AGENTD_STATE_DIR="elsewhere"))
    assert via_env.returncode == 1 and "no socket at elsewhere/agentd.sock" in via_env.stderr


def test_client_state_dir_follows_config_server_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.client_state_dir(None) == Path(".agentd")
    (tmp_path / "agentd.toml").write_text('[server]\nstate_dir = "from-file"\n')
    assert cli.client_state_dir(None) == Path("from-file")
    monkeypatch.setenv("AGENTD_STATE_DIR", "from-env")
    assert cli.client_state_dir(None) == Path("from-env")
    assert cli.client_state_dir("from-flag") == Path("from-flag")


def test_stale_socket_is_not_running(short_dir: Path) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(short_dir / "agentd.sock"))
    stale.close()  # the file stays, nobody listens: what a crashed daemon leaves behind
    with (
        AgentdClient(short_dir) as client,
        pytest.raises(DaemonNotRunning, match=r"does not accept connections.*stale socket"),
    ):
        client.status()


def test_tcp_connection_refused_is_not_running() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    with AgentdClient(url=f"http://user:pw@127.0.0.1:{port}", token="s3cret") as client:
        with pytest.raises(DaemonNotRunning) as caught:
            client.health()
    message = str(caught.value)
    assert f"not reachable at http://127.0.0.1:{port}" in message
    assert "s3cret" not in message and "pw" not in message


# =========================================================================== SSE parser


def _all(parser: SSEParser, chunks: list[str]) -> list[SSEEvent]:
    return [event for chunk in chunks for event in parser.feed(chunk)]


TRICKY_STREAM = (
    "\ufeff: hello, a comment\r\n"
    "event: tool.call\r\n"
    'data: {"a":\r\n'
    "data:1}\r\n"
    "\r\n"
    ":keepalive\n"
    "\n"  # a blank line after only a comment dispatches nothing
    "id: 7\r"
    "event: swap.parked\r"
    'data: {"b": 2}\r'
    "\r"
    "event: nodata\n"
    "\n"  # an event with no data line is dropped
    "data\n"  # a field with no colon: empty data
    "retry: 1500\n"
    "unknown: ignored\n"
    "\n"
    "event: turn.done\n"
    'data: {"c": 3}\n'
    "\n"
    "event: cut.off\n"
    'data: {"never": 1}\n'  # no blank line: never dispatched
)
TRICKY_EXPECTED = [
    SSEEvent("tool.call", '{"a":\n1}', None),
    SSEEvent("swap.parked", '{"b": 2}', "7"),
    SSEEvent("message", "", "7", 1500),  # events carry the stream's reconnection time once "retry:" set it
    SSEEvent("turn.done", '{"c": 3}', "7", 1500),
]


def test_sse_parser_tricky_input_in_one_piece() -> None:
    parser = SSEParser()
    assert _all(parser, [TRICKY_STREAM]) == TRICKY_EXPECTED
    assert parser.retry_ms == 1500
    assert msgspec.json.decode(TRICKY_EXPECTED[0].data) == {"a": 1}


def test_sse_parser_one_character_at_a_time() -> None:
    assert _all(SSEParser(), list(TRICKY_STREAM)) == TRICKY_EXPECTED


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(TRICKY_STREAM)), max_size=12))
def test_sse_parser_any_chunking(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(TRICKY_STREAM)]
    chunks = [TRICKY_STREAM[a:b] for a, b in itertools.pairwise(bounds)]
    assert list(iter_sse(chunks)) == TRICKY_EXPECTED


def test_sse_crlf_split_between_chunks_is_one_line_end() -> None:
    # "\r" ends a line; the "\n" arriving next belongs to it and must not end a second (blank) line,
    # which would dispatch "a" before its second data line.
    events = _all(SSEParser(), ["data: a\r", "\ndata: b\r", "\n\r", "\n"])
    assert events == [SSEEvent("message", "a\nb", None)]


def test_sse_value_keeps_all_but_one_leading_space() -> None:
    assert _all(SSEParser(), ["data:  two spaces\n\n"]) == [SSEEvent("message", " two spaces", None)]


# =========================================================================== the API test double

SESSION_ID = "s-1"
TURN_ID = "t-1"
TOKEN = "s3cret-token"


def sse(name: str, data: dict[str, Any], *, crlf: bool = False, split: bool = False) -> str:
    """One SSE event, optionally with CRLF line ends or the JSON split over two data lines."""
    body = msgspec.json.encode(data).decode()
    lines = [f"event: {name}"]
    if split and "," in body:
        head, tail = body.split(",", 1)
        lines += [f"data: {head},", f"data:{tail}"]
    else:
        lines.append(f"data: {body}")
    end = "\r\n" if crlf else "\n"
    return end.join(lines) + end + end


def entry(seq: int, role: str, content: str, **extra: Any) -> dict[str, Any]:
    return {"seq": seq, "turn": TURN_ID, "role": role, "content": content, **extra}


TURN_MESSAGES = [
    entry(3, "user", "what time is it? then transfer me to billing"),
    entry(
        4,
        "assistant",
        "Let me check the clock.",
        model="echo-small",
        assistant="triage",
        tool_calls=[{"id": "c1", "name": "clock", "arguments": {"offset_hours": 1}}],
    ),
    entry(5, "tool", "2026-01-01T01:00:00+01:00", name="clock", tool_call_id="c1"),
    entry(6, "assistant", "Connecting you to billing.", model="echo-small", assistant="triage"),
    entry(7, "assistant", "Billing here. What can I do for you?", model="echo-large", assistant="billing"),
]


def turn_events(turn_id: str) -> list[str]:
    """A turn as the server streams it: tool call, swap, restart, transfer, done."""
    base = {"session": SESSION_ID, "turn": turn_id}
    return [
        ": subscribed\n\n",
        sse("turn.started", {**base, "assistant": "triage", "model": "echo-small"}),
        sse("step.started", {**base, "step": 1, "model": "echo-small"}),
        sse("delta", {**base, "text": "Let"}),
        sse(
            "step.done",
            {
                **base,
                "step": 1,
                "model": "echo-small",
                "usage": {},
                "content": "Let me check the clock.",
                "thinking": "the user wants the time",
                "tool_calls": [{"id": "c1", "name": "clock", "arguments": {"offset_hours": 1}}],
            },
            split=True,
        ),
        sse("tool.call", {**base, "id": "c1", "name": "clock", "arguments": {"offset_hours": 1}}, crlf=True),
        sse(
            "tool.result",
            {
                **base,
                "id": "c1",
                "name": "clock",
                "is_error": False,
                "replayed": True,
                "content": "2026-01-01T01:00:00+01:00",
            },
        ),
        sse(
            "swap.parked",
            {**base, "generation": 2, "model_from": "echo-small", "model_to": "echo-large", "policy": "restart-turn"},
            split=True,
        ),
        sse(
            "turn.restarted",
            {**base, "model_from": "echo-small", "model_to": "echo-large", "restarts": 1, "discarded_steps": 1},
        ),
        sse(
            "swap.applied",
            {
                **base,
                "generation": 2,
                "kind": "model",
                "model_from": "echo-small",
                "model_to": "echo-large",
                "policy": "restart-turn",
            },
        ),
        # A stray event of another turn: not this turn's business.
        sse("tool.call", {"session": SESSION_ID, "turn": "t-other", "id": "x", "name": "stray_tool", "arguments": {}}),
        sse(
            "step.done",
            {
                **base,
                "step": 2,
                "model": "echo-large",
                "usage": {},
                "content": "final words",
                "thinking": None,
                "tool_calls": [],
            },
        ),
        sse("transfer", {**base, "from": "triage", "to": "billing", "mode": "rolling-history"}),
        sse(
            "turn.done",
            {
                **base,
                "status": "transferred",
                "models": ["echo-small", "echo-large"],
                "steps": 2,
                "restarts": 1,
                "discarded": [],
                "usage": {},
                "error": None,
                "messages": TURN_MESSAGES,
            },
            crlf=True,
            split=True,
        ),
    ]


def session_body(assistant: str = "triage") -> dict[str, Any]:
    return {
        "id": SESSION_ID,
        "assistant": assistant,
        "state": "idle",
        "generation": 1,
        "model": "echo-small",
        "transcript": [
            {"seq": 1, "role": "system", "content": "You route customers.", "name": "triage"},
            {
                "seq": 2,
                "role": "assistant",
                "content": "Hi! How can I help?",
                "model": "echo-small",
                "assistant": assistant,
            },
        ],
        "turns": [],
    }


def error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


class FakeDaemon:
    """A test double of the daemon's routes. Handlers run on uvicorn's loop (one thread)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        self.subscribers: list[asyncio.Queue[str | None]] = []
        self.reload_status = 200
        self.turn_status = "completed"
        self.finished_turns: list[dict[str, Any]] = []
        self.transcript_extra: list[dict[str, Any]] = []
        self.app = Starlette(
            routes=[
                Route("/v1/health", self.health),
                Route("/v1/ready", self.ready),
                Route("/v1/status", self.status),
                Route("/v1/reload", self.reload, methods=["POST"]),
                Route("/v1/sessions", self.create, methods=["POST"]),
                Route("/v1/sessions", self.list, methods=["GET"]),
                Route("/v1/sessions/{id}", self.get, methods=["GET"]),
                Route("/v1/sessions/{id}", self.delete, methods=["DELETE"]),
                Route("/v1/sessions/{id}/messages", self.message, methods=["POST"]),
                Route("/v1/sessions/{id}/cancel", self.cancel, methods=["POST"]),
                Route("/v1/sessions/{id}/events", self.events),
            ]
        )

    async def _record(self, request: Request) -> bytes:
        body = await request.body()
        self.requests.append((request.method, request.url.path, dict(request.headers), body))
        return body

    async def health(self, request: Request) -> Response:
        await self._record(request)
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        return JSONResponse({"ready": False, "reasons": ["draining"]}, status_code=503)

    async def status(self, request: Request) -> Response:
        view = StatusView(
            pid=4242,
            version="0.1.0",
            generation=3,
            model_swap=PolicyView(policy="restart-turn", source="env"),
            config_path="/etc/agentd.toml",
            children=[ChildView(pid=5151, sessions=2, in_flight=1, state="active", generation=3, restarts=1)],
            sessions=SessionCounts(open=2, loaded=2, running=1, failed=1),
        )
        raw = msgspec.to_builtins(view)
        raw["added_later"] = {"x": 1}  # a field a newer daemon might add: clients must tolerate it
        return JSONResponse(raw)

    async def reload(self, request: Request) -> Response:
        if self.reload_status == 200:
            result = ReloadResult(
                generation=4,
                applied=True,
                changed=["intelligence.model"],
                restart_required=["server.listen"],
                swapped_sessions=["s-1", "s-2"],
            )
        else:
            from agentd.config import ConfigIssue

            result = ReloadResult(
                generation=3,
                applied=False,
                errors=[ConfigIssue("model_swap", "invalid value 'x'"), ConfigIssue("limits.deadline", "bad duration")],
            )
        return JSONResponse(msgspec.to_builtins(result), status_code=self.reload_status)

    async def create(self, request: Request) -> Response:
        body = msgspec.json.decode(await self._record(request) or b"{}", type=CreateSession)
        if body.assistant not in (None, "triage", "billing"):
            return error(404, "assistant_not_found", f"no assistant named {body.assistant!r}")
        return JSONResponse(session_body(body.assistant or "triage"), status_code=201)

    async def list(self, request: Request) -> Response:
        return JSONResponse(
            [
                {
                    "id": SESSION_ID,
                    "assistant": "triage",
                    "state": "idle",
                    "generation": 1,
                    "model": "echo-small",
                    "turns": 0,
                }
            ]
        )

    async def get(self, request: Request) -> Response:
        if request.path_params["id"] == "explode":
            return PlainTextResponse("boom", status_code=500)
        if request.path_params["id"] != SESSION_ID:
            return error(404, "session_not_found", f"no session {request.path_params['id']!r}")
        body = session_body()
        body["transcript"] += self.transcript_extra
        body["turns"] = self.finished_turns
        return JSONResponse(body)

    async def delete(self, request: Request) -> Response:
        return JSONResponse({"id": request.path_params["id"], "state": "closed"})

    async def cancel(self, request: Request) -> Response:
        return JSONResponse({"cancelled": True})

    async def message(self, request: Request) -> Response:
        body = msgspec.json.decode(await self._record(request), type=PostMessage)
        if request.path_params["id"] != SESSION_ID:
            return error(404, "session_not_found", f"no session {request.path_params['id']!r}")
        if body.content == "busy":
            return error(409, "turn_running", "a turn is already running in this session")
        if body.content == "unavailable":
            return error(503, "draining", "the daemon is shutting down")
        turn = {
            "id": TURN_ID,
            "status": self.turn_status,
            "models": ["echo-small"],
            "steps": 1,
            "error": "turn deadline (120s) passed" if self.turn_status == "deadline" else None,
        }
        if body.wait:
            return JSONResponse({"turn": turn, "messages": TURN_MESSAGES})
        if not self.subscribers:
            # The client must subscribe first; failing loudly here keeps a wrong order from hanging.
            return error(409, "no_subscriber", "test double: POST with wait=false before subscribing")
        chunks = turn_events(TURN_ID)
        if body.content == "drop":  # the stream ends mid-turn; the turn itself finishes
            chunks = [*chunks[:6], None]
            self.finished_turns = [{**turn, "status": "completed"}]
            self.transcript_extra = [entry(9, "assistant", "recovered reply", model="echo-small", assistant="triage")]
        for queue in self.subscribers:
            for chunk in chunks:
                queue.put_nowait(chunk)
        return JSONResponse({"turn_id": TURN_ID}, status_code=202)

    async def events(self, request: Request) -> Response:
        await self._record(request)
        if request.path_params["id"] != SESSION_ID:
            return error(404, "session_not_found", "no such session")
        # Registered before the headers go out: a client that has the headers is subscribed.
        queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.subscribers.append(queue)

        async def stream() -> AsyncIterator[str]:
            try:
                while (chunk := await queue.get()) is not None:
                    yield chunk
            finally:
                self.subscribers.remove(queue)

        return StreamingResponse(stream(), media_type="text/event-stream")


@contextlib.contextmanager
def serving(app: Any, sock: socket.socket) -> Iterator[None]:
    """Serve ``app`` on an already listening socket: clients may connect at once (the backlog
    holds them until uvicorn accepts), so there is nothing to wait for."""
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture
def daemon(short_dir: Path) -> Iterator[tuple[FakeDaemon, Path]]:
    """The double on ``short_dir/agentd.sock``; yields it and the state dir."""
    fake = FakeDaemon()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(short_dir / "agentd.sock"))
    sock.listen(64)
    with serving(fake.app, sock):
        yield fake, short_dir


# =========================================================================== the client against the double


def test_client_routes_and_bodies(daemon: tuple[FakeDaemon, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    fake, state_dir = daemon
    monkeypatch.setenv("AGENTD_API_TOKEN", TOKEN)  # must not be sent over the unix socket
    with AgentdClient(state_dir) as client:
        assert client.health() == {"status": "ok"}
        assert client.ready() == {"ready": False, "reasons": ["draining"]}
        status = client.status()
        assert (status.generation, status.model_swap.policy, status.model_swap.source) == (3, "restart-turn", "env")
        assert status.children[0].sessions == 2 and status.children[0].in_flight == 1
        session = client.create_session("billing")
        assert session.assistant == "billing" and session.transcript[-1].content == "Hi! How can I help?"
        assert [s.id for s in client.list_sessions()] == [SESSION_ID]
        assert client.get_session(SESSION_ID).id == SESSION_ID
        assert client.cancel(SESSION_ID) == {"cancelled": True}
        assert client.close_session(SESSION_ID)["state"] == "closed"
    created = [r for r in fake.requests if r[:2] == ("POST", "/v1/sessions")]
    assert msgspec.json.decode(created[0][3]) == {"assistant": "billing"}
    assert all("authorization" not in headers for _, _, headers, _ in fake.requests)


def test_client_send_waited_is_message_result(daemon: tuple[FakeDaemon, Path]) -> None:
    fake, state_dir = daemon
    with AgentdClient(state_dir) as client:
        result = client.send_message(SESSION_ID, "hello", images=["aGk="])
    assert isinstance(result, MessageResult)
    assert result.turn.id == TURN_ID and result.messages[-1].assistant == "billing"
    sent = msgspec.json.decode(fake.requests[-1][3])
    assert sent == {"content": "hello", "wait": True, "images": ["aGk="]}


def test_client_send_unwaited_is_accepted_and_events_follow(daemon: tuple[FakeDaemon, Path]) -> None:
    _, state_dir = daemon
    with AgentdClient(state_dir) as client, client.events(SESSION_ID) as stream:
        accepted = client.send_message(SESSION_ID, "hello", wait=False)
        assert isinstance(accepted, Accepted) and accepted.turn_id == TURN_ID
        seen: list[tuple[str, dict[str, Any]]] = []
        for name, data in stream:
            seen.append((name, data))
            if name == "turn.done":
                break
    names = [name for name, _ in seen]
    assert names[:3] == ["turn.started", "step.started", "delta"]
    assert names[-1] == "turn.done"
    done = seen[-1][1]
    assert done["turn"] == TURN_ID and done["status"] == "transferred" and len(done["messages"]) == len(TURN_MESSAGES)
    step = next(data for name, data in seen if name == "step.done")  # its JSON came split over two data lines
    assert step["tool_calls"][0]["name"] == "clock"


@pytest.mark.parametrize(
    ("call", "status", "code", "text"),
    [
        (lambda c: c.get_session("nope"), 404, "session_not_found", "no session 'nope'"),
        (lambda c: c.create_session("ghost"), 404, "assistant_not_found", "no assistant named 'ghost'"),
        (
            lambda c: c.send_message(SESSION_ID, "busy"),
            409,
            "turn_running",
            "a turn is already running in this session",
        ),
        (lambda c: c.send_message(SESSION_ID, "unavailable"), 503, "draining", "the daemon is shutting down"),
        (lambda c: c.events("nope"), 404, "session_not_found", "no such session"),
        (lambda c: c.get_session("explode"), 500, "http_500", "boom"),
    ],
)
def test_client_error_mapping(daemon: tuple[FakeDaemon, Path], call: Any, status: int, code: str, text: str) -> None:
    _, state_dir = daemon
    with AgentdClient(state_dir) as client, pytest.raises(ClientError) as caught:
        call(client)
    assert (caught.value.status, caught.value.code, caught.value.message) == (status, code, text)


def test_client_reload_applied_and_rejected(daemon: tuple[FakeDaemon, Path]) -> None:
    fake, state_dir = daemon
    with AgentdClient(state_dir) as client:
        applied = client.reload()
        assert applied.applied and applied.generation == 4 and applied.swapped_sessions == ["s-1", "s-2"]
        fake.reload_status = 422
        rejected = client.reload()  # 422 carries a ReloadResult: a result, not an exception
    assert not rejected.applied
    assert [str(e) for e in rejected.errors] == ["model_swap: invalid value 'x'", "limits.deadline: bad duration"]


def test_client_bearer_token_over_tcp() -> None:
    fake = FakeDaemon()

    async def guarded(scope: Any, receive: Any, send: Any) -> None:
        headers = dict(scope.get("headers") or [])
        if scope["type"] == "http" and headers.get(b"authorization") != f"Bearer {TOKEN}".encode():
            await error(401, "unauthorized", "missing or wrong bearer token")(scope, receive, send)
            return
        await fake.app(scope, receive, send)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with serving(guarded, sock):
        with AgentdClient(url=url, token=TOKEN) as client:
            assert client.health() == {"status": "ok"}
            assert TOKEN not in repr(client)
        with AgentdClient(url=url, token="zq-not-it-zq") as client, pytest.raises(ClientError) as caught:
            client.health()
    assert (caught.value.status, caught.value.code) == (401, "unauthorized")
    assert "zq-not-it-zq" not in str(caught.value) and "zq-not-it-zq" not in repr(caught.value)
    # Only the right token got through: the double saw no request from the wrong one.
    assert [r[1] for r in fake.requests] == ["/v1/health"]


# =========================================================================== CLI commands against the double


def test_status_table_and_json(daemon: tuple[FakeDaemon, Path], capsys: pytest.CaptureFixture[str]) -> None:
    _, state_dir = daemon
    assert cli.main(["status", "--state-dir", str(state_dir)]) == 0
    table = capsys.readouterr().out
    assert "generation 3" in table
    assert "restart-turn (from env)" in table
    assert "/etc/agentd.toml" in table
    assert "2 open, 2 loaded, 1 running, 1 failed" in table
    child = next(line for line in table.splitlines() if "5151" in line)
    assert child.split() == ["5151", "active", "3", "1", "1", "2"]

    assert cli.main(["status", "--state-dir", str(state_dir), "--json"]) == 0
    raw = msgspec.json.decode(capsys.readouterr().out)
    assert raw["model_swap"] == {"policy": "restart-turn", "source": "env"}
    assert raw["added_later"] == {"x": 1}  # raw: nothing the client does not know is dropped


def test_reload_command_applied_and_rejected(
    daemon: tuple[FakeDaemon, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    fake, state_dir = daemon
    assert cli.main(["reload", "--state-dir", str(state_dir)]) == 0
    out = capsys.readouterr().out
    assert "applied" in out and "generation 4" in out
    assert "intelligence.model" in out and "server.listen" in out and "s-1, s-2" in out

    fake.reload_status = 422
    assert cli.main(["reload", "--state-dir", str(state_dir)]) == 1
    captured = capsys.readouterr()
    assert "rejected" in captured.out
    assert "model_swap: invalid value 'x'" in captured.out.splitlines()
    assert "limits.deadline: bad duration" in captured.out.splitlines()
    assert captured.err.startswith("agentd: reload rejected")


def test_send_creates_session_and_prints_reply(
    daemon: tuple[FakeDaemon, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    fake, state_dir = daemon
    fake.turn_status = "completed"
    assert cli.main(["send", "--state-dir", str(state_dir), "--assistant", "billing", "what", "time?"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "Billing here. What can I do for you?\n"  # the last assistant entry only
    assert captured.err == f"{SESSION_ID}\n"  # the new session's bare id
    created = [r for r in fake.requests if r[:2] == ("POST", "/v1/sessions")]
    assert msgspec.json.decode(created[0][3]) == {"assistant": "billing"}
    assert msgspec.json.decode(fake.requests[-1][3]) == {"content": "what time?", "wait": True}


def test_send_to_session_reports_unfinished_turn(
    daemon: tuple[FakeDaemon, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    fake, state_dir = daemon
    fake.turn_status = "deadline"
    assert cli.main(["send", "--state-dir", str(state_dir), "--session", SESSION_ID, "hi"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "Billing here. What can I do for you?\n"
    assert captured.err.strip() == "agentd: turn deadline: turn deadline (120s) passed"
    assert not [r for r in fake.requests if r[:2] == ("POST", "/v1/sessions")]  # no session created


def test_send_api_errors_exit_1(daemon: tuple[FakeDaemon, Path], capsys: pytest.CaptureFixture[str]) -> None:
    _, state_dir = daemon
    assert cli.main(["send", "--state-dir", str(state_dir), "--session", "nope", "hi"]) == 1
    assert capsys.readouterr().err.strip() == "agentd: no session 'nope' (HTTP 404, session_not_found)"
    assert cli.main(["send", "--state-dir", str(state_dir), "--session", SESSION_ID, "busy"]) == 1
    assert "turn_running" in capsys.readouterr().err


def test_chat_shows_events_then_reply(
    daemon: tuple[FakeDaemon, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, state_dir = daemon
    monkeypatch.setattr(sys, "stdin", io.StringIO("what time is it?\n\nbusy\nagain\n"))
    assert cli.main(["chat", "--state-dir", str(state_dir)]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert f"session {SESSION_ID}" in captured.err
    assert lines[0] == "triage (echo-small): Hi! How can I help?"  # the opener

    def index(fragment: str, start: int = 0) -> int:
        return next(i for i, line in enumerate(lines) if i >= start and fragment in line)

    # Events in the order they happened, then the reply (after the transfer: M and the new opener).
    order = [
        index("[thinking] the user wants the time"),
        index("[step 1, echo-small] Let me check the clock."),
        index('-> tool clock({"offset_hours":1})'),
        index("<- clock [replayed]: 2026-01-01T01:00:00+01:00"),
        index("[swap parked] echo-small -> echo-large (generation 2, policy restart-turn)"),
        index("[turn restarted] echo-small -> echo-large (restart 1, 1 step(s) discarded)"),
        index("[swap applied] echo-small -> echo-large (generation 2, model, policy restart-turn)"),
        index("[transfer] triage -> billing (rolling-history)"),
        index("triage (echo-small): Connecting you to billing."),
        index("billing (echo-large): Billing here. What can I do for you?"),
        index("[turn transferred]"),
    ]
    assert order == sorted(order)
    assert not any("stray_tool" in line for line in lines)  # another turn's event
    assert not any("final words" in line for line in lines)  # the last step's content is the reply, not shown twice
    # The second line was a 409: reported, and the chat went on to the third line.
    assert "agentd: a turn is already running in this session" in captured.err
    assert sum("Billing here." in line for line in lines) == 2
    # Subscribe first, then post: the double answers 409 no_subscriber otherwise.
    assert "no_subscriber" not in captured.err
    posted = [msgspec.json.decode(r[3]) for r in fake.requests if r[1].endswith("/messages")]
    assert [p["wait"] for p in posted] == [False, False, False]


def test_chat_recovers_when_the_stream_ends_early(
    daemon: tuple[FakeDaemon, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, state_dir = daemon
    monkeypatch.setattr(sys, "stdin", io.StringIO("drop\n"))
    assert cli.main(["chat", "--state-dir", str(state_dir), "--session", SESSION_ID]) == 0
    captured = capsys.readouterr()
    assert "resumed session" in captured.err
    lines = captured.out.splitlines()
    assert lines[0] == "triage (echo-small): Hi! How can I help?"
    assert lines[-1] == "triage (echo-small): recovered reply"  # from GET /v1/sessions/{id}


# =========================================================================== pure helpers


def test_reply_entries_after_last_tool_call() -> None:
    messages = msgspec.convert(TURN_MESSAGES, list[Entry])
    assert [e.content for e in cli.reply_entries(messages)] == [
        "Connecting you to billing.",
        "Billing here. What can I do for you?",
    ]
    only_calls = messages[:3]  # a turn that ran out of steps: no answer yet
    assert cli.reply_entries(only_calls) == []


def test_describe_event_ignores_noise() -> None:
    base = {"session": "s", "turn": "t"}
    assert cli.describe_event("delta", {**base, "text": "x"}) is None
    assert cli.describe_event("turn.started", {**base, "assistant": "a", "model": "m"}) is None
    assert cli.describe_event("step.done", {**base, "step": 1, "content": "answer", "tool_calls": []}) is None
    error_line = cli.describe_event("tool.result", {**base, "name": "clock", "is_error": True, "content": "x" * 500})
    assert error_line is not None and error_line.startswith("  <- clock [error]: ") and len(error_line) < 260
    assert (
        cli.describe_event("session.failed", {**base, "error": "crashed 6 times"})
        == "  [session failed] crashed 6 times"
    )


def test_no_command_means_run() -> None:
    assert cli.with_default_command([]) == ["run"]
    assert cli.with_default_command(["--model-swap", "restart-turn"]) == ["run", "--model-swap", "restart-turn"]
    assert cli.with_default_command(["--config=a.toml"]) == ["run", "--config=a.toml"]
    assert cli.with_default_command(["status", "--json"]) == ["status", "--json"]
    for top_level in (["--help"], ["-h"], ["--version"]):
        assert cli.with_default_command(top_level) == top_level


def test_help_shows_both_forms(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "agentd [flags of run]" in out and "agentd COMMAND [flags]" in out


def test_main_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--no-such-flag"]) == 2  # read as `agentd run --no-such-flag`
    assert cli.main(["frobnicate"]) == 2
    assert cli.main(["send"]) == 2  # TEXT is required
    assert cli.main(["run", "--log-format", "xml"]) == 2
    err = capsys.readouterr().err
    assert "agentd: argument --log-format" in err
