"""The pool end to end (RFC 0006): many sessions per child, swaps across the pool, sessions loaded
and unloaded around reloads, crash containment, hung tools and stopped children.

Every test starts the real ``agentd run`` and waits on events (SSE, log lines, the API), never on
sleeps.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.child_harness import tool_log
from tests.daemon_harness import REPO, Daemon, EventStream, pid_alive, running_daemon, wait_until

pytestmark = pytest.mark.e2e

ONE_CHILD = 'children = 1\nspare_children = 0\nspawn_timeout = "60s"'


def pool_config(
    tmp: Path, *, a_model: str = "a-old", supervisor: str = ONE_CHILD, top: str = "", more: str = ""
) -> str:
    """Assistants ``a`` and ``b`` on their own models, each model call held until its hold file exists."""
    return f"""{top}
[intelligence]
provider = "scripted"
model = "default-model"

[supervisor]
{supervisor}

[[assistants]]
name = "a"
first_message_mode = "assistant-waits-for-user"
intelligence = {{ model = "{a_model}", options = {{ hold_file = "{tmp / "hold-a"}" }} }}

[[assistants]]
name = "b"
first_message_mode = "assistant-waits-for-user"
intelligence = {{ model = "b-model", options = {{ hold_file = "{tmp / "hold-b"}" }} }}
{more}
"""


def loaded_on(daemon: Daemon, session: str) -> int:
    """The pid of the child ``session`` is loaded on (waits until it is loaded)."""
    return int(wait_until(lambda: daemon.session(session)["child"], f"{session} to be loaded on a child"))


def held_turns(daemon: Daemon, sessions: list[str], text: str = "work") -> dict[str, tuple[str, EventStream]]:
    """Start a turn on each session and return once each model call is in flight: session → (turn, events)."""
    started = {}
    for session in sessions:
        events = daemon.events(session)
        turn_id = daemon.send(session, text, wait=False)["turn_id"]
        events.wait("step.started", lambda d, t=turn_id: d["turn"] == t)
        started[session] = (turn_id, events)
    return started


# --------------------------------------------------------------------------- swaps across the pool


@pytest.mark.parametrize("policy", ["finish-on-old", "restart-turn"])
def test_a_mid_turn_swap_on_a_shared_child_swaps_only_the_changed_assistants_sessions(
    tmp_path: Path, policy: str
) -> None:
    top = f'model_swap = "{policy}"'
    with running_daemon(tmp_path, pool_config(tmp_path, top=top)) as daemon:
        a1, a2, b1 = daemon.new_session("a"), daemon.new_session("a"), daemon.new_session("b")
        turns = held_turns(daemon, [a1, a2, b1])
        assert len({loaded_on(daemon, s) for s in (a1, a2, b1)}) == 1, "one child hosts all three"

        daemon.write_config(pool_config(tmp_path, a_model="a-new", top=top))
        result = daemon.json("POST", "/v1/reload", status=200)
        assert sorted(result["swapped_sessions"]) == sorted([a1, a2]) and result["swapped_total"] == 2
        for session in (a1, a2):
            turns[session][1].wait("swap.parked", lambda d: d["model_to"] == "a-new")
        (tmp_path / "hold-a").touch()
        (tmp_path / "hold-b").touch()
        done = {s: turns[s][1].wait("turn.done", lambda d, t=turns[s][0]: d["turn"] == t) for s in turns}

        for session in (a1, a2):
            if policy == "finish-on-old":
                assert done[session]["models"] == ["a-old"] and done[session]["restarts"] == 0
            else:
                assert done[session]["models"] == ["a-new"] and done[session]["restarts"] == 1
                assert [d["model"] for d in done[session]["discarded"]] == ["a-old"]
            assert daemon.send(session, "next")["turn"]["models"] == ["a-new"]
            assert daemon.session(session)["generation"] == 2
        assert done[b1]["models"] == ["b-model"] and done[b1]["restarts"] == 0
        b_events = [name for name, data in turns[b1][1].seen if name.startswith("swap.")]
        assert b_events == [], "another assistant's change leaves the session alone"
        assert daemon.session(b1)["model"] == "b-model"
        assert daemon.session(b1)["generation"] == 2, "it runs the new generation, its model unchanged"


def test_an_idle_loaded_session_of_an_unchanged_assistant_shows_the_new_generation(tmp_path: Path) -> None:
    (tmp_path / "hold-a").touch()
    (tmp_path / "hold-b").touch()
    with running_daemon(tmp_path, pool_config(tmp_path)) as daemon:
        a, b = daemon.new_session("a"), daemon.new_session("b")
        for session in (a, b):
            assert daemon.send(session, "hello")["turn"]["status"] == "completed"
        assert loaded_on(daemon, a) == loaded_on(daemon, b)
        daemon.write_config(pool_config(tmp_path, a_model="a-new"))
        assert daemon.json("POST", "/v1/reload", status=200)["generation"] == 2
        wait_until(lambda: daemon.session(a)["model"] == "a-new", "a to swap")
        viewed = wait_until(lambda: (s := daemon.session(b))["generation"] == 2 and s, "b to show generation 2")
        assert viewed["model"] == "b-model" and viewed["child"] is not None


def test_a_swap_while_a_session_is_being_loaded_reaches_it(tmp_path: Path) -> None:
    gate = tmp_path / "import.gate"
    (tmp_path / "hold-a").touch()
    more = 'tools = ["tests.slow_import_tool:ping"]'
    text = pool_config(tmp_path).replace('name = "b"\n', f'name = "b"\n{more}\n')
    with running_daemon(tmp_path, text, env={"AGENTD_TEST_IMPORT_GATE": str(gate)}) as daemon:
        # The only child is held in its start-up (it imports b's tool), so the session waits to be loaded.
        session = daemon.new_session("a")
        turn_id = daemon.send(session, "hello", wait=False)["turn_id"]
        assert daemon.session(session)["child"] is None
        daemon.write_config(pool_config(tmp_path, a_model="a-new").replace('name = "b"\n', f'name = "b"\n{more}\n'))
        assert daemon.json("POST", "/v1/reload", status=200)["generation"] == 2
        gate.touch()
        turn = daemon.turn(session, turn_id)
        assert turn["status"] == "completed" and turn["models"] == ["a-new"]
        assert daemon.session(session)["generation"] == 2


def test_a_session_unloaded_across_two_reloads_loads_on_the_newest(tmp_path: Path) -> None:
    (tmp_path / "hold-a").touch()
    supervisor = ONE_CHILD + '\nidle_unload = "300ms"'
    with running_daemon(tmp_path, pool_config(tmp_path, supervisor=supervisor)) as daemon:
        session = daemon.new_session("a")
        assert daemon.send(session, "one")["turn"]["models"] == ["a-old"]
        daemon.wait_log("session.unloaded", lambda d: d["session"] == session)
        assert daemon.session(session)["child"] is None
        assert daemon.status()["sessions"]["loaded"] == 0

        for generation, model in ((2, "a-new"), (3, "a-newer")):
            daemon.write_config(pool_config(tmp_path, a_model=model, supervisor=supervisor))
            result = daemon.json("POST", "/v1/reload", status=200)
            assert result["generation"] == generation and result["swapped_total"] == 1
            # Not loaded, so idle: it takes the swap at once, without a process.
            view = daemon.session(session)
            assert (view["generation"], view["model"], view["child"]) == (generation, model, None)

        reply = daemon.send(session, "two")
        assert reply["turn"]["models"] == ["a-newer"]
        assert reply["messages"][-1]["content"] == "[a-newer] You said: two"
        assert daemon.session(session)["generation"] == 3
        loads = [e for e in daemon.log_events("session.loaded") if e["session"] == session]
        assert len(loads) == 2
        metrics = daemon.api("GET", "/metrics").text
        assert "agentd_session_loads_total 2.0" in metrics and "agentd_session_unloads_total" in metrics


def test_one_session_per_child_gives_each_loaded_session_its_own_process(tmp_path: Path) -> None:
    for hold in ("hold-a", "hold-b"):
        (tmp_path / hold).touch()
    supervisor = "children = 2\nsessions_per_child = 1\nspare_children = 1"
    with running_daemon(tmp_path, pool_config(tmp_path, supervisor=supervisor)) as daemon:
        sessions = [daemon.new_session("a") for _ in range(3)]
        for session in sessions:
            assert daemon.send(session, "hi")["turn"]["status"] == "completed"
        pids = [loaded_on(daemon, s) for s in sessions]
        assert len(set(pids)) == 3
        assert all(c["sessions"] <= 1 for c in daemon.status()["children"])


# --------------------------------------------------------------------------- crash containment


def test_a_session_whose_tool_kills_its_child_never_fails_its_bystanders(tmp_path: Path) -> None:
    killer = """
