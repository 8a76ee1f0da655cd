"""Streaming figures (RFC 0005 §8): how fast a streamed piece reaches a client, and what it costs.

    .venv/bin/python bench/streaming.py [--pieces 150] [--clients 32] [--seconds 10] [--words 40]

Real ``agentd run`` daemons (JSON logs, temp state dirs) driven over their unix socket.

1. Latency, piece → subscriber: a fake Ollama server in its own process streams an answer of
   ``--pieces`` distinct words, one NDJSON line each, ``pace`` apart, noting ``time.monotonic()``
   (one clock for every process of the machine) as it writes each line; an SSE subscriber in this
   process notes it as it reads each ``delta``. The latency of a word is the read time of the delta
   that carries it minus the write time of its line: loopback, the child's parse, its coalescer and
   frame, the supervisor and the SSE response — an upper bound of "chunk received by the child →
   event read by the subscriber". Twice: 30 ms apart (longer than the 20 ms coalescing window:
   a frame per piece) and 1 ms apart (pieces coalesced: what the window adds).
2. Turns/s: ``--clients`` threads, each on its own session, posting messages back to back
   (``wait: true``) for ``--seconds`` after a 1 s warm-up, the scripted model streaming a
   ``--words``-word answer 2 ms a word (``chunk_ms = 2``); once with no subscriber, once with an
   SSE subscriber on every session (a thread each, in this process, that reads the bytes away on a
   raw socket). The ratio is the figure (target ≥ 80 %).
3. Supervisor CPU per delta: the supervisor's CPU seconds (``/proc``) over the watched window
   divided by the delta frames it received (``agentd_delta_frames_total``), and the marginal cost:
   the watched run's supervisor CPU per turn minus the unwatched run's, per delta of a turn.

Percentiles are nearest-rank. Nothing is asserted: the figures are printed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import socket
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from swap_latency import cpu_seconds, loadavg
from tables import percentile, print_table

from tests.daemon_harness import Daemon

WARMUP_SECONDS = 1.0
SLOW_PACE_MS = 30.0
FAST_PACE_MS = 1.0


# --------------------------------------------------------------------------- the fake server process


def _serve(words: int, pace_ms: float, conn: Connection) -> None:
    """Child process: a fake Ollama streaming ``words`` distinct words ``pace_ms`` apart."""
    import logging

    logging.disable(logging.CRITICAL)
    from tests.fakes import FakeOllama, Reply

    reply = Reply(content="".join(f"w{k:05d} " for k in range(words)), pieces=words, pace_ms=pace_ms)
    server = FakeOllama(default=reply, split_writes=False).start()
    conn.send(server.url)
    conn.recv()  # "dump"
    conn.send([list(r.record_times) for r in server.chat_requests])
    server.stop()


class ServerProcess:
    def __init__(self, words: int, pace_ms: float) -> None:
        self._conn, child = mp.Pipe()
        self._process = mp.get_context("spawn").Process(target=_serve, args=(words, pace_ms, child), daemon=True)
        self._process.start()
        self.url: str = self._conn.recv()

    def record_times(self) -> list[list[float]]:
        self._conn.send("dump")
        times: list[list[float]] = self._conn.recv()
        self._process.join(10)
        return times


# --------------------------------------------------------------------------- SSE subscribers


class Subscriber:
    """One SSE subscription read on a thread: (monotonic read time, name, data) per event."""

    def __init__(self, client: httpx.Client, session: str) -> None:
        self.events: list[tuple[float, str, dict[str, Any]]] = []
        self.turns_done = threading.Semaphore(0)
        self._connected = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(client, session), daemon=True)
        self._thread.start()
        if not self._connected.wait(30):
            raise RuntimeError(f"could not subscribe to {session}")

    def _read(self, client: httpx.Client, session: str) -> None:
        name, data = "", ""
        try:
            with client.stream("GET", f"/v1/sessions/{session}/events", timeout=None) as response:
                self._connected.set()
                for line in response.iter_lines():
                    if line.startswith("event:"):
                        name = line[6:].strip()
                    elif line.startswith("data:"):
                        data = line[5:].strip()
                    elif not line and name:
                        self.events.append((time.monotonic(), name, json.loads(data)))
                        if name == "turn.done":
                            self.turns_done.release()
                        name, data = "", ""
        except httpx.HTTPError:
            pass
        finally:
            self._connected.set()


class Drain:
    """An SSE subscription that only reads its bytes away (a raw unix socket, a thread): the
    cheapest subscriber that keeps up, so figure 2 weighs agentd, not this script's parsing."""

    def __init__(self, daemon: Daemon, session: str) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(str(daemon.socket))
        self._sock.sendall(f"GET /v1/sessions/{session}/events HTTP/1.1\r\nHost: agentd\r\n\r\n".encode())
        first = self._sock.recv(65536)
        if b" 200 " not in first.split(b"\r\n", 1)[0]:
            raise RuntimeError(f"could not subscribe to {session}: {first[:200]!r}")
        self.bytes = len(first)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            while data := self._sock.recv(65536):
                self.bytes += len(data)
        except OSError:
            pass

    def close(self) -> None:
        self._sock.close()


