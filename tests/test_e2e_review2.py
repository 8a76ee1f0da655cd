"""Hostile review (wave-review2) of the listener, secret-scrubbing and MCP log-flood fixes: each
test here is a break found, through the real daemon where possible; xfail(strict) until fixed."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.daemon_harness import running_daemon, wait_until
from tests.mcp_servers import stdio_fault_command
from tests.test_e2e_mcp_secrets import ask, config, stdio_server

pytestmark = pytest.mark.e2e

FORGED = 3000


@pytest.mark.xfail(
    strict=True,
    reason="review2: a stdio MCP server's stderr is the child's stderr; its JSON lines with an 'event' "
    "are re-emitted as agentd's own events (level as given), never rate-limited",
)
def test_json_lines_an_mcp_server_writes_to_stderr_are_neither_agentds_own_nor_unlimited(tmp_path: Path) -> None:
    """A stdio MCP server shares the child's stderr. One that logs structlog-style JSON (any Python
    server using structlog does) has every line re-emitted by the supervisor as one of agentd's own
    events — its ``event`` and ``level`` taken as given, and never rate-limited: a flood of them is
    a flood of the daemon's log, and a server can forge any agentd event line."""
    servers = stdio_server("chatty", stdio_fault_command("--stderr-events", str(FORGED)))
    with running_daemon(tmp_path, config(servers, ["chatty:echo"])) as daemon:
        session = daemon.new_session()
        assert ask(daemon, session, 'call tool chatty__echo {"text": "hi"}')["content"] == "faults:hi"

        def accounted() -> int:
            forged = len(daemon.log_events("forged.by.mcp"))
            raw = [r for r in daemon.log_events("child.stderr") if "forged.by.mcp" in str(r.get("line"))]
            dropped = sum(int(r["dropped"]) for r in daemon.log_events("log.dropped"))
            return forged + len(raw) + dropped

        wait_until(lambda: accounted() >= FORGED, f"{FORGED} server lines logged or counted")
        # No line of the server's passes as an agentd event of its own choosing...
        assert daemon.log_events("forged.by.mcp") == []
        # ...and the flood is bounded like every other line a child's stderr carries.
        relogged = [r for r in daemon.log_events("child.stderr") if "forged.by.mcp" in str(r.get("line"))]
        assert len(relogged) <= FORGED // 10


KEY_CONFIG = """
[supervisor]
pass_env = ["AGENTD_TEST_*"]

[[assistants]]
name = "main"
first_message_mode = "assistant-waits-for-user"
tools = ["tests.review2_tools:leak_encoded", "tests.review2_tools:ancestor_environ"]
intelligence = {{ api_key_env = "REVIEW2_KEY" }}
"""

#: A provider key as they come: base64 with '/', '+' and '=' — and a '"' a JSON encoder escapes.
KEY = 'sk-r2/Ab+cD"eF=='


def test_a_secret_percent_encoded_or_json_escaped_in_a_tool_result_is_scrubbed(tmp_path: Path) -> None:
    """Secrets are scrubbed only verbatim: the same key in a URL (an HTTP client's error names the
    URL it called) or in JSON (a server echoing the key) reaches the store and the API as is."""
    with running_daemon(tmp_path, KEY_CONFIG.format(), env={"REVIEW2_KEY": KEY}) as daemon:
        session = daemon.new_session()
        turn = daemon.send(session, "call tool leak_encoded")["turn"]
        [result] = [e for e in daemon.entries(session, turn["id"]) if e["role"] == "tool"]
        content = str(result["content"])
        assert "[redacted]" in content
        assert "sk-r2" not in content, content


@pytest.mark.xfail(
    strict=True,
    reason="review2: the supervisor's /proc/PID/environ is readable by its children (same user); the "
    "child cannot scrub a token it does not know, and the supervisor does not scrub what children send",
)
def test_a_tool_cannot_read_the_api_token_from_the_supervisors_proc_environ(tmp_path: Path) -> None:
    """The token is withheld from children's environment, but the supervisor runs as the same user:
    a tool reads ``/proc/<supervisor>/environ`` and the token is in its result, unscrubbed (the
    child does not know the value, so it cannot scrub it) — in the store and the API."""
    token = "r2-api-token-7731-secret"
    env = {"REVIEW2_KEY": KEY, "AGENTD_API_TOKEN": token}
    with running_daemon(tmp_path, KEY_CONFIG.format(), env=env) as daemon:
        session = daemon.new_session()
        turn = daemon.send(session, "call tool ancestor_environ")["turn"]
        [result] = [e for e in daemon.entries(session, turn["id"]) if e["role"] == "tool"]
        assert token not in str(result["content"]), result["content"]