[[assistants]]
name = "killer"
first_message_mode = "assistant-waits-for-user"
tools = ["tests.tooling:kill_child"]
"""
    supervisor = 'children = 1\nspare_children = 1\nspawn_timeout = "60s"'
    with running_daemon(tmp_path, pool_config(tmp_path, supervisor=supervisor, more=killer)) as daemon:
        bystanders = [daemon.new_session("a") for _ in range(4)]
        turns = held_turns(daemon, bystanders)
        culprit = daemon.new_session("killer")

        result = daemon.send(culprit, "please kill_child")
        assert result["turn"]["status"] == "failed"
        assert "crashes" in result["turn"]["error"]
        assert daemon.session(culprit)["state"] == "failed"
        # Bounded: quarantined after 2 crashes, failed after more than 5 — never an endless cycle.
        assert sum(line.startswith("kill_child") for line in tool_log(tmp_path)) == 6
        assert daemon.log_events("session.quarantined")

        (tmp_path / "hold-a").touch()
        for session in bystanders:
            turn_id, events = turns[session]
            done = events.wait("turn.done", lambda d, t=turn_id: d["turn"] == t)
            assert done["status"] == "completed", done
            assert daemon.session(session)["state"] == "idle"
            assert daemon.send(session, "and again")["turn"]["status"] == "completed"
        # The failed session is kept and resumable by a new message.
        assert daemon.send(culprit, "hello")["turn"]["status"] == "completed"
        assert daemon.session(culprit)["state"] == "idle"


def test_a_tool_that_blocks_its_child_ends_the_turn_at_its_deadline(tmp_path: Path) -> None:
    (tmp_path / "hold-a").touch()
    blocker = """
