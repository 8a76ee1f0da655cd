"""Hot swap end to end: the real ``agentd run``, a config edit, a real SIGHUP (RFC 0002, RFC 0003 §4).

"Mid-turn" is an event, not a guess: the scripted model's ``hold_file`` keeps the model call in
flight until the test has seen ``step.started`` and the reload's ``swap.parked``.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.child_harness import tool_log
from tests.daemon_harness import Daemon, running_daemon, wait_until

pytestmark = pytest.mark.e2e

DOCUMENTED_STATUSES = {
    "completed",
    "transferred",
    "exhausted_steps",
    "exhausted_tokens",
    "deadline",
    "loop_detected",
    "cancelled",
    "intel_unavailable",
    "failed",
}


def config(model: str = "old-model", *, options: str = "", more: str = "", top: str = "", main_intel: str = "") -> str:
    return f"""{top}
[intelligence]
provider = "scripted"
model = "{model}"
options = {{ {options} }}

[[assistants]]
name = "main"
first_message_mode = "assistant-waits-for-user"
tools = ["tests.tooling:record"]
{main_intel}
{more}
"""


def hold(path: Path) -> str:
    return f'hold_file = "{path}"'


def assistant_entries(daemon: Daemon, session: str, turn: str) -> list[dict]:
    return [e for e in daemon.entries(session, turn) if e["role"] == "assistant"]


def start_held_turn(daemon: Daemon, session: str, text: str = "work") -> tuple[str, object]:
    events = daemon.events(session)
    turn_id = daemon.send(session, text, wait=False)["turn_id"]
    events.wait("step.started", lambda d: d["turn"] == turn_id)
    return turn_id, events


def test_finish_on_old_keeps_the_in_flight_turn_on_the_old_model(tmp_path: Path) -> None:
    gate = tmp_path / "model.gate"
    with running_daemon(tmp_path, config(options=f"steps = 2, {hold(gate)}")) as daemon:
        session = daemon.new_session()
        turn_id, events = start_held_turn(daemon, session)
        daemon.write_config(config("new-model", options="steps = 2"))
        daemon.signal(signal.SIGHUP)
        events.wait("swap.parked", lambda d: d["model_to"] == "new-model")
        gate.touch()
        events.wait("turn.done", lambda d: d["turn"] == turn_id)
        turn = daemon.turn(session, turn_id)
        assert turn["status"] == "completed" and turn["restarts"] == 0
        entries = assistant_entries(daemon, session, turn_id)
        assert len(entries) == 3
        assert {e["model"] for e in entries} == {"old-model"}
        events.wait("swap.applied", lambda d: d["model_to"] == "new-model")
        assert daemon.status()["generation"] == 2
        second = daemon.send(session, "next")
        assert {e["model"] for e in second["messages"] if e["role"] == "assistant"} == {"new-model"}
        assert daemon.session(session)["model"] == "new-model"
        assert daemon.log_events("intel.swap.sent"), "the supervisor logs intel.swap.sent per child"
        acked = daemon.wait_log("intel.swap.fanout_acked")
        assert acked[0]["generation"] == 2 and acked[0]["seconds"] >= 0


@pytest.mark.parametrize("how", ["flag", "env", "flag without a command"])
def test_restart_turn_reruns_on_the_new_model(tmp_path: Path, how: str) -> None:
    gate = tmp_path / "model.gate"
    kwargs: dict[str, Any] = {
        "flag": {"args": ["--model-swap", "restart-turn"]},
        "env": {"env": {"AGENTD_MODEL_SWAP": "restart-turn"}},
        # The original usage: `agentd --model-swap restart-turn` is `agentd run --model-swap restart-turn`.
        "flag without a command": {"args": ["--model-swap", "restart-turn"], "command": None},
    }[how]
    with running_daemon(tmp_path, config(options=f"steps = 1, {hold(gate)}"), **kwargs) as daemon:
        assert daemon.status()["model_swap"] == {"policy": "restart-turn", "source": how.split()[0]}
        session = daemon.new_session()
        turn_id, events = start_held_turn(daemon, session)
        daemon.write_config(config("new-model", options="steps = 1"))
        daemon.signal(signal.SIGHUP)
        events.wait("swap.parked", lambda d: d["model_to"] == "new-model")
        gate.touch()
        events.wait("turn.restarted", lambda d: d["turn"] == turn_id)
        done = events.wait("turn.done", lambda d: d["turn"] == turn_id)
        assert done["restarts"] == 1
        turn = daemon.turn(session, turn_id)
        assert turn["status"] == "completed"
        assert turn["restarts"] == 1
        assert [d["model"] for d in turn["discarded"]] == ["old-model"]
        assert turn["models"] == ["new-model"]
        entries = assistant_entries(daemon, session, turn_id)
        assert entries and {e["model"] for e in entries} == {"new-model"}
        # The discarded step asked for the tool; only the re-run's call ever ran.
        assert tool_log(tmp_path) == ["record step 1"]


def test_repoint_never_restarts_and_an_idle_session_swaps_at_once(tmp_path: Path) -> None:
    gate = tmp_path / "model.gate"
    with running_daemon(
        tmp_path, config(options=f"steps = 1, {hold(gate)}"), args=["--model-swap", "restart-turn"]
    ) as daemon:
        busy, idle = daemon.new_session(), daemon.new_session()
        idle_events = daemon.events(idle)
        turn_id, events = start_held_turn(daemon, busy)
        daemon.write_config(config(options=f"steps = 1, temperature = 0.3, {hold(gate)}"))
        daemon.signal(signal.SIGHUP)
        applied_idle = idle_events.wait("swap.applied")
        assert applied_idle["kind"] == "repoint" and applied_idle["turn"] is None
        events.wait("swap.parked")
        gate.touch()
        events.wait("turn.done", lambda d: d["turn"] == turn_id)
        turn = daemon.turn(session=busy, turn_id=turn_id)
        assert turn["restarts"] == 0 and turn["discarded"] == []
        assert tool_log(tmp_path) == ["record step 1"]
        # An idle session on restart-turn with a model change swaps at once too.
        daemon.write_config(config("new-model", options="steps = 1"))
        daemon.signal(signal.SIGHUP)
        applied = idle_events.wait("swap.applied", lambda d: d["model_to"] == "new-model")
        assert applied["kind"] == "model" and applied["turn"] is None
        wait_until(lambda: daemon.session(idle)["model"] == "new-model", "the idle session to report the new model")


def test_a_reload_swaps_only_the_sessions_of_the_changed_assistant(tmp_path: Path) -> None:
    other = '[[assistants]]\nname = "other"\nfirst_message_mode = "assistant-waits-for-user"\nintelligence = { model = "other-model" }\n'
    with running_daemon(tmp_path, config(more=other)) as daemon:
        on_main, on_other = daemon.new_session("main"), daemon.new_session("other")
        daemon.send(on_main, "hi")
        daemon.send(on_other, "hi")
        daemon.write_config(config("new-main", more=other))
        result = daemon.json("POST", "/v1/reload", status=200)
        assert result["applied"] is True and result["generation"] == 2
        assert result["swapped_sessions"] == [on_main]
        assert "intelligence.model" in result["changed"]
        wait_until(lambda: daemon.session(on_main)["model"] == "new-main", "main's session to swap")
        assert daemon.send(on_other, "again")["messages"][-1]["model"] == "other-model"
        assert daemon.session(on_other)["model"] == "other-model"
        assert daemon.send(on_main, "again")["messages"][-1]["model"] == "new-main"


def test_an_invalid_reload_is_rejected_and_the_old_model_still_serves(tmp_path: Path) -> None:
    with running_daemon(tmp_path, config()) as daemon:
        session = daemon.new_session()
        daemon.write_config(config(top='model_swap = "sometimes"', more="bogus = 1"))
        response = daemon.api("POST", "/v1/reload")
        assert response.status_code == 422
        body = response.json()
        assert body["applied"] is False and body["generation"] == 1
        paths = {e["path"] for e in body["errors"]}
        assert {"model_swap", "assistants[0].bogus"} <= paths
        assert any("accepted values" in e["message"] for e in body["errors"])
        cli = daemon.run_cli("reload")
        assert cli.returncode == 1
        assert "model_swap" in cli.stdout + cli.stderr
        daemon.signal(signal.SIGHUP)
        daemon.wait_log("config.reload", lambda r: r.get("applied") is False, count=3)
        assert daemon.status()["generation"] == 1
        assert daemon.send(session, "still there?")["messages"][-1]["model"] == "old-model"


def test_fifty_sighups_while_turns_run(tmp_path: Path) -> None:
    with running_daemon(tmp_path, config(options="steps = 2, delay_ms = 20")) as daemon:
        sessions = [daemon.new_session() for _ in range(3)]
        turns = [(s, daemon.send(s, "busy", wait=False)["turn_id"]) for s in sessions]
        for i in range(50):
            daemon.write_config(config(f"model-{i}", options="steps = 2, delay_ms = 20"))
            daemon.signal(signal.SIGHUP)
        daemon.write_config(config("final-model", options="steps = 2, delay_ms = 20"))
        final = daemon.json("POST", "/v1/reload", status=200)
        assert daemon.json("GET", "/v1/health", status=200) == {"status": "ok"}
        for session, turn_id in turns:
            assert daemon.turn(session, turn_id)["status"] in DOCUMENTED_STATUSES
        status = daemon.status()
        assert status["generation"] == final["generation"] >= 2
        for session in sessions:
            wait_until(lambda s=session: daemon.session(s)["model"] == "final-model", f"{session} on the final model")
            assert daemon.session(session)["generation"] == status["generation"]
        more = [daemon.send(s, "after") for s in sessions]
        assert all(m["turn"]["status"] == "completed" and m["messages"][-1]["model"] == "final-model" for m in more)
        assert not daemon.log_events("supervisor.task_failed")


def test_a_sighup_during_start_up_is_a_reload_not_a_kill(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, config())
    daemon._log = open(daemon.log_path, "wb")  # noqa: SIM115 - closed by daemon.stop()
    daemon.process = subprocess.Popen(
        daemon.command(), stdout=daemon._log, stderr=subprocess.STDOUT, env=daemon.env, cwd=tmp_path
    )
    # The pid file appears while the daemon is still starting (before it serves the API).
    wait_until(lambda: (daemon.state_dir / "agentd.pid").exists(), "the pid file")
    daemon.process.send_signal(signal.SIGHUP)
    try:
        daemon.start_client()
        daemon.wait_log("config.reload")
        assert daemon.process.poll() is None
    finally:
        daemon.stop()


def test_watch_config_reloads_when_the_file_changes(tmp_path: Path) -> None:
    with running_daemon(tmp_path, config(), args=["--watch-config"]) as daemon:
        session = daemon.new_session()
        events = daemon.events(session)
        daemon.write_config(config("watched-model"))
        events.wait("swap.applied", lambda d: d["model_to"] == "watched-model")
        assert daemon.status()["generation"] == 2
        assert daemon.log_events("config.watch"), "the reload was triggered by the file watch"


def test_restart_only_fields_are_reported_and_kept(tmp_path: Path) -> None:
    with running_daemon(tmp_path, config()) as daemon:
        moved = f'[server]\nstate_dir = "{tmp_path / "elsewhere"}"\n'
        daemon.write_config(moved + config("new-model"))
        result = daemon.json("POST", "/v1/reload", status=200)
        assert result["restart_required"] == ["server.state_dir"]
        assert result["applied"] is True and "intelligence.model" in result["changed"]
        assert daemon.socket.exists() and not (tmp_path / "elsewhere").exists()


def test_reloads_that_would_strand_sessions_or_cannot_be_read_are_rejected(tmp_path: Path) -> None:
    with running_daemon(tmp_path, config()) as daemon:
        session = daemon.new_session()
        daemon.write_config(config().replace('name = "main"', 'name = "renamed"'))
        rejected = daemon.api("POST", "/v1/reload")
        assert rejected.status_code == 422
        assert any(e["path"] == "assistants" and "'main'" in e["message"] for e in rejected.json()["errors"])
        daemon.config_path.write_bytes(
            config().replace('name = "main"', 'name = "main"\nsystem = "caf\u00e9"').encode("latin-1")
        )
        unreadable = daemon.api("POST", "/v1/reload")
        assert unreadable.status_code == 422 and "UTF-8" in unreadable.text
        daemon.signal(signal.SIGHUP)
        daemon.wait_log("config.reload", lambda r: r.get("applied") is False, count=3)
        assert daemon.process is not None and daemon.process.poll() is None
        assert daemon.send(session, "still here")["turn"]["status"] == "completed"


def test_a_limits_only_reload_reaches_running_children(tmp_path: Path) -> None:
    with running_daemon(tmp_path, config(options="steps = 3")) as daemon:
        session = daemon.new_session()
        assert daemon.send(session, "first")["turn"]["status"] == "completed"
        daemon.write_config(config(options="steps = 3") + "\n[limits]\nmax_steps = 1\n")
        result = daemon.json("POST", "/v1/reload", status=200)
        assert result["changed"] == ["limits.max_steps"] and result["swapped_sessions"] == []
        daemon.wait_log("intel.swap.fanout_acked", lambda r: r["generation"] == 2)
        assert daemon.send(session, "second")["turn"]["status"] == "exhausted_steps"
