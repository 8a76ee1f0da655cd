"""The HTTP API (RFC 0000 §6) and the CLI, against one real ``agentd run`` subprocess.

One daemon serves the whole module (each test uses its own sessions); the TCP listener tests
start their own. Turns that must stay in flight use the ``held`` assistant, whose scripted
model waits for a file that is never created; they are cancelled before their test ends.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import agentd
from tests.daemon_harness import (
    TIMEOUT,
    Daemon,
    agentd_env,
    child_pids_of,
    free_port,
    running_daemon,
    two_assistant_config,
    wait_until,
)

pytestmark = pytest.mark.e2e

MODEL = "echo-small"
ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")
TURN_KEYS = {"id", "status", "models", "steps", "restarts", "discarded", "usage", "started_at", "ended_at"}
SESSION_KEYS = {"id", "assistant", "state", "generation", "model", "transcript", "turns"}


def config(hold: Path) -> str:
    return two_assistant_config(hold, top='model_swap = "restart-turn"', supervisor='stop_grace = "2s"')


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("api")
    with running_daemon(tmp, config(tmp / "never")) as d:
        yield d


def assert_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, f"{response.status_code}: {response.text}"
    error = response.json()["error"]
    assert isinstance(error["code"], str) and error["code"]
    assert isinstance(error["message"], str) and error["message"]
    return error


def assert_turn_shape(turn: dict[str, Any]) -> None:
    assert set(turn) >= TURN_KEYS, turn
    assert isinstance(turn["id"], str) and turn["id"]
    assert isinstance(turn["models"], list) and isinstance(turn["steps"], int) and isinstance(turn["restarts"], int)
    assert isinstance(turn["discarded"], list)
    assert set(turn["usage"]) >= {"input_tokens", "output_tokens"}
    assert ISO.match(turn["started_at"]), turn["started_at"]
    if turn["status"] != "pending":
        assert ISO.match(turn["ended_at"]), turn["ended_at"]


def assert_entry_shape(entry: dict[str, Any]) -> None:
    assert isinstance(entry["seq"], int)
    assert entry["role"] in {"system", "user", "assistant", "tool"}
    assert isinstance(entry["content"], str)
    if entry["role"] == "assistant":
        assert entry["model"], f"assistant entry without a model: {entry}"


def post_raw(daemon: Daemon, path: str, content: bytes) -> httpx.Response:
    assert daemon.client is not None
    return daemon.client.post(path, content=content, headers={"content-type": "application/json"})


# --------------------------------------------------------------------------- health, ready, status


def test_health_and_ready(daemon: Daemon) -> None:
    assert daemon.json("GET", "/v1/health", status=200) == {"status": "ok"}
    assert daemon.json("GET", "/v1/ready", status=200) == {"ready": True}


def test_status_has_the_documented_fields(daemon: Daemon) -> None:
    assert daemon.process is not None
    session = daemon.new_session()
    daemon.send(session, "hi")
    status = daemon.status()
    assert status["pid"] == daemon.process.pid
    assert status["version"] == agentd.__version__
    assert status["generation"] == 1
    assert status["model_swap"] == {"policy": "restart-turn", "source": "file"}
    assert status["config_path"] == str(daemon.config_path)
    assert set(status["sessions"]) == {"open", "loaded", "running", "failed"}
    assert status["sessions"]["open"] >= 1 and status["sessions"]["failed"] == 0
    assert status["sessions"]["loaded"] >= 1 and status["sessions"]["running"] == 0
    # SQLite: one replica, this one; the registry lists just itself, at its generation.
    assert status["replica"].startswith(f"{socket.gethostname()}-{daemon.process.pid}-")
    [me] = status["replicas"]
    assert set(me) == {"id", "generation", "sessions", "seen_at"}
    assert me["id"] == status["replica"] and me["generation"] == 1 and abs(me["seen_at"] - time.time()) < 60
    pid = daemon.session(session)["child"]  # the child the session is loaded on
    mine = [c for c in status["children"] if c["pid"] == pid]
    assert len(mine) == 1
    child = mine[0]
    assert set(child) >= {"pid", "sessions", "in_flight", "state", "generation", "restarts"}
    assert child["state"] == "active" and child["sessions"] >= 1 and child["in_flight"] == 0
    assert child["generation"] == 1 and child["restarts"] == 0
    assert child["pid"] in child_pids_of(daemon.process.pid)

    # The pool: the session's active child and a ready spare (children = 0 keeps no other child
    # warm: what load needs plus spare_children, RFC 0006 §2).
    def pool_settled() -> bool:
        states = [c["state"] for c in daemon.status()["children"]]
        return states.count("active") >= 1 and "spare" in states

    wait_until(pool_settled, "an active child and a spare")


def test_reload_route_reports_the_documented_result(daemon: Daemon) -> None:
    result = daemon.json("POST", "/v1/reload", status=200)  # the file is unchanged
    assert set(result) >= {"generation", "applied", "errors", "changed", "restart_required", "swapped_sessions"}
    assert result["applied"] is True and result["generation"] == daemon.status()["generation"] == 1
    assert result["errors"] == [] and result["changed"] == [] and result["restart_required"] == []
    assert result["swapped_sessions"] == []


# --------------------------------------------------------------------------- sessions


def test_create_session_returns_the_session_with_its_opener(daemon: Daemon) -> None:
    response = daemon.api("POST", "/v1/sessions", {})
    assert response.status_code == 201
    session = response.json()
    assert set(session) >= SESSION_KEYS
    assert session["assistant"] == "main" and session["state"] == "idle" and session["model"] == MODEL
    assert session["generation"] == 1 and session["turns"] == []
    for entry in session["transcript"]:
        assert_entry_shape(entry)
    assert [e["role"] for e in session["transcript"]] == ["system", "assistant"]
    assert session["transcript"][-1]["content"] == "Hello from main."

    held = daemon.json("POST", "/v1/sessions", {"assistant": "held"}, status=201)
    assert held["assistant"] == "held"
    assert not [e for e in held["transcript"] if e["role"] == "assistant"]  # assistant-waits-for-user

    error = assert_error(daemon.api("POST", "/v1/sessions", {"assistant": "nobody"}), 400)
    assert "nobody" in error["message"]


def test_list_sessions(daemon: Daemon) -> None:
    a, b = daemon.new_session(), daemon.new_session("held")
    listed = daemon.json("GET", "/v1/sessions", status=200)
    assert isinstance(listed, list)
    by_id = {s["id"]: s for s in listed}
    assert {a, b} <= set(by_id)
    assert by_id[a]["assistant"] == "main" and by_id[b]["assistant"] == "held"
    for summary in (by_id[a], by_id[b]):
        assert summary["state"] == "idle" and summary["model"] == MODEL and summary["generation"] == 1


def test_post_message_wait_and_no_wait_and_the_full_session(daemon: Daemon) -> None:
    session = daemon.new_session()
    response = daemon.api("POST", f"/v1/sessions/{session}/messages", {"content": "first", "wait": True})
    assert response.status_code == 200
    result = response.json()
    assert set(result) >= {"turn", "messages"}
    turn = result["turn"]
    assert_turn_shape(turn)
    assert (
        turn["status"] == "completed"
        and turn["models"] == [MODEL]
        and turn["restarts"] == 0
        and turn["discarded"] == []
    )
    assert turn["steps"] == 1
    assert result["messages"], "a waited message returns the turn's entries"
    for entry in result["messages"]:
        assert_entry_shape(entry)
        assert entry["turn"] == turn["id"]
    assert result["messages"][-1]["content"] == f"[{MODEL}] You said: first"

    accepted = daemon.api("POST", f"/v1/sessions/{session}/messages", {"content": "second", "wait": False})
    assert accepted.status_code == 202
    second_id = accepted.json()["turn_id"]
    assert isinstance(second_id, str) and second_id != turn["id"]
    assert daemon.turn(session, second_id)["status"] == "completed"

    full = daemon.session(session)
    assert set(full) >= SESSION_KEYS
    seqs = [e["seq"] for e in full["transcript"]]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    for entry in full["transcript"]:
        assert_entry_shape(entry)
    users = [(e["content"], e["turn"]) for e in full["transcript"] if e["role"] == "user"]
    assert users == [("first", turn["id"]), ("second", second_id)]
    assert [t["id"] for t in full["turns"]] == [turn["id"], second_id]
    for t in full["turns"]:
        assert_turn_shape(t)
        assert t["status"] == "completed"
    stored = full["turns"][0]
    for key in ("id", "status", "models", "steps", "restarts", "discarded", "usage", "ended_at"):
        assert stored[key] == turn[key], key
    assert [e for e in full["transcript"] if e.get("turn") == turn["id"] and e["role"] != "user"] == result["messages"]


def test_the_turn_in_a_message_answer_is_the_stored_turn(daemon: Daemon) -> None:
    session = daemon.new_session()
    answer = daemon.send(session, "one turn, one record")
    stored = next(t for t in daemon.session(session)["turns"] if t["id"] == answer["turn"]["id"])
    assert answer["turn"] == stored


def test_bad_bodies_are_400(daemon: Daemon) -> None:
    session = daemon.new_session()
    path = f"/v1/sessions/{session}/messages"
    assert_error(post_raw(daemon, path, b'{"content": "unterminated'), 400)
    assert_error(post_raw(daemon, path, b"not json at all"), 400)
    assert_error(daemon.api("POST", path, {"content": "hi", "bogus": 1}), 400)
    assert_error(daemon.api("POST", path, {"content": 5}), 400)
    assert_error(daemon.api("POST", path, {"content": "hi", "wait": "soon"}), 400)
    assert_error(daemon.api("POST", path, {"wait": True}), 400)  # content is required
    assert_error(post_raw(daemon, "/v1/sessions", b"{nope"), 400)
    assert_error(daemon.api("POST", "/v1/sessions", {"assistant": 3}), 400)
    assert_error(daemon.api("POST", "/v1/sessions", {"assistnt": "main"}), 400)
    # None of it started a turn.
    assert daemon.session(session)["turns"] == []


def test_unknown_session_is_404(daemon: Daemon) -> None:
    missing = "s_doesnotexist"
    assert_error(daemon.api("GET", f"/v1/sessions/{missing}"), 404)
    assert_error(daemon.api("POST", f"/v1/sessions/{missing}/messages", {"content": "hi"}), 404)
    assert_error(daemon.api("POST", f"/v1/sessions/{missing}/cancel"), 404)
    assert_error(daemon.api("DELETE", f"/v1/sessions/{missing}"), 404)
    assert_error(daemon.api("GET", f"/v1/sessions/{missing}/events"), 404)


def test_a_second_message_while_a_turn_runs_is_409_and_cancel_ends_the_turn(daemon: Daemon) -> None:
    session = daemon.new_session("held")
    events = daemon.events(session)
    turn_id = daemon.send(session, "hold on", wait=False)["turn_id"]
    events.wait("step.started", lambda d: d["turn"] == turn_id)
    assert daemon.session(session)["state"] == "running"
    assert_error(daemon.api("POST", f"/v1/sessions/{session}/messages", {"content": "me too"}), 409)
    assert_error(daemon.api("POST", f"/v1/sessions/{session}/messages", {"content": "me too", "wait": False}), 409)

    cancel = daemon.api("POST", f"/v1/sessions/{session}/cancel")
    assert 200 <= cancel.status_code < 300, cancel.text
    done = events.wait("turn.done", lambda d: d["turn"] == turn_id)
    assert done["status"] == "cancelled"
    turn = daemon.turn(session, turn_id)
    assert turn["status"] == "cancelled"
    assert ISO.match(turn["ended_at"])
    assert daemon.session(session)["state"] == "idle"
    users = [e for e in daemon.session(session)["transcript"] if e["role"] == "user"]
    assert [(u["content"], u["turn"]) for u in users] == [("hold on", turn_id)]


def test_a_turn_that_spent_nothing_still_reports_both_token_counts(daemon: Daemon) -> None:
    session = daemon.new_session("held")
    events = daemon.events(session)
    turn_id = daemon.send(session, "cancel me", wait=False)["turn_id"]
    events.wait("step.started", lambda d: d["turn"] == turn_id)
    daemon.json("POST", f"/v1/sessions/{session}/cancel")
    events.wait("turn.done", lambda d: d["turn"] == turn_id)
    turn = daemon.turn(session, turn_id)
    assert turn["status"] == "cancelled"
    assert turn["usage"] == {
        "input_tokens": 0,
        "output_tokens": 0,
        "cached_input_tokens": 0,
        "reasoning_tokens": 0,
        "requests": 0,  # the held model call never answered
        "unreported": 0,
        "cost": None,
    }


def test_delete_closes_the_session_and_keeps_its_transcript(daemon: Daemon) -> None:
    session = daemon.new_session()
    daemon.send(session, "remember me")
    before = daemon.session(session)
    closed = daemon.json("DELETE", f"/v1/sessions/{session}", status=200)
    assert closed["id"] == session and closed["state"] == "closed"
    after = daemon.session(session)
    assert after["state"] == "closed"
    assert after["transcript"] == before["transcript"]
    assert after["turns"] == before["turns"]
    assert_error(daemon.api("POST", f"/v1/sessions/{session}/messages", {"content": "hello?"}), 404)
    assert_error(daemon.api("DELETE", f"/v1/sessions/{session}"), 404)
    listed = {s["id"]: s["state"] for s in daemon.json("GET", "/v1/sessions", status=200)}
    assert listed[session] == "closed"
    assert after["child"] is None  # unloaded from its child
    status = daemon.status()
    assert status["sessions"]["loaded"] == sum(c["sessions"] for c in status["children"])


def test_events_stream_a_turn_that_uses_the_clock(daemon: Daemon) -> None:
    session = daemon.new_session()
    events = daemon.events(session)
    turn_id = daemon.send(session, "what does the clock say?", wait=False)["turn_id"]
    done = events.wait("turn.done", lambda d: d["turn"] == turn_id)
    assert done["status"] == "completed"
    seen = [(name, data) for name, data in events.seen if data.get("turn") == turn_id]
    names = [name for name, _ in seen]
    for name in ("turn.started", "step.started", "step.done", "tool.call", "tool.result", "turn.done"):
        assert name in names, f"{name} missing from {names}"
    assert names[0] == "turn.started" and names[-1] == "turn.done"
    assert names.index("tool.call") < names.index("tool.result")
    for _, data in seen:
        assert data["session"] == session and data["turn"] == turn_id
    call = next(data for name, data in seen if name == "tool.call")
    result = next(data for name, data in seen if name == "tool.result")
    assert call["name"] == "clock" and result["name"] == "clock"
    assert call["id"] == result["id"]
    assert not result["is_error"]
    assert names.count("step.done") == 2


def test_metrics_is_prometheus_text(daemon: Daemon) -> None:
    session = daemon.new_session()
    daemon.send(session, "count me")
    response = daemon.api("GET", "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert "# TYPE agentd_turns_total counter" in text or "# TYPE agentd_turns counter" in text
    completed = [
        line for line in text.splitlines() if line.startswith("agentd_turns_total{") and 'status="completed"' in line
    ]
    assert completed and float(completed[0].rsplit(" ", 1)[1]) >= 1
    idle = [line for line in text.splitlines() if line.startswith('agentd_sessions{state="idle"}')]
    assert idle and float(idle[0].rsplit(" ", 1)[1]) >= 1
    children = [line for line in text.splitlines() if line.startswith("agentd_children ")]
    assert children and float(children[0].rsplit(" ", 1)[1]) >= 1


# --------------------------------------------------------------------------- TCP listener


def test_tcp_listener_requires_the_bearer_token(tmp_path: Path) -> None:
    port = free_port()
    token = "s3cret-token"
    with running_daemon(
        tmp_path, config(tmp_path / "never"), args=["--listen", f"127.0.0.1:{port}"], env={"AGENTD_API_TOKEN": token}
    ):
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT) as tcp:

            def answered() -> httpx.Response | None:
                try:
                    return tcp.get("/v1/status")
                except httpx.TransportError:
                    return None

            assert_error(wait_until(answered, "the TCP listener to answer"), 401)
            assert_error(tcp.get("/v1/sessions"), 401)
            # The probes answer without it (an orchestrator's HTTP probe cannot read a Secret).
            assert tcp.get("/v1/health").json() == {"status": "ok"}
            assert_error(tcp.get("/v1/status", headers={"Authorization": "Bearer wrong"}), 401)
            assert_error(tcp.post("/v1/sessions", json={}), 401)
            auth = {"Authorization": f"Bearer {token}"}
            assert tcp.get("/v1/health", headers=auth).json() == {"status": "ok"}
            assert tcp.get("/v1/status", headers=auth).status_code == 200
            assert tcp.post("/v1/sessions", json={}, headers=auth).status_code == 201


def test_listen_without_a_token_is_a_usage_error(tmp_path: Path) -> None:
    env = agentd_env(tmp_path)
    assert "AGENTD_API_TOKEN" not in env
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentd",
            "run",
            "--state-dir",
            str(tmp_path / "state"),
            "--listen",
            f"127.0.0.1:{free_port()}",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=TIMEOUT,
    )
    assert run.returncode == 2, run.stderr
    assert "AGENTD_API_TOKEN" in run.stderr
    assert not (tmp_path / "state" / "agentd.sock").exists()


# --------------------------------------------------------------------------- CLI against the live daemon


def test_cli_status_json(daemon: Daemon) -> None:
    result = daemon.run_cli("status", "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["generation"] == daemon.status()["generation"]
    assert status["model_swap"] == {"policy": "restart-turn", "source": "file"}


def test_cli_status_table_shows_the_policy_and_its_source(daemon: Daemon) -> None:
    result = daemon.run_cli("status")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "restart-turn" in line]
    assert lines and "file" in lines[0], result.stdout
    assert "generation" in result.stdout


def test_cli_send_creates_a_session_and_prints_the_reply(daemon: Daemon) -> None:
    result = daemon.run_cli("send", "hello from the cli")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"[{MODEL}] You said: hello from the cli"
    session = result.stderr.strip().splitlines()[0].strip()
    transcript = daemon.session(session)["transcript"]
    assert [e["content"] for e in transcript if e["role"] == "user"] == ["hello from the cli"]


def test_cli_send_to_an_existing_session(daemon: Daemon) -> None:
    session = daemon.new_session()
    count = len(daemon.json("GET", "/v1/sessions", status=200))
    result = daemon.run_cli("send", "--session", session, "second", "message")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"[{MODEL}] You said: second message"
    assert session not in result.stderr
    assert len(daemon.json("GET", "/v1/sessions", status=200)) == count
    assert [e["content"] for e in daemon.session(session)["transcript"] if e["role"] == "user"] == ["second message"]


def test_cli_chat_through_stdin(daemon: Daemon) -> None:
    result = daemon.run_cli("chat", input="please read the clock\nthanks\n")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Hello from main." in out
    assert "-> tool clock(" in out, out
    assert f"[{MODEL}] You said: please read the clock (after 1 tool result)" in out
    assert f"[{MODEL}] You said: thanks" in out
    assert out.index("-> tool clock(") < out.index("You said: thanks")


def test_cli_reload(daemon: Daemon) -> None:
    result = daemon.run_cli("reload")
    assert result.returncode == 0, result.stderr
    generation = daemon.status()["generation"]
    assert f"generation {generation}" in result.stdout


def test_sessions_are_listed_in_pages_newest_last(daemon: Daemon) -> None:
    made = [daemon.new_session() for _ in range(3)]
    everything = daemon.json("GET", "/v1/sessions?limit=10000", status=200)
    ids = [s["id"] for s in everything]
    assert ids[-3:] == made  # creation order, newest last
    page = daemon.json("GET", f"/v1/sessions?limit=2&after={made[0]}", status=200)
    assert [s["id"] for s in page] == made[1:]
    assert daemon.json("GET", f"/v1/sessions?after={made[-1]}", status=200) == []
    assert len(daemon.json("GET", "/v1/sessions?limit=1", status=200)) == 1
    assert_error(daemon.api("GET", "/v1/sessions?limit=0"), 400)
    assert_error(daemon.api("GET", "/v1/sessions?limit=ten"), 400)
    assert_error(daemon.api("GET", "/v1/sessions?after=s_nope"), 400)


def test_a_message_too_large_is_refused_with_413_before_anything_is_stored(daemon: Daemon) -> None:
    session = daemon.new_session()
    before = daemon.session(session)
    big = "x" * (4 * 1024 * 1024 + 1)  # over the default [server] max_message_bytes
    error = assert_error(daemon.api("POST", f"/v1/sessions/{session}/messages", {"content": big}), 413)
    assert "max_message_bytes" in error["message"]
    assert daemon.client is not None

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit holds while the body streams in
        yield b'{"content": "'
        for _ in range(5):
            yield b"y" * (1024 * 1024)
        yield b'"}'

    response = daemon.client.post(f"/v1/sessions/{session}/messages", content=chunked())
    assert_error(response, 413)
    after = daemon.session(session)
    assert after["turns"] == before["turns"] and after["transcript"] == before["transcript"]
    assert after["state"] == "idle"
    assert daemon.send(session, "small")["turn"]["status"] == "completed"
