"""Regressions from a hostile review, through the real daemon: a tool whose import exits the
process, provider options of the wrong type, SIGTERM during a slow reload, unexpected route errors,
a SIGHUP at launch, and the bounds of the supervisor's timers."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.daemon_harness import REPO, Daemon, pid_alive, running_daemon, wait_until

pytestmark = pytest.mark.e2e

BASE = """
[intelligence]
provider = "scripted"
model = "echo-small"

[[assistants]]
name = "main"
first_message_mode = "assistant-waits-for-user"
"""


def tool_dir(tmp: Path, **modules: str) -> dict[str, str]:
    """Modules written to ``tmp/mods``; the env that puts them on the daemon's (and children's) path."""
    mods = tmp / "mods"
    mods.mkdir(exist_ok=True)
    for name, text in modules.items():
        (mods / f"{name}.py").write_text(text)
    return {"PYTHONPATH": f"{REPO}:{mods}"}


@pytest.mark.parametrize("exit_call", ["import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n"])
def test_a_tool_whose_import_exits_0_is_refused_by_check_config_start_up_and_reload(
    tmp_path: Path, exit_call: str
) -> None:
    env = tool_dir(tmp_path, sysexitmod=exit_call)
    bad = BASE + 'tools = ["sysexitmod:f"]\n'
    daemon = Daemon(tmp_path, bad, env=env)
    checked = daemon.run_cli("check-config", str(daemon.config_path), "--json")
    assert checked.returncode == 2, checked.stdout + checked.stderr
    report = json.loads(checked.stdout)
    assert report["valid"] is False
    assert report["errors"][0]["path"] == "assistants[0].tools"
    assert "sysexitmod" in report["errors"][0]["message"]
    # Start-up refuses it (exit 2), before any child could die importing it.
    started = subprocess.run(daemon.command(), env=daemon.env, cwd=tmp_path, capture_output=True, timeout=60)
    assert started.returncode == 2, started.stderr
    # A reload to it is rejected; the running config keeps serving.
    daemon.write_config(BASE)
    with running_daemon(tmp_path, BASE, env=env) as running:
        running.write_config(bad)
        result = running.json("POST", "/v1/reload", status=422)
        assert result["applied"] is False and result["errors"][0]["path"] == "assistants[0].tools"
        session = running.new_session()
        assert running.send(session, "hello")["turn"]["status"] == "completed"


def test_provider_options_of_the_wrong_type_are_refused_with_their_field_path(tmp_path: Path) -> None:
    bad = BASE.replace('model = "echo-small"', 'model = "echo-small"\noptions = { delay_ms = "abc" }')
    daemon = Daemon(tmp_path, bad)
    started = subprocess.run(daemon.command(), env=daemon.env, cwd=tmp_path, capture_output=True, timeout=60)
    assert started.returncode == 2, started.stderr
    assert b"intelligence.options.delay_ms" in started.stderr
    with running_daemon(tmp_path, BASE) as running:
        running.write_config(
            BASE
            + "intelligence = { options = { steps = 1.5 } }\n"
            + '[[assistants]]\nname = "http"\nintelligence = { provider = "ollama", endpoints = ["http://127.0.0.1:9"],'
            + ' options = { read_timeout = "soon", temperature = 0.2 } }\n'
        )
        result = running.json("POST", "/v1/reload", status=422)
        assert [e["path"] for e in result["errors"]] == [
            "assistants[0].intelligence.options.steps",
            "assistants[1].intelligence.options.read_timeout",
        ], result
        session = running.new_session()
        assert running.send(session, "hello")["turn"]["status"] == "completed"


SLOW_IMPORT = """
import os, sys, time
_MAIN = getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", "") or ""
if _MAIN == "agentd.validate":
    with open(os.environ["SLOW_MARK"], "w") as mark:
        mark.write(str(os.getpid()))
    time.sleep(25)
def f() -> str:
    return "ok"
"""


@pytest.mark.parametrize("sigterms", [1, 2])
def test_sigterm_during_a_slow_reload_exits_at_once_and_kills_the_tool_check(tmp_path: Path, sigterms: int) -> None:
    mark = tmp_path / "check.pid"
    env = {**tool_dir(tmp_path, slowmod=SLOW_IMPORT), "SLOW_MARK": str(mark)}
    supervisor = '[supervisor]\nspawn_timeout = "60s"\npass_env = ["SLOW_MARK", "AGENTD_TEST_*"]\n'
    with running_daemon(tmp_path, BASE + supervisor, env=env) as daemon:
        daemon.write_config(BASE + 'tools = ["slowmod:f"]\n' + supervisor)
        daemon.signal(signal.SIGHUP)
        wait_until(lambda: mark.exists() and mark.read_text(), "the reload's tool check to import slowmod")
        check_pid = int(mark.read_text())
        started = time.monotonic()
        for _ in range(sigterms):
            daemon.signal(signal.SIGTERM)
        code = daemon.wait_exit(timeout=20)
        assert time.monotonic() - started < 8, "the exit waited for the tool check"
        assert code in ((0,) if sigterms == 1 else (0, 1))  # a second may find the drain already done
        wait_until(lambda: not pid_alive(check_pid), "the tool check to be killed", timeout=5)


FAULTY_STATUS = """
import os
if os.environ.get("FAULT_STATUS"):
    import agentd.supervisor.core as core

    async def status(self):
        raise RuntimeError("injected\\nfault")

    core.Supervisor.status = status
