"""The daemon's life end to end: files in the state dir, children, the durable store, shutdown.

Everything runs through the real ``agentd run`` subprocess, its API and real signals. "Mid-turn"
is an event, not a guess: the ``held`` assistant's scripted model waits for its ``hold_file``, and
a test acts only after it has seen that turn's ``step.started``.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_harness import (
    TIMEOUT,
    Daemon,
    child_pids_of,
    pid_alive,
    reaped,
    running_daemon,
    two_assistant_config,
    wait_until,
    zombie_children_of,
)

pytestmark = pytest.mark.e2e

MODEL = "echo-small"


def config(hold: Path, *, supervisor: str = "") -> str:
    return two_assistant_config(hold, supervisor=supervisor)


def start_held_turn(daemon: Daemon, session: str, text: str = "work"):  # type: ignore[no-untyped-def]
    """Post a message on a ``held`` session and return once its model call is in flight."""
    events = daemon.events(session)
    turn_id = daemon.send(session, text, wait=False)["turn_id"]
    events.wait("step.started", lambda d: d["turn"] == turn_id)
    return turn_id, events


def ready_children(daemon: Daemon, sessions: list[str]) -> dict[str, int]:
    """Wait until every one of ``sessions`` is loaded on a child; return session → child pid."""

    def get() -> dict[str, int] | None:
        found = {s: daemon.session(s)["child"] for s in sessions}
        return found if all(found.values()) else None

    return wait_until(get, f"children hosting {sessions}")


def pool_pids(daemon: Daemon) -> set[int]:
    """Every child process of the pool, once each has started."""

    def get() -> set[int] | None:
        children = daemon.status()["children"]
        return {c["pid"] for c in children} if children and all(c["pid"] for c in children) else None

    return wait_until(get, "every child to have a pid")


def user_entries(daemon: Daemon, session: str, turn_id: str) -> list[dict]:
    return [e for e in daemon.entries(session, turn_id) if e["role"] == "user"]


# --------------------------------------------------------------------------- state dir files


def test_run_owns_pid_and_socket_refuses_a_second_daemon_and_cleans_up(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, config(tmp_path / "hold")).start()
    try:
        assert daemon.process is not None
        pid_file = daemon.state_dir / "agentd.pid"
        assert pid_file.read_text().strip() == str(daemon.process.pid)
        mode = os.stat(daemon.socket).st_mode
        assert stat.S_ISSOCK(mode)
        assert stat.S_IMODE(mode) == 0o600, oct(stat.S_IMODE(mode))

        second = subprocess.run(
            daemon.command(), env=daemon.env, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT
        )
        assert second.returncode == 1, second.stderr
        assert str(daemon.process.pid) in second.stderr, second.stderr
        assert "running" in second.stderr, second.stderr
        # The refused daemon touched nothing of the live one.
        assert pid_file.read_text().strip() == str(daemon.process.pid)
        assert daemon.json("GET", "/v1/health", status=200) == {"status": "ok"}

        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit() == 0
        assert not pid_file.exists()
        assert not daemon.socket.exists()
    finally:
        daemon.stop()


def test_no_config_at_all_runs_the_builtin_quickstart(tmp_path: Path) -> None:
    assert not (tmp_path / "agentd.toml").exists()
    with running_daemon(tmp_path) as daemon:
        assert "--config" not in daemon.command()
        assert daemon.status()["config_path"] is None
        session = daemon.json("POST", "/v1/sessions", {}, status=201)
        assert session["assistant"] == "triage"
        assert session["model"] == MODEL
        openers = [e for e in session["transcript"] if e["role"] == "assistant"]
        assert openers and openers[0]["content"].startswith("Hi! I'm the scripted triage assistant")
        reply = daemon.send(session["id"], "hello there")
        assert reply["turn"]["status"] == "completed"
        final = [e for e in reply["messages"] if e["role"] == "assistant"][-1]
        assert final["content"].startswith(f"[{MODEL}]")
        assert final["model"] == MODEL


# --------------------------------------------------------------------------- children


def test_kill_9_of_the_supervisor_takes_every_child_down(tmp_path: Path) -> None:
    # children = 2: two active children kept whatever the load (the default keeps none idle).
    with running_daemon(tmp_path, config(tmp_path / "hold", supervisor="children = 2")) as daemon:
        assert daemon.process is not None
        idle = [daemon.new_session("main"), daemon.new_session("main")]
        for session in idle:
            daemon.send(session, "hi")  # loaded on a child, idle now
        busy = daemon.new_session("held")
        start_held_turn(daemon, busy)
        ready_children(daemon, [*idle, busy])
        pids = pool_pids(daemon)
        assert len(pids) >= 3  # two active children and a spare
        assert pids <= set(child_pids_of(daemon.process.pid))

        os.kill(daemon.process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        assert daemon.wait_exit() == -signal.SIGKILL
        wait_until(
            lambda: not any(pid_alive(p) for p in pids),
            f"every child of the killed supervisor to die (alive: {[p for p in pids if pid_alive(p)]})",
            timeout=max(0.1, 2.0 - (time.monotonic() - killed_at)),
        )


def test_closing_a_session_unloads_it_and_leaves_no_zombie(tmp_path: Path) -> None:
    with running_daemon(tmp_path, config(tmp_path / "hold")) as daemon:
        assert daemon.process is not None
        session = daemon.new_session("main")
        keep = daemon.new_session("main")
        daemon.send(session, "hi")
        daemon.send(keep, "hi")
        children = ready_children(daemon, [session, keep])
        loaded = daemon.status()["sessions"]["loaded"]
        closed = daemon.json("DELETE", f"/v1/sessions/{session}", status=200)
        assert closed["state"] == "closed"
        assert daemon.session(session)["child"] is None
        wait_until(lambda: daemon.status()["sessions"]["loaded"] == loaded - 1, "the closed session to be unloaded")
        # Its child is shared: it keeps serving the other sessions.
        assert pid_alive(children[keep]) and pid_alive(children[session])
        assert daemon.send(keep, "still here?")["turn"]["status"] == "completed"
        assert zombie_children_of(daemon.process.pid) == []


def test_a_crashed_child_is_respawned_and_its_interrupted_turn_reruns(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    with running_daemon(tmp_path, config(hold)) as daemon:
        assert daemon.process is not None
        session = daemon.new_session("held")
        turn_id, events = start_held_turn(daemon, session, "survive this")
        old_pid = ready_children(daemon, [session])[session]

        os.kill(old_pid, signal.SIGKILL)
        # The turn re-runs on another child: a new model call of the same turn starts.
        events.wait("step.started", lambda d: d["turn"] == turn_id)
        new_pid = wait_until(
            lambda: (p := ready_children(daemon, [session])[session]) != old_pid and p, "a new child for the session"
        )
        assert pid_alive(new_pid)
        wait_until(lambda: reaped(old_pid), f"the crashed child {old_pid} to be reaped")
        assert zombie_children_of(daemon.process.pid) == []

        hold.touch()
        done = events.wait("turn.done", lambda d: d["turn"] == turn_id)
        assert done["status"] == "completed"
        turn = daemon.turn(session, turn_id)
        assert turn["status"] == "completed"
        users = user_entries(daemon, session, turn_id)
        assert [u["content"] for u in users] == ["survive this"]
        final = [e for e in daemon.entries(session, turn_id) if e["role"] == "assistant"][-1]
        assert final["content"] == f"[{MODEL}] You said: survive this" and final["model"] == MODEL
        # The pool replaced the crashed child; the replacement carries the restart count.
        wait_until(lambda: any(c["restarts"] >= 1 for c in daemon.status()["children"]), "a replacement child")
        metrics = daemon.api("GET", "/metrics").text
        assert "agentd_child_crashes_total 1.0" in metrics
        assert "agentd_turn_reruns_total 1.0" in metrics


# --------------------------------------------------------------------------- durability


def test_sessions_and_transcripts_survive_a_restart(tmp_path: Path) -> None:
    first = Daemon(tmp_path, config(tmp_path / "hold")).start()
    try:
        a, b, c = (first.new_session("main") for _ in range(3))
        first.send(a, "hello")
        first.send(a, "what does the clock say")
        first.send(b, "one")
        first.send(c, "bye")
        first.json("DELETE", f"/v1/sessions/{c}", status=200)
        before = {s: first.session(s) for s in (a, b, c)}
        assert before[a]["turns"] and len(before[a]["turns"]) == 2
        first.signal(signal.SIGTERM)
        assert first.wait_exit() == 0
    finally:
        first.stop()

    with running_daemon(tmp_path) as second:  # same state dir, same config file
        for s in (a, b):
            assert {**second.session(s), "child": None} == {**before[s], "child": None}
        closed = second.session(c)
        assert closed["state"] == "closed"
        assert closed["transcript"] == before[c]["transcript"]
        assert closed["turns"] == before[c]["turns"]
        assert second.api("POST", f"/v1/sessions/{c}/messages", {"content": "back?"}).status_code == 404
        listed = {s["id"]: s["state"] for s in second.json("GET", "/v1/sessions", status=200)}
        assert listed == {a: "idle", b: "idle", c: "closed"}
        assert second.status()["sessions"] == {"open": 2, "loaded": 0, "running": 0, "failed": 0}
        last_seq = max(e["seq"] for e in before[a]["transcript"])
        for s in (a, b):
            reply = second.send(s, "still there?")
            assert reply["turn"]["status"] == "completed"
            assert reply["messages"][-1]["content"] == f"[{MODEL}] You said: still there?"
        assert min(e["seq"] for e in second.session(a)["transcript"] if e["seq"] > last_seq) == last_seq + 1
        assert second.session(a)["transcript"][: len(before[a]["transcript"])] == before[a]["transcript"]


def test_a_turn_interrupted_by_kill_9_reruns_after_restart(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    first = Daemon(tmp_path, config(hold)).start()
    try:
        assert first.process is not None
        session = first.new_session("held")
        turn_id, _ = start_held_turn(first, session, "finish me")
        pids = set(ready_children(first, [session]).values())
        os.kill(first.process.pid, signal.SIGKILL)
        first.wait_exit()
        wait_until(lambda: not any(pid_alive(p) for p in pids), "the old children to die")
    finally:
        first.stop()

    hold.touch()
    with running_daemon(tmp_path) as second:
        turn = second.turn(session, turn_id)
        assert turn["status"] == "completed"
        assert [t["id"] for t in second.session(session)["turns"]] == [turn_id]
        users = [e for e in second.session(session)["transcript"] if e["role"] == "user"]
        assert [(u["content"], u["turn"]) for u in users] == [("finish me", turn_id)]
        final = [e for e in second.entries(session, turn_id) if e["role"] == "assistant"][-1]
        assert final["content"] == f"[{MODEL}] You said: finish me" and final["model"] == MODEL
        assert second.session(session)["state"] == "idle"
        assert second.send(session, "and now?")["turn"]["status"] == "completed"


# --------------------------------------------------------------------------- shutdown


def test_sigterm_mid_turn_drains_the_turn_commits_it_and_exits_0(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    daemon = Daemon(tmp_path, config(hold)).start()
    try:
        assert daemon.process is not None
        busy, other = daemon.new_session("held"), daemon.new_session("main")
        turn_id, events = start_held_turn(daemon, busy, "drain me")
        ready_children(daemon, [busy])
        pids = pool_pids(daemon)

        daemon.signal(signal.SIGTERM)
        not_ready = wait_until(
            lambda: (r := daemon.api("GET", "/v1/ready")).status_code == 503 and r,
            "/v1/ready to answer 503 while draining",
        )
        assert not_ready.json()["ready"] is False
        assert "draining" in not_ready.json()["reasons"]
        refused = daemon.api("POST", f"/v1/sessions/{other}/messages", {"content": "more work"})
        assert refused.status_code == 503
        error = refused.json()["error"]
        assert error["code"] and error["message"]
        assert daemon.api("POST", "/v1/sessions", {}).status_code == 503
        assert daemon.process.poll() is None, "the daemon must wait for the in-flight turn"

        hold.touch()
        done = events.wait("turn.done", lambda d: d["turn"] == turn_id)
        assert done["status"] == "completed"
        assert daemon.wait_exit() == 0
        assert not any(pid_alive(p) for p in pids), "a child outlived the daemon"
        assert not (daemon.state_dir / "agentd.pid").exists() and not daemon.socket.exists()
        assert daemon.log_events("supervisor.stopped")
    finally:
        daemon.stop()

    # It was committed: a new daemon has it completed, and does not run it again.
    with running_daemon(tmp_path) as second:
        turn = second.turn(busy, turn_id)
        assert turn["status"] == "completed"
        assert [t["id"] for t in second.session(busy)["turns"]] == [turn_id]
        assert [u["content"] for u in user_entries(second, busy, turn_id)] == ["drain me"]
        final = [e for e in second.entries(busy, turn_id) if e["role"] == "assistant"][-1]
        assert final["content"] == f"[{MODEL}] You said: drain me"
        assert second.session(other)["turns"] == []


def test_a_second_sigterm_while_draining_forces_exit(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, config(tmp_path / "never", supervisor='stop_grace = "60s"')).start()
    try:
        assert daemon.process is not None
        busy = daemon.new_session("held")
        start_held_turn(daemon, busy)
        ready_children(daemon, [busy])
        pids = pool_pids(daemon)

        daemon.signal(signal.SIGTERM)
        wait_until(lambda: daemon.api("GET", "/v1/ready").status_code == 503, "the daemon to start draining")
        assert daemon.process.poll() is None
        daemon.signal(signal.SIGTERM)
        forced_at = time.monotonic()
        code = daemon.wait_exit(timeout=15)
        assert code != 0
        assert time.monotonic() - forced_at < 15
        wait_until(lambda: not any(pid_alive(p) for p in pids), "no child left after a forced exit", timeout=2)
    finally:
        daemon.stop()


def test_a_child_not_ready_within_spawn_timeout_is_killed_and_retried(tmp_path: Path) -> None:
    gate = tmp_path / "import.gate"
    text = """
