"""Scale: what many sessions cost, for the default pool and for one process per loaded session.

    .venv/bin/python bench/scale.py [--sessions 10000] [--isolated-sessions 200] [--idle 100000]
        [--new-sessions 200] [--in-flight 200] [--isolated-in-flight 50] [--reloads 20]
        [--clients 64] [--seconds 10] [--serial-turns 500] [--restarts 3] [--hold file|delay] [--quick]

Every figure is measured, in the same run, on real ``agentd run`` daemons (JSON logs, temp state
dirs, the scripted model with ``delay_ms = 0``, driven over the unix socket) in two modes:

- ``pool``: the default pool, ``sessions_per_child = 1000``;
- ``1/child``: ``sessions_per_child = 1``, a process per loaded session (isolation).

Both set ``idle_unload = "24h"`` (every session stays loaded while it is measured) and a
``max_children`` large enough for every loaded session; everything else is the default. One
daemon per mode runs figures 4, 1, 6 and 5 in that order (each figure's sessions stay loaded for
the next); a third state dir, filled directly with ``--idle`` idle session rows, serves figures
2 and 3 for both modes in turn.

1. Summed ``VmRSS`` (and ``Pss``) of the daemon and all its descendants with N open sessions that
   each completed one turn. With 1/child, N is ``--isolated-sessions`` (10,000 processes would
   not fit the machine) and the 10,000-session figure is extrapolated linearly: the daemon's
   memory with no session plus N × the measured cost per loaded session.
2. The same with ``--idle`` idle sessions in the store and none loaded (fresh start).
3. Restart → API ready with those sessions: ``Popen`` → first 200 from ``GET /v1/health`` and
   from ``GET /v1/status`` (probed every 2 ms on a new connection), ``--restarts`` times per mode.
4. New session → first answer: ``POST /v1/sessions`` then ``POST …/messages`` with
   ``wait: true``, ``--new-sessions`` sessions one after another, on the fresh daemon.
5. SIGHUP → every child acked: ``seconds`` of the supervisor's ``intel.swap.fanout_acked`` log line,
   with all figure-1 sessions loaded and idle and ``--in-flight`` turns held mid model call (a
   second assistant whose scripted model waits on a ``hold_file``; ``--hold delay``: one long
   ``delay_ms`` sleep instead), ``--reloads`` reloads after one warm-up, the model alternating. A
   reload starts once the previous one has fully settled: every held turn parked the swap and
   every idle loaded session has applied it and its new generation is in the store (that time is
   shown too).
6. Aggregate turns/s: ``--clients`` threads, each on its own loaded session, posting messages
   back to back (``wait: true``) for ``--seconds`` after a 1 s warm-up; and the serial round trip
   of one client doing ``--serial-turns`` turns, round-robin over 10 sessions so transcripts stay
   short.

The HTTP client is a minimal keep-alive HTTP/1.1 client on the unix socket (a few µs per request,
so the figures are the daemon's, not httpx's); it runs in this process, on the same 2 cores, and
its CPU is reported for figure 6. Percentiles are nearest-rank. Every daemon is stopped with
SIGTERM; the script checks /proc that none of their children is left.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import msgspec
from swap_latency import LogTail, cpu_seconds, loadavg, log_time, write_atomically
from tables import percentile, print_table

from agentd.config import parse_config
from agentd.store.codec import encode_message as _encode_message
from agentd.transfer import session_start_history
from tests.daemon_harness import agentd_env, pid_alive

MB = 1e6 / 1024  # KiB per MB (10^6 bytes): the targets are in MB
REQUEST_TIMEOUT = 300.0
START_TIMEOUT = 120.0
SETTLE_TIMEOUT = 600.0
RELOAD_TIMEOUT = 600.0
PROBE_INTERVAL = 0.002
KEEPALIVE_REUSE = 3.0  # uvicorn closes an idle keep-alive connection after 5 s
HOLD_DELAY_MS = 3_600_000
MODELS = ("echo-a", "echo-b")  # generation g runs MODELS[(g - 1) % 2]
EXTRAPOLATE_TO = 10_000
FILL_WORKERS = 8
SERIAL_SESSIONS = 10
WARMUP_SECONDS = 1.0
HELD_CPU_SECONDS = 2.0


# --------------------------------------------------------------------------- problems seen


class Problems:
    """Everything that went wrong but did not stop the run: unexpected statuses, error log lines."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.first: dict[str, str] = {}

    def add(self, what: str, detail: str = "") -> None:
        with self._lock:
            self.counts[what] += 1
            self.first.setdefault(what, detail[:300])

    def lines(self) -> list[str]:
        return [f"{n} × {what}: {self.first[what]}" for what, n in self.counts.most_common()]


PROBLEMS = Problems()


# --------------------------------------------------------------------------- a lean HTTP client


class HttpError(Exception):
    """A request answered with a status other than the expected one."""

    def __init__(self, method: str, target: str, status: int, body: bytes) -> None:
        self.status = status
        super().__init__(f"{method} {target} → {status}: {body[:300].decode(errors='replace')}")


class _Closed(Exception):
    """The server closed a kept-alive connection before answering (safe to retry once)."""


