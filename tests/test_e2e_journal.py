"""End to end through ``agentd run``: the tool journal keeps a side-effecting tool at most once per
turn whatever is killed (RFC 0008 §5).

The tools append lines to ``tools.log`` (``tests.tooling``): ``record`` and ``held`` are
side-effecting, ``held_pure`` is declared free of side effects; the ``held`` ones wait for the
gate file, so the test kills a process at a known point, never by timing. Each case kills with
SIGKILL — the child running the turn, or the supervisor (whose children die with it) — and then
checks the log: a call that returned is replayed (its line is there once), a call cut off while
it ran is never run again (at most one line), and the turn completes either way.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.daemon_harness import Daemon, child_pids_of, running_daemon, wait_until
from tests.mcp_servers import toml_list

pytestmark = pytest.mark.e2e

ONE_CHILD = "children = 1\nmax_children = 1\nspare_children = 0"


def config(tools: list[str]) -> str:
    return f"""
[intelligence]
provider = "scripted"
model = "echo-small"

[supervisor]
{ONE_CHILD}

[[assistants]]
name = "main"
tools = {toml_list(tools)}
"""


def log_lines(tmp: Path) -> list[str]:
    path = tmp / "tools.log"
    return path.read_text().splitlines() if path.exists() else []


def wait_line(tmp: Path, prefix: str) -> None:
    wait_until(lambda: any(line.startswith(prefix) for line in log_lines(tmp)), f"tools.log to show {prefix!r}")


def count(tmp: Path, prefix: str) -> int:
    return sum(1 for line in log_lines(tmp) if line.startswith(prefix))


def kill_the_child(daemon: Daemon) -> None:
    assert daemon.process is not None
    [pid] = child_pids_of(daemon.process.pid)
    os.kill(pid, signal.SIGKILL)


def kill_the_supervisor_and_restart(daemon: Daemon, tmp: Path) -> Daemon:
    """SIGKILL the supervisor (its children die with it), open the gate, start it again on the same state."""
    assert daemon.process is not None
    pids = child_pids_of(daemon.process.pid)
    daemon.process.kill()
    daemon.wait_exit()
    daemon.stop()
    wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in pids), "the children to die with it")
    (tmp / "tool.gate").touch()
    return Daemon(tmp, None, state_dir=daemon.state_dir).start()


def tool_entry(daemon: Daemon, session: str, turn: str, name: str) -> dict[str, object]:
    [entry] = [e for e in daemon.entries(session, turn) if e["role"] == "tool" and e["name"] == name]
    return entry


def start_turn(daemon: Daemon, text: str) -> tuple[str, str]:
    session = daemon.new_session()
    return session, daemon.send(session, text, wait=False)["turn_id"]


@pytest.mark.parametrize("kill", ["child", "supervisor"])
def test_a_call_that_returned_is_replayed_after_a_kill(tmp_path: Path, kill: str) -> None:
    """(a) ``record`` returned, then the turn is killed (in ``held_pure``): the re-run replays it."""
    daemon = Daemon(tmp_path, config(["tests.tooling:record", "tests.tooling:held_pure"])).start()
    try:
        session, turn = start_turn(daemon, "record and held_pure please")
        wait_line(tmp_path, "held-start")  # record returned (and was journaled) before held_pure began
        if kill == "child":
            kill_the_child(daemon)
            (tmp_path / "tool.gate").touch()
        else:
            daemon = kill_the_supervisor_and_restart(daemon, tmp_path)
        assert daemon.turn(session, turn)["status"] == "completed"
        assert count(tmp_path, "record") == 1  # exactly one line: the tool ran once
        assert count(tmp_path, "held-start") == 2  # side-effect free: simply run again
        entry = tool_entry(daemon, session, turn, "record")
        assert entry["replayed"] is True and not entry.get("is_error")
        assert entry["content"] == "recorded step 1"
    finally:
        daemon.stop()


@pytest.mark.parametrize("kill", ["child", "supervisor"])
def test_a_call_cut_off_while_it_ran_is_never_run_again(tmp_path: Path, kill: str) -> None:
    """(b) ``held`` is killed while it runs: its outcome is unknown, and it is not run a second time."""
    daemon = Daemon(tmp_path, config(["tests.tooling:held"])).start()
    try:
        session, turn = start_turn(daemon, "held please")
        wait_line(tmp_path, "held-start")
        if kill == "child":
            kill_the_child(daemon)
            (tmp_path / "tool.gate").touch()  # a re-run of it would now run to its end: none may
        else:
            daemon = kill_the_supervisor_and_restart(daemon, tmp_path)
        assert daemon.turn(session, turn)["status"] == "completed"
        assert count(tmp_path, "held-start") == 1
        assert count(tmp_path, "held-end") <= 1  # at most one line of its effect (here: none)
        entry = tool_entry(daemon, session, turn, "held")
        assert entry["outcome_unknown"] is True and entry["is_error"] is True
        assert "outcome is unknown" in str(entry["content"])
    finally:
        daemon.stop()


def test_the_journal_is_pruned_when_the_turn_commits(tmp_path: Path) -> None:
    import sqlite3

    with running_daemon(tmp_path, config(["tests.tooling:record"])) as daemon:
        session = daemon.new_session()
        reply = daemon.send(session, "record it")
        assert reply["turn"]["status"] == "completed"
        assert count(tmp_path, "record") == 1
        db = daemon.state_dir / "agentd.db"
        assert sqlite3.connect(db).execute("SELECT COUNT(*) FROM journal").fetchone() == (0,)
