"""Several ``agentd run`` replicas on one PostgreSQL database (RFC 0009 §7), end to end.

Real processes on the suite's server, each replica with a state dir (and socket) of its own and a
short lease. "Mid-turn" is an event — the scripted model of assistant ``held`` waits for the hold
file — and takeovers are waited for as log events, never guessed with a sleep.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from agentd.store import EVENTS, ORPHANS
from agentd.supervisor.relay import Reassembler, RelayedEvent
from tests.daemon_harness import Daemon, child_pids_of, two_assistant_config, wait_until
from tests.pg_harness import PgServer

pytestmark = pytest.mark.e2e

MODEL = "echo-small"
LEASE = "2s"
ONE_CHILD = "children = 1\nspare_children = 0"


@contextlib.contextmanager
def replicas(
    tmp: Path,
    pg: PgServer,
    count: int,
    *,
    supervisor: str = ONE_CHILD,
    lease: str = LEASE,
    more: str = "",
    env: dict[str, str] | None = None,
) -> Iterator[tuple[list[Daemon], Path]]:
    """``count`` replicas on one new database (lease 2s); they and the hold file they share.
    ``more`` is added to the config, ``env`` to every replica's environment."""
    hold = tmp / "hold"
    with pg.database() as url:
        top = f'[store]\nurl = "{url}"\nlease = "{lease}"\n'
        config = two_assistant_config(hold, top=top, supervisor=supervisor) + more
        started: list[Daemon] = []
        try:
            for index in range(count):
                home = tmp / f"r{index}"
                home.mkdir()
                replica_env = {**(env or {}), "AGENTD_REPLICA_ID": f"r{index}"}
                started.append(Daemon(home, config, env=replica_env, state_dir=home / "state").start())
            yield started, hold
        finally:
            hold.touch()  # nothing stays held while the replicas stop
            for daemon in started:
                with contextlib.suppress(ProcessLookupError):
                    if daemon.process is not None and daemon.process.poll() is None:
                        os.kill(daemon.process.pid, signal.SIGCONT)
                daemon.stop()


def answers(daemon: Daemon, session: str, turn: str) -> list[Any]:
    """The assistant entries a turn committed (exactly one when it was committed once)."""
    return [e for e in daemon.entries(session, turn) if e["role"] == "assistant"]


def kill_replica(daemon: Daemon) -> None:
    """kill -9 of a replica, its children with it (a pod that vanished)."""
    assert daemon.process is not None
    children = child_pids_of(daemon.process.pid)
    daemon.process.kill()
    daemon.process.wait()
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_any_replica_serves_any_session(tmp_path: Path, pg: PgServer) -> None:
    with replicas(tmp_path, pg, 3) as (started, _hold):
        a, b, c = started
        session = a.new_session("main")
        reply = b.send(session, "hello from b")  # posted to a replica that did not create it
        assert reply["turn"]["status"] == "completed"
        assert reply["messages"][-1]["content"] == f"[{MODEL}] You said: hello from b"
        seen = c.session(session)  # visible on a third
        assert [t["status"] for t in seen["turns"]] == ["completed"]
        assert seen["transcript"][-1]["content"] == f"[{MODEL}] You said: hello from b"

        accepted = c.send(session, "and from c", wait=False)
        assert a.turn(session, accepted["turn_id"])["status"] == "completed"
        assert [e["content"] for e in answers(b, session, accepted["turn_id"])] == [f"[{MODEL}] You said: and from c"]
        again = a.send(session, "back on a")  # a's copy of the session is stale: it reloads it
        assert again["turn"]["status"] == "completed"
        assert len(a.session(session)["turns"]) == 3

        def all_live() -> Any:
            status = a.status()
            return status if len(status["replicas"]) == 3 else None

        status = all_live() or wait_until(all_live, "three live replicas")
        assert status["replica"] == "r0"
        assert [r["id"] for r in status["replicas"]] == ["r0", "r1", "r2"]
        assert all(r["generation"] == 1 for r in status["replicas"])
        for daemon in started:  # every replica released its leases after its turns
            assert not daemon.log_events("session.lease_lost")


