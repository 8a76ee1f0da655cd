"""``agentd run`` on PostgreSQL (RFC 0009 §1), end to end through the real daemon and the suite's server.

One replica: the daemon opens the store ``[store] url`` names, with the password from the env var
``password_env`` names; sessions, transcripts and turns live in the database, not the state dir,
so a daemon restarted on another state dir finds them all.
"""

from __future__ import annotations

import secrets
import signal
from pathlib import Path

import psycopg
import pytest

from tests import pg_proxy
from tests.daemon_harness import Daemon, running_daemon, two_assistant_config
from tests.pg_harness import PgServer

pytestmark = pytest.mark.e2e

MODEL = "echo-small"


def postgres_config(url: str, hold: Path) -> str:
    store = f'[store]\nurl = "{url}"\npassword_env = "AGENTD_STORE_PASSWORD"\nlease = "10s"\n'
    return two_assistant_config(hold, top=store).replace(
        'tools = ["clock"]', 'tools = ["clock", "tests.tooling:env_names"]', 1
    )


def test_a_daemon_on_postgres_keeps_its_sessions_across_a_restart(tmp_path: Path, pg: PgServer) -> None:
    secret = f"pw-{secrets.token_hex(8)}"
    with pg.role(secret) as role, pg.database(owner=role) as url:
        config = postgres_config(url, tmp_path / "hold")
        env = {"AGENTD_STORE_PASSWORD": secret}
        first = Daemon(tmp_path, config, env=env, state_dir=tmp_path / "first").start()
        try:
            session = first.new_session("main")
            reply = first.send(session, "hello there")
            assert reply["turn"]["status"] == "completed"
            assert reply["messages"][-1]["content"] == f"[{MODEL}] You said: hello there"
            assert first.send(session, "call tool env_names")["turn"]["status"] == "completed"
            before = first.session(session)
            assert len(before["turns"]) == 2
            assert first.status()["sessions"]["open"] == 1
            assert first.api("GET", "/v1/ready").status_code == 200
            [started] = first.log_events("supervisor.started")
            assert started["store"].startswith("postgresql:///agentd_test_") and role not in started["store"]
            first.signal(signal.SIGTERM)
            assert first.wait_exit() == 0
        finally:
            first.stop()
        assert not (tmp_path / "first" / "agentd.db").exists()  # nothing of it went to SQLite

        # Another state dir: everything comes from the database.
        with running_daemon(tmp_path, env=env, state_dir=tmp_path / "second") as second:
            assert {**second.session(session), "child": None} == {**before, "child": None}
            again = second.send(session, "still there?")
            assert again["turn"]["status"] == "completed"
            assert again["messages"][-1]["content"] == f"[{MODEL}] You said: still there?"
            assert [s["id"] for s in second.json("GET", "/v1/sessions", status=200)] == [session]
            logs = first.log_text() + second.log_text()

    assert secret not in logs
    seen = [line.split() for line in (tmp_path / "tools.log").read_text().splitlines() if line.startswith("env ")]
    assert seen, "the env_names tool ran"
    for names in seen:  # tools never see the password, nor the variable that holds it
        assert "AGENTD_STORE_PASSWORD" not in names and secret not in names
        assert "AGENTD_LOG_LEVEL" in names


def test_a_daemon_whose_database_cannot_be_reached_exits_1_naming_it(tmp_path: Path) -> None:
    config = two_assistant_config(tmp_path / "hold", top='[store]\nurl = "postgresql://agentd@127.0.0.1:1/agentd"\n')
    daemon = Daemon(tmp_path, config)
    result = daemon.run_cli(*daemon.command()[3:])
    assert result.returncode == 1, result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("agentd: ")]
    assert line.startswith("agentd: cannot open the store postgresql://127.0.0.1:1/agentd: "), line