def client_of(daemon: Daemon) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.socket)), base_url="http://agentd", timeout=300)


def ollama_config(url: str) -> str:
    return f"""
[intelligence]
provider = "ollama"
endpoints = ["{url}"]
model = "fake-model"

[limits]
deadline = "300s"

[[assistants]]
name = "main"
first_message_mode = "assistant-waits-for-user"
"""


def scripted_config() -> str:
    return """
[intelligence]
provider = "scripted"
model = "streamer"
options = { chunk_ms = 2 }

[supervisor]
idle_unload = "24h"

[[assistants]]
name = "main"
first_message_mode = "assistant-waits-for-user"
"""


# --------------------------------------------------------------------------- figure 1


def latency(workdir: Path, pieces: int, pace_ms: float, turns: int) -> tuple[list[float], int]:
    """Figure 1 for one pace: per-word latencies (seconds) and how many delta frames carried them."""
    server = ServerProcess(pieces, pace_ms)
    home = workdir / f"latency-{pace_ms:g}"
    home.mkdir()
    daemon = Daemon(home, ollama_config(server.url)).start()
    try:
        with client_of(daemon) as client:
            session = client.post("/v1/sessions", json={}).json()["id"]
            subscriber = Subscriber(client, session)
            for _ in range(turns):
                client.post(f"/v1/sessions/{session}/messages", json={"content": "go", "wait": True})
                subscriber.turns_done.acquire(timeout=60)
    finally:
        daemon.stop()
    record_times = server.record_times()
    samples: list[float] = []
    frames = 0
    turn_index = -1
    for read_at, name, data in subscriber.events:
        if name == "turn.started":
            turn_index += 1
        if name != "delta" or "content" not in data or turn_index >= len(record_times):
            continue
        frames += 1
        written = [t for i, t in enumerate(record_times[turn_index]) if i != 1]  # the fake's blank line 1
        for word in re.findall(r"w(\d{5})", data["content"]):
            samples.append(read_at - written[int(word)])
    return samples, frames


# --------------------------------------------------------------------------- figures 2 and 3