def test_a_killed_owner_mid_turn_is_taken_over_and_the_turn_commits_once(tmp_path: Path, pg: PgServer) -> None:
    with replicas(tmp_path, pg, 3) as (started, hold):
        a, b, c = started
        session = a.new_session("held")
        turn = a.send(session, "hold this", wait=False)["turn_id"]
        a.wait_log("session.loaded", lambda r: r.get("session") == session)  # on a's child, held
        kill_replica(a)
        adopted = wait_until(
            lambda: [d for d in (b, c) if d.log_events("session.adopted")], "another replica to adopt the session"
        )
        [taker] = adopted
        [event] = taker.log_events("session.adopted")
        assert event["session"] == session and event["turn"] == turn
        hold.touch()
        record = taker.turn(session, turn)
        assert record["status"] == "completed"
        other = c if taker is b else b
        assert [e["content"] for e in answers(other, session, turn)] == [f"[{MODEL}] You said: hold this"]
        assert [t["id"] for t in other.session(session)["turns"]] == [turn]


TOOLED = """
[[assistants]]
name = "tooled"
first_message_mode = "assistant-waits-for-user"
tools = ["tests.tooling:held"]
"""


def test_a_side_effecting_tool_cut_off_by_its_replicas_death_is_never_run_again(tmp_path: Path, pg: PgServer) -> None:
    """The owner dies while a side-effecting tool runs: the replica that adopts the turn finds the
    call in the journal with no result, never runs it again, and the turn completes (RFC 0008 §5)."""
    tool_log, gate = tmp_path / "tools.log", tmp_path / "tool.gate"
    shared = {"AGENTD_TEST_TOOL_LOG": str(tool_log), "AGENTD_TEST_GATE": str(gate)}
    with replicas(tmp_path, pg, 2, more=TOOLED, env=shared) as (started, _hold):
        a, b = started
        session = a.new_session("tooled")
        turn = a.send(session, "call tool held", wait=False)["turn_id"]
        wait_until(lambda: tool_log.exists() and "held-start" in tool_log.read_text(), "the tool to start on a")
        kill_replica(a)
        b.wait_log("session.adopted", lambda r: r.get("session") == session)
        gate.touch()  # were it run again, it would finish now
        record = b.turn(session, turn)
        assert record["status"] == "completed", record
        starts = [line for line in tool_log.read_text().splitlines() if line.startswith("held-start")]
        assert len(starts) == 1, tool_log.read_text()
        tool_entries = [e for e in b.entries(session, turn) if e["role"] == "tool"]
        assert tool_entries and tool_entries[0].get("outcome_unknown") is True, tool_entries


def test_a_paused_replica_past_its_lease_cannot_commit_after_it_resumes(tmp_path: Path, pg: PgServer) -> None:
    with replicas(tmp_path, pg, 2) as (started, hold):
        a, b = started
        session = a.new_session("held")
        turn = a.send(session, "hold this", wait=False)["turn_id"]
        a.wait_log("session.loaded", lambda r: r.get("session") == session)
        assert a.process is not None
        a.signal(signal.SIGSTOP)  # its child runs on; the supervisor is frozen past its lease
        b.wait_log("session.adopted", lambda r: r.get("session") == session)
        hold.touch()  # both children finish the model call; only b may commit
        assert b.turn(session, turn)["status"] == "completed"
        a.signal(signal.SIGCONT)
        # The heartbeat, the commit of the result a's child sent, or both find the lease gone.
        a.wait_log("session.lease_lost", lambda r: r.get("session") == session)
        assert [e["content"] for e in answers(b, session, turn)] == [f"[{MODEL}] You said: hold this"]
        assert [t["status"] for t in a.session(session)["turns"]] == ["completed"]
        assert a.send(session, "a again")["turn"]["status"] == "completed"  # a serves it again, reloaded
        assert len(answers(b, session, a.session(session)["turns"][-1]["id"])) == 1


