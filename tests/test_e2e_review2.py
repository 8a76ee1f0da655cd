"""Hostile review (wave-review2) of the listener, secret-scrubbing and MCP log-flood fixes: each
test here is a break found, through the real daemon where possible; xfail(strict) until fixed."""

from __future__ import annotations

from pathlib import Path

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
