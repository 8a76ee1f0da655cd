"""Idempotency keys across replicas on one PostgreSQL database (RFC 0010 §2, RFC 0009 §7).

A key claimed on one replica holds on the others: its answer is given again there, it is in
progress there while its replica lives, and once that replica is killed mid-turn another takes
the key over and answers with the turn the killed one stored — never a second.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.daemon_harness import TIMEOUT, Daemon, wait_until
from tests.pg_harness import PgServer
from tests.test_e2e_replicas import kill_replica, replicas

pytestmark = pytest.mark.e2e


def keyed(daemon: Daemon, path: str, body: Any, key: str) -> httpx.Response:
    assert daemon.client is not None
    return daemon.client.post(path, json=body, headers={"Idempotency-Key": key})


def test_a_key_answered_on_one_replica_is_answered_the_same_on_another(tmp_path: Path, pg: PgServer) -> None:
    with replicas(tmp_path, pg, 2) as (started, _hold):
        a, b = started
        first = keyed(a, "/v1/sessions", {"assistant": "main"}, "replicated-1")
        again = keyed(b, "/v1/sessions", {"assistant": "main"}, "replicated-1")
        assert (first.status_code, again.status_code) == (201, 201)
        assert again.json() == first.json() and again.headers["idempotent-replayed"] == "true"
        assert keyed(b, "/v1/sessions", {"assistant": "held"}, "replicated-1").status_code == 422


def test_a_replica_killed_mid_turn_leaves_its_key_to_another_which_answers_that_turn(
    tmp_path: Path, pg: PgServer
) -> None:
    with replicas(tmp_path, pg, 2) as (started, hold):
        a, b = started
        session = a.new_session("held")
        path = f"/v1/sessions/{session}/messages"
        assert a.client is not None
        client = a.client

        def post() -> None:
            with contextlib.suppress(httpx.TransportError):  # a is killed under it
                client.post(path, json={"content": "work"}, headers={"Idempotency-Key": "kill-r"}, timeout=TIMEOUT)

        waiting = threading.Thread(target=post)
        waiting.start()
        turn = wait_until(lambda: (t := b.session(session)["turns"]) and t[0]["id"], "the keyed turn to be stored")
        busy = keyed(b, path, {"content": "work"}, "kill-r")  # a lives: in progress there
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "idempotency_in_progress"
        kill_replica(a)
        waiting.join(TIMEOUT)
        hold.touch()

        def retried() -> httpx.Response | None:
            answer = keyed(b, path, {"content": "work"}, "kill-r")
            return None if answer.status_code == 409 else answer

        answer = wait_until(retried, "b to answer the key")
        assert answer.status_code == 200, answer.text
        assert answer.json()["turn"]["id"] == turn and answer.json()["turn"]["status"] == "completed"
        assert [t["id"] for t in b.session(session)["turns"]] == [turn]
        assert [e["content"] for e in b.session(session)["transcript"] if e["role"] == "user"] == ["work"]