[intelligence]
provider = "scripted"
model = "echo-small"

[supervisor]
spawn_timeout = "2s"

[[assistants]]
name = "main"
first_message_mode = "assistant-waits-for-user"
tools = ["tests.slow_import_tool:ping"]
"""
    with running_daemon(tmp_path, text, env={"AGENTD_TEST_IMPORT_GATE": str(gate)}) as daemon:
        session = daemon.new_session()
        turn_id = daemon.send(session, "hello", wait=False)["turn_id"]
        failures = daemon.wait_log("child.spawn_failed", count=2)
        assert all("not Ready within 2s" in f["error"] for f in failures)
        assert daemon.turn(session, turn_id, finished=False)["status"] == "pending"
        gate.touch()
        assert daemon.turn(session, turn_id)["status"] == "completed"
        assert daemon.process is not None
        wait_until(lambda: not zombie_children_of(daemon.process.pid), "every timed-out child to be reaped")


# --------------------------------------------------------------------------- the store failing


def test_a_commit_that_fails_answers_503_naming_the_turn_and_the_turn_is_kept(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    with running_daemon(tmp_path, config(hold)) as daemon:
        session = daemon.new_session("held")
        turn_id, events = start_held_turn(daemon, session, "keep me")
        # Another process takes the database's write lock: the daemon's commit fails (busy).
        blocker = sqlite3.connect(daemon.state_dir / "agentd.db", isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")
        try:
            answers: list[Any] = []
            waiter = threading.Thread(
                target=lambda: answers.append(
                    daemon.api("POST", f"/v1/sessions/{session}/messages", {"content": "next"})
                )
            )
            hold.touch()
            events.wait("step.done", lambda d: d["turn"] == turn_id)
            daemon.wait_log("turn.commit_failed", lambda d: d["turn"] == turn_id)
            ready = daemon.api("GET", "/v1/ready")
            assert ready.status_code == 503 and any("store" in r for r in ready.json()["reasons"]), ready.text
            # The session is still busy with the turn being committed: a new message is refused, not lost.
            waiter.start()
            waiter.join(TIMEOUT)
            assert answers and answers[0].status_code in (409, 503), answers[0].text
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        turn = daemon.turn(session, turn_id)  # the retry commits it once the store works again
        assert turn["status"] == "completed"
        assert [e["content"] for e in user_entries(daemon, session, turn_id)] == ["keep me"]
        wait_until(lambda: daemon.api("GET", "/v1/ready").status_code == 200, "readiness to come back")
        assert daemon.send(session, "and now")["turn"]["status"] == "completed"


def test_the_waiting_client_of_a_failed_commit_gets_503_with_the_turn(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    with running_daemon(tmp_path, config(hold)) as daemon:
        session = daemon.new_session("held")
        blocker = sqlite3.connect(daemon.state_dir / "agentd.db", isolation_level=None)
        answers: list[Any] = []
        waiter = threading.Thread(
            target=lambda: answers.append(daemon.api("POST", f"/v1/sessions/{session}/messages", {"content": "x"}))
        )
        events = daemon.events(session)
        waiter.start()
        started = events.wait("step.started")
        blocker.execute("BEGIN EXCLUSIVE")
        try:
            hold.touch()
            waiter.join(TIMEOUT)
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        assert answers, "the waiting client was answered"
        response = answers[0]
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["turn"] == started["turn"] and "commit" in error["message"]
        assert daemon.turn(session, started["turn"])["status"] == "completed"


def test_a_waiting_client_whose_turn_is_cut_by_shutdown_gets_503_naming_the_turn(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    text = config(hold, supervisor='stop_grace = "500ms"')
    daemon = Daemon(tmp_path, text).start()
    try:
        session = daemon.new_session("held")
        events = daemon.events(session)
        answers: list[Any] = []
        waiter = threading.Thread(
            target=lambda: answers.append(daemon.api("POST", f"/v1/sessions/{session}/messages", {"content": "cut"}))
        )
        waiter.start()
        turn_id = events.wait("step.started")["turn"]
        daemon.signal(signal.SIGTERM)
        waiter.join(TIMEOUT)
        assert daemon.wait_exit() == 1  # a turn had to be cut off
    finally:
        daemon.stop()
    assert answers, "the waiting client was answered"
    assert answers[0].status_code == 503, answers[0].text
    error = answers[0].json()["error"]
    assert error["code"] == "turn_cut" and error["turn"] == turn_id
    hold.touch()
    with running_daemon(tmp_path, text) as second:  # it re-runs at the next start, once
        assert second.turn(session, turn_id)["status"] == "completed"
        assert [e["content"] for e in user_entries(second, session, turn_id)] == ["cut"]


def test_a_close_the_store_cannot_write_leaves_the_session_open_and_usable(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    hold.touch()
    with running_daemon(tmp_path, config(hold)) as daemon:
        session = daemon.new_session("held")
        assert daemon.send(session, "before")["turn"]["status"] == "completed"
        blocker = sqlite3.connect(daemon.state_dir / "agentd.db", isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")  # the daemon's writes fail (busy) until released
        try:
            refused = daemon.api("DELETE", f"/v1/sessions/{session}")
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        assert refused.status_code in (503, 507), refused.text
        assert "was not closed" in refused.json()["error"]["message"]
        assert daemon.session(session)["state"] == "idle"
        assert daemon.send(session, "after")["turn"]["status"] == "completed"
        assert daemon.api("DELETE", f"/v1/sessions/{session}").status_code == 200
        assert daemon.session(session)["state"] == "closed"