def delta_frames(client: httpx.Client) -> float:
    text = client.get("/metrics").text
    found = re.search(r'^agentd_delta_frames_total\{event="delta"\} ([0-9.e+]+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def throughput(workdir: Path, clients: int, seconds: float, words: int, watched: bool) -> dict[str, float]:
    """Figures 2 and 3 for one mode: turns/s, supervisor CPU, delta frames over the window."""
    home = workdir / ("watched" if watched else "unwatched")
    home.mkdir()
    daemon = Daemon(home, scripted_config()).start()
    message = " ".join(f"word{k}" for k in range(words))
    try:
        with client_of(daemon) as client:
            sessions = [client.post("/v1/sessions", json={}).json()["id"] for _ in range(clients)]
            for session in sessions:  # every session loaded before the window
                client.post(f"/v1/sessions/{session}/messages", json={"content": "warm", "wait": True})
            subscribers = [Drain(daemon, s) for s in sessions] if watched else []
            began = time.monotonic() + 0.2
            window = (began + WARMUP_SECONDS, began + WARMUP_SECONDS + seconds)
            ends: list[float] = []
            lock = threading.Lock()

            def post(session: str) -> None:
                with client_of(daemon) as own:
                    time.sleep(max(0.0, began - time.monotonic()))
                    while time.monotonic() < window[1]:
                        own.post(f"/v1/sessions/{session}/messages", json={"content": message, "wait": True})
                        with lock:
                            ends.append(time.monotonic())

            threads = [threading.Thread(target=post, args=(s,), daemon=True) for s in sessions]
            for thread in threads:
                thread.start()
            assert daemon.process is not None
            time.sleep(max(0.0, window[0] - time.monotonic()))
            cpu0, frames0 = cpu_seconds([daemon.process.pid]), delta_frames(client)
            time.sleep(max(0.0, window[1] - time.monotonic()))
            cpu1, frames1 = cpu_seconds([daemon.process.pid]), delta_frames(client)
            for thread in threads:
                thread.join()
            turns = sum(1 for end in ends if window[0] <= end < window[1])
            for subscriber in subscribers:
                subscriber.close()
    finally:
        daemon.stop()
    return {"turns": turns, "rate": turns / seconds, "cpu": cpu1 - cpu0, "frames": frames1 - frames0}


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pieces", type=int, default=150, help="words per streamed answer (figure 1)")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--words", type=int, default=40, help="words of each message the scripted model echoes")
    args = parser.parse_args()
    began = time.monotonic()
    print(f"agentd streaming — python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {loadavg()}")
    with tempfile.TemporaryDirectory(prefix="agentd-bench-stream-") as tmp:
        workdir = Path(tmp)
        rows = []
        for pace, turns in ((SLOW_PACE_MS, 1), (FAST_PACE_MS, 5)):
            samples, frames = latency(workdir, args.pieces, pace, turns)
            rows.append(
                [
                    f"{pace:g} ms apart",
                    str(len(samples)),
                    str(frames),
                    f"{percentile(samples, 50) * 1000:.2f}",
                    f"{percentile(samples, 99) * 1000:.2f}",
                ]
            )
        print_table(
            "1. streamed word → SSE subscriber read (ms)", ["pace", "words", "delta frames", "p50", "p99"], rows
        )
        quiet = throughput(workdir, args.clients, args.seconds, args.words, watched=False)
        loud = throughput(workdir, args.clients, args.seconds, args.words, watched=True)
        print_table(
            f"2. turns/s, {args.clients} clients, scripted chunk_ms = 2, {args.words}-word answers",
            ["mode", "turns/s", "delta frames/s", "supervisor CPU (cores)"],
            [
                [
                    name,
                    f"{m['rate']:.1f}",
                    f"{m['frames'] / args.seconds:.0f}",
                    f"{m['cpu'] / args.seconds:.2f}",
                ]
                for name, m in (("no subscriber", quiet), ("SSE subscriber on every session", loud))
            ],
        )
        print(f"   watched / unwatched: {loud['rate'] / quiet['rate'] * 100:.0f} % (target >= 80 %)")
        per_delta = loud["cpu"] / loud["frames"] if loud["frames"] else float("nan")
        marginal = (
            (loud["cpu"] / loud["turns"] - quiet["cpu"] / quiet["turns"]) / (loud["frames"] / loud["turns"])
            if loud["frames"] and loud["turns"] and quiet["turns"]
            else float("nan")
        )
        print_table(
            "3. supervisor CPU per delta frame (µs)",
            ["measure", "µs"],
            [
                ["all supervisor CPU of the watched window / its delta frames", f"{per_delta * 1e6:.0f}"],
                [
                    "extra supervisor CPU per turn when watched (every event) / delta frames per turn",
                    f"{marginal * 1e6:.0f}",
                ],
            ],
        )
    print(f"total {time.monotonic() - began:.1f}s; load average {loadavg()}")


if __name__ == "__main__":
    main()