def test_a_drained_replica_releases_its_leases_and_another_takes_over(tmp_path: Path, pg: PgServer) -> None:
    # A long lease: the takeover cannot come from expiry within the test, only from the release.
    with replicas(tmp_path, pg, 2, supervisor=ONE_CHILD + '\nstop_grace = "1s"', lease="600s") as (started, hold):
        a, b = started
        session = a.new_session("held")
        turn = a.send(session, "hold this", wait=False)["turn_id"]
        a.wait_log("session.loaded", lambda r: r.get("session") == session)
        a.signal(signal.SIGTERM)  # the held turn outlives stop_grace: it is cut and its lease released
        a.wait_exit()
        [released] = a.log_events("session.released")
        assert released["session"] == session
        b.wait_log("session.adopted", lambda r: r.get("session") == session and r.get("turn") == turn)
        hold.touch()
        assert b.turn(session, turn)["status"] == "completed"
        assert [e["content"] for e in answers(b, session, turn)] == [f"[{MODEL}] You said: hold this"]


def test_events_and_cancel_on_a_replica_that_does_not_run_the_turn(tmp_path: Path, pg: PgServer) -> None:
    with replicas(tmp_path, pg, 2) as (started, _hold):
        a, b = started
        session = a.new_session("held")
        stream = b.events(session)  # b watches; the turns run on a
        turn = a.send(session, "hold this", wait=False)["turn_id"]
        a.wait_log("session.loaded", lambda r: r.get("session") == session)
        cancelled = b.json("POST", f"/v1/sessions/{session}/cancel", status=202)
        assert cancelled == {"turn_id": turn, "cancelling": True}
        assert a.turn(session, turn)["status"] == "cancelled"
        done = stream.wait("turn.done", lambda data: data.get("turn") == turn)
        assert done["status"] == "cancelled"


def events_of(stream: Any, turn: str) -> list[tuple[str, dict[str, Any]]]:
    """The events of ``turn`` a stream got, up to and with its ``turn.done`` (waited for)."""
    stream.wait("turn.done", lambda data: data.get("turn") == turn)
    return [(name, data) for name, data in stream.seen if data.get("turn") == turn]


def test_a_remote_subscriber_gets_every_event_of_a_turn_in_order(tmp_path: Path, pg: PgServer) -> None:
    """Subscribers on replicas that do not run a turn get the same events, in the same order, as
    one on the replica that runs it: progress events (a tool call, an event far over PostgreSQL's
    8,000-byte notification limit, non-ASCII text) and then ``turn.done`` — across turns that run
    on different replicas (RFC 0009 §7)."""
    with replicas(tmp_path, pg, 3) as (started, _hold):
        a, b, c = started
        session = a.new_session("main")
        on_b, on_c = b.events(session), c.events(session)
        long_text = "é✓ ünïcode " * 1500  # about 17,000 bytes of reply, escaped into several notifications
        first = b.send(session, f"call tool clock {long_text}")["turn"]["id"]  # b runs it
        local, remote = events_of(on_b, first), events_of(on_c, first)
        names = [name for name, _ in local]
        assert names[0] == "turn.started" and names[-1] == "turn.done", names
        assert {"step.started", "step.done", "tool.call", "tool.result"} <= set(names), names
        assert remote == local
        step_done = [data for name, data in remote if name == "step.done"][-1]
        assert long_text.strip() in step_done["content"]

        second = a.send(session, "and now on a")["turn"]["id"]  # a runs it; b and c both watch from afar
        on_a_later = events_of(on_b, second), events_of(on_c, second)
        assert on_a_later[0] == on_a_later[1]
        assert [name for name, _ in on_a_later[0]][-1] == "turn.done"
        assert "step.done" in [name for name, _ in on_a_later[0]]
        seen_on_c = [data.get("turn") for name, data in on_c.seen if name == "turn.done"]
        assert seen_on_c == [first, second]  # in order, once each


