"""``agentd run`` on PostgreSQL (RFC 0009 §1), end to end through the real daemon and the suite's server.

One replica: the daemon opens the store ``[store] url`` names, with the password from the env var
``password_env`` names; sessions, transcripts and turns live in the database, not the state dir,
so a daemon restarted on another state dir finds them all.

Start-up before the database (tests/pg_front.py puts a port in front of the suite's server that
refuses, hangs, says "starting up", then forwards): the daemon waits, serving probes, and starts
once the database is there; SIGTERM stops the wait; a refusal for good exits 1 at once.
"""

from __future__ import annotations

import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from agentd.store import postgres
from tests import pg_proxy
from tests.daemon_harness import TIMEOUT, Daemon, free_port, running_daemon, two_assistant_config, wait_until
from tests.pg_front import FrontMode, PgFront, database_name
from tests.pg_harness import PgServer, url_for

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


# --------------------------------------------------------------------------- start-up before the database


class Database:
    """A role with a password, its own database, and a front port towards it: what a daemon needs."""

    def __init__(self, pg: PgServer, role: str, url: str, secret: str, front: PgFront) -> None:
        self.pg, self.role, self.url, self.secret, self.front = pg, role, url, secret, front
        self.name = database_name(url)

    def front_url(self) -> str:
        return self.front.url(self.role, self.name)


@pytest.fixture
def database(pg: PgServer) -> Iterator[Database]:
    secret = f"pw-{secrets.token_hex(8)}"
    with pg.role(secret) as role, pg.database(owner=role) as url, PgFront(pg.admin_url) as front:
        yield Database(pg, role, url, secret, front)


def waiting_lines(daemon: Daemon, words: str) -> list[dict[str, Any]]:
    """The daemon's ``store.waiting`` lines whose error has ``words``, once there is one."""
    return daemon.wait_log("store.waiting", lambda r: words in r["error"])


def test_a_daemon_started_before_its_database_waits_serving_probes_then_serves(
    tmp_path: Path, database: Database
) -> None:
    port, token = free_port(), f"token-{secrets.token_hex(8)}"
    config = postgres_config(database.front_url(), tmp_path / "hold")
    env = {"AGENTD_STORE_PASSWORD": database.secret, "AGENTD_API_TOKEN": token}
    location = f"postgresql://127.0.0.1:{database.front.port}/{database.name}"
    # Nothing listens on the store's port yet. The harness's start waits for /v1/health: it answers.
    with running_daemon(tmp_path, config, env=env, args=["--listen", f"127.0.0.1:{port}"]) as daemon:
        [first, *_] = waiting_lines(daemon, "Connection refused")
        assert first["store"] == location and first["attempt"] == 1 and first["retry_in"] == 0.5
        assert first["error"].startswith(f"cannot open the store {location}: ")
        assert daemon.api("GET", "/v1/health").json() == {"status": "ok"}  # alive: liveness must not restart it
        not_ready = daemon.api("GET", "/v1/ready")
        assert not_ready.status_code == 503
        [reason] = not_ready.json()["reasons"]
        assert reason.startswith(f"waiting for the store: cannot open the store {location}: "), reason
        for method, path in [("GET", "/v1/status"), ("POST", "/v1/sessions"), ("GET", "/v1/sessions/s1")]:
            refused = daemon.api(method, path, {} if method == "POST" else None)
            assert refused.status_code == 503, (method, path, refused.text)
            error = refused.json()["error"]
            assert error["code"] == "store_unavailable" and error["turn"] is None
            assert "waiting for the store" in error["message"] and location in error["message"]
        assert daemon.api("GET", "/v1/nowhere").json()["error"]["code"] == "not_found"  # as when serving

        # The TCP listener, exactly as when serving: the probes without the token, the rest with it.
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT) as tcp:
            auth = {"Authorization": f"Bearer {token}"}
            assert tcp.get("/v1/health").status_code == 200
            anonymous = tcp.get("/v1/ready")
            assert anonymous.status_code == 503 and anonymous.json() == {"ready": False}  # never why
            assert tcp.get("/v1/ready", headers=auth).json()["reasons"] == [reason]
            assert tcp.get("/v1/status").status_code == 401
            assert tcp.get("/v1/status", headers=auth).json()["error"]["code"] == "store_unavailable"

        # A SIGHUP while waiting does not kill it: it is the reload once the daemon serves.
        daemon.signal(signal.SIGHUP)
        daemon.wait_log("supervisor.signal", lambda r: r["signal"] == "SIGHUP" and r["action"] == "deferred")

        # The server is up but not accepting connections yet: PostgreSQL's own 57P03, on the wire.
        database.front.set(FrontMode.STARTING)
        waiting_lines(daemon, "the database system is starting up")
        assert daemon.process is not None and daemon.process.poll() is None

        database.front.set(FrontMode.FORWARD)
        [opened] = daemon.wait_log("store.opened")
        assert opened["store"] == location and opened["attempts"] >= 3
        daemon.wait_log("supervisor.started")
        wait_until(lambda: daemon.api("GET", "/v1/ready").status_code == 200, "the daemon to be ready")
        daemon.wait_log("config.reload")  # the SIGHUP of the wait, replayed
        session = daemon.new_session("main")
        reply = daemon.send(session, "hello there")
        assert reply["turn"]["status"] == "completed"
        assert reply["messages"][-1]["content"] == f"[{MODEL}] You said: hello there"
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT) as tcp:
            assert tcp.get(f"/v1/sessions/{session}", headers={"Authorization": f"Bearer {token}"}).status_code == 200
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit() == 0
        logs = daemon.log_text()
    assert database.secret not in logs
    assert database.role not in logs  # the store is named without its user