class Http:
    """A minimal HTTP/1.1 client on a unix socket: keep-alive, ``Content-Length`` bodies only."""

    def __init__(self, socket_path: Path, timeout: float = REQUEST_TIMEOUT) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._buf = bytearray()
        self._used = 0.0

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._buf.clear()

    def _connect(self) -> socket.socket:
        self.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(str(self.socket_path))
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        return sock

    def request(self, method: str, target: str, body: object = None) -> tuple[int, bytes]:
        """Send one request; (status, body). Reconnects when the kept-alive connection was closed."""
        data = b"" if body is None else msgspec.json.encode(body)
        head = (
            f"{method} {target} HTTP/1.1\r\nHost: agentd\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        ).encode()
        reused = self._sock is not None and time.monotonic() - self._used < KEEPALIVE_REUSE
        sock = self._sock if reused and self._sock is not None else self._connect()
        try:
            return self._exchange(sock, head + data)
        except (_Closed, BrokenPipeError, ConnectionResetError):
            if not reused:
                raise
            return self._exchange(self._connect(), head + data)

    def _exchange(self, sock: socket.socket, payload: bytes) -> tuple[int, bytes]:
        sock.sendall(payload)
        buf = self._buf
        while (end := buf.find(b"\r\n\r\n")) < 0:
            chunk = sock.recv(65536)
            if not chunk:
                if not buf:
                    raise _Closed
                raise ConnectionError("connection closed in the middle of a response")
            buf += chunk
        lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        if "content-length" not in headers:
            raise ConnectionError(f"response without Content-Length: {lines[0]}")
        length = int(headers["content-length"])
        while len(buf) < end + 4 + length:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("connection closed in the middle of a response body")
            buf += chunk
        body = bytes(buf[end + 4 : end + 4 + length])
        del buf[: end + 4 + length]
        self._used = time.monotonic()
        if headers.get("connection", "").lower() == "close":
            self.close()
        return status, body

    def call(self, method: str, target: str, body: object = None, expect: int = 200) -> Any:
        """The decoded JSON answer; HttpError when the status is not ``expect``."""
        status, data = self.request(method, target, body)
        if status != expect:
            raise HttpError(method, target, status, data)
        return msgspec.json.decode(data)


def parallel(count: int, workers: int, socket_path: Path, work: Callable[[Http, int], None]) -> float:
    """Run ``work(http, i)`` for i in range(count) on ``workers`` threads (one connection each); seconds."""
    lock = threading.Lock()
    next_index = iter(range(count))
    failures: list[BaseException] = []

    def worker() -> None:
        http = Http(socket_path)
        try:
            while not failures:
                with lock:
                    i = next(next_index, None)
                if i is None:
                    return
                work(http, i)
        except BaseException as exc:
            failures.append(exc)
        finally:
            http.close()

    began = time.monotonic()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, min(workers, count)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return time.monotonic() - began


# --------------------------------------------------------------------------- processes and memory


@dataclass(frozen=True)
class Memory:
    """Summed over the daemon and its descendants."""

    rss_kib: int
    pss_kib: int
    processes: int
    supervisor_rss_kib: int  # the first pid's share (the daemon itself)


def live_processes() -> dict[int, int]:
    """pid → parent pid of every live (non-zombie) process."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if stat[0] != "Z":
            parents[int(entry.name)] = int(stat[1])
    return parents


def process_tree(root: int) -> list[int]:
    """``root`` and all its live descendants."""
    children: dict[int, list[int]] = {}
    for pid, parent in live_processes().items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _kib_field(path: Path, name: str) -> int:
    try:
        for line in path.read_text().splitlines():
            if line.startswith(name):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def memory_of(pids: Sequence[int]) -> Memory:
    rss = [_kib_field(Path(f"/proc/{pid}/status"), "VmRSS:") for pid in pids]
    pss = sum(_kib_field(Path(f"/proc/{pid}/smaps_rollup"), "Pss:") for pid in pids)
    return Memory(sum(rss), pss, len(pids), rss[0] if rss else 0)


# --------------------------------------------------------------------------- the daemon


@dataclass(frozen=True)
class Mode:
    """One way of running the pool, with the sizes used for it."""

    key: str
    sessions_per_child: int
    sessions: int  # figure 1: loaded sessions, one turn each
    in_flight: int  # figure 5: held turns

    @property
    def slug(self) -> str:
        """The key as a file name."""
        return self.key.replace("/", "-")

    def max_children(self) -> int:
        loaded = self.sessions + self.in_flight
        return max(64, -(-loaded // self.sessions_per_child) + 8)


def scale_config(mode: Mode, *, generation: int, hold: str, hold_file: Path) -> str:
    """The bench config: ``bench`` answers at once, ``held`` waits in its model call."""
    held = f'hold_file = "{hold_file}"' if hold == "file" else f"delay_ms = {HOLD_DELAY_MS}"
    return f"""
[intelligence]
provider = "scripted"
model = "{MODELS[(generation - 1) % 2]}"
options = {{ delay_ms = 0 }}

[limits]
deadline = "3600s"

[supervisor]
sessions_per_child = {mode.sessions_per_child}
max_children = {mode.max_children()}
idle_unload = "24h"
spawn_timeout = "120s"
stop_grace = "30s"

[[assistants]]
name = "bench"
system = "You are the scale benchmark."
first_message_mode = "assistant-waits-for-user"

[[assistants]]
name = "held"
first_message_mode = "assistant-waits-for-user"
intelligence = {{ options = {{ {held} }} }}
"""


@dataclass(frozen=True)
class Startup:
    """Seconds from ``Popen`` to the first 200 of each route."""

    health: float
    status: float


class Agentd:
    """One ``agentd run`` on a state dir; restartable."""

    def __init__(self, workdir: Path, state_dir: Path, name: str) -> None:
        self.workdir = workdir
        self.state_dir = state_dir
        self.name = name
        self.config_path = workdir / f"{name}.toml"
        self.env = agentd_env(workdir)
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / f"{name}.log"
        self.http = Http(self.socket)
        self._starts = 0
        self._log: Any = None
        self.exit_codes: list[int | None] = []

    @property
    def socket(self) -> Path:
        return self.state_dir / "agentd.sock"

    @property
    def db(self) -> Path:
        return self.state_dir / "agentd.db"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self) -> Startup:
        """Start the daemon and probe until both /v1/health and /v1/status have answered 200."""
        self._starts += 1
        self.log_path = self.workdir / f"{self.name}-{self._starts}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        command = [sys.executable, "-m", "agentd", "run", "--config", str(self.config_path)]
        command += ["--state-dir", str(self.state_dir), "--log-format", "json"]
        began = time.monotonic()
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, cwd=self.workdir
        )
        answered: dict[str, float] = {}
        while len(answered) < 2:
            if self.process.poll() is not None:
                raise RuntimeError(f"agentd exited with {self.process.returncode}: {self.log_tail()}")
            for route in ("/v1/health", "/v1/status"):
                if route not in answered and self._probe(route):
                    answered[route] = time.monotonic() - began
            if time.monotonic() - began > START_TIMEOUT:
                raise RuntimeError(f"agentd did not answer within {START_TIMEOUT:g}s (log: {self.log_path})")
            if len(answered) < 2:
                time.sleep(PROBE_INTERVAL)
        return Startup(answered["/v1/health"], answered["/v1/status"])

    def _probe(self, route: str) -> bool:
        probe = Http(self.socket, timeout=START_TIMEOUT)
        try:
            return probe.request("GET", route)[0] == 200
        except (OSError, _Closed):
            return False
        finally:
            probe.close()

    def status(self) -> Any:
        return self.http.call("GET", "/v1/status")

    def settle(self, *, running: int = 0, timeout: float = SETTLE_TIMEOUT) -> Any:
        """Wait until no child is starting and exactly ``running`` turns are in flight; the status."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            starting = sum(c["state"] == "starting" or c["pid"] is None for c in status["children"])
            if not starting and status["sessions"]["running"] == running:
                return status
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: pool not settled after {timeout:g}s: {status['sessions']}")
            time.sleep(0.05)

    def memory(self) -> Memory:
        return memory_of(process_tree(self.pid))

    def stop(self) -> int | None:
        """SIGTERM, wait, and fail if a child outlived the daemon. Returns the exit code."""
        self.http.close()
        if self.process is None:
            return None
        left: list[int] = []
        if self.process.poll() is None:
            descendants = process_tree(self.process.pid)[1:]
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                PROBLEMS.add(f"{self.name}: agentd did not exit 120 s after SIGTERM (killed)")
                self.process.kill()
                self.process.wait()
            deadline = time.monotonic() + 10
            while (left := [p for p in descendants if pid_alive(p)]) and time.monotonic() < deadline:
                time.sleep(0.05)
        if self._log is not None:
            self._log.close()
        code = self.process.returncode
        self.exit_codes.append(code)
        self.process = None
        self._scan_log()
        if left:
            raise RuntimeError(f"{self.name}: children left after the daemon stopped: {left}")
        return code

    def _scan_log(self) -> None:
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                PROBLEMS.add(f"{self.name}: non-JSON log line", line)
                continue
            if isinstance(record, dict) and record.get("level") in ("error", "critical", "exception"):
                PROBLEMS.add(f"{self.name}: log {record.get('level')} {record.get('event')}", line)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""


# --------------------------------------------------------------------------- figures 4, 1 and 6


@dataclass
class NewSessions:
    ids: list[str]
    create: list[float]  # POST /v1/sessions
    first: list[float]  # POST /v1/sessions → first answer


def new_session_latency(daemon: Agentd, count: int) -> NewSessions:
    """Figure 4: one new session after another, each created and then asked one message (wait)."""
    out = NewSessions([], [], [])
    http = daemon.http
    for _ in range(count):
        began = time.perf_counter()
        session = http.call("POST", "/v1/sessions", {"assistant": "bench"}, expect=201)["id"]
        created = time.perf_counter()
        http.call("POST", f"/v1/sessions/{session}/messages", {"content": "hello", "wait": True})
        answered = time.perf_counter()
        out.ids.append(session)
        out.create.append(created - began)
        out.first.append(answered - began)
    return out


def open_sessions(daemon: Agentd, count: int, *, assistant: str, wait: bool) -> tuple[list[str], float]:
    """Create ``count`` sessions in parallel, each with one message (``wait``: until it answered)."""
    ids: list[str] = [""] * count

    def one(http: Http, i: int) -> None:
        try:
            session = http.call("POST", "/v1/sessions", {"assistant": assistant}, expect=201)["id"]
            http.call(
                "POST", f"/v1/sessions/{session}/messages", {"content": "hello", "wait": wait}, 200 if wait else 202
            )
        except HttpError as exc:
            PROBLEMS.add(f"{daemon.name}: opening a {assistant} session: {exc.status}", str(exc))
            return
        ids[i] = session

    seconds = parallel(count, FILL_WORKERS, daemon.socket, one)
    return [s for s in ids if s], seconds


@dataclass
class Throughput:
    turns: int
    seconds: float
    latencies: list[float]
    errors: int
    cores: dict[str, float]  # CPU used in the window, in cores: supervisor, children, bench client


def throughput(daemon: Agentd, sessions: Sequence[str], seconds: float) -> Throughput:
    """Figure 6: one thread per session posting messages back to back; counted after a warm-up."""
    began = time.monotonic() + 0.2
    window = (began + WARMUP_SECONDS, began + WARMUP_SECONDS + seconds)
    done: list[list[tuple[float, float]]] = [[] for _ in sessions]
    errors = [0] * len(sessions)

    def client(i: int) -> None:
        http = Http(daemon.socket)
        target = f"/v1/sessions/{sessions[i]}/messages"
        time.sleep(max(0.0, began - time.monotonic()))
        try:
            while (start := time.monotonic()) < window[1]:
                status, body = http.request("POST", target, {"content": "ping", "wait": True})
                end = time.monotonic()
                if status == 200:
                    done[i].append((end, end - start))
                else:
                    errors[i] += 1
                    PROBLEMS.add(f"{daemon.name}: turn under load: {status}", body.decode(errors="replace"))
        finally:
            http.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(sessions))]
    for thread in threads:
        thread.start()
    children = process_tree(daemon.pid)[1:]
    time.sleep(max(0.0, window[0] - time.monotonic()))
    cpu0 = cpu_seconds([daemon.pid]), cpu_seconds(children), _own_cpu()
    time.sleep(max(0.0, window[1] - time.monotonic()))
    cpu1 = cpu_seconds([daemon.pid]), cpu_seconds(children), _own_cpu()
    for thread in threads:
        thread.join()
    in_window = [(end, lat) for per in done for end, lat in per if window[0] <= end < window[1]]
    cores = {
        name: (b - a) / seconds for name, a, b in zip(("supervisor", "children", "client"), cpu0, cpu1, strict=True)
    }
    return Throughput(len(in_window), seconds, [lat for _, lat in in_window], sum(errors), cores)


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def serial_turns(daemon: Agentd, sessions: Sequence[str], turns: int) -> list[float]:
    """Figure 6, serial: one client, one turn after another, round-robin over ``sessions``."""
    http = daemon.http
    out = []
    for i in range(turns):
        target = f"/v1/sessions/{sessions[i % len(sessions)]}/messages"
        began = time.perf_counter()
        http.call("POST", target, {"content": "ping", "wait": True})
        out.append(time.perf_counter() - began)
    return out


