"""End to end through ``agentd run``: human approval of tool calls (RFC 0010).

The scripted model calls every offered tool the user's text names; ``record`` (``tests.tooling``)
is side-effecting and appends a line to ``tools.log`` each time it runs, so a test counts its runs
exactly. Each case drives the daemon through its HTTP API and signals, as an operator would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.daemon_harness import Daemon, wait_until
from tests.mcp_servers import toml_list

pytestmark = pytest.mark.e2e

ONE_CHILD = "children = 1\nmax_children = 1\nspare_children = 0"


def config(tools: list[str], require: list[str], *, limits: str = "", top: str = "", model: str = "echo-small") -> str:
    return f"""
{top}
[intelligence]
provider = "scripted"
model = "{model}"

[supervisor]
{ONE_CHILD}

[limits]
{limits}

[[assistants]]
name = "main"
tools = {toml_list(tools)}
require_approval = {toml_list(require)}
"""


RECORD = ["tests.tooling:record", "clock"]


def runs(tmp: Path, prefix: str = "record") -> int:
    path = tmp / "tools.log"
    lines = path.read_text().splitlines() if path.exists() else []
    return sum(1 for line in lines if line.startswith(prefix))


def pending_approvals(daemon: Daemon, session: str | None = None) -> list[dict[str, Any]]:
    query = "?status=pending" + (f"&session={session}" if session else "")
    return list(daemon.json("GET", f"/v1/approvals{query}", status=200))


def wait_pending(daemon: Daemon, session: str, count: int = 1) -> list[dict[str, Any]]:
    return wait_until(
        lambda: (found := pending_approvals(daemon, session)) and len(found) >= count and found,
        f"{count} pending approval(s) of {session}",
    )


def decide(daemon: Daemon, approval: str, body: dict[str, Any], status: int = 200) -> Any:
    return daemon.json("POST", f"/v1/approvals/{approval}", body, status=status)


def tool_results(daemon: Daemon, session: str, turn: str) -> list[dict[str, Any]]:
    return [e for e in daemon.entries(session, turn) if e["role"] == "tool"]


def test_a_call_waits_for_approval_then_runs_once(tmp_path: Path) -> None:
    """Stored before announced; the session awaits approval and holds no slot; approve → runs once."""
    daemon = Daemon(tmp_path, config(RECORD, ["tests.tooling:record"])).start()
    try:
        session = daemon.new_session()
        stream = daemon.events(session)
        answer = daemon.send(session, "record please")
        turn = answer["turn"]["id"]
        assert answer["turn"]["status"] == "pending"
        [waiting] = answer["approvals"]
        assert waiting["tool"] == "record" and waiting["status"] == "pending"
        requested = stream.wait("approval.requested")
        assert requested["approval"] == waiting["id"] and requested["tool"] == "record"
        assert runs(tmp_path) == 0
        assert daemon.session(session)["state"] == "awaiting_approval"
        status = daemon.status()
        assert status["approvals"] == {"pending": 1}
        assert all(child["in_flight"] == 0 for child in status["children"])
        assert daemon.json("GET", f"/v1/approvals/{waiting['id']}", status=200)["status"] == "pending"
        metrics = daemon.api("GET", "/metrics").text
        assert "agentd_approvals_pending 1.0" in metrics
        # A new message is refused while the turn waits.
        refused = daemon.api("POST", f"/v1/sessions/{session}/messages", {"content": "hi"})
        assert refused.status_code == 409

        decided = decide(daemon, waiting["id"], {"decision": "approve", "reason": "ok"})
        assert decided["status"] == "approved"
        assert stream.wait("approval.decided")["status"] == "approved"
        assert daemon.turn(session, turn)["status"] == "completed"
        assert runs(tmp_path) == 1
        [result] = tool_results(daemon, session, turn)
        assert result["content"] == "recorded step 1" and not result.get("is_error")
        again = daemon.api("POST", f"/v1/approvals/{waiting['id']}", {"decision": "reject"})
        assert again.status_code == 409 and again.json()["error"]["code"] == "already_decided"
        assert daemon.status()["approvals"] == {"pending": 0}
        assert 'agentd_approvals_total{decision="approved"} 1.0' in daemon.api("GET", "/metrics").text
    finally:
        daemon.stop()
