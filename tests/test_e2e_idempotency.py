"""``Idempotency-Key`` on the creating POSTs (RFC 0010 §2), against real ``agentd run`` processes.

The same key again answers the first request's answer — never a second session or turn — even
when the daemon is killed (SIGKILL) between storing the request and answering it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.daemon_harness import TIMEOUT, Daemon, running_daemon, two_assistant_config, wait_until

pytestmark = pytest.mark.e2e


def keyed(daemon: Daemon, path: str, body: Any, key: str) -> httpx.Response:
    assert daemon.client is not None
    return daemon.client.post(path, json=body, headers={"Idempotency-Key": key})


def session_count(daemon: Daemon) -> int:
    return len(daemon.json("GET", "/v1/sessions?limit=10000", status=200))


def user_turns(daemon: Daemon, session: str) -> list[dict[str, Any]]:
    return daemon.session(session)["turns"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("idem")
    with running_daemon(tmp, two_assistant_config(tmp / "never")) as d:
        yield d


def test_a_session_created_with_a_key_is_created_once(daemon: Daemon) -> None:
    before = session_count(daemon)
    first = keyed(daemon, "/v1/sessions", {}, "create-1")
    again = keyed(daemon, "/v1/sessions", {}, "create-1")
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.json() == first.json()
    assert again.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers
    assert session_count(daemon) == before + 1
    other = keyed(daemon, "/v1/sessions", {}, "create-2")
    assert other.json()["id"] != first.json()["id"]


def test_a_message_sent_with_a_key_is_one_turn(daemon: Daemon) -> None:
    session = daemon.new_session()
    first = keyed(daemon, f"/v1/sessions/{session}/messages", {"content": "hi"}, "msg-1")
    again = keyed(daemon, f"/v1/sessions/{session}/messages", {"content": "hi"}, "msg-1")
    assert (first.status_code, again.status_code) == (200, 200)
    assert again.json() == first.json()
    turns = [t for t in user_turns(daemon, session) if t["id"] == first.json()["turn"]["id"]]
    assert len(turns) == 1
    assert len(user_turns(daemon, session)) == 1  # a first_message opener is no turn


def test_a_key_sent_with_another_request_is_refused_422(daemon: Daemon) -> None:
    session = daemon.new_session()
    path = f"/v1/sessions/{session}/messages"
    assert keyed(daemon, path, {"content": "one"}, "reused").status_code == 200
    refused = keyed(daemon, path, {"content": "two"}, "reused")
    assert refused.status_code == 422
    assert refused.json()["error"]["code"] == "idempotency_key_reused"
    other = daemon.new_session()  # the same key on another session is another request too
    assert keyed(daemon, f"/v1/sessions/{other}/messages", {"content": "one"}, "reused").status_code == 422
    assert keyed(daemon, "/v1/sessions", {}, "reused").status_code == 201  # another route: another key


def test_a_bad_key_is_refused_naming_the_header(daemon: Daemon) -> None:
    refused = keyed(daemon, "/v1/sessions", {}, "with space")
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "bad_idempotency_key"
    assert "Idempotency-Key" in refused.json()["error"]["message"]


def test_an_error_is_not_kept_so_the_request_asked_again_is_done_once(daemon: Daemon) -> None:
    session = daemon.new_session("held")
    daemon.send(session, "block", wait=False)  # holds the session: the keyed message gets 409
    busy = keyed(daemon, f"/v1/sessions/{session}/messages", {"content": "later", "wait": False}, "busy-1")
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "turn_running"
    daemon.json("POST", f"/v1/sessions/{session}/cancel", status=202)
    wait_until(lambda: user_turns(daemon, session)[-1]["status"] == "cancelled", "the held turn to end")
    done = keyed(daemon, f"/v1/sessions/{session}/messages", {"content": "later", "wait": False}, "busy-1")
    assert done.status_code == 202
    again = keyed(daemon, f"/v1/sessions/{session}/messages", {"content": "later", "wait": False}, "busy-1")
    assert again.json() == done.json()
    assert [t["id"] for t in user_turns(daemon, session)].count(done.json()["turn_id"]) == 1
    daemon.json("POST", f"/v1/sessions/{session}/cancel", status=202)


def test_a_key_in_progress_answers_409_then_the_first_answer(daemon: Daemon, tmp_path: Path) -> None:
    hold = daemon.tmp / "never"
    session = daemon.new_session("held")
    path = f"/v1/sessions/{session}/messages"
    answers: list[httpx.Response] = []
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.socket)), base_url="http://agentd") as other:
        waiting = threading.Thread(
            target=lambda: answers.append(
                other.post(path, json={"content": "slow"}, headers={"Idempotency-Key": "slow-1"}, timeout=TIMEOUT)
            )
        )
        waiting.start()
        wait_until(lambda: user_turns(daemon, session), "the keyed turn to be stored")
        busy = keyed(daemon, path, {"content": "slow"}, "slow-1")
        assert busy.status_code == 409
        assert busy.json()["error"]["code"] == "idempotency_in_progress"
        turn = user_turns(daemon, session)[0]["id"]
        daemon.json("POST", f"/v1/sessions/{session}/cancel", status=202)
        waiting.join(TIMEOUT)
    assert not hold.exists()
    assert answers[0].status_code == 200 and answers[0].json()["turn"]["id"] == turn
    again = keyed(daemon, path, {"content": "slow"}, "slow-1")
    assert again.json() == answers[0].json()
    assert len(user_turns(daemon, session)) == 1


def test_a_daemon_killed_mid_turn_answers_the_retry_with_that_turn_not_a_second(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    config = two_assistant_config(hold)
    first = Daemon(tmp_path, config).start()
    try:
        session = first.new_session("held")
        path = f"/v1/sessions/{session}/messages"
        assert first.client is not None
        client = first.client

        def post() -> None:
            with contextlib.suppress(httpx.TransportError):  # the daemon dies under it: no answer
                client.post(path, json={"content": "work"}, headers={"Idempotency-Key": "kill-1"}, timeout=TIMEOUT)

        waiting = threading.Thread(target=post)
        waiting.start()
        # Stored and running, unanswered (the model waits for the hold file): kill it there.
        turn = wait_until(lambda: (t := user_turns(first, session)) and t[0]["id"], "the keyed turn to be stored")
        assert first.process is not None
        os.kill(first.process.pid, signal.SIGKILL)
        assert first.wait_exit() == -signal.SIGKILL
        waiting.join(TIMEOUT)
    finally:
        first.stop()
    hold.touch()  # the restarted daemon's re-run of the turn completes
    second = Daemon(tmp_path, config).start()
    try:

        def retried() -> httpx.Response | None:
            answer = keyed(second, path, {"content": "work"}, "kill-1")
            if answer.status_code == 409:  # the resumed turn is still running
                assert answer.json()["error"]["code"] == "idempotency_in_progress"
                return None
            return answer

        answer = wait_until(retried, "the retry to be answered")
        assert answer.status_code == 200, answer.text
        assert answer.json()["turn"]["id"] == turn
        assert answer.json()["turn"]["status"] == "completed"
        turns = user_turns(second, session)
        assert [t["id"] for t in turns] == [turn]
        users = [e for e in second.session(session)["transcript"] if e["role"] == "user"]
        assert [e["content"] for e in users] == ["work"]
        assert keyed(second, path, {"content": "work"}, "kill-1").json() == answer.json()
    finally:
        second.stop()


def test_an_expired_key_is_a_new_request(tmp_path: Path) -> None:
    config = two_assistant_config(tmp_path / "never", top='[server]\nidempotency_ttl = "1s"')
    with running_daemon(tmp_path, config) as daemon:
        first = keyed(daemon, "/v1/sessions", {}, "short").json()["id"]
        wait_until(
            lambda: keyed(daemon, "/v1/sessions", {}, "short").json()["id"] != first,
            "the key to expire",
            interval=0.3,
        )
        assert session_count(daemon) >= 2


def test_a_chat_completion_killed_mid_turn_is_answered_after_the_restart_with_one_session(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    config = two_assistant_config(hold)
    body = {"model": "held", "messages": [{"role": "user", "content": "earlier"}, {"role": "user", "content": "now"}]}
    first = Daemon(tmp_path, config).start()
    try:
        assert first.client is not None
        client = first.client

        def post() -> None:
            with contextlib.suppress(httpx.TransportError):
                client.post(
                    "/v1/chat/completions", json=body, headers={"Idempotency-Key": "chat-kill"}, timeout=TIMEOUT
                )

        waiting = threading.Thread(target=post)
        waiting.start()
        session = wait_until(
            lambda: (s := first.json("GET", "/v1/sessions", status=200)) and s[0]["turns"] and s[0]["id"],
            "the keyed chat turn to be stored",
        )
        turn = user_turns(first, session)[0]["id"]
        assert first.process is not None
        os.kill(first.process.pid, signal.SIGKILL)
        first.wait_exit()
        waiting.join(TIMEOUT)
    finally:
        first.stop()
    hold.touch()
    second = Daemon(tmp_path, config).start()
    try:

        def retried() -> httpx.Response | None:
            answer = keyed(second, "/v1/chat/completions", body, "chat-kill")
            return None if answer.status_code == 409 else answer

        answer = wait_until(retried, "the retried chat completion")
        assert answer.status_code == 200, answer.text
        assert answer.json()["id"] == f"chatcmpl-{turn}"
        assert answer.headers["x-agentd-session"] == session
        assert [s["id"] for s in second.json("GET", "/v1/sessions", status=200)] == [session]
        users = [e["content"] for e in second.session(session)["transcript"] if e["role"] == "user"]
        assert users == ["earlier", "now"]
    finally:
        second.stop()