# --------------------------------------------------------------------------- figure 5


@dataclass
class Reload:
    """One reload, in seconds from SIGHUP sent (``acked`` is the supervisor's own measure)."""

    acked: float  # intel.swap.fanout_acked ``seconds``
    acked_logged: float  # the fanout_acked line's timestamp
    reload_logged: float  # config.reload
    all_parked: float | None  # last intel.swap.parked_running (the held turns; None: no swap for them)
    all_applied: float  # last intel.swap.applied (the idle loaded sessions)


@dataclass
class SwapRun:
    reloads: list[Reload] = field(default_factory=list)
    children: int = 0
    in_flight: int = 0
    idle_loaded: int = 0
    held_cores: float = 0.0  # CPU of the whole daemon, in cores, while only the held turns run
    seconds: float = 0.0  # holding the turns and all the reloads


class Reloader:
    """SIGHUPs a daemon and follows its log and its store until the reload has fully settled."""

    def __init__(self, daemon: Agentd, mode: Mode, hold: str, hold_file: Path, idle: int, held: int) -> None:
        self.daemon, self.mode, self.hold, self.hold_file = daemon, mode, hold, hold_file
        self.idle, self.held = idle, held
        self.tail = LogTail(daemon.log_path)
        self.db = sqlite3.connect(f"file:{daemon.db}?mode=ro", uri=True, isolation_level=None)

    def close(self) -> None:
        self.tail.close()
        self.db.close()

    def stored(self, generation: int) -> int:
        return int(
            self.db.execute(
                "SELECT COUNT(*) FROM sessions WHERE assistant = 'bench' AND generation = ?", (generation,)
            ).fetchone()[0]
        )

    def reload(self) -> Reload:
        generation = self.daemon.status()["generation"] + 1
        # A held turn runs on generation 1's model: a reload back to that model is no swap for it.
        parks = self.held if MODELS[(generation - 1) % 2] != MODELS[0] else 0
        text = scale_config(self.mode, generation=generation, hold=self.hold, hold_file=self.hold_file)
        write_atomically(self.daemon.config_path, text)
        self.tail.records()  # skip what came before
        parked: dict[str, float] = {}  # child → when its intel.swap.parked_running line came
        parked_sessions: dict[str, int] = {}  # child → how many of its turns in flight parked the swap
        applied: dict[str, float] = {}
        idle_applied: dict[str, tuple[int, float]] = {}  # child → (sessions it swapped at once, when)
        acked: tuple[float, float] | None = None
        reload_logged: float | None = None
        sent = time.time()
        os.kill(self.daemon.pid, signal.SIGHUP)
        while True:
            for record in self.tail.records():
                event = record.get("event")
                if record.get("generation") != generation:
                    continue
                if event == "intel.swap.fanout_acked":
                    acked = float(record["seconds"]), log_time(record) - sent
                elif event == "intel.swap.parked_running":
                    parked[str(record["child"])] = log_time(record) - sent
                    parked_sessions[str(record["child"])] = int(record["sessions"])
                elif event == "intel.swap.applied":
                    applied[str(record["session"])] = log_time(record) - sent
                elif event == "intel.swap.applied_idle":
                    idle_applied[str(record["child"])] = (int(record["sessions"]), log_time(record) - sent)
                elif event == "config.reload":
                    if not record.get("applied"):
                        raise RuntimeError(f"reload to generation {generation} rejected: {record}")
                    reload_logged = log_time(record) - sent
            now = time.time()
            # A swap is not written to each session's row (RFC 0006 §8): nothing to read back.
            swapped = len(applied) + sum(n for n, _ in idle_applied.values())
            if (
                acked is not None
                and reload_logged is not None
                and sum(parked_sessions.values()) >= parks
                and swapped >= self.idle
            ):
                break
            if now - sent > RELOAD_TIMEOUT:
                raise RuntimeError(
                    f"generation {generation} not settled after {RELOAD_TIMEOUT:g}s: acked {acked}, "
                    f"parked {sum(parked_sessions.values())}/{parks}, applied {swapped}/{self.idle}, "
                    f"stored {self.stored(generation)}/{self.idle} (log {self.daemon.log_path})"
                )
            time.sleep(0.002)
        return Reload(
            acked=acked[0],
            acked_logged=acked[1],
            reload_logged=reload_logged,
            all_parked=max(parked.values()) if parked else None,
            all_applied=max([*applied.values(), *(t for _, t in idle_applied.values())], default=0.0),
        )