[[assistants]]
name = "blocker"
first_message_mode = "assistant-waits-for-user"
tools = ["tests.tooling:block_child"]
"""
    supervisor = 'children = 1\nspare_children = 1\nping_interval = "200ms"\nping_timeout = "1s"'
    limits = '[limits]\ndeadline = "4s"\n'
    with running_daemon(tmp_path, pool_config(tmp_path, supervisor=supervisor, top=limits, more=blocker)) as daemon:
        other = daemon.new_session("a")
        session = daemon.new_session("blocker")
        result = daemon.send(session, "please block_child")
        assert result["turn"]["status"] == "deadline", result["turn"]
        assert daemon.session(session)["state"] == "idle"
        # Every blocked child was killed by the ladder and reaped; the session and the others go on.
        assert daemon.log_events("child.unresponsive")
        assert daemon.send(other, "fine?")["turn"]["status"] == "completed"
        assert daemon.send(session, "hello")["turn"]["status"] == "completed"


def test_a_stopped_child_is_killed_and_its_turn_reruns_elsewhere(tmp_path: Path) -> None:
    supervisor = 'children = 1\nspare_children = 1\nping_interval = "200ms"\nping_timeout = "1s"'
    with running_daemon(tmp_path, pool_config(tmp_path, supervisor=supervisor)) as daemon:
        session = daemon.new_session("a")
        turn_id, events = held_turns(daemon, [session])[session]
        pid = loaded_on(daemon, session)
        os.kill(pid, signal.SIGSTOP)
        try:
            daemon.wait_log("child.unresponsive", lambda d: d["pid"] == pid)
            events.wait("step.started", lambda d: d["turn"] == turn_id)
        finally:
            with contextlib.suppress(ProcessLookupError):  # never leave a stopped process behind
                os.kill(pid, signal.SIGCONT)
        wait_until(lambda: daemon.session(session)["child"] not in (None, pid), "the turn to re-run elsewhere")
        (tmp_path / "hold-a").touch()
        done = events.wait("turn.done", lambda d: d["turn"] == turn_id)
        assert done["status"] == "completed"
        assert len([e for e in daemon.entries(session, turn_id) if e["role"] == "user"]) == 1


FORKER = """
[[assistants]]
name = "forker"
first_message_mode = "assistant-waits-for-user"
tools = ["tests.tooling:leave_grandchild", "tests.tooling:hold_with_grandchild"]
"""


def grandchildren(tmp: Path) -> list[int]:
    """The pids of the processes the test tools forked (``grandchild <pid>`` in the tool log)."""
    return [int(line.split()[1]) for line in tool_log(tmp) if line.startswith("grandchild ")]


@contextlib.contextmanager
def killing_grandchildren(tmp: Path) -> Iterator[None]:
    """Whatever the test's outcome, leave none of the tools' grandchildren running."""
    try:
        yield
    finally:
        for pid in grandchildren(tmp):
            if pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def test_a_child_killed_while_its_grandchild_holds_the_channel_is_replaced_at_once(tmp_path: Path) -> None:
    """The grandchild keeps the control socket (and stderr) open, so no EOF tells of the death; with
    pings 10 minutes apart, only watching the child's exit can notice it within the test."""
    supervisor = 'children = 1\nspare_children = 0\nspawn_timeout = "60s"\nping_interval = "10m"\nping_timeout = "10m"'
    with (
        killing_grandchildren(tmp_path),
        running_daemon(tmp_path, pool_config(tmp_path, supervisor=supervisor, more=FORKER)) as daemon,
    ):
        session = daemon.new_session("forker")
        turn_id = daemon.send(session, "please hold_with_grandchild", wait=False)["turn_id"]
        grandchild = wait_until(lambda: grandchildren(tmp_path), "the tool to fork a grandchild")[0]
        wait_until(lambda: any(line.startswith("held-start") for line in tool_log(tmp_path)), "the tool to hold")
        child = loaded_on(daemon, session)
        os.kill(child, signal.SIGKILL)
        (tmp_path / "tool.gate").touch()  # a re-run that runs the tool again would not be held
        turn = daemon.turn(session, turn_id)
        assert turn["status"] == "completed", turn
        assert [e["session"] for e in daemon.log_events("turn.rerun")] == [session]
        assert any(e["pid"] == child for e in daemon.log_events("child.exit"))
        assert daemon.session(session)["child"] not in (None, child)
        # The grandchild went down with its child's process group when the child was reaped.
        wait_until(lambda: not pid_alive(grandchild), "the grandchild to be killed with its child")
        assert any(e["pid"] == child for e in daemon.log_events("child.leftovers_killed"))


