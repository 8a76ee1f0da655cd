"""Nothing stuck, nothing half-applied — against the real ``agentd run`` subprocess.

- A reload is validated whole before anything changes (RFC 0003 §4): a number beyond the wire, an
  option a frame cannot carry, a tool that cannot be imported, an empty file are each refused,
  the generation stays, and children started afterwards still start. Start-up refuses exactly
  what ``agentd check-config`` refuses.
- One endpoint failing half of its attempts (503s, truncated and dropped streams): every turn
  completes; a truncated stream is retried, never the answer (RFC 0005 §4, panic mode).
- A store that cannot be opened is one line naming it, exit 1; a config path that is a FIFO hangs
  neither a reload nor the shutdown.
- The ``Bearer`` scheme is case-insensitive; a lone surrogate in a message gets a 400 saying so.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.daemon_harness import (
    TIMEOUT,
    Daemon,
    agentd_env,
    child_pids_of,
    free_port,
    passing_test_env,
    running_daemon,
    two_assistant_config,
    wait_until,
)
from tests.fakes import FakeOllama, RecordedRequest, Reply, drop_mid_stream, status, truncated

pytestmark = pytest.mark.e2e

BASE = """
[[assistants]]
name = "main"
first_message_mode = "assistant-waits-for-user"
tools = ["clock", "tests.tooling:record"]
"""


def run_agentd(tmp: Path, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """``python -m agentd ARGS`` to completion; a daemon that starts instead of failing is an error."""
    process = subprocess.Popen(
        [sys.executable, "-m", "agentd", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=agentd_env(tmp),
        cwd=tmp,
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=TIMEOUT)
        raise AssertionError(f"agentd {' '.join(args)} did not exit within {timeout:g}s: {err[-2000:]}") from None
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


# --------------------------------------------------------------------------- 1. a reload is validated whole


@pytest.mark.parametrize(
    ("text", "path", "words"),
    [
        (f"[limits]\nmax_steps = {2**64}\n" + BASE, "limits.max_steps", "<= 100000"),
        (f"[intelligence]\noptions = {{ seed = {2**64} }}\n" + BASE, "intelligence.options.seed", "64 bits"),
        (
            BASE + f"intelligence = {{ options = {{ a = [{{ b = {-(2**64)} }}] }} }}\n",
            "assistants[0].intelligence.options.a[0].b",
            "64 bits",
        ),
        (BASE.replace('"clock", ', '"clock", "no_such_module_q:fn", '), "assistants[0].tools", "no_such_module_q"),
        ("", "assistants", "no assistants"),
        ("# being rewritten\n", "assistants", "no assistants"),
    ],
    ids=["huge-max-steps", "huge-option", "huge-nested-option", "unimportable-tool", "empty", "only-comments"],
)
def test_a_reload_that_cannot_be_applied_whole_changes_nothing(
    tmp_path: Path, text: str, path: str, words: str
) -> None:
    with running_daemon(tmp_path, BASE) as daemon:
        session = daemon.new_session()
        assert daemon.send(session, "before")["turn"]["status"] == "completed"
        daemon.config_path.write_text(text)  # exactly this text: nothing added for the test tools
        result = daemon.json("POST", "/v1/reload", status=422)
        assert result["applied"] is False and result["generation"] == 1, result
        assert [e["path"] for e in result["errors"]] == [path], result
        assert words in result["errors"][0]["message"]
        assert daemon.status()["generation"] == 1
        # Children started from now on get the running generation: kill the pool's children and
        # a turn still runs on a fresh one (a half-applied generation made every spawn fail).
        assert daemon.process is not None
        wait_until(lambda: settled(daemon), "the pool to have no child starting")
        for pid in child_pids_of(daemon.process.pid):
            os.kill(pid, signal.SIGKILL)
        after = daemon.send(session, "after")
        assert after["turn"]["status"] == "completed", after["turn"]
        wait_until(lambda: settled(daemon), "the pool to have no child starting")
        assert daemon.status()["generation"] == 1
        assert not daemon.log_events("child.spawn_failed"), daemon.log_events("child.spawn_failed")


def settled(daemon: Any) -> bool:
    children = daemon.status()["children"]
    return bool(children) and all(c["state"] != "starting" and c["pid"] for c in children)


def test_start_up_refuses_what_check_config_refuses_with_the_same_errors(tmp_path: Path) -> None:
    config = tmp_path / "agentd.toml"
    config.write_text(
        BASE.replace('"clock", ', '"clock", "no_such_module_q:fn", ') + f"[limits]\nmax_tokens = {2**64}\n"
    )
    checked = run_agentd(tmp_path, "check-config", str(config), "--json")
    assert checked.returncode == 2, checked.stdout
    errors = [f"{e['path']}: {e['message']}" for e in json.loads(checked.stdout)["errors"]]
    assert len(errors) == 2 and any("no_such_module_q" in e for e in errors), errors
    started = run_agentd(tmp_path, "run", "--config", str(config), "--state-dir", str(tmp_path / "state"))
    assert started.returncode == 2, started.stderr
    assert started.stderr.splitlines() == [f"agentd: invalid config ({config}):", *[f"  {e}" for e in errors]]


def test_start_up_refuses_an_empty_config_file(tmp_path: Path) -> None:
    config = tmp_path / "agentd.toml"
    config.write_text("# to be written\n")
    started = run_agentd(tmp_path, "run", "--config", str(config), "--state-dir", str(tmp_path / "state"))
    assert started.returncode == 2, started.stderr
    assert "assistants: the config defines no assistants" in started.stderr


def test_start_up_refuses_a_config_edited_while_stopped_to_drop_an_assistant_sessions_are_on(
    tmp_path: Path,
) -> None:
    """The reload rule holds at start-up: removing an assistant that open sessions are on is refused
    (exit 2, naming it and the count); the old file starts again and the session is usable."""
    two = BASE + '\n[[assistants]]\nname = "billing"\nfirst_message_mode = "assistant-waits-for-user"\n'
    with running_daemon(tmp_path, two) as daemon:
        session = daemon.new_session("billing")
        assert daemon.send(session, "hi")["turn"]["status"] == "completed"
    (tmp_path / "agentd.toml").write_text(passing_test_env(BASE))
    started = run_agentd(
        tmp_path, "run", "--config", str(tmp_path / "agentd.toml"), "--state-dir", str(tmp_path / "state")
    )
    assert started.returncode == 2, started.stderr
    assert "assistant 'billing' was removed but 1 open session(s) are on it" in started.stderr
    assert "Traceback" not in started.stderr
    with running_daemon(tmp_path, two) as daemon:
        assert daemon.send(session, "again")["turn"]["status"] == "completed"


# --------------------------------------------------------------------------- 2. one endpoint failing half the time

# What the one endpoint does with each chat request, in order: S 503, T a truncated stream (it ends
# cleanly without done:true, after part of an answer), D a dropped stream, R a whole answer. Nine
# faults in sixteen, and a run of five at the start: three open the breaker, and its cooldown then
# doubles past the deadline (5 s, 10 s, 20 s) unless an open breaker still lets the only endpoint
# be probed.
PATTERN = "STDSTRTRDRSRRRTR"
FAULTS = {"S": status(503, "overloaded"), "T": truncated(after=2), "D": drop_mid_stream(after=2)}
OUTCOMES = {"S": "status", "T": "truncate", "D": "drop", "R": "reply"}
ANSWER = "the whole answer"


def half_failing() -> Any:
    served = itertools.count()

    def respond(request: RecordedRequest) -> Reply | Any:
        kind = PATTERN[next(served) % len(PATTERN)]
        return FAULTS.get(kind, Reply(content=ANSWER))

    return respond


def test_one_endpoint_failing_half_of_its_attempts_still_completes_every_turn(tmp_path: Path) -> None:
    with FakeOllama(default=half_failing()) as server:
        text = f"""
