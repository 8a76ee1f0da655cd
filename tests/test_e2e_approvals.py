"""End to end through ``agentd run``: human approval of tool calls (RFC 0012).

The scripted model calls every offered tool the user's text names; ``record`` (``tests.tooling``)
is side-effecting and appends a line to ``tools.log`` each time it runs, so a test counts its runs
exactly. Each case drives the daemon through its HTTP API and signals, as an operator would.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_harness import Daemon, child_pids_of, wait_until
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


def test_rejected_and_edited_and_several_calls_in_one_step(tmp_path: Path) -> None:
    """Two calls in one step each get an approval; the turn goes on once both are decided: one
    approved with edited arguments (checked against the tool's schema), one rejected."""
    daemon = Daemon(tmp_path, config(RECORD, ["tests.tooling:record"])).start()
    try:
        session = daemon.new_session()
        text = 'call tool record {"label": "a"} and call tool record {"label": "b"}'
        answer = daemon.send(session, text)
        turn = answer["turn"]["id"]
        first, second = answer["approvals"]
        assert (first["arguments"], second["arguments"]) == ({"label": "a"}, {"label": "b"})
        bad = daemon.api("POST", f"/v1/approvals/{first['id']}", {"decision": "approve", "arguments": {"label": 5}})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "bad_arguments"
        assert daemon.api("POST", "/v1/approvals/ap_nope", {"decision": "approve"}).status_code == 404
        decide(daemon, first["id"], {"decision": "approve", "arguments": {"label": "edited"}})
        assert daemon.session(session)["state"] == "awaiting_approval"  # the second still waits
        decide(daemon, second["id"], {"decision": "reject", "reason": "not b"})
        assert daemon.turn(session, turn)["status"] == "completed"
        assert runs(tmp_path, "record edited") == 1 and runs(tmp_path) == 1
        ok, rejected = tool_results(daemon, session, turn)
        assert ok["content"] == "recorded edited"
        assert rejected["is_error"] and "rejected" in rejected["content"] and "not b" in rejected["content"]
        [call_entry] = [e for e in daemon.entries(session, turn) if e["role"] == "assistant" and e.get("tool_calls")]
        assert [c["arguments"] for c in call_entry["tool_calls"]] == [{"label": "edited"}, {"label": "b"}]
        listed = daemon.json("GET", f"/v1/approvals?session={session}&limit=1", status=200)
        assert [a["id"] for a in listed] == [first["id"]]
        after = daemon.json("GET", f"/v1/approvals?session={session}&after={first['id']}", status=200)
        assert [(a["id"], a["status"]) for a in after] == [(second["id"], "rejected")]
        assert daemon.api("GET", "/v1/approvals?status=bogus").status_code == 400
    finally:
        daemon.stop()


def test_the_calls_before_the_wait_count_in_the_turns_spend_by_model(tmp_path: Path) -> None:
    """A turn that parked for approval and went on: its by_model (and so its cost) counts the model
    call made before the wait, not only those after it (RFC 0011 §1)."""
    daemon = Daemon(tmp_path, config(RECORD, ["tests.tooling:record"])).start()
    try:
        session = daemon.new_session()
        answer = daemon.send(session, "record please")
        [waiting] = answer["approvals"]
        decide(daemon, waiting["id"], {"decision": "approve"})
        turn = daemon.turn(session, answer["turn"]["id"])
        assert turn["status"] == "completed" and turn["usage"]["requests"] == 2
        [part] = daemon.session(session)["usage"]["by_model"]
        counts = ("input_tokens", "output_tokens", "requests")
        assert [part[k] for k in counts] == [turn["usage"][k] for k in counts]
    finally:
        daemon.stop()


def test_an_approval_expires_and_the_model_is_told(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, config(RECORD, ["*"], limits='approval_timeout = "1s"')).start()
    try:
        session = daemon.new_session()
        answer = daemon.send(session, "record please")
        turn = answer["turn"]["id"]
        assert daemon.turn(session, turn)["status"] == "completed"
        [result] = tool_results(daemon, session, turn)
        assert result["is_error"] and "expired" in result["content"]
        assert runs(tmp_path) == 0
        [approval] = daemon.json("GET", f"/v1/approvals?session={session}", status=200)
        assert approval["status"] == "expired" and approval["reason"]
    finally:
        daemon.stop()


def test_clock_is_side_effect_free_so_star_does_not_ask(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, config(RECORD, ["*"])).start()
    try:
        session = daemon.new_session()
        answer = daemon.send(session, "clock please")
        assert answer["turn"]["status"] == "completed" and "approvals" not in answer
    finally:
        daemon.stop()


@pytest.mark.parametrize("how", ["cancel", "close"])
def test_cancel_or_close_cancels_pending_approvals(tmp_path: Path, how: str) -> None:
    daemon = Daemon(tmp_path, config(RECORD, ["tests.tooling:record"])).start()
    try:
        session = daemon.new_session()
        stream = daemon.events(session)
        answer = daemon.send(session, "record please")
        turn, [approval] = answer["turn"]["id"], answer["approvals"]
        if how == "cancel":
            assert daemon.json("POST", f"/v1/sessions/{session}/cancel", status=202)["turn_id"] == turn
            decided = stream.wait("approval.decided")
            assert decided["status"] == "cancelled"
        else:
            daemon.json("DELETE", f"/v1/sessions/{session}", status=200)
        assert daemon.turn(session, turn)["status"] == "cancelled"
        stored = daemon.json("GET", f"/v1/approvals/{approval['id']}", status=200)
        assert stored["status"] == "cancelled" and stored["reason"]
        late = daemon.api("POST", f"/v1/approvals/{approval['id']}", {"decision": "approve"})
        assert late.status_code == 409
        assert runs(tmp_path) == 0
    finally:
        daemon.stop()


def kill_supervisor(daemon: Daemon) -> None:
    """SIGKILL the supervisor; its children die with it."""
    assert daemon.process is not None
    pids = child_pids_of(daemon.process.pid)
    daemon.process.kill()
    daemon.wait_exit()
    daemon.stop()
    wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in pids), "the children to die with it")


