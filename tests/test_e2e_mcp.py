"""End to end through ``agentd run``: tools of real MCP servers (RFC 0008).

``mcp-server-time`` from PyPI over stdio (offline), and the SDK-built fault server over
streamable HTTP, started by the test on loopback. The scripted model calls a tool named in the
user's text (``call tool NAME {json}``); what the tool answered reaches the transcript.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from tests.daemon_harness import running_daemon
from tests.mcp_servers import TIME_COMMAND, FaultServer, fault_server, toml_list

pytestmark = pytest.mark.e2e


def config(servers: str, tools: list[str], *, supervisor: str = "") -> str:
    return f"""
[intelligence]
provider = "scripted"
model = "echo-small"

[supervisor]
{supervisor}

{servers}

[[assistants]]
name = "main"
tools = {toml_list(tools)}
"""


TIME_SERVER = f"""
[[mcp_servers]]
name = "time"
command = {toml_list(TIME_COMMAND)}
connect_timeout = "60s"
"""


def http_server(server: FaultServer, extra: str = "") -> str:
    return f"""
[[mcp_servers]]
name = "faults"
url = "{server.url}"
{extra}
"""


def tool_entries(entries: list[dict[str, object]]) -> list[dict[str, object]]:
    return [e for e in entries if e["role"] == "tool"]


def ask(daemon: object, session: str, text: str) -> list[dict[str, object]]:
    """Send ``text``, wait for the turn, return the tool entries it added."""
    reply = daemon.send(session, text)  # type: ignore[attr-defined]
    assert reply["turn"]["status"] == "completed", reply
    return tool_entries(daemon.entries(session, reply["turn"]["id"]))  # type: ignore[attr-defined]


def test_time_server_over_stdio_answers_into_the_transcript(tmp_path: Path) -> None:
    """The model calls get_current_time; one server process per child serves every session there."""
    one_child = "children = 1\nmax_children = 1\nspare_children = 0"
    with running_daemon(tmp_path, config(TIME_SERVER, ["clock", "time:*"], supervisor=one_child)) as daemon:
        first, second = daemon.new_session(), daemon.new_session()
        call = 'call tool time__get_current_time {"timezone": "UTC"}'
        for session in (first, second):
            [result] = ask(daemon, session, call)
            assert result["name"] == "time__get_current_time" and not result.get("is_error")
            answer = json.loads(str(result["content"]))
            assert answer["timezone"] == "UTC" and answer["datetime"].endswith("+00:00")
            assert not result.get("replayed")
        # One connection on the one child, shared by both sessions.
        connected = daemon.log_events("mcp.connected")
        assert len(connected) == 1 and connected[0]["server"] == "time"


def test_http_server_faults_are_error_results_and_the_turn_goes_on(tmp_path: Path) -> None:
    """Slow (call_timeout), isError, dies mid-call; then back at the same URL: calls work again."""
    with fault_server(tmp_path) as server:
        text = config(http_server(server, 'call_timeout = "1s"'), ["faults:*"])
        with running_daemon(tmp_path, text) as daemon:
            session = daemon.new_session()
            [echo] = ask(daemon, session, 'call tool faults__echo {"text": "hi"}')
            assert echo["content"] == "faults:hi" and not echo.get("is_error")
            [slow] = ask(daemon, session, 'call tool faults__slow {"seconds": 30}')
            assert slow["is_error"] and "call_timeout" in str(slow["content"])
            [failed] = ask(daemon, session, "call tool faults__fail")
            assert failed["is_error"] and "told to fail" in str(failed["content"])
            [died] = ask(daemon, session, "call tool faults__die")
            assert died["is_error"] and "faults" in str(died["content"])
            assert server.wait_dead() == 3
            [down] = ask(daemon, session, 'call tool faults__echo {"text": "anyone?"}')
            assert down["is_error"]
            server.start()
            for _ in range(200):  # reconnects with backoff (bounded: at most 30 s between attempts)
                [again] = ask(daemon, session, 'call tool faults__echo {"text": "back"}')
                if not again.get("is_error"):
                    break
            assert again["content"] == "faults:back"
            # The daemon and its children never crashed over any of it.
            assert not daemon.log_events("child.exit")


def test_a_cancelled_turn_cancels_its_mcp_call(tmp_path: Path) -> None:
    with (
        fault_server(tmp_path) as server,
        running_daemon(tmp_path, config(http_server(server), ["faults:*"])) as daemon,
    ):
        session = daemon.new_session()
        turn_id = daemon.send(session, 'call tool faults__slow {"seconds": 60}', wait=False)["turn_id"]
        server.wait_line("slow-start 60.0")
        daemon.json("POST", f"/v1/sessions/{session}/cancel", {}, status=202)
        assert daemon.turn(session, turn_id)["status"] == "cancelled"
        server.wait_line("slow-cancelled")


def test_secrets_come_from_the_environment_and_go_nowhere_else(tmp_path: Path) -> None:
    secret = "Bearer e2e-s3cret-token-7731"
    with fault_server(tmp_path, require_auth=secret) as server:
        text = config(http_server(server, 'headers_from = { Authorization = "FAULTS_AUTH" }'), ["faults:*"])
        with running_daemon(tmp_path, text, env={"FAULTS_AUTH": secret}) as daemon:
            session = daemon.new_session()
            [echo] = ask(daemon, session, 'call tool faults__echo {"text": "authorized"}')
            assert echo["content"] == "faults:authorized"
            api = daemon.api("GET", f"/v1/sessions/{session}").text + daemon.api("GET", "/v1/status").text
            daemon.stop()
            assert "s3cret" not in api
            assert "s3cret" not in daemon.log_text()
            stored = sqlite3.connect(daemon.state_dir / "agentd.db").execute("SELECT message FROM entries").fetchall()
            assert stored and not any("s3cret" in row[0] for row in stored)
            for path in daemon.state_dir.iterdir():
                assert b"s3cret" not in path.read_bytes(), path


def test_a_wrong_credential_is_an_error_result(tmp_path: Path) -> None:
    with fault_server(tmp_path, require_auth="Bearer right") as server:
        text = config(http_server(server, 'headers_from = { Authorization = "FAULTS_AUTH" }'), ["faults:echo"])
        with running_daemon(tmp_path, text, env={"FAULTS_AUTH": "Bearer wrong"}) as daemon:
            session = daemon.new_session()
            [echo] = ask(daemon, session, 'call tool faults__echo {"text": "x"}')
            assert echo["is_error"] and "unavailable" in str(echo["content"])


def test_a_reload_that_changes_a_server_applies_from_the_next_turn(tmp_path: Path) -> None:
    with fault_server(tmp_path, tag="A") as a, fault_server(tmp_path, tag="B") as b:
        with running_daemon(tmp_path, config(http_server(a), ["faults:echo"])) as daemon:
            session = daemon.new_session()
            [first] = ask(daemon, session, 'call tool faults__echo {"text": "one"}')
            assert first["content"] == "A:one"
            daemon.config_path.write_text(config(http_server(b), ["faults:echo"]))
            result = daemon.json("POST", "/v1/reload", {}, status=200)
            assert result["applied"], result
            [second] = ask(daemon, session, 'call tool faults__echo {"text": "two"}')
            assert second["content"] == "B:two"


def test_check_config_connect_lists_tools_and_names_a_bad_server(tmp_path: Path) -> None:
    bad = '\n[[mcp_servers]]\nname = "broken"\ncommand = ["false"]\nconnect_timeout = "20s"\n'
    path = tmp_path / "agentd.toml"
    path.write_text(config(TIME_SERVER + bad, ["time:get_current_time", "time:nope", "broken:*"]))
    from tests.daemon_harness import Daemon

    daemon = Daemon(tmp_path)
    checked = daemon.run_cli("check-config", str(path), "--connect", "--json", timeout=120)
    assert checked.returncode == 2, checked
    report = json.loads(checked.stdout)
    servers = {s["name"]: s for s in report["mcp_servers"]}
    assert "get_current_time" in servers["time"]["tools"] and servers["time"]["error"] is None
    assert servers["broken"]["error"]
    paths = {issue["path"] for issue in report["errors"]}
    assert "mcp_servers[1]" in paths and "assistants[0].tools[1]" in paths
    path.write_text(config(TIME_SERVER, ["time:get_current_time"]))
    ok = daemon.run_cli("check-config", str(path), "--connect", timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "get_current_time" in ok.stdout


def test_a_side_effecting_mcp_call_cut_off_by_a_child_kill_is_not_run_again(tmp_path: Path) -> None:
    """The journal's rule holds for MCP tools too: ``hold`` has no readOnlyHint, so it is journaled."""
    import os
    import signal

    from tests.daemon_harness import child_pids_of

    one_child = "children = 1\nmax_children = 1\nspare_children = 0"
    with fault_server(tmp_path) as server:
        with running_daemon(tmp_path, config(http_server(server), ["faults:*"], supervisor=one_child)) as daemon:
            session = daemon.new_session()
            turn_id = daemon.send(session, 'call tool faults__hold {"seconds": 2}', wait=False)["turn_id"]
            server.wait_line("hold-start 2.0")
            assert daemon.process is not None
            [pid] = child_pids_of(daemon.process.pid)
            os.kill(pid, signal.SIGKILL)
            assert daemon.turn(session, turn_id)["status"] == "completed"
            [entry] = tool_entries(daemon.entries(session, turn_id))
            assert entry["outcome_unknown"] is True
            assert sum(line.startswith("hold-start") for line in server.lines()) == 1  # run once, never again