[intelligence]
provider = "ollama"
endpoints = ["{server.url}"]
model = "flaky:1b"

[limits]
deadline = "12s"

[[assistants]]
name = "main"
first_message_mode = "assistant-waits-for-user"
"""
        with running_daemon(tmp_path, text) as daemon:
            session = daemon.new_session()
            turns = [daemon.send(session, f"question {n}") for n in range(PATTERN.count("R"))]
            statuses = [t["turn"]["status"] for t in turns]
            assert statuses == ["completed"] * len(turns), [t["turn"] for t in turns]
            for result in turns:
                assert [m["content"] for m in result["messages"] if m["role"] == "assistant"] == [ANSWER]
            transcript = json.dumps(daemon.session(session)["transcript"])
            assert "partial answer" not in transcript  # what the truncated and dropped streams carried
        # The server's own log: every fault was followed by another attempt, and each turn's last
        # attempt was a whole answer — nothing given up on, nothing short taken for an answer.
        assert [r.outcome for r in server.chat_requests] == [OUTCOMES[kind] for kind in PATTERN]


# --------------------------------------------------------------------------- 3. the store and the config file


def damaged_stores(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """State dirs whose agentd.db is damaged in one way each, from a store a daemon wrote."""
    (tmp_path / "seed").mkdir()
    with running_daemon(tmp_path / "seed", BASE) as daemon:
        for n in range(40):
            daemon.send(daemon.new_session(), f"message {n} " + "x" * 200)
        state = daemon.state_dir
    pristine = (state / "agentd.db").read_bytes()
    assert len(pristine) > 8 * 4096 and not (state / "agentd.db-wal").exists()
    variants: dict[str, tuple[bytes | None, str]] = {
        "not-sqlite": (b"PK\x03\x04 a zip file, not a database" * 100, "file is not a database"),
        "truncated": (pristine[: len(pristine) // 2], "database disk image is malformed"),
        "corrupt-header": (b"SQLite format 9\x00" + pristine[16:], "file is not a database"),
        "empty-next-to-its-log": (
            b"",
            "the database file is empty (0 bytes) but agentd.db-wal (4096 bytes) is next to it: the store's data "
            "was lost or moved; restore the database file, or move agentd.db, agentd.db-wal and agentd.db-shm "
            "away to start an empty store",
        ),
        "a-directory": (None, "not a regular file (it is a directory)"),
    }
    dirs: dict[str, tuple[Path, str]] = {}
    for name, (data, reason) in variants.items():
        target = tmp_path / name
        target.mkdir()
        if data is None:
            (target / "agentd.db").mkdir()
        else:
            (target / "agentd.db").write_bytes(data)
        if name == "empty-next-to-its-log":
            (target / "agentd.db-wal").write_bytes(b"\x00" * 4096)  # what a crash leaves next to the database
        dirs[name] = (target, reason)
    return dirs


def test_a_store_that_cannot_be_opened_is_one_line_naming_it_and_exit_1(tmp_path: Path) -> None:
    for name, (state, reason) in damaged_stores(tmp_path).items():
        before = sorted(p.name for p in state.iterdir())
        result = run_agentd(tmp_path, "run", "--state-dir", str(state), "--log-format", "json")
        assert result.returncode == 1, (name, result.stderr)
        errors = [line for line in result.stderr.splitlines() if not line.startswith("{")]  # json log lines aside
        assert errors == [f"agentd: cannot open the store {state / 'agentd.db'}: {reason}"], (name, result.stderr)
        assert "Traceback" not in result.stderr
        assert sorted(p.name for p in state.iterdir() if p.name != "agentd.pid") == before, name  # nothing created


def test_a_fifo_as_the_config_file_hangs_neither_a_reload_nor_the_shutdown(tmp_path: Path) -> None:
    with running_daemon(tmp_path, BASE) as daemon:
        session = daemon.new_session()
        daemon.config_path.unlink()
        os.mkfifo(daemon.config_path)  # nobody ever writes to it
        assert daemon.client is not None
        started = time.monotonic()
        response = daemon.client.post("/v1/reload", timeout=20)
        assert response.status_code == 422, response.text
        assert time.monotonic() - started < 10
        [error] = response.json()["errors"]
        assert error["message"] == f"cannot read config file {daemon.config_path}: not a regular file (it is a FIFO)"
        daemon.reload_via_signal()  # SIGHUP takes the same path
        daemon.wait_log("config.reload", lambda r: r.get("applied") is False, count=2)
        assert daemon.send(session, "still here")["turn"]["status"] == "completed"
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit(timeout=20) == 0
    started_up = run_agentd(tmp_path, "run", "--config", str(daemon.config_path), "--state-dir", str(tmp_path / "s2"))
    assert started_up.returncode == 2
    assert f"cannot read config file {daemon.config_path}: not a regular file (it is a FIFO)" in started_up.stderr


# --------------------------------------------------------------------------- 4. small ones


def test_the_bearer_scheme_is_case_insensitive(tmp_path: Path) -> None:
    port = free_port()
    token = "t0ken-With-Case"
    with running_daemon(tmp_path, BASE, args=["--listen", f"127.0.0.1:{port}"], env={"AGENTD_API_TOKEN": token}):
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT) as tcp:

            def answered() -> httpx.Response | None:
                try:
                    return tcp.get("/v1/health", headers={"Authorization": f"Bearer {token}"})
                except httpx.TransportError:
                    return None

            assert wait_until(answered, "the TCP listener to answer").status_code == 200
            for header in (f"bearer {token}", f"BEARER {token}", f"bEaReR {token}", f"Bearer   {token}"):
                assert tcp.get("/v1/status", headers={"Authorization": header}).status_code == 200, header
            for header in (f"Bearer {token.lower()}", f"Basic {token}", f"Bearer{token}", token, "bearer"):
                assert tcp.get("/v1/status", headers={"Authorization": header}).status_code == 401, header


def test_a_lone_surrogate_in_a_message_gets_a_400_that_says_so(tmp_path: Path) -> None:
    with running_daemon(tmp_path, BASE) as daemon:
        session = daemon.new_session()
        assert daemon.client is not None
        for body in (b'{"content": "\\ud800"}', b'{"content": "ok \\udc00 then"}', b'{"content": "x\\ud83dy"}'):
            response = daemon.client.post(
                f"/v1/sessions/{session}/messages", content=body, headers={"Content-Type": "application/json"}
            )
            assert response.status_code == 400, response.text
            message = response.json()["error"]["message"]
            assert "lone UTF-16 surrogate" in message and "$.content" in message, message
        assert daemon.session(session)["turns"] == []  # nothing was stored
        paired = daemon.client.post(
            f"/v1/sessions/{session}/messages",
            content=b'{"content": "a pair \\ud83d\\ude00 is fine"}',
            headers={"Content-Type": "application/json"},
        )
        assert paired.status_code == 200 and paired.json()["turn"]["status"] == "completed"


ENV_CONFIG = """
[supervisor]
pass_env = ["AGENTD_TEST_*", "TOOL_SETTING"]