def test_stopping_the_daemon_kills_what_a_tool_left_running_in_its_child(tmp_path: Path) -> None:
    (tmp_path / "hold-a").touch()
    with killing_grandchildren(tmp_path), running_daemon(tmp_path, pool_config(tmp_path, more=FORKER)) as daemon:
        session = daemon.new_session("forker")
        assert daemon.send(session, "please leave_grandchild")["turn"]["status"] == "completed"
        [grandchild] = grandchildren(tmp_path)
        assert pid_alive(grandchild)
        assert daemon.stop() == 0
        wait_until(lambda: not pid_alive(grandchild), "the grandchild to be killed when agentd stopped")
        assert daemon.log_events("child.leftovers_killed")


# --------------------------------------------------------------------------- the pool's shape


def faked_cpus(count: int) -> dict[str, str]:
    """The daemon's environment additions that make it believe it may use ``count`` CPUs
    (``tests/fake_cpus/sitecustomize.py`` fakes the affinity mask; agentd counts as it always does)."""
    path = os.pathsep.join(filter(None, [str(REPO / "tests" / "fake_cpus"), str(REPO), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "AGENTD_TEST_FAKE_CPUS": str(count)}


def pool_states(daemon: Daemon) -> list[str]:
    """The roles of the pool's children (``children[].state`` of /v1/status), sorted."""
    return sorted(c["state"] for c in daemon.status()["children"])


def test_a_default_pool_on_a_large_host_starts_lean_grows_with_load_and_shrinks_back(tmp_path: Path) -> None:
    """Every pool key at its default on a host faked to have 32 CPUs, but ``sessions_per_child``
    (small, so a few sessions need several children) and ``idle_unload`` (short, so the shrink is
    seen within the test). Counts are asserted, never how long anything took."""
    supervisor = 'sessions_per_child = 2\nidle_unload = "500ms"\nspawn_timeout = "60s"'
    text = pool_config(tmp_path, supervisor=supervisor)
    with running_daemon(tmp_path, text, env=faked_cpus(32)) as daemon:
        [started] = daemon.wait_log("pool.started")
        assert (started["cpus"], started["spread"], started["children"]) == (32, 32, 0), started
        assert started["spare_children"] == 1
        # At start: the spare alone — at most spare_children + 1 children, not one per CPU.
        at_start = wait_until(lambda: (s := pool_states(daemon)) and "starting" not in s and s, "the spare to be Ready")
        assert len(at_start) <= 1 + 1 and at_start == ["spare"], at_start

        # Load: six sessions, each with a turn held mid model call, two at most per child.
        sessions = [daemon.new_session("a") for _ in range(6)]
        turns = held_turns(daemon, sessions)
        hosts = {loaded_on(daemon, s) for s in sessions}
        assert len(hosts) >= 3, "six sessions at two per child need at least three children"
        grown = daemon.status()["children"]
        assert sum(c["state"] == "active" for c in grown) >= 3
        assert all(c["sessions"] <= 2 for c in grown)

        (tmp_path / "hold-a").touch()
        for session, (turn_id, events) in turns.items():
            done = events.wait("turn.done", lambda d, t=turn_id: d["turn"] == t)
            assert done["status"] == "completed", (session, done)

        # Idle: the sessions are unloaded, then the children that hosted them are retired; the
        # spare stays warm.
        wait_until(
            lambda: daemon.status()["sessions"]["loaded"] == 0 and pool_states(daemon) == ["spare"],
            "the pool to shrink back to its spare",
        )
        retired = {e["pid"] for e in daemon.log_events("child.retired") if e["role"] == "active"}
        assert hosts <= retired, (hosts, retired)
        assert all(not pid_alive(pid) for pid in hosts)
        # Shrunk, it still serves: the next message takes the spare (and another is started).
        assert daemon.send(sessions[0], "again")["turn"]["status"] == "completed"
        assert not daemon.log_events("turn.rerun"), "a shrink never cuts a turn"


def test_a_reload_that_shrinks_the_pool_drains_children_and_cuts_no_turn(tmp_path: Path) -> None:
    (tmp_path / "hold-b").touch()
    wide = "children = 3\nsessions_per_child = 1\nmax_children = 6\nspare_children = 1"
    with running_daemon(tmp_path, pool_config(tmp_path, supervisor=wide)) as daemon:
        sessions = [daemon.new_session("a") for _ in range(3)]
        turns = held_turns(daemon, sessions)
        assert len({loaded_on(daemon, s) for s in sessions}) == 3
        narrow = "children = 1\nsessions_per_child = 1\nmax_children = 1\nspare_children = 0"
        daemon.write_config(pool_config(tmp_path, supervisor=narrow))
        result = daemon.json("POST", "/v1/reload", status=200)
        assert "supervisor.max_children" in result["changed"]
        wait_until(
            lambda: sum(c["state"] == "draining" for c in daemon.status()["children"]) >= 2,
            "the surplus children to drain",
        )
        (tmp_path / "hold-a").touch()
        for session, (turn_id, events) in turns.items():
            done = events.wait("turn.done", lambda d, t=turn_id: d["turn"] == t)
            assert done["status"] == "completed" and done["restarts"] == 0, (session, done)
        wait_until(lambda: len(daemon.status()["children"]) == 1, "the pool to shrink to one child")
        assert all(daemon.send(s, "more")["turn"]["status"] == "completed" for s in sessions)
        assert not daemon.log_events("turn.rerun"), "a shrink never cuts a turn"


def test_a_reload_that_lowers_idle_unload_applies_it_at_once(tmp_path: Path) -> None:
    """With ``idle_unload = "1h"`` the idle scan runs every 30 s (a quarter, capped at 30 s). The
    test waits at most 15 s after the reload, so only the lowered value's interval can unload the
    session in time."""
    (tmp_path / "hold-a").touch()
    with running_daemon(tmp_path, pool_config(tmp_path, supervisor=ONE_CHILD + '\nidle_unload = "1h"')) as daemon:
        session = daemon.new_session("a")
        assert daemon.send(session, "hi")["turn"]["status"] == "completed"
        assert daemon.status()["sessions"]["loaded"] == 1
        daemon.write_config(pool_config(tmp_path, supervisor=ONE_CHILD + '\nidle_unload = "300ms"'))
        assert "supervisor.idle_unload" in daemon.json("POST", "/v1/reload", status=200)["changed"]
        wait_until(lambda: daemon.status()["sessions"]["loaded"] == 0, "the idle session to be unloaded", timeout=15)
        assert [e["session"] for e in daemon.log_events("session.unloaded")] == [session]
        assert daemon.session(session)["child"] is None


def test_the_supervisor_spends_no_thread_per_child(tmp_path: Path) -> None:
    (tmp_path / "hold-a").touch()
    isolated = "children = 2\nsessions_per_child = 1\nmax_children = 16\nspare_children = 1"
    with running_daemon(tmp_path, pool_config(tmp_path, supervisor=isolated)) as daemon:
        assert daemon.process is not None
        first = daemon.new_session("a")
        daemon.send(first, "hi")
        threads = len(os.listdir(f"/proc/{daemon.process.pid}/task"))
        more = [daemon.new_session("a") for _ in range(8)]
        for session in more:
            daemon.send(session, "hi")
        assert len({loaded_on(daemon, s) for s in [first, *more]}) == 9
        assert len(os.listdir(f"/proc/{daemon.process.pid}/task")) <= threads + 1


def test_a_stopped_child_cannot_hold_up_a_reload_that_sends_it_a_large_frame(tmp_path: Path) -> None:
    supervisor = 'children = 1\nspare_children = 1\nping_interval = "200ms"\nping_timeout = "1s"'
    # A system prompt larger than the socket's buffer: the SwapIntel cannot be written to a child
    # that does not read.
    big = "p" * 3_000_000
    text = pool_config(tmp_path, supervisor=supervisor).replace('name = "a"\n', f'name = "a"\nsystem = "{big}"\n', 1)
    (tmp_path / "hold-a").touch()
    with running_daemon(tmp_path, text) as daemon:
        session = daemon.new_session("a")
        assert daemon.send(session, "hi")["turn"]["status"] == "completed"
        pid = loaded_on(daemon, session)
        os.kill(pid, signal.SIGSTOP)
        try:
            daemon.write_config(text.replace('model = "a-old"', 'model = "a-new"'))
            result = daemon.json("POST", "/v1/reload", status=200)  # answered, not stuck behind the child
            assert result["generation"] == 2
            daemon.wait_log("child.unresponsive", lambda d: d["pid"] == pid)
            wait_until(lambda: pid not in {c["pid"] for c in daemon.status()["children"]}, "the stopped child to go")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        reply = daemon.send(session, "again")
        assert reply["turn"]["status"] == "completed" and reply["turn"]["models"] == ["a-new"]


def test_a_turn_that_no_child_can_take_ends_at_its_deadline_and_readiness_says_why(tmp_path: Path) -> None:
    """Children that cannot start (here: a spawn timeout no child can meet) never strand a turn:
    it ends ``deadline`` and /v1/ready names the cause; a reload that fixes it makes turns work."""
    broken = 'spawn_timeout = "10ms"\nchildren = 1\nspare_children = 0'
    text = pool_config(tmp_path, supervisor=broken, more='[limits]\ndeadline = "3s"\n')
    (tmp_path / "hold-a").touch()
    with running_daemon(tmp_path, text) as daemon:
        session = daemon.new_session("a")
        turn = daemon.send(session, "hello")["turn"]
        assert turn["status"] == "deadline" and "no child could take the turn" in turn["error"], turn
        ready = wait_until(lambda: (r := daemon.api("GET", "/v1/ready")).status_code == 503 and r, "not ready")
        assert any("no child can start" in reason for reason in ready.json()["reasons"]), ready.json()
        assert daemon.session(session)["state"] == "idle"
        daemon.write_config(pool_config(tmp_path, supervisor="children = 1", more='[limits]\ndeadline = "3s"\n'))
        assert daemon.json("POST", "/v1/reload", status=200)["applied"]
        after = wait_until(
            lambda: (t := daemon.send(session, "again")["turn"])["status"] == "completed" and t, "a turn"
        )
        assert after["status"] == "completed"
        wait_until(lambda: daemon.api("GET", "/v1/ready").status_code == 200, "ready again")