"""


def test_an_unexpected_error_in_a_route_is_a_json_500_and_one_log_line(tmp_path: Path) -> None:
    # A sitecustomize on the daemon's path breaks GET /v1/status (FAULT_STATUS: the daemon only).
    env = {**tool_dir(tmp_path, sitecustomize=FAULTY_STATUS), "FAULT_STATUS": "1"}
    with running_daemon(tmp_path, BASE, env=env) as daemon:
        limit = daemon.api("GET", "/v1/sessions?limit=\u00b2")
        assert limit.status_code == 400 and limit.json()["error"]["code"] == "bad_limit", limit.text
        assert "limit" in limit.json()["error"]["message"]
        broken = daemon.api("GET", "/v1/status")
        assert broken.status_code == 500, broken.text
        assert broken.json()["error"]["code"] == "internal"
        assert "RuntimeError" in broken.json()["error"]["message"]
        (line,) = daemon.wait_log("api.internal_error")
        assert line["error_type"] == "RuntimeError" and line["error"] == "injected fault"
        assert line["path"] == "/v1/status" and line["level"] == "error"
        assert daemon.api("GET", "/v1/health").status_code == 200
    lines = [line for line in daemon.log_text().splitlines() if line.strip()]
    not_json = [line for line in lines if not line.startswith("{")]
    assert not not_json, not_json[:5]
    assert "Traceback" not in daemon.log_text()


SLOW_CLI_IMPORT = """
import os, sys, time
if os.environ.get("DELAY_CLI_IMPORT"):
    class _Slow:
        def find_spec(self, name, path=None, target=None):
            if name == "agentd.cli":
                time.sleep(1.5)
            return None
    sys.meta_path.insert(0, _Slow())
"""


def catches_sighup(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGHUP - 1)))
    return False


def test_a_sighup_right_after_launch_is_a_reload_not_a_kill(tmp_path: Path) -> None:
    # The CLI's import is made slow (sitecustomize, DELAY_CLI_IMPORT: the daemon only), so the
    # SIGHUP surely lands while it is imported, well before the daemon's own handlers exist.
    env = {**tool_dir(tmp_path, sitecustomize=SLOW_CLI_IMPORT), "DELAY_CLI_IMPORT": "1"}
    daemon = Daemon(tmp_path, BASE, env=env)
    daemon._log = open(daemon.log_path, "wb")  # noqa: SIM115 - closed in stop()
    daemon.process = subprocess.Popen(
        daemon.command(), stdout=daemon._log, stderr=subprocess.STDOUT, env=daemon.env, cwd=tmp_path
    )
    try:
        pid = daemon.process.pid
        wait_until(lambda: catches_sighup(pid), "the entry point's SIGHUP handler", timeout=1.0, interval=0.001)
        daemon.signal(signal.SIGHUP)
        daemon.start_client()
        daemon.wait_log("supervisor.signal", lambda r: r.get("action") == "reload")
        daemon.wait_log("config.reload")
        assert daemon.status()["generation"] == 1
    finally:
        code = daemon.stop()
    assert code == 0, daemon.log_text()[-2000:]


@pytest.mark.parametrize("key", ["ping_interval", "ping_timeout", "spawn_timeout"])
def test_supervisor_timers_below_10ms_are_refused(tmp_path: Path, key: str) -> None:
    daemon = Daemon(tmp_path, BASE + f'[supervisor]\n{key} = "0.000001ms"\n')
    started = subprocess.run(daemon.command(), env=daemon.env, cwd=tmp_path, capture_output=True, timeout=60)
    assert started.returncode == 2, started.stderr
    assert f"supervisor.{key}: must be at least 10ms".encode() in started.stderr, started.stderr


def test_the_413_of_post_sessions_names_its_real_limit(tmp_path: Path) -> None:
    with running_daemon(tmp_path, BASE) as daemon:
        assert daemon.client is not None
        big = daemon.client.post("/v1/sessions", content=b" " * ((1 << 20) + 1))
        assert big.status_code == 413, big.text
        message = big.json()["error"]["message"]
        assert "1048576 bytes" in message and "1 MiB, the fixed limit of this route" in message
        session = daemon.new_session()
        huge = daemon.client.post(f"/v1/sessions/{session}/messages", content=b" " * (5 << 20))
        assert huge.status_code == 413 and huge.json()["error"]["message"].endswith("([server] max_message_bytes)")