def test_kill_9_of_the_supervisor_while_pending_and_right_after_approve(tmp_path: Path) -> None:
    """The approval survives a kill -9 while it waits; after an approve and another kill -9 the
    call runs exactly once and the turn completes."""
    daemon = Daemon(tmp_path, config(RECORD, ["tests.tooling:record"])).start()
    try:
        session = daemon.new_session()
        answer = daemon.send(session, "record please")
        turn, [approval] = answer["turn"]["id"], answer["approvals"]
        kill_supervisor(daemon)
        daemon = Daemon(tmp_path, None, state_dir=daemon.state_dir).start()
        [still] = pending_approvals(daemon, session)
        assert still["id"] == approval["id"]
        assert daemon.session(session)["state"] == "awaiting_approval"
        [listed] = [s for s in daemon.json("GET", "/v1/sessions", status=200) if s["id"] == session]
        assert listed["state"] == "awaiting_approval"
        assert daemon.turn(session, turn, finished=False)["status"] == "pending"
        assert runs(tmp_path) == 0
        decide(daemon, approval["id"], {"decision": "approve"})
        kill_supervisor(daemon)  # right after the approve: the turn may or may not have run the call
        daemon = Daemon(tmp_path, None, state_dir=daemon.state_dir).start()
        assert daemon.turn(session, turn)["status"] == "completed"
        [result] = [e for e in daemon.entries(session, turn) if e["role"] == "tool"]
        # Exactly once — unless the kill cut the call while it ran (journaled as started, never
        # finished): then at most once, and the result says so (RFC 0008 §5).
        assert runs(tmp_path) == 1 or (result.get("outcome_unknown") is True and runs(tmp_path) == 0), result
        assert daemon.json("GET", f"/v1/approvals/{approval['id']}", status=200)["status"] == "approved"
    finally:
        daemon.stop()


def test_kill_9_of_the_child_while_pending_changes_nothing(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, config(RECORD, ["tests.tooling:record"])).start()
    try:
        session = daemon.new_session()
        answer = daemon.send(session, "record please")
        turn, [approval] = answer["turn"]["id"], answer["approvals"]
        assert daemon.process is not None
        for pid in child_pids_of(daemon.process.pid):
            os.kill(pid, signal.SIGKILL)
        assert [a["id"] for a in pending_approvals(daemon, session)] == [approval["id"]]
        decide(daemon, approval["id"], {"decision": "approve"})
        assert daemon.turn(session, turn)["status"] == "completed"
        assert runs(tmp_path) == 1
    finally:
        daemon.stop()