def swap_fanout(daemon: Agentd, mode: Mode, idle: int, reloads: int, hold: str, hold_file: Path) -> SwapRun:
    """Figure 5: hold ``mode.in_flight`` turns, then time ``reloads`` reloads after one warm-up."""
    began = time.monotonic()
    held, _ = open_sessions(daemon, mode.in_flight, assistant="held", wait=False)
    status = daemon.settle(running=len(held))
    run = SwapRun(children=len(status["children"]), in_flight=len(held), idle_loaded=idle)
    run.held_cores = tree_cores(daemon, HELD_CPU_SECONDS)
    reloader = Reloader(daemon, mode, hold, hold_file, idle, len(held))
    try:
        reloader.reload()  # warm-up: proves every held turn is in flight (it parks) and every idle one swaps
        run.reloads = [reloader.reload() for _ in range(reloads)]
    finally:
        reloader.close()
    if daemon.status()["sessions"]["running"] != len(held):
        PROBLEMS.add(f"{daemon.name}: a held turn ended while reloading")
    release_held(daemon, held, hold, hold_file)
    run.seconds = time.monotonic() - began
    return run


def tree_cores(daemon: Agentd, seconds: float) -> float:
    """CPU the daemon and its children use over ``seconds``, in cores."""
    pids = process_tree(daemon.pid)
    before = cpu_seconds(pids)
    time.sleep(seconds)
    return (cpu_seconds(pids) - before) / seconds