def test_a_client_that_never_reads_its_answers_is_closed_and_cannot_pin_a_slot(tmp_path: Path) -> None:
    """Pipelined ``GET /v1/health`` (no token needed), never read: once the socket buffers fill,
    uvicorn's send waits for a drain that never comes, so the app never returns and the header
    timer is never armed again. With ``max_connections`` such clients the TCP API is gone."""
    import contextlib
    import socket
    import threading

    from tests.test_e2e_listener import health_request, listening, started

    daemon, port = listening(tmp_path, 'max_connections = 2\nheader_timeout = "0.5s"')
    with started(daemon):
        hogs = []
        for _ in range(2):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            sock.settimeout(0.5)
            hogs.append(sock)

        def flood(sock: socket.socket) -> None:  # until the daemon stops reading, or cuts it off
            burst = health_request(close=False) * 2000
            with contextlib.suppress(OSError):
                for _ in range(200):  # ~15 MB of requests at most; stops once the daemon stops reading
                    sock.sendall(burst)

        threads = [threading.Thread(target=flood, args=(s,), daemon=True) for s in hogs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        # The daemon must not keep a connection whose client reads nothing for ever: a new client
        # gets its answer.
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=20) as tcp:
            assert tcp.get("/v1/health").status_code == 200
        for sock in hogs:
            sock.close()


def test_an_mcp_env_setting_that_is_no_secret_leaves_log_levels_alone(tmp_path: Path) -> None:
    """``env = { LOG_LEVEL = "warning" }`` is how a stdio server is configured, yet every inline
    ``env`` value of 6+ characters is scrubbed as a secret: each ``"level": "warning"`` of the
    daemon's log read ``"[redacted]"`` (what log pipelines filter on) until a restart — a rejected
    reload's values count too. The fields structlog adds itself (level, timestamp) are never a
    secret's and are not scrubbed."""
    servers = stdio_server("faults", stdio_fault_command(), 'env = { LOG_LEVEL = "warning" }')
    with running_daemon(tmp_path, config(servers, ["faults:echo"])) as daemon:
        daemon.write_config(config(servers, ["faults:echo"]) + "\n[nonsense]\n")
        daemon.json("POST", "/v1/reload", {}, status=422)
        [rejected] = [r for r in daemon.log_events("config.reload") if r.get("applied") is False]
        assert rejected["level"] == "warning", rejected


@pytest.mark.xfail(
    strict=True,
    reason="review2: every MCP 'env' value of 6+ characters is scrubbed as a secret (settings like "
    "LOG_LEVEL='warning' too): tool results lose the word",
)
def test_an_mcp_env_setting_that_is_no_secret_does_not_garble_tool_results(tmp_path: Path) -> None:
    """A tool result saying "warning" loses the word when an MCP server is configured with
    ``env = { LOG_LEVEL = "warning" }``: inline ``env`` values are not all secrets (``env_from`` is
    where secrets go); scrubbing them all garbles what the model reads."""
    servers = stdio_server("faults", stdio_fault_command(), 'env = { LOG_LEVEL = "warning" }')
    with running_daemon(tmp_path, config(servers, ["faults:echo"])) as daemon:
        session = daemon.new_session()
        result = ask(daemon, session, 'call tool faults__echo {"text": "warning: disk almost full"}')
        assert result["content"] == "faults:warning: disk almost full"


PEM = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\nBKcwggSjAgEAAoIBAQC7r2pemkey9xQ\n-----END PRIVATE KEY-----"


def test_a_multi_line_secret_printed_to_stderr_is_scrubbed_line_by_line(tmp_path: Path) -> None:
    """A PEM key (or a JSON service-account credential) in ``env_from`` is a multi-line value. A
    server that prints it to stderr has it re-logged a line at a time: no line is the whole value,
    so none was scrubbed and the key reached the log in pieces."""
    command = stdio_fault_command("--leak-env", "LEAKY_TOKEN")
    servers = stdio_server("leaky", command, 'env_from = ["LEAKY_TOKEN"]')
    with running_daemon(tmp_path, config(servers, ["leaky:echo"]), env={"LEAKY_TOKEN": PEM}) as daemon:
        session = daemon.new_session()
        assert ask(daemon, session, 'call tool leaky__echo {"text": "hi"}')["content"] == "faults:hi"
        daemon.wait_log("child.stderr", lambda r: "LEAKY_TOKEN=" in str(r.get("line")))
        daemon.stop()
        text = daemon.log_text()
        assert "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC" not in text
        assert "BKcwggSjAgEAAoIBAQC7r2pemkey9xQ" not in text


def test_a_secret_astride_the_cut_of_an_overlong_stderr_line_is_scrubbed(tmp_path: Path) -> None:
    """A stderr line over ``MAX_STDERR_LINE`` is passed on in pieces, cut before it is scrubbed: a
    secret across the cut is in neither piece whole, and the next piece (logged from its start)
    carried the secret's tail — all but its first characters."""
    from agentd.supervisor.launcher import MAX_STDERR_LINE

    secret = "astride-s3cret-0042-tail-that-leaks"
    pad = MAX_STDERR_LINE - len("LEAKY_TOKEN=") - 4  # the cut falls 4 characters into the secret
    command = stdio_fault_command("--leak-env", "LEAKY_TOKEN", "--leak-pad", str(pad))
    servers = stdio_server("leaky", command, 'env_from = ["LEAKY_TOKEN"]')
    with running_daemon(tmp_path, config(servers, ["leaky:echo"]), env={"LEAKY_TOKEN": secret}) as daemon:
        session = daemon.new_session()
        assert ask(daemon, session, 'call tool leaky__echo {"text": "hi"}')["content"] == "faults:hi"
        daemon.stop()
        assert "s3cret-0042" not in daemon.log_text()