def test_a_held_approved_call_cut_by_kill_9_is_never_run_again(tmp_path: Path) -> None:
    """Approved, started, and the supervisor killed while it runs: at most once (outcome unknown)."""
    daemon = Daemon(tmp_path, config(["tests.tooling:held"], ["tests.tooling:held"])).start()
    try:
        session = daemon.new_session()
        answer = daemon.send(session, "held please")
        turn, [approval] = answer["turn"]["id"], answer["approvals"]
        decide(daemon, approval["id"], {"decision": "approve"})
        wait_until(lambda: runs(tmp_path, "held-start") == 1, "the approved call to start")
        kill_supervisor(daemon)
        (tmp_path / "tool.gate").touch()
        daemon = Daemon(tmp_path, None, state_dir=daemon.state_dir).start()
        assert daemon.turn(session, turn)["status"] == "completed"
        assert runs(tmp_path, "held-start") == 1
        [result] = tool_results(daemon, session, turn)
        assert result.get("outcome_unknown") is True
    finally:
        daemon.stop()


def test_finish_on_old_a_waiting_turn_goes_on_with_the_old_model(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, config(RECORD, ["tests.tooling:record"])).start()
    try:
        session = daemon.new_session()
        answer = daemon.send(session, "record please")
        turn, [approval] = answer["turn"]["id"], answer["approvals"]
        daemon.write_config(config(RECORD, ["tests.tooling:record"], model="echo-large"))
        assert daemon.json("POST", "/v1/reload", status=200)["applied"]
        assert [a["id"] for a in pending_approvals(daemon, session)] == [approval["id"]]
        decide(daemon, approval["id"], {"decision": "approve"})
        record = daemon.turn(session, turn)
        assert record["status"] == "completed" and record["models"] == ["echo-small"]
        assert runs(tmp_path) == 1
        # The next turn runs on the new model.
        assert daemon.send(session, "hello")["turn"]["models"] == ["echo-large"]
    finally:
        daemon.stop()


def test_restart_turn_discards_the_waiting_run_and_keeps_the_same_approval(tmp_path: Path) -> None:
    """restart-turn: the waiting run is discarded at once and re-runs on the new model; it asks for
    the same call, so the approval is kept (same id, still pending); approved, it runs once."""
    top = 'model_swap = "restart-turn"'
    daemon = Daemon(tmp_path, config(RECORD, ["tests.tooling:record"], top=top)).start()
    try:
        session = daemon.new_session()
        answer = daemon.send(session, "record please")
        turn, [approval] = answer["turn"]["id"], answer["approvals"]
        daemon.write_config(config(RECORD, ["tests.tooling:record"], top=top, model="echo-large"))
        assert daemon.json("POST", "/v1/reload", status=200)["applied"]
        daemon.wait_log("approval.discarded")
        [kept] = pending_approvals(daemon, session)
        assert kept["id"] == approval["id"] and kept["status"] == "pending"
        # Decided while the re-run may still be running: it keeps this decision when it asks again.
        decide(daemon, approval["id"], {"decision": "approve"})
        record = daemon.turn(session, turn)
        assert record["status"] == "completed" and record["models"] == ["echo-large"]
        assert runs(tmp_path) == 1
    finally:
        daemon.stop()


