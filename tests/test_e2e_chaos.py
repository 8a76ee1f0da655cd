"""Chaos, bounded: clients send turns while the supervisor and its children are killed at random.

Afterwards every accepted message is stored exactly once and every turn has a terminal status.
Loopback only; the run is bounded by a fixed number of kills, not by wall time, and the random
choices come from a seeded generator, so a failure can be replayed.
"""

from __future__ import annotations

import os
import random
import signal
import threading
from pathlib import Path

import httpx
import pytest

from tests.daemon_harness import Daemon, child_pids_of, wait_until

pytestmark = pytest.mark.e2e

CLIENTS = 6
SUPERVISOR_KILLS = 3
CHILD_KILLS = 6
CONFIG = """
[intelligence]
provider = "scripted"
model = "echo-small"
options = { delay_ms = 30, steps = 1 }

[supervisor]
children = 2
sessions_per_child = 4
spare_children = 1
idle_unload = "500ms"

[[assistants]]
name = "main"
first_message_mode = "assistant-waits-for-user"
tools = ["clock"]
"""


class Client(threading.Thread):
    """Sends numbered messages to its own session until told to stop; remembers what was accepted."""

    def __init__(self, socket: Path, session: str, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.socket, self.session, self.stop = socket, session, stop
        self.accepted: dict[str, str] = {}  # turn id -> content
        self.sent = 0

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            content = f"{self.session} message {n}"
            try:
                with httpx.Client(
                    transport=httpx.HTTPTransport(uds=str(self.socket)), base_url="http://agentd", timeout=30
                ) as client:
                    response = client.post(
                        f"/v1/sessions/{self.session}/messages", json={"content": content, "wait": True}
                    )
            except httpx.HTTPError:
                self.stop.wait(0.05)  # the daemon is down or restarting: try again
                continue
            self.sent += 1
            if response.status_code == 200:
                self.accepted[response.json()["turn"]["id"]] = content
            elif response.status_code == 503 and (turn := response.json()["error"].get("turn")):
                self.accepted[turn] = content  # accepted, cut by a shutdown: it re-runs at the next start


def test_kills_at_random_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    rng = random.Random(1201)
    daemon = Daemon(tmp_path, CONFIG).start()
    clients: list[Client] = []
    stop = threading.Event()
    try:
        sessions = [daemon.new_session() for _ in range(CLIENTS)]
        clients = [Client(daemon.socket, s, stop) for s in sessions]
        for client in clients:
            client.start()
        kills = ["supervisor"] * SUPERVISOR_KILLS + ["child"] * CHILD_KILLS
        rng.shuffle(kills)
        for kill in kills:
            # Wait for progress between kills: each kill lands while turns are being run.
            target = sum(len(c.accepted) for c in clients) + CLIENTS
            wait_until(lambda t=target: sum(len(c.accepted) for c in clients) >= t, "turns between kills")
            assert daemon.process is not None
            if kill == "supervisor":
                daemon.process.send_signal(signal.SIGKILL)
                daemon.process.wait()
                daemon.stop()
                daemon = Daemon(tmp_path, CONFIG, state_dir=daemon.state_dir).start()
            else:
                children = child_pids_of(daemon.process.pid)
                if children:
                    os.kill(rng.choice(children), signal.SIGKILL)
        stop.set()
        for client in clients:
            client.join(60)
        # Every interrupted turn re-runs: wait until none is pending.
        wait_until(
            lambda: all(t["status"] != "pending" for s in sessions for t in daemon.session(s)["turns"]),
            "every turn to end",
        )
        accepted = {turn: content for c in clients for turn, content in c.accepted.items()}
        stored_turns = {t["id"]: t for s in sessions for t in daemon.session(s)["turns"]}
        for turn in accepted:
            assert turn in stored_turns, f"accepted turn {turn} was lost"
        users = [
            (e["turn"], e["content"]) for s in sessions for e in daemon.session(s)["transcript"] if e["role"] == "user"
        ]
        assert len(users) == len(set(users)), "a user message was stored twice"
        stored_by_turn = dict(users)
        for turn, content in accepted.items():
            assert stored_by_turn.get(turn) == content, f"accepted message of {turn} not stored once"
        terminal = {"completed", "deadline", "cancelled", "failed", "exhausted_steps", "loop_detected"}
        assert {t["status"] for t in stored_turns.values()} <= terminal
        assert all(daemon.session(s)["state"] == "idle" for s in sessions)
        print(
            f"chaos: {len(accepted)} accepted, {len(stored_turns)} turns stored, "
            f"{sum(c.sent for c in clients)} sent, kills: {SUPERVISOR_KILLS} supervisor, {CHILD_KILLS} child"
        )
    finally:
        stop.set()
        daemon.stop()