def test_a_replica_started_after_the_subscriber_still_relays_to_it(tmp_path: Path, pg: PgServer) -> None:
    """The replica that runs a turn learns of remote subscribers from the store when it claims the
    session, not only from notifications: one that started after the subscription (it heard no
    notice, and with a 30 s lease the next one is 10 s away) relays the turn's events all the same."""
    with replicas(tmp_path, pg, 1, lease="30s") as (started, _hold):
        [a] = started
        session = a.new_session("main")
        stream = a.events(session)
        home = tmp_path / "late"
        home.mkdir()
        late = Daemon(home, a.config_path.read_text(), env={"AGENTD_REPLICA_ID": "late"}, state_dir=home / "state")
        try:
            late.start()
            turn = late.send(session, "call tool clock please")["turn"]["id"]  # runs on the late replica
            got = [name for name, _ in events_of(stream, turn)]
            assert {"turn.started", "step.done", "tool.call", "tool.result"} <= set(got), got
        finally:
            late.stop()


def test_a_turn_that_ended_while_a_watcher_could_not_listen_still_reaches_its_stream(
    tmp_path: Path, pg: PgServer
) -> None:
    """The watching replica's listening connection is lost (its server process terminated while
    the replica is paused) and a turn ends meanwhile: its notice is lost with the connection. Once
    listening again the replica catches up from the store: the stream gets the turn's ``turn.done``."""
    with replicas(tmp_path, pg, 2) as (started, _hold):
        a, b = started
        session = a.new_session("main")
        stream = b.events(session)
        b.signal(signal.SIGSTOP)
        try:
            pg.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query LIKE 'LISTEN %'")
            turn = a.send(session, "while b is away")["turn"]["id"]
        finally:
            b.signal(signal.SIGCONT)
        done = stream.wait("turn.done", lambda data: data.get("turn") == turn)
        assert done["status"] == "completed"
        assert b.log_events("replica.listen_gap")
        assert [data["turn"] for name, data in stream.seen if name == "turn.done"] == [turn]  # once


def test_a_subscriber_that_joins_mid_turn_on_another_replica_gets_the_rest_of_it(tmp_path: Path, pg: PgServer) -> None:
    with replicas(tmp_path, pg, 2) as (started, hold):
        a, b = started
        session = a.new_session("held")
        turn = a.send(session, "hold this", wait=False)["turn_id"]  # a runs it; its model call waits
        a.wait_log("session.loaded", lambda r: r.get("session") == session)
        stream = b.events(session)
        a.wait_log("session.relayed", lambda r: r.get("session") == session and r.get("to") == "r1")
        hold.touch()
        got = [name for name, _ in events_of(stream, turn)]
        assert "step.done" in got and got[-1] == "turn.done", got


def test_closing_a_session_on_a_replica_that_does_not_run_its_turn_cancels_the_turn(
    tmp_path: Path, pg: PgServer
) -> None:
    with replicas(tmp_path, pg, 2) as (started, _hold):
        a, b = started
        session = a.new_session("held")
        turn = a.send(session, "hold this", wait=False)["turn_id"]  # a runs it; its model call waits
        a.wait_log("session.loaded", lambda r: r.get("session") == session)
        closed = b.json("DELETE", f"/v1/sessions/{session}", status=200)
        assert closed["state"] == "closed"
        record = b.turn(session, turn)  # the hold is never released: only a cancel ends it
        assert record["status"] == "cancelled", record
        assert answers(b, session, turn) == []
        assert a.session(session)["state"] == "closed"

        def refused_on_a() -> bool:  # a dropped what it held of the session: it is gone there too
            response = a.api("POST", f"/v1/sessions/{session}/messages", {"content": "still there?"})
            return response.status_code == 404

        wait_until(refused_on_a, "the closed session to be gone on a")
        a.wait_log("session.closed", lambda r: r.get("session") == session and r.get("elsewhere") is True)