def test_the_cli_lists_approves_rejects_and_chat_asks_inline(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, config(RECORD, ["tests.tooling:record"])).start()
    try:
        sent = daemon.run_cli("send", "record please")
        assert sent.returncode == 0, sent.stderr
        assert "waits for approval ap_" in sent.stderr
        listed = daemon.run_cli("approvals", "--json")
        assert listed.returncode == 0, listed.stderr
        [waiting] = json.loads(listed.stdout)
        table = daemon.run_cli("approvals")
        assert waiting["id"] in table.stdout and "record" in table.stdout
        approved = daemon.run_cli("approve", waiting["id"], "--reason", "fine", "--arguments", '{"label": "cli"}')
        assert approved.returncode == 0 and f"{waiting['id']} approved: fine" in approved.stdout
        wait_until(lambda: runs(tmp_path, "record cli") == 1, "the approved call to run")
        twice = daemon.run_cli("reject", waiting["id"], "--reason", "late")
        assert twice.returncode == 1 and "already_decided" in twice.stderr

        daemon.run_cli("send", "--session", waiting["session"], "record again")
        [second] = pending_approvals(daemon, waiting["session"])
        rejected = daemon.run_cli("reject", second["id"], "--reason", "no more")
        assert rejected.returncode == 0 and "rejected: no more" in rejected.stdout

        streamed = daemon.run_cli("send", "--stream", "record please")
        assert streamed.returncode == 0 and "waits for approval ap_" in streamed.stderr, streamed.stderr
        [third] = [a for a in pending_approvals(daemon) if a["session"] != waiting["session"]]
        daemon.run_cli("reject", third["id"], "--reason", "streamed")

        chat = daemon.run_cli("chat", input="record please\ny\n")
        assert chat.returncode == 0, chat.stderr
        assert "[approval]" in chat.stdout and "approved]" in chat.stdout
        assert runs(tmp_path) == 2
    finally:
        daemon.stop()


def test_a_waiting_turn_unloads_and_its_deadline_does_not_run(tmp_path: Path) -> None:
    """The session unloads while its turn waits (it holds no child), the wait outlasts the turn's
    deadline, and once approved the turn goes on from where it stopped and completes."""
    text = config(RECORD, ["tests.tooling:record"], limits='deadline = "2s"').replace(
        ONE_CHILD, ONE_CHILD + '\nidle_unload = "1s"'
    )
    daemon = Daemon(tmp_path, text).start()
    try:
        session = daemon.new_session()
        answer = daemon.send(session, "record please")
        turn, [approval] = answer["turn"]["id"], answer["approvals"]
        daemon.wait_log("session.unloaded", lambda r: r.get("session") == session)
        wait_until(lambda: daemon.status()["sessions"]["loaded"] == 0, "the session to be unloaded")
        # Past the turn's deadline (2 s from its start): a wait that counted would end it `deadline`.
        time.sleep(2.5)
        assert daemon.turn(session, turn, finished=False)["status"] == "pending"
        decide(daemon, approval["id"], {"decision": "approve"})
        record = daemon.turn(session, turn)
        assert record["status"] == "completed", record
        assert runs(tmp_path) == 1
    finally:
        daemon.stop()


def test_restart_turn_cancels_the_approvals_its_rerun_does_not_ask_for_again(tmp_path: Path) -> None:
    """Two calls wait; a reload swaps the model (restart-turn) and no longer requires approval for
    one of them: the re-run keeps the other's approval (same id) and cancels this one with the reason."""
    top = 'model_swap = "restart-turn"'
    tools = ["tests.tooling:record", "tests.tooling:stamp"]
    daemon = Daemon(tmp_path, config(tools, tools, top=top)).start()
    try:
        session = daemon.new_session()
        stream = daemon.events(session)
        answer = daemon.send(session, 'call tool record {"label": "a"} and call tool stamp {"label": "b"}')
        turn = answer["turn"]["id"]
        kept, dropped = answer["approvals"]
        assert (kept["tool"], dropped["tool"]) == ("record", "stamp")
        daemon.write_config(config(tools, ["tests.tooling:record"], top=top, model="echo-large"))
        assert daemon.json("POST", "/v1/reload", status=200)["applied"]
        cancelled = stream.wait("approval.decided", lambda d: d["approval"] == dropped["id"])
        assert cancelled["status"] == "cancelled" and "restart-turn" in cancelled["reason"]
        [still] = pending_approvals(daemon, session)
        assert still["id"] == kept["id"]
        decide(daemon, kept["id"], {"decision": "approve"})
        record = daemon.turn(session, turn)
        assert record["status"] == "completed" and record["models"] == ["echo-large"]
        assert runs(tmp_path) == 1 and runs(tmp_path, "stamp b") == 1
    finally:
        daemon.stop()