def release_held(daemon: Agentd, held: Sequence[str], hold: str, hold_file: Path) -> None:
    """End the held turns (so the daemon's drain is clean) and wait until they have."""
    if hold == "file":
        hold_file.touch()
    else:
        for session in held:
            daemon.http.call("POST", f"/v1/sessions/{session}/cancel", expect=202)
    daemon.settle(running=0)


# --------------------------------------------------------------------------- one mode, figures 4, 1, 6, 5


@dataclass
class ModeRun:
    mode: Mode
    empty_start: Startup | None = None
    empty: Memory | None = None
    loaded: Memory | None = None
    loaded_children: int = 0
    fill_seconds: float = 0.0
    new: NewSessions | None = None
    load: Throughput | None = None
    serial: list[float] = field(default_factory=list)
    swap: SwapRun | None = None
    idle_store: Memory | None = None
    restarts: list[Startup] = field(default_factory=list)
    exit_codes: list[int | None] = field(default_factory=list)


def run_mode(workdir: Path, mode: Mode, args: argparse.Namespace) -> ModeRun:
    """Figures 4, 1, 6 and 5 on one fresh daemon of ``mode``."""
    result = ModeRun(mode)
    hold_file = workdir / f"{mode.slug}.hold"
    daemon = Agentd(workdir, workdir / f"{mode.slug}-state", mode.slug)
    daemon.config_path.write_text(scale_config(mode, generation=1, hold=args.hold, hold_file=hold_file))
    try:
        result.empty_start = daemon.start()
        daemon.settle()
        result.empty = daemon.memory()
        step(f"{mode.key}: figure 4, {args.new_sessions} new sessions one after another")
        result.new = new_session_latency(daemon, args.new_sessions)
        step(f"{mode.key}: figure 1, opening {max(0, mode.sessions - args.new_sessions)} more sessions")
        more, result.fill_seconds = open_sessions(
            daemon, max(0, mode.sessions - len(result.new.ids)), assistant="bench", wait=True
        )
        sessions = result.new.ids + more
        status = daemon.settle()
        time.sleep(1.0)
        result.loaded = daemon.memory()
        result.loaded_children = len(status["children"])
        if status["sessions"]["loaded"] != len(sessions):
            PROBLEMS.add(f"{mode.key}: {status['sessions']['loaded']} sessions loaded, expected {len(sessions)}")
        step(f"{mode.key}: figure 6, {args.clients} clients for {args.seconds:g}s, then {args.serial_turns} serial")
        result.load = throughput(daemon, sessions[: args.clients], args.seconds)
        serial_pool = sessions[args.clients : args.clients + SERIAL_SESSIONS] or sessions[:SERIAL_SESSIONS]
        result.serial = serial_turns(daemon, serial_pool, args.serial_turns)
        step(f"{mode.key}: figure 5, {mode.in_flight} turns held, {args.reloads} reloads")
        daemon.settle()
        result.swap = swap_fanout(daemon, mode, len(sessions), args.reloads, args.hold, hold_file)
    finally:
        daemon.stop()
        result.exit_codes += daemon.exit_codes
    return result