[[assistants]]
name = "main"
first_message_mode = "assistant-waits-for-user"
tools = ["tests.tooling:env_names"]
intelligence = {{ api_key_env = "{key}" }}
"""


def _names_seen_by_tool(daemon: Any, session: str) -> set[str]:
    turn = daemon.send(session, "call tool env_names")["turn"]
    result = next(e for e in daemon.entries(session, turn["id"]) if e["role"] == "tool")
    return set(result["content"].split())


def test_children_see_only_the_environment_they_need(tmp_path: Path) -> None:
    """A tool sees the base set, ``pass_env`` and the variables the config names; never the rest of
    the daemon's environment. A reload that names a new variable hands it to running children."""
    env = {
        "CLOUD_SECRET": "must-not-leak",
        "TOOL_SETTING": "on",
        "PROVIDER_KEY": "first-key",
        "LATER_KEY": "second-key",
        "LC_TIME": "C",
    }
    with running_daemon(tmp_path, ENV_CONFIG.format(key="PROVIDER_KEY"), env=env) as daemon:
        session = daemon.new_session()
        seen = _names_seen_by_tool(daemon, session)
        assert {"PATH", "PYTHONPATH", "LC_TIME", "TOOL_SETTING", "PROVIDER_KEY", "AGENTD_TEST_TOOL_LOG"} <= seen
        assert "CLOUD_SECRET" not in seen and "LATER_KEY" not in seen
        pid = daemon.session(session)["child"]
        daemon.write_config(ENV_CONFIG.format(key="LATER_KEY"))
        assert daemon.json("POST", "/v1/reload", {}, status=200)["generation"] == 2
        seen = _names_seen_by_tool(daemon, session)
        assert "LATER_KEY" in seen and "CLOUD_SECRET" not in seen
        assert daemon.session(session)["child"] == pid  # the same child: the reload handed it the name


