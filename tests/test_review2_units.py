"""Hostile review (wave-review2): breaks shown below the daemon, where a real process adds nothing."""

from __future__ import annotations

import json

import pytest
import structlog

from agentd.supervisor.child import STDERR_LINES_PER_WINDOW, Child


@pytest.mark.xfail(
    strict=True,
    reason="review2: a library line's rate-limit kind includes its message text, so a server that makes "
    "the SDK log a different message each time (an HTTP MCP server's unknown SSE event names) is unlimited",
)
def test_library_lines_with_a_different_message_each_are_still_rate_limited() -> None:
    """``mcp.client.streamable_http`` logs ``Unknown SSE event: <name>`` at warning for each SSE
    event of a name it does not know — a name the server chooses. Keyed by its message, each line
    is a kind of its own with a budget of its own: a server sending events of fresh names floods
    the daemon's log (and grows the limiter's table) without limit."""
    child = Child("c1")
    flood = 10 * STDERR_LINES_PER_WINDOW
    with structlog.testing.capture_logs() as logged:
        for i in range(flood):
            child._stderr_line(
                json.dumps(
                    {
                        "event": "stdlib.log",
                        "level": "warning",
                        "logger": "mcp.client.streamable_http",
                        "message": f"Unknown SSE event: e{i}",
                    }
                )
            )
    relogged = [r for r in logged if r.get("event") == "stdlib.log"]
    assert len(relogged) <= 2 * STDERR_LINES_PER_WINDOW