# --------------------------------------------------------------------------- figures 2 and 3


def populate_store(db: Path, count: int, config_text: str) -> float:
    """Insert ``count`` idle sessions (a row and their system prompt each) in one transaction; seconds."""
    history = session_start_history(parse_config(config_text).assistant("bench"))
    texts = [_encode_message(message) for message in history]
    began = time.monotonic()
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        now = time.time()
        ids = [f"s_{i:012x}" for i in range(count)]
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(
            "INSERT INTO sessions (id, assistant, state, generation, model, created_at, updated_at)"
            " VALUES (?, 'bench', 'idle', 1, ?, ?, ?)",
            ((session, MODELS[0], now, now) for session in ids),
        )
        conn.executemany(
            "INSERT INTO entries (session, seq, turn, active, message) VALUES (?, ?, NULL, 1, ?)",
            ((session, seq, text) for session in ids for seq, text in enumerate(texts, start=1)),
        )
        conn.execute("COMMIT")
    finally:
        conn.close()
    return time.monotonic() - began


def idle_store(
    workdir: Path, modes: Sequence[Mode], runs: dict[str, ModeRun], args: argparse.Namespace
) -> tuple[float, list[int | None]]:
    """Figures 2 and 3: one store with ``--idle`` idle sessions, each mode restarted on it in turn."""
    hold_file = workdir / "idle.hold"
    daemon = Agentd(workdir, workdir / "idle-state", "idle")

    def configure(mode: Mode) -> None:
        daemon.config_path.write_text(scale_config(mode, generation=1, hold=args.hold, hold_file=hold_file))

    configure(modes[0])
    daemon.start()  # creates the schema
    daemon.stop()
    populated = populate_store(daemon.db, args.idle, daemon.config_path.read_text())
    memories: dict[str, list[Memory]] = {m.key: [] for m in modes}
    try:
        for _ in range(args.restarts):
            for mode in modes:
                configure(mode)
                startup = daemon.start()
                status = daemon.settle()
                if status["sessions"]["open"] != args.idle:
                    PROBLEMS.add(f"idle store: {status['sessions']['open']} open sessions, expected {args.idle}")
                time.sleep(0.5)
                memories[mode.key].append(daemon.memory())
                runs[mode.key].restarts.append(startup)
                daemon.stop()
        # Sanity: a stored idle session answers (the rows are what agentd writes).
        daemon.start()
        daemon.http.call("POST", "/v1/sessions/s_000000000000/messages", {"content": "hello", "wait": True})
    finally:
        daemon.stop()
    for mode in modes:
        ordered = sorted(memories[mode.key], key=lambda m: m.rss_kib)
        runs[mode.key].idle_store = ordered[len(ordered) // 2]
    return populated, daemon.exit_codes


# --------------------------------------------------------------------------- the table


def _ms(values: Sequence[float], p: float) -> float | None:
    return percentile(values, p) * 1000 if values else None


def _mib(memory: Memory | None, pss: bool = False) -> float | None:
    if memory is None:
        return None
    return (memory.pss_kib if pss else memory.rss_kib) / MB


def per_session_kib(run: ModeRun, pss: bool = False) -> float | None:
    """The memory one more loaded session costs: (loaded − no session) / sessions."""
    if run.loaded is None or run.empty is None or run.new is None:
        return None
    n = run.mode.sessions
    loaded, empty = (run.loaded.pss_kib, run.empty.pss_kib) if pss else (run.loaded.rss_kib, run.empty.rss_kib)
    return (loaded - empty) / n if n else None


def at_scale_mib(run: ModeRun, target: int, pss: bool = False) -> tuple[float | None, bool]:
    """Memory with ``target`` loaded sessions: measured when the run had that many, else extrapolated."""
    if run.mode.sessions == target:
        return _mib(run.loaded, pss), False
    slope = per_session_kib(run, pss)
    base = _mib(run.empty, pss)
    if slope is None or base is None:
        return None, True
    return base + slope * target / MB, True


def fmt(value: float | None, digits: int = 1, mark: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}{mark}"


def ratio(pool: float | None, isolated: float | None) -> str:
    if pool is None or isolated is None or pool == 0:
        return "-"
    return f"{isolated / pool:,.1f}×"


def table_rows(pool: ModeRun, iso: ModeRun, args: argparse.Namespace) -> list[list[str]]:
    rows: list[list[str]] = []

    def add(label: str, target: str, a: float | None, b: float | None, digits: int = 1, marks: str = "") -> None:
        rows.append([label, target, fmt(a, digits), fmt(b, digits, marks), ratio(a, b)])

    n_pool, n_iso = pool.mode.sessions, iso.mode.sessions
    add("1. RSS, daemon with no session (MB)", "", _mib(pool.empty), _mib(iso.empty))
    add(
        f"1. RSS, N loaded sessions, 1 turn each (MB) [N = {n_pool} / {n_iso}]",
        "",
        _mib(pool.loaded),
        _mib(iso.loaded),
    )
    add("1. PSS, same (MB)", "", _mib(pool.loaded, True), _mib(iso.loaded, True))
    add("1. processes, same", "", pool.loaded_children + 1.0, iso.loaded_children + 1.0, 0)
    add("1. RSS per loaded session (KiB)", "", per_session_kib(pool), per_session_kib(iso))
    rss_pool, extra_pool = at_scale_mib(pool, EXTRAPOLATE_TO)
    rss_iso, extra_iso = at_scale_mib(iso, EXTRAPOLATE_TO)
    pss_pool, _ = at_scale_mib(pool, EXTRAPOLATE_TO, True)
    pss_iso, _ = at_scale_mib(iso, EXTRAPOLATE_TO, True)
    star = "*" if extra_iso else ""
    rows.append(
        [
            f"1. RSS, {EXTRAPOLATE_TO:,} loaded sessions (MB)",
            "≤ 600",
            fmt(rss_pool, 1, "*" if extra_pool else ""),
            fmt(rss_iso, 1, star),
            ratio(rss_pool, rss_iso),
        ]
    )
    rows.append(
        [
            f"1. PSS, {EXTRAPOLATE_TO:,} loaded sessions (MB)",
            "",
            fmt(pss_pool, 1, "*" if extra_pool else ""),
            fmt(pss_iso, 1, star),
            ratio(pss_pool, pss_iso),
        ]
    )
    add(f"2. RSS, {args.idle:,} idle sessions in the store (MB)", "≤ 1000", _mib(pool.idle_store), _mib(iso.idle_store))
    add("2. PSS, same (MB)", "", _mib(pool.idle_store, True), _mib(iso.idle_store, True))
    for label, pick in (("/v1/health", lambda s: s.health), ("/v1/status", lambda s: s.status)):
        a = [pick(s) for s in pool.restarts]
        b = [pick(s) for s in iso.restarts]
        add(f"3. restart → {label} 200, {args.idle:,} sessions, p50 (ms)", "≤ 1000", _ms(a, 50), _ms(b, 50), 0)
        add(f"3. restart → {label} 200, max of {len(a)} (ms)", "≤ 1000", _ms(a, 100), _ms(b, 100), 0)
    if pool.empty_start and iso.empty_start:
        add(
            "3. (ref.) start → /v1/status 200, empty store (ms)",
            "",
            pool.empty_start.status * 1000,
            iso.empty_start.status * 1000,
            0,
        )
    new_a = pool.new or NewSessions([], [], [])
    new_b = iso.new or NewSessions([], [], [])
    add("4. new session → first answer, p50 (ms)", "≤ 10", _ms(new_a.first, 50), _ms(new_b.first, 50), 2)
    add("4. new session → first answer, p95 (ms)", "", _ms(new_a.first, 95), _ms(new_b.first, 95), 2)
    add("4. … of which POST /v1/sessions, p50 (ms)", "", _ms(new_a.create, 50), _ms(new_b.create, 50), 2)
    swaps_a = pool.swap.reloads if pool.swap else []
    swaps_b = iso.swap.reloads if iso.swap else []
    in_a = pool.swap.in_flight if pool.swap else 0
    in_b = iso.swap.in_flight if iso.swap else 0
    add(
        f"5. children acked a reload [loaded {n_pool}+{in_a} / {n_iso}+{in_b}]",
        "",
        pool.swap.children if pool.swap else None,
        iso.swap.children if iso.swap else None,
        0,
    )
    for p in (50, 99):
        add(
            f"5. SIGHUP → every child acked (fanout_acked), p{p} (ms)",
            "≤ 10" if p == 99 else "",
            _ms([r.acked for r in swaps_a], p),
            _ms([r.acked for r in swaps_b], p),
            2,
        )
    add(
        "5. SIGHUP → fanout_acked line logged, p50 (ms)",
        "",
        _ms([r.acked_logged for r in swaps_a], 50),
        _ms([r.acked_logged for r in swaps_b], 50),
        2,
    )
    add(
        "5. SIGHUP → every held turn parked, p50 (ms)",
        "",
        _ms([r.all_parked for r in swaps_a if r.all_parked is not None], 50),
        _ms([r.all_parked for r in swaps_b if r.all_parked is not None], 50),
        1,
    )
    add(
        "5. SIGHUP → every idle loaded session swapped, p50 (ms)",
        "",
        _ms([r.all_applied for r in swaps_a], 50),
        _ms([r.all_applied for r in swaps_b], 50),
        0,
    )
    load_a, load_b = pool.load, iso.load
    add(
        f"6. turns/s, {args.clients} clients back to back",
        "≥ 1000",
        load_a.turns / load_a.seconds if load_a else None,
        load_b.turns / load_b.seconds if load_b else None,
        0,
    )
    add(
        "6. turn round trip under that load, p50 (ms)",
        "",
        _ms(load_a.latencies if load_a else [], 50),
        _ms(load_b.latencies if load_b else [], 50),
        2,
    )
    add("6. serial turn round trip, one client, p50 (ms)", "≤ 1.5", _ms(pool.serial, 50), _ms(iso.serial, 50), 2)
    add("6. serial turn round trip, one client, p95 (ms)", "", _ms(pool.serial, 95), _ms(iso.serial, 95), 2)
    return rows


# --------------------------------------------------------------------------- main


def print_results(runs: dict[str, ModeRun], modes: Sequence[Mode], args: argparse.Namespace, when: str) -> None:
    """The table (a mode not run yet shows "-")."""
    pool, iso = (runs.get(mode.key) or ModeRun(mode) for mode in modes)
    print_table(
        "agentd at scale: the default pool vs a process per loaded session" + (f", {when}" if when else ""),
        ["figure", "target", "pool (1000/child)", "1/child", "ratio 1/child ÷ pool"],
        table_rows(pool, iso, args),
    )
    print(flush=True)


def print_run_end(began: float, fingerprint: str) -> None:
    """The lines every bench run ends with: problems seen, a warning if agentd/ changed meanwhile,
    the total time and the load average."""
    problems = PROBLEMS.lines()
    print("problems: " + ("none" if not problems else ""))
    for line in problems:
        print(f"  {line}")
    if source_fingerprint() != fingerprint:
        print(f"warning: agentd/ changed during the run (sources {fingerprint} → {source_fingerprint()})")
    print(f"total {time.monotonic() - began:.0f}s; load average {loadavg()}; no child left running")


def source_fingerprint() -> str:
    """A short hash of every ``agentd/*.py``: which code was measured (the tree may be edited meanwhile)."""
    root = Path(__file__).resolve().parent.parent / "agentd"
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def step(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--sessions", type=int, default=10_000, help="figure 1 loaded sessions, pool (default 10000)")
    add("--isolated-sessions", type=int, default=200, help="figure 1 loaded sessions, 1/child (default 200)")
    add("--idle", type=int, default=100_000, help="figures 2-3: idle sessions in the store (default 100000)")
    add("--new-sessions", type=int, default=200, help="figure 4: sequential new sessions (default 200)")
    add("--in-flight", type=int, default=200, help="figure 5: held turns, pool (default 200)")
    add("--isolated-in-flight", type=int, default=50, help="figure 5: held turns, 1/child (default 50)")
    add("--reloads", type=int, default=20, help="figure 5: measured reloads (default 20)")
    add("--clients", type=int, default=64, help="figure 6: concurrent clients (default 64)")
    add("--seconds", type=float, default=10.0, help="figure 6: measured seconds (default 10)")
    add("--serial-turns", type=int, default=500, help="figure 6: serial turns (default 500)")
    add("--restarts", type=int, default=3, help="figure 3: restarts per mode (default 3)")
    add("--hold", choices=["file", "delay"], default="file", help="figure 5: hold_file (default) or a long delay_ms")
    add("--quick", action="store_true", help="small sizes for a smoke run (under a minute)")
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in (
            ("sessions", 300),
            ("isolated_sessions", 20),
            ("idle", 2000),
            ("new_sessions", 20),
            ("in_flight", 10),
            ("isolated_in_flight", 10),
            ("reloads", 3),
            ("clients", 8),
            ("seconds", 1.0),
            ("serial_turns", 100),
            ("restarts", 1),
        ):
            setattr(args, name, min(getattr(args, name), value))
    for name in ("sessions", "isolated_sessions", "idle", "new_sessions", "reloads", "clients", "restarts"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.clients > min(args.sessions, args.isolated_sessions):
        parser.error("--clients must not exceed --sessions or --isolated-sessions (one session per client)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    modes = [
        Mode("pool", 1000, max(args.sessions, args.new_sessions), args.in_flight),
        Mode("1/child", 1, max(args.isolated_sessions, args.new_sessions), args.isolated_in_flight),
    ]
    fingerprint = source_fingerprint()
    print(
        f"agentd scale — python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {loadavg()}, "
        f"agentd sources {fingerprint}"
    )
    began = time.monotonic()
    runs: dict[str, ModeRun] = {}
    with tempfile.TemporaryDirectory(prefix="agentd-scale-") as tmp:
        workdir = Path(tmp)
        for mode in modes:
            sub = workdir / mode.slug
            sub.mkdir()
            runs[mode.key] = run_mode(sub, mode, args)
            print_results(runs, modes, args, f"so far ({time.monotonic() - began:.0f}s)")
        step(f"figures 2-3: {args.idle} idle sessions, {args.restarts} restart(s) per mode")
        populated, idle_codes = idle_store(workdir, modes, runs, args)
    pool, iso = runs["pool"], runs["1/child"]
    print_results(runs, modes, args, "")
    print()
    if iso.mode.sessions != EXTRAPOLATE_TO:
        print(
            f"* extrapolated: measured with {iso.mode.sessions} loaded sessions, then the daemon with no "
            f"session + {EXTRAPOLATE_TO:,} × the cost per loaded session ({EXTRAPOLATE_TO:,} processes do not fit)"
        )
    for run in (pool, iso):
        notes = [
            f"{run.mode.key}: sessions_per_child={run.mode.sessions_per_child}, max_children={run.mode.max_children()}"
        ]
        if run.fill_seconds and run.new:
            opened = run.mode.sessions - len(run.new.ids)
            notes.append(f"opened {opened} sessions (one turn each, {FILL_WORKERS} clients) in {run.fill_seconds:.1f}s")
        if run.load:
            cores = ", ".join(f"{k} {v:.2f}" for k, v in run.load.cores.items())
            notes.append(f"figure 6 CPU in cores: {cores}; {run.load.errors} failed turns")
        if run.swap:
            notes.append(
                f"figure 5: {run.swap.children} children, {run.swap.in_flight} held ({args.hold}), "
                f"{run.swap.idle_loaded} idle loaded, daemon CPU with only the held turns running "
                f"{run.swap.held_cores:.2f} cores, {run.swap.seconds:.0f}s in all"
            )
        for label, memory in (("no session", run.empty), ("loaded", run.loaded), ("idle store", run.idle_store)):
            if memory is not None:
                notes.append(
                    f"RSS {label}: supervisor {memory.supervisor_rss_kib / MB:.1f} MB + "
                    f"{memory.processes - 1} children {(memory.rss_kib - memory.supervisor_rss_kib) / MB:.1f} MB"
                )
        notes.append(f"exit codes after SIGTERM: {run.exit_codes}")
        print("; ".join(notes))
    print(
        f"idle store: {args.idle:,} sessions inserted in {populated:.1f}s; figure 2 is the median of "
        f"{args.restarts} restart(s) per mode; exit codes after SIGTERM: {idle_codes}"
    )
    print_run_end(began, fingerprint)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