def test_a_cancel_whose_replica_died_is_kept_and_the_adopter_ends_the_turn_cancelled(
    tmp_path: Path, pg: PgServer
) -> None:
    """The replica running the turn is killed; a cancel asked on another one, while the dead one's
    lease still holds, is kept in the store: the replica that adopts the turn ends it ``cancelled``
    and never runs it (RFC 0009 §7)."""
    with replicas(tmp_path, pg, 2, lease="3s") as (started, _hold):
        a, b = started
        session = a.new_session("held")
        turn = a.send(session, "hold this", wait=False)["turn_id"]
        a.wait_log("session.loaded", lambda r: r.get("session") == session)
        kill_replica(a)
        assert b.json("POST", f"/v1/sessions/{session}/cancel", status=202)["turn_id"] == turn
        record = b.turn(session, turn)  # ended once the lease expired and b adopted the turn
        assert record["status"] == "cancelled" and "before it resumed" in record["error"], record
        assert answers(b, session, turn) == []
        assert b.send(session, "and now", wait=False)["turn_id"]


def test_a_reload_of_one_replica_shows_in_the_status_of_every_replica(tmp_path: Path, pg: PgServer) -> None:
    with replicas(tmp_path, pg, 2) as (started, _hold):
        a, b = started
        b.write_config(b.config_path.read_text().replace('model = "echo-small"', 'model = "echo-large"', 1))
        b.reload_via_signal()
        b.wait_log("config.reload", lambda r: r.get("applied") is True and r.get("generation") == 2)

        def generations() -> Any:
            seen = {r["id"]: r["generation"] for r in a.status()["replicas"]}
            return seen if seen == {"r0": 1, "r1": 2} else None

        assert wait_until(generations, "r1's generation 2 in r0's status") == {"r0": 1, "r1": 2}
        assert a.status()["generation"] == 1 and b.status()["generation"] == 2


def test_chaos_replica_kills_while_clients_send_every_accepted_message_is_committed_once(
    tmp_path: Path, pg: PgServer
) -> None:
    """Clients post to random replicas while replicas are killed (-9) and replaced: accepted = committed."""
    rng = random.Random(11)
    with replicas(tmp_path, pg, 3) as (started, _hold):
        live = list(started)
        lock = threading.Lock()
        accepted: dict[str, str] = {}  # turn id -> session
        stop = threading.Event()
        sessions = [live[i % 3].new_session("main") for i in range(3)]

        def some_replica() -> Daemon:
            with lock:
                return rng.choice(live)

        def idle(session: str) -> bool:
            try:
                return all(t["status"] != "pending" for t in some_replica().session(session)["turns"])
            except (httpx.HTTPError, AssertionError):
                return False

        def client(session: str) -> None:
            sent = 0
            while not stop.is_set():
                wait_until(lambda: idle(session), f"session {session} to be idle", timeout=120)
                try:
                    response = some_replica().api(
                        "POST", f"/v1/sessions/{session}/messages", {"content": f"m{sent}", "wait": False}
                    )
                except httpx.HTTPError:
                    continue  # that replica is gone; the message may be stored, and then runs anyway
                if response.status_code == 202:
                    with lock:
                        accepted[response.json()["turn_id"]] = session
                    sent += 1

        threads = [threading.Thread(target=client, args=(s,), daemon=True) for s in sessions]
        for thread in threads:
            thread.start()
        for round_ in range(2):
            wait_until(lambda n=round_: len(accepted) >= 5 * (n + 1), "clients to get messages accepted")
            with lock:
                victim = live.pop(rng.randrange(len(live)))
            kill_replica(victim)
            home = tmp_path / f"replacement{round_}"
            home.mkdir()
            replacement = Daemon(
                home,
                victim.config_path.read_text(),
                env={"AGENTD_REPLICA_ID": f"new{round_}"},
                state_dir=home / "state",
            ).start()
            started.append(replacement)
            with lock:
                live.append(replacement)
        wait_until(lambda: len(accepted) >= 15, "more messages accepted after the kills")
        stop.set()
        for thread in threads:
            thread.join(120)
        reader = live[0]
        for session in sessions:
            wait_until(lambda s=session: idle(s), f"session {session} to end its turns", timeout=120)
        by_session = {s: reader.session(s) for s in sessions}
        for turn_id, session in accepted.items():
            view = by_session[session]
            [record] = [t for t in view["turns"] if t["id"] == turn_id]
            assert record["status"] == "completed", record
            assert len([e for e in view["transcript"] if e.get("turn") == turn_id and e["role"] == "assistant"]) == 1


