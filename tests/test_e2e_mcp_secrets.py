"""End to end through ``agentd run``: what MCP servers must not do to the daemon (RFC 0008 §3).

A server that echoes its credential, prints its token to stderr or floods stdout with what is not
JSON; a ``pass_env`` that names an MCP secret; a config whose MCP secrets cannot work. Each is
driven through the real daemon, its API and its log.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_harness import running_daemon, wait_until
from tests.mcp_servers import fault_server, stdio_fault_command, toml_list

pytestmark = pytest.mark.e2e

ONE_CHILD = "children = 1\nmax_children = 1\nspare_children = 0"


def config(servers: str, tools: list[str], *, supervisor: str = ONE_CHILD) -> str:
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


def stdio_server(name: str, command: list[str], extra: str = "") -> str:
    return f"""
[[mcp_servers]]
name = "{name}"
command = {toml_list(command)}
connect_timeout = "60s"
{extra}
"""


def ask(daemon: Any, session: str, text: str) -> dict[str, Any]:
    """Send ``text``, wait for the turn, return the one tool entry it added."""
    reply = daemon.send(session, text)
    assert reply["turn"]["status"] == "completed", reply
    [entry] = [e for e in daemon.entries(session, reply["turn"]["id"]) if e["role"] == "tool"]
    return entry  # type: ignore[no-any-return]


def everything_stored(daemon: Any) -> bytes:
    """Every byte of the state dir (the SQLite store with its WAL)."""
    return b"".join(path.read_bytes() for path in daemon.state_dir.iterdir() if path.is_file())


# --------------------------------------------------------------------------- item 4: scrubbed


def test_a_server_that_echoes_its_credential_has_it_scrubbed_from_results_api_logs_and_store(tmp_path: Path) -> None:
    """A 401 that quotes the ``headers_from`` value: the reason stays, the value is ``[redacted]``."""
    secret = "Bearer wrong-s3cret-4412-credential"
    with fault_server(tmp_path, require_auth="Bearer right", echo_auth=True) as server:
        servers = f'[[mcp_servers]]\nname = "faults"\nurl = "{server.url}"\n'
        servers += 'headers_from = { Authorization = "FAULTS_AUTH" }\n'
        with running_daemon(tmp_path, config(servers, ["faults:echo"]), env={"FAULTS_AUTH": secret}) as daemon:
            session = daemon.new_session()
            result = ask(daemon, session, 'call tool faults__echo {"text": "x"}')
            assert result["is_error"]
            failures = daemon.wait_log("mcp.connect_failed")
            api = daemon.api("GET", f"/v1/sessions/{session}").text
            daemon.stop()
            assert "s3cret" not in str(result["content"]) and "s3cret" not in api
            assert "s3cret" not in daemon.log_text()
            assert b"s3cret" not in everything_stored(daemon)
            # What the server said is kept, with the value replaced: the operator still sees why.
            assert "[redacted]" in json.dumps(failures[0])


def test_a_stdio_server_printing_its_token_to_stderr_is_relogged_without_it(tmp_path: Path) -> None:
    secret = "stdio-s3cret-9931-token"
    command = stdio_fault_command("--leak-env", "LEAKY_TOKEN")
    servers = stdio_server("leaky", command, 'env_from = ["LEAKY_TOKEN"]')
    with running_daemon(tmp_path, config(servers, ["leaky:echo"]), env={"LEAKY_TOKEN": secret}) as daemon:
        session = daemon.new_session()
        assert ask(daemon, session, 'call tool leaky__echo {"text": "hi"}')["content"] == "faults:hi"
        [line] = daemon.wait_log("child.stderr", lambda r: "LEAKY_TOKEN=" in str(r.get("line")))
        daemon.stop()
        assert line["line"] == "LEAKY_TOKEN=[redacted]"
        assert "s3cret" not in daemon.log_text()


# --------------------------------------------------------------------------- item 5: withheld


def test_pass_env_cannot_hand_an_mcp_secret_to_the_tools(tmp_path: Path) -> None:
    """``env_from`` names MCP_TOKEN and ``pass_env`` lists it too: the MCP server gets it, tools do not."""
    servers = stdio_server("faults", stdio_fault_command(), 'env_from = ["MCP_TOKEN"]')
    supervisor = f'{ONE_CHILD}\npass_env = ["AGENTD_TEST_*", "MCP_TOKEN", "TOOL_SETTING"]'
    text = config(servers, ["faults:echo", "tests.tooling:env_names"], supervisor=supervisor)
    env = {"MCP_TOKEN": "mcp-s3cret-5512-token", "TOOL_SETTING": "on"}
    with running_daemon(tmp_path, text, env=env) as daemon:
        session = daemon.new_session()
        assert ask(daemon, session, 'call tool faults__echo {"text": "up"}')["content"] == "faults:up"
        seen = set(str(ask(daemon, session, "call tool env_names")["content"]).split())
        assert "TOOL_SETTING" in seen  # pass_env works for everything else
        assert "MCP_TOKEN" not in seen


# --------------------------------------------------------------------------- item 7: rate-limited

NOISE = 3000


def test_a_stdio_server_flooding_stdout_with_non_json_is_rate_limited_with_a_dropped_count(tmp_path: Path) -> None:
    """Every line the SDK cannot parse is one log line in the child; the daemon logs a bounded
    number of them and says how many it dropped — and the server still works."""
    servers = stdio_server("noisy", stdio_fault_command("--noise", str(NOISE)))
    with running_daemon(tmp_path, config(servers, ["noisy:echo"])) as daemon:
        session = daemon.new_session()
        assert ask(daemon, session, 'call tool noisy__echo {"text": "hi"}')["content"] == "faults:hi"

        def parse_failures() -> tuple[int, int]:
            logged = [r for r in daemon.log_events("stdlib.log") if "JSONRPC" in str(r.get("message"))]
            dropped = sum(int(r["dropped"]) for r in daemon.log_events("log.dropped") if r.get("of") == "stdlib.log")
            return len(logged), dropped

        # Every failure is accounted for: logged, or counted in a log.dropped line.
        wait_until(lambda: sum(parse_failures()) >= NOISE, f"{NOISE} parse failures logged or counted")
        logged, dropped = parse_failures()
        assert logged + dropped == NOISE
        assert logged <= NOISE // 10 and dropped > 0


# --------------------------------------------------------------------------- item 10: errors that say what


def test_a_bad_header_name_is_an_error_at_its_field_path(tmp_path: Path) -> None:
    good = stdio_server("faults", stdio_fault_command())
    bad = (
        '[[mcp_servers]]\nname = "web"\nurl = "http://127.0.0.1:9/mcp"\nheaders_from = { "Bad Header" = "WEB_AUTH" }\n'
    )
    with running_daemon(tmp_path, config(good, ["faults:echo"]), env={"WEB_AUTH": "x"}) as daemon:
        daemon.write_config(config(good + bad, ["faults:echo"]))
        result = daemon.json("POST", "/v1/reload", {}, status=422)
        assert not result["applied"]
        [issue] = result["errors"]
        assert issue["path"] == "mcp_servers[1].headers_from" and "'Bad Header'" in issue["message"], issue


def test_an_mcp_secret_variable_that_is_not_set_is_an_error_at_start_and_at_reload(tmp_path: Path) -> None:
    """The daemon's environment cannot change after it started: a config naming a variable it does
    not have could never work until a restart, so start-up and reload refuse it, at its path."""
    good = stdio_server("faults", stdio_fault_command())
    unset = stdio_server("faults", stdio_fault_command(), 'env_from = ["SET_TOKEN", "NOT_SET_TOKEN"]')
    with running_daemon(tmp_path, config(good, ["faults:echo"]), env={"SET_TOKEN": "x"}) as daemon:
        daemon.write_config(config(unset, ["faults:echo"]))
        result = daemon.json("POST", "/v1/reload", {}, status=422)
        assert not result["applied"]
        [issue] = result["errors"]
        assert issue["path"] == "mcp_servers[0].env_from[1]" and "NOT_SET_TOKEN" in issue["message"], issue
        [logged] = daemon.log_events("config.reload")[-1:]
        assert logged["applied"] is False and "NOT_SET_TOKEN" in json.dumps(logged)
        # Start-up refuses the same file the same way (exit 2, the issue on stderr).
        started = daemon.run_cli("run", "--config", str(daemon.config_path), "--state-dir", str(tmp_path / "other"))
        assert started.returncode == 2, started
        assert "mcp_servers[0].env_from[1]" in started.stderr and "NOT_SET_TOKEN" in started.stderr