def test_a_module_in_the_working_directory_cannot_shadow_one_in_children(tmp_path: Path) -> None:
    """Children run ``python -P``: a ``json.py`` where the daemon was started is never imported by
    them (it used to kill every child). The daemon runs as its console script, as installed."""
    (tmp_path / "json.py").write_text("raise SystemExit('a json.py from the working directory was imported')\n")
    daemon = Daemon(tmp_path, BASE)
    module_form = daemon.command()
    assert module_form[1:3] == ["-m", "agentd"]
    script = Path(sys.executable).with_name("agentd")
    daemon.command = lambda: [str(script), *module_form[3:]]  # type: ignore[method-assign]
    try:
        daemon.start()
        session = daemon.new_session()
        assert daemon.send(session, "call tool record")["turn"]["status"] == "completed"
        assert daemon.status()["children"], "no child is running"
        assert "json.py from the working directory" not in daemon.log_text()
    finally:
        daemon.stop()


def test_probes_answer_on_tcp_without_the_token_and_readiness_keeps_its_reasons_private(tmp_path: Path) -> None:
    """An orchestrator's HTTP probe cannot send a Secret: /v1/health and /v1/ready answer without
    the token; every other route still needs it, and readiness tells only an authorised caller why."""
    port = free_port()
    token = "probe-t0ken"
    hold = tmp_path / "hold"
    config = two_assistant_config(hold)
    with running_daemon(tmp_path, config, args=["--listen", f"127.0.0.1:{port}"], env={"AGENTD_API_TOKEN": token}) as d:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT) as tcp:

            def answered() -> httpx.Response | None:
                try:
                    return tcp.get("/v1/health")
                except httpx.TransportError:
                    return None

            assert wait_until(answered, "the TCP listener to answer").json() == {"status": "ok"}
            assert tcp.get("/v1/ready").json() == {"ready": True}
            assert tcp.get("/v1/status").status_code == 401
            assert tcp.post("/v1/ready").status_code == 401  # only GET is a probe
            # A turn held mid model call keeps the drain (and the listener) going while it is probed.
            d.send(d.new_session("held"), "hold this", wait=False)
            d.wait_log("session.loaded")
            d.signal(signal.SIGTERM)  # draining: not ready
            try:
                anonymous = wait_until(lambda: (r := tcp.get("/v1/ready")).status_code == 503 and r, "draining")
                assert anonymous.json() == {"ready": False}
                authorised = tcp.get("/v1/ready", headers={"Authorization": f"Bearer {token}"})
                assert authorised.status_code == 503 and "draining" in authorised.json()["reasons"]
            finally:
                hold.touch()