def test_a_turn_whose_commit_answer_was_lost_ends_as_the_child_reported_it_stored_once(
    tmp_path: Path, pg: PgServer
) -> None:
    """The connection to PostgreSQL is lost once the server committed the turn and before the daemon
    heard (RFC 0003 §3): the client waiting is told 503, the retry recognises the commit, and the
    turn ends as the child reported it — with its messages once — not ``failed``."""
    with pg.database() as url, pg_proxy.proxy_in_thread(url) as proxy:
        top = f'[store]\nurl = "{proxy.url(url)}"\nlease = "10s"\n'
        with running_daemon(tmp_path, two_assistant_config(tmp_path / "hold", top=top)) as daemon:
            session = daemon.new_session("main")
            events = daemon.events(session)
            proxy.arm(pg_proxy.TURN_COMMIT, pg_proxy.Cut.AFTER_REPLY)
            answer = daemon.api("POST", f"/v1/sessions/{session}/messages", {"content": "hello there", "wait": True})
            assert proxy.cut.is_set()
            assert answer.status_code == 503, answer.text  # the first commit failed, as far as the daemon knows
            error = answer.json()["error"]
            assert error["code"] == "store_unavailable"
            turn_id = error["turn"]

            reply = f"[{MODEL}] You said: hello there"
            done = events.wait("turn.done", lambda d: d["turn"] == turn_id)
            assert done["status"] == "completed"
            assert [m["content"] for m in done["messages"]] == [reply]
            assert daemon.turn(session, turn_id)["status"] == "completed"
            assert [(e["role"], e["content"]) for e in daemon.entries(session, turn_id)] == [
                ("user", "hello there"),
                ("assistant", reply),
            ]
            [logged] = daemon.wait_log("turn.done", lambda r: r.get("turn") == turn_id)
            assert logged["status"] == "completed"
            assert daemon.log_events("turn.commit_failed")
            assert [r["turn"] for r in daemon.log_events("turn.commit_recovered")] == [turn_id]
            assert not daemon.log_events("turn.commit_refused")

            again = daemon.send(session, "still there?")  # the session is usable as before
            assert again["turn"]["status"] == "completed"
            assert len(daemon.session(session)["turns"]) == 2


def test_a_retried_commit_the_store_refuses_ends_the_turn_failed_and_frees_the_session(
    tmp_path: Path, pg: PgServer
) -> None:
    """A commit that failed (the connection lost before its COMMIT reached the server) is retried;
    when the retry is refused — the turn ended otherwise meanwhile — the turn ends ``failed`` (RFC
    0003 §3) and the session takes the next message, rather than staying busy with a turn that
    will never commit."""
    with pg.database() as url, pg_proxy.proxy_in_thread(url) as proxy:
        top = f'[store]\nurl = "{proxy.url(url)}"\nlease = "10s"\n'
        with running_daemon(tmp_path, two_assistant_config(tmp_path / "hold", top=top)) as daemon:
            session = daemon.new_session("main")
            events = daemon.events(session)
            proxy.arm(pg_proxy.TURN_COMMIT, pg_proxy.Cut.BEFORE_COMMIT, every=True)  # every attempt is lost
            answer = daemon.api("POST", f"/v1/sessions/{session}/messages", {"content": "hello", "wait": True})
            assert answer.status_code == 503, answer.text
            turn_id = answer.json()["error"]["turn"]
            with psycopg.connect(url, autocommit=True) as conn:  # behind the daemon's back, not through the proxy
                conn.execute(
                    "UPDATE turns SET status = 'cancelled', ended_at = 1, error = 'ended elsewhere' WHERE id = %s",
                    (turn_id,),
                )
            proxy.disarm()

            done = events.wait("turn.done", lambda d: d["turn"] == turn_id)
            assert done["status"] == "failed"
            assert done["error"].startswith("the store refused the turn's results: "), done["error"]
            assert done["messages"] == []
            [refused] = daemon.wait_log("turn.commit_refused", lambda r: r.get("turn") == turn_id)
            assert "not pending (status cancelled)" in refused["error"]
            assert not daemon.log_events("turn.commit_recovered")
            again = daemon.send(session, "still there?")  # not 409 turn_running: the session is free
            assert again["turn"]["status"] == "completed"