def test_a_replica_restarted_under_its_own_id_takes_up_its_interrupted_turn(tmp_path: Path, pg: PgServer) -> None:
    """A Kubernetes pod keeps its name (``AGENTD_REPLICA_ID``) across a container restart: the new
    process is a new lease holder (RFC 0009 §7), so it neither renews nor skips the dead one's
    leases — the interrupted turn is adopted and committed once, and the session takes messages."""
    with replicas(tmp_path, pg, 1) as (started, hold):
        [a] = started
        session = a.new_session("held")
        turn = a.send(session, "hold this", wait=False)["turn_id"]
        a.wait_log("session.loaded", lambda r: r.get("session") == session)
        kill_replica(a)
        hold.touch()
        again = Daemon(a.tmp, env={"AGENTD_REPLICA_ID": "r0"}, state_dir=a.state_dir)
        started.append(again.start())
        assert again.turn(session, turn)["status"] == "completed"
        assert [e["content"] for e in answers(again, session, turn)] == [f"[{MODEL}] You said: hold this"]
        after = again.send(session, "and after the restart")
        assert after["turn"]["status"] == "completed"
        assert again.status()["replica"] == "r0"
        assert [r["id"] for r in again.status()["replicas"]] == ["r0"]  # one replica, not one per process


def test_a_second_live_replica_with_an_id_in_use_is_refused(tmp_path: Path, pg: PgServer) -> None:
    with replicas(tmp_path, pg, 1) as (started, _hold):
        [a] = started
        home = tmp_path / "twin"
        home.mkdir()
        twin = Daemon(home, a.config_path.read_text(), env={"AGENTD_REPLICA_ID": "r0"}, state_dir=home / "state")
        result = subprocess.run(twin.command(), env=twin.env, cwd=home, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, result.stderr[-2000:]
        assert "AGENTD_REPLICA_ID=r0 is in use by a live replica" in result.stderr
        session = a.new_session("main")
        assert a.send(session, "still served")["turn"]["status"] == "completed"


@contextlib.contextmanager
def relayed_events(url: str) -> Iterator[list[RelayedEvent]]:
    """Every event any replica relays on the database, decoded, as a listener of the channel sees it."""
    heard: list[RelayedEvent] = []
    stop = threading.Event()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"LISTEN {EVENTS}")

        def listen() -> None:
            reassembler = Reassembler()
            while not stop.is_set():
                for note in conn.notifies(timeout=0.1):
                    event = reassembler.feed(note.payload)
                    if event is not None:
                        heard.append(event)

        thread = threading.Thread(target=listen, daemon=True)
        thread.start()
        try:
            yield heard
        finally:
            stop.set()
            thread.join()