def test_sigterm_while_waiting_for_the_database_exits_0_even_mid_connect(tmp_path: Path, database: Database) -> None:
    database.front.set(FrontMode.HOLD)  # a server that accepts and never answers: each attempt hangs
    config = postgres_config(database.front_url(), tmp_path / "hold")
    daemon = Daemon(tmp_path, config, env={"AGENTD_STORE_PASSWORD": database.secret})
    try:
        daemon.start()  # /v1/health answers once the first attempt has been under way for 1 s
        waiting_lines(daemon, "timeout")
        # The next attempt is under way: connected, waiting for the server's answer.
        wait_until(lambda: database.front.accepted >= 2, "the second connection attempt")
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit() == 0
        daemon.wait_log("supervisor.signal", lambda r: r["signal"] == "SIGTERM" and r["action"] == "stop")
        assert [r["exit_code"] for r in daemon.log_events("supervisor.stopped")] == [0]
        assert not daemon.log_events("supervisor.started")
        assert not daemon.socket.exists() and not (daemon.state_dir / "agentd.pid").exists()
        assert database.secret not in daemon.log_text()
    finally:
        daemon.stop()


@pytest.mark.parametrize("refusal", ["wrong password", "unknown database"])
def test_a_store_refused_for_good_exits_1_at_once_naming_it(tmp_path: Path, database: Database, refusal: str) -> None:
    wrong = f"wrong-{secrets.token_hex(8)}"
    if refusal == "wrong password":
        url, password, words = database.url, wrong, f'password authentication failed for user "{database.role}"'
    else:
        url, password = url_for(database.url, "agentd_no_such_db", user=database.role), database.secret
        words = 'database "agentd_no_such_db" does not exist'
    daemon = Daemon(tmp_path, postgres_config(url, tmp_path / "hold"), env={"AGENTD_STORE_PASSWORD": password})
    result = daemon.run_cli(*daemon.command()[3:])  # a daemon that waited instead would time out here
    assert result.returncode == 1, result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("agentd: ")]
    assert line.startswith("agentd: cannot open the store postgresql:///agentd_"), line
    assert words in line, line
    assert "store.waiting" not in result.stderr
    output = result.stdout + result.stderr
    assert database.secret not in output and wrong not in output
    assert not daemon.socket.exists()


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


def test_a_first_open_that_takes_long_still_answers_the_probes(tmp_path: Path, pg: PgServer) -> None:
    """Review: the first attempt to open the store can take long without failing — here it waits for
    the migration lock another replica holds (a long migration), as it would for a server that
    answers the connection and then hangs. The probes must answer meanwhile (RFC 0009 §1: a replica
    that waits is alive); before the fix nothing was bound until the first attempt *failed*, so for
    up to the migrations' bound (600 s) /v1/health was refused and a startup probe restarted the pod."""
    with pg.database() as url, psycopg.connect(url, autocommit=True) as migrating:
        migrating.execute("SELECT pg_advisory_lock(%s)", (postgres.MIGRATION_LOCK,))
        daemon = Daemon(tmp_path, postgres_config(url, tmp_path / "hold"))
        try:
            started = time.monotonic()
            daemon.start()  # waits for /v1/health
            assert time.monotonic() - started < 10, "the probes waited for the migration lock"
            not_ready = daemon.api("GET", "/v1/ready")
            assert not_ready.status_code == 503
            [reason] = not_ready.json()["reasons"]
            assert reason.startswith("waiting for the store: "), reason
            assert daemon.api("GET", "/v1/status").json()["error"]["code"] == "store_unavailable"
            migrating.execute("SELECT pg_advisory_unlock(%s)", (postgres.MIGRATION_LOCK,))
            daemon.wait_log("supervisor.started")
            wait_until(lambda: daemon.api("GET", "/v1/ready").status_code == 200, "the daemon to be ready")
            daemon.signal(signal.SIGTERM)
            assert daemon.wait_exit() == 0
        finally:
            daemon.stop()


def test_a_message_whose_begin_answer_was_lost_is_not_answered_nothing_was_stored(tmp_path: Path, pg: PgServer) -> None:
    """Review: the connection is lost once the server committed ``begin_turn`` (the message stored,
    its turn pending) and before the daemon heard. Before the fix the client was told 503 "nothing
    was stored" — yet the turn was stored, and the failover scan (the session has no owner) ran it;
    a client that believed the answer and sent the message again had it stored and answered twice.
    Now the daemon asks the store whether its turn is there, and runs it as accepted."""
    with pg.database() as url, pg_proxy.proxy_in_thread(url) as proxy:
        top = f'[store]\nurl = "{proxy.url(url)}"\nlease = "10s"\n'
        with running_daemon(tmp_path, two_assistant_config(tmp_path / "hold", top=top)) as daemon:
            session = daemon.new_session("main")
            proxy.arm("INSERT INTO turns (session, id, status", pg_proxy.Cut.AFTER_REPLY)
            answer = daemon.api("POST", f"/v1/sessions/{session}/messages", {"content": "hello there", "wait": True})
            assert proxy.cut.is_set()
            reply = f"[{MODEL}] You said: hello there"
            assert answer.status_code == 200, answer.text
            assert answer.json()["turn"]["status"] == "completed"
            assert [m["content"] for m in answer.json()["messages"]] == [reply]
            transcript = [(e["role"], e["content"]) for e in daemon.session(session)["transcript"]]
            assert transcript.count(("user", "hello there")) == 1
            assert len(daemon.session(session)["turns"]) == 1
            [recovered] = daemon.log_events("turn.begin_recovered")
            assert recovered["session"] == session


def test_a_session_whose_create_answer_was_lost_is_answered_as_created_once(tmp_path: Path, pg: PgServer) -> None:
    """The connection is lost once the server committed ``create_session`` and before the daemon
    heard: the session exists, so the client gets it (201), not a 503 that would make it create a
    second one."""
    with pg.database() as url, pg_proxy.proxy_in_thread(url) as proxy:
        top = f'[store]\nurl = "{proxy.url(url)}"\nlease = "10s"\n'
        with running_daemon(tmp_path, two_assistant_config(tmp_path / "hold", top=top)) as daemon:
            proxy.arm("INSERT INTO sessions (id, assistant", pg_proxy.Cut.AFTER_REPLY)
            answer = daemon.api("POST", "/v1/sessions", {"assistant": "main"})
            assert proxy.cut.is_set()
            assert answer.status_code == 201, answer.text
            session = answer.json()["id"]
            [recovered] = daemon.log_events("session.create_recovered")
            assert recovered["session"] == session
            assert [s["id"] for s in daemon.json("GET", "/v1/sessions", status=200)] == [session]
            assert daemon.send(session, "hello")["turn"]["status"] == "completed"


def test_a_database_lost_just_after_the_open_is_waited_for_not_an_exit_1(tmp_path: Path, pg: PgServer) -> None:
    """Review: the store opens (migrated, pool up) and the connection is lost at the start's first
    read (the sessions by assistant, for the config check) — a database restarting or failing over
    just then. Before the fix that was exit 1 ("count sessions by assistant: …"), not the wait RFC
    0009 §1 promises for a database that is not there yet."""
    with pg.database() as url, pg_proxy.proxy_in_thread(url) as proxy:
        top = f'[store]\nurl = "{proxy.url(url)}"\nlease = "10s"\n'
        proxy.arm("SELECT assistant, COUNT(*)", pg_proxy.Cut.BEFORE_COMMIT)
        with running_daemon(tmp_path, two_assistant_config(tmp_path / "hold", top=top)) as daemon:
            daemon.wait_log("supervisor.started")
            assert proxy.cut.is_set()
            [waiting] = daemon.log_events("store.waiting")
            assert "count sessions by assistant" in waiting["error"], waiting
            wait_until(lambda: daemon.api("GET", "/v1/ready").status_code == 200, "the daemon to be ready")
            assert daemon.send(daemon.new_session("main"), "hello")["turn"]["status"] == "completed"