def test_a_run_whose_lease_was_lost_relays_nothing_more_and_nothing_follows_turn_done(
    tmp_path: Path, pg: PgServer
) -> None:
    """A replica loses the lease of a turn it runs (frozen while the lease ran out — a database
    restart or a partition does the same) and another replica adopts and commits the turn, whose
    subscribers get ``turn.done``. When the first resumes, what its child produced meanwhile is not
    relayed (fenced by the store like its commit), and no subscriber gets an event of the turn after
    its ``turn.done`` (RFC 0009 §7). The lease is long (30 s) so that the frozen replica still knows
    the remote subscriber when it resumes; the test ends the lease in the store itself."""
    with replicas(tmp_path, pg, 3, lease="30s") as (started, hold):
        a, b, c = started
        url = tomllib.loads(a.config_path.read_text())["store"]["url"]
        session = a.new_session("held")
        stream = c.events(session)
        with relayed_events(url) as heard:
            turn = a.send(session, "hold this", wait=False)["turn_id"]
            stream.wait("step.started", lambda data: data.get("turn") == turn)  # relayed from a, live
            # The test's own LISTEN hears the NOTIFY c relayed, in a thread of its own: maybe later.
            origin = wait_until(
                lambda: next((e.origin for e in list(heard) if e.turn == turn), None), "the relayed event"
            )
            a.signal(signal.SIGSTOP)  # it renews nothing now; its child runs on
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("UPDATE sessions SET lease_expires = 0 WHERE id = %s", (session,))
                conn.execute(f"NOTIFY {ORPHANS}")  # the other replicas' failover scans look now
            wait_until(
                lambda: [d for d in (b, c) if d.log_events("session.adopted")], "another replica to adopt the session"
            )
            hold.touch()  # both children finish the step; only the adopter's run may speak
            stream.wait("turn.done", lambda data: data.get("turn") == turn)
            a.signal(signal.SIGCONT)
            a.wait_log("session.lease_lost", lambda r: r.get("session") == session)
            # What a relays from now on goes after its late events (one ordered queue): a next turn
            # run on a is the barrier that shows they were not relayed before it.
            later = a.send(session, "after the pause")["turn"]["id"]
            stream.wait("turn.done", lambda data: data.get("turn") == later)
            wait_until(lambda: any(e.turn == later and e.name == "step.done" for e in heard), "a's later step.done")
        from_a = [e.name for e in heard if e.origin == origin and e.turn == turn]
        assert "step.done" not in from_a, from_a  # its child's step ended after the lease was lost
        names = [(name, data.get("turn")) for name, data in stream.seen]
        done_at = names.index(("turn.done", turn))
        assert not [n for n in names[done_at + 1 :] if n[1] == turn], names


def test_a_remote_subscriber_gets_the_same_deltas_in_order(tmp_path: Path, pg: PgServer) -> None:
    """Token deltas cross replicas like every other event (RFC 0005 §7, RFC 0009 §7): the same
    sequence on a replica that does not run the turn, in order, each one within PostgreSQL's
    notification limit however much text it carries, and adding up to the step's content."""
    streamer = '\n[[assistants]]\nname = "streamer"\nintelligence = { options = { chunk_ms = 1 } }\n'
    with replicas(tmp_path, pg, 2, more=streamer) as (started, _hold):
        a, b = started
        session = a.new_session("streamer")
        on_a, on_b = a.events(session), b.events(session)
        long_text = "é✓ ünïcode " * 900 + " ".join(f"w{i}" for i in range(300))  # big pieces and many small ones
        turn = a.send(session, long_text)["turn"]["id"]  # a runs it; b watches from afar
        local, remote = events_of(on_a, turn), events_of(on_b, turn)
        assert remote == local
        deltas = [data for name, data in remote if name == "delta"]
        assert deltas and all(d["run"] == 0 and d["step"] == 1 for d in deltas)
        content = [data for name, data in remote if name == "step.done"][-1]["content"]
        assert "".join(d.get("content", "") for d in deltas) == content == f"[{MODEL}] You said: {long_text}"
