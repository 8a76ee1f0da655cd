"""Swap fan-out latency: SIGHUP → every affected child has sent SwapAck, with N turns in flight.

    .venv/bin/python bench/swap_latency.py [--sizes 1,10,50] [--reloads 20] [--log-level debug]

For each size N a fresh ``agentd run`` (the real daemon, JSON logs, a temp state dir) is started
with a scripted config whose model calls wait on a ``hold_file`` that never exists. N sessions are
created over the API on the unix socket and each gets a message, so every session has a turn
held mid model call (one child per session). One unmeasured warm-up reload checks that all N
sessions park the swap (a session logs ``intel.swap.parked`` only while a turn is in flight).
Then, ``--reloads`` times: the config is rewritten with a new model name, SIGHUP is sent (wall
clock ``time.time()`` noted just before), and the supervisor's log is tailed until all N sessions
have answered for the new generation.

What is read from the supervisor's log (its ``timestamp`` field, ISO UTC, is when the supervisor
emitted the line; the child's own timestamp on re-emitted lines is dropped by the supervisor):

- ``intel.swap.acked``: the supervisor handled the child's ``SwapAck`` frame. Logged at debug
  level only, so the daemon runs with ``--log-level debug`` by default (no other line in agentd
  is logged at debug). ``--log-level info`` drops this column.
- ``intel.swap.parked``: the child parked the swap (logged by the child right after it sent
  SwapAck, on its stderr, re-emitted by the supervisor when it reads the line).
- ``intel.swap.sent``: logged after SwapIntel was written to that session's child (first and
  last). The fan-out tasks all write before the first of these lines is logged.
- ``config.reload``: the reload finished, i.e. SwapIntel was written to every child.

Per reload, "all acked" = last of the N ``intel.swap.acked`` − SIGHUP sent; the same for parked.
Percentiles are nearest-rank over the reloads (with 20 reloads p99 is the maximum; use
``--reloads 100`` for a p99 that is not). Every daemon is stopped with SIGTERM and the script
checks /proc that none of its children is left.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tables import percentile, print_table

from tests.daemon_harness import Daemon, child_pids_of, pid_alive, wait_until

ACK_TIMEOUT = 60.0
READY_TIMEOUT = 180.0
POLL_SECONDS = 0.002


# --------------------------------------------------------------------------- statistics and tables


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds consumed so far by ``pids`` (those that still exist)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


# --------------------------------------------------------------------------- the daemon and its log


HOLD_DELAY_MS = 3_600_000


def bench_config(model: str, hold: str, hold_file: Path) -> str:
    """Every model call is held: on ``hold_file`` (hold "file"), or in one long ``delay_ms`` sleep
    (hold "delay"); generous spawn timeout and turn deadline."""
    option = f'hold_file = "{hold_file}"' if hold == "file" else f"delay_ms = {HOLD_DELAY_MS}"
    return f"""
[intelligence]
provider = "scripted"
model = "{model}"
options = {{ {option} }}

[limits]
deadline = "3600s"

[supervisor]
spawn_timeout = "120s"
stop_grace = "30s"

[[assistants]]
name = "bench"
first_message_mode = "assistant-waits-for-user"
"""


def write_atomically(path: Path, text: str) -> None:
    scratch = path.with_suffix(".tmp")
    scratch.write_text(text)
    os.replace(scratch, path)


def log_time(record: dict[str, Any]) -> float:
    """The record's ISO UTC ``timestamp`` as epoch seconds."""
    return datetime.fromisoformat(str(record["timestamp"]).replace("Z", "+00:00")).timestamp()


class LogTail:
    """Reads the JSON lines appended to the daemon's log since the last call."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "rb")  # noqa: SIM115 - closed in close()
        self._partial = b""

    def records(self) -> list[dict[str, Any]]:
        data = self._partial + self._file.read()
        lines = data.split(b"\n")
        self._partial = lines.pop()
        found = []
        for line in lines:
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(record, dict):
                found.append(record)
        return found

    def close(self) -> None:
        self._file.close()


@dataclass
class Reload:
    """One reload's observations (epoch seconds from the supervisor's log)."""

    sent: float
    acked: dict[str, float] = field(default_factory=dict)
    parked: dict[str, float] = field(default_factory=dict)
    swap_sent: dict[str, float] = field(default_factory=dict)
    reload_logged: float | None = None


class Bench:
    """One daemon with ``size`` sessions, each holding a turn in flight."""

    _per_session: ClassVar[dict[str, str]] = {
        "intel.swap.sent": "swap_sent",
        "intel.swap.acked": "acked",
        "intel.swap.parked": "parked",
    }

    def __init__(self, tmp: Path, size: int, log_level: str, hold: str) -> None:
        self.tmp = tmp
        self.size = size
        self.hold = hold
        self.watch_acks = log_level == "debug"
        self.hold_file = tmp / "never-created"
        self.daemon = Daemon(tmp, bench_config("bench-g1", hold, self.hold_file), args=["--log-level", log_level])
        self.sessions: list[str] = []
        self.children: set[int] = set()
        self.tail: LogTail | None = None
        self.swaps_applied = 0

    def start(self) -> None:
        self.daemon.start()
        self.tail = LogTail(self.daemon.log_path)
        for _ in range(self.size):
            session = self.daemon.new_session()
            self.daemon.send(session, "hold this turn", wait=False)
            self.sessions.append(session)
        wait_until(
            lambda: sum(c["state"] == "ready" for c in self.daemon.status()["children"]) == self.size,
            f"{self.size} children to be ready",
            timeout=READY_TIMEOUT,
            interval=0.1,
        )
        self.children = {c["pid"] for c in self.daemon.status()["children"] if c["pid"]}

    def reload(self) -> Reload:
        """Rewrite the config with a new model, SIGHUP, and wait until every session acked and parked."""
        assert self.tail is not None and self.daemon.process is not None
        generation = self.daemon.status()["generation"] + 1
        write_atomically(self.daemon.config_path, bench_config(f"bench-g{generation}", self.hold, self.hold_file))
        for record in self.tail.records():  # what came before this reload: only count ended turns
            self.swaps_applied += record.get("event") == "intel.swap.applied"
        observed = Reload(sent=time.time())
        self.daemon.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + ACK_TIMEOUT
        while not self._complete(observed):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"generation {generation}: {len(observed.acked)} acked, {len(observed.parked)} parked "
                    f"of {self.size} after {ACK_TIMEOUT:g}s (log: {self.daemon.log_path})"
                )
            time.sleep(POLL_SECONDS)
            for record in self.tail.records():
                self._observe(record, generation, observed)
        return observed

    def _complete(self, observed: Reload) -> bool:
        return (
            len(observed.parked) == self.size
            and len(observed.swap_sent) == self.size
            and observed.reload_logged is not None
            and (not self.watch_acks or len(observed.acked) == self.size)
        )

    def _observe(self, record: dict[str, Any], generation: int, observed: Reload) -> None:
        event = record.get("event")
        if event == "config.reload":
            if not record.get("applied") or record.get("generation") != generation:
                raise RuntimeError(f"unexpected reload result: {record}")
            observed.reload_logged = log_time(record)
        elif record.get("generation") == generation and event in self._per_session:
            getattr(observed, self._per_session[str(event)])[str(record["session"])] = log_time(record)
        elif event == "intel.swap.applied":
            self.swaps_applied += 1  # a turn ended: the hold did not hold

    def stop(self) -> int | None:
        """Release the held turns, SIGTERM the daemon (a clean drain exits 0), and fail if any of
        its children is still alive afterwards. Returns the daemon's exit code."""
        daemon_pid = self.daemon.process.pid if self.daemon.process else None
        if daemon_pid is not None and self.daemon.process and self.daemon.process.poll() is None:
            self.children |= set(child_pids_of(daemon_pid))
        # Only now do the in-flight turns end, so the drain is clean.
        if self.hold == "file":
            self.hold_file.touch()
        elif self.daemon.process is not None and self.daemon.process.poll() is None:
            for session in self.sessions:
                self.daemon.api("POST", f"/v1/sessions/{session}/cancel")
        code = self.daemon.stop()
        if self.tail is not None:
            self.tail.close()
        left = sorted(pid for pid in self.children if pid_alive(pid))
        if left:
            raise RuntimeError(f"children left after the daemon stopped: {left}")
        return code


# --------------------------------------------------------------------------- main


@dataclass
class Run:
    """One size's results."""

    reloads: list[Reload]
    ready_seconds: float
    swaps_applied: int
    exit_code: int | None
    children_cores: float  # CPU used by all children while measuring, in cores (CPU s / wall s)
    supervisor_cores: float


def measure(size: int, reloads: int, log_level: str, hold: str) -> Run:
    """Start a daemon with ``size`` held turns, warm up once, time ``reloads`` reloads, stop it."""
    with tempfile.TemporaryDirectory(prefix=f"agentd-swap-{size}-") as tmp:
        bench = Bench(Path(tmp), size, log_level, hold)
        try:
            began = time.monotonic()
            bench.start()
            ready_seconds = time.monotonic() - began
            bench.reload()  # warm-up: proves all turns are in flight (N parked), not measured
            children, supervisor = sorted(bench.children), [bench.daemon.process.pid] if bench.daemon.process else []
            cpu_before, supervisor_before, wall_before = (
                cpu_seconds(children),
                cpu_seconds(supervisor),
                time.monotonic(),
            )
            measured = [bench.reload() for _ in range(reloads)]
            wall = time.monotonic() - wall_before
            children_cores = (cpu_seconds(children) - cpu_before) / wall
            supervisor_cores = (cpu_seconds(supervisor) - supervisor_before) / wall
        except BaseException:
            bench.stop()
            raise
        return Run(measured, ready_seconds, bench.swaps_applied, bench.stop(), children_cores, supervisor_cores)


def rows_for(size: int, measured: list[Reload], watch_acks: bool) -> list[list[str]]:
    """Table rows for one size: each figure is a latency from SIGHUP sent, in ms."""

    def row(label: str, values: list[float]) -> list[str]:
        ms = [v * 1000 for v in values]
        return [
            str(size),
            label,
            str(len(ms)),
            f"{percentile(ms, 50):.1f}",
            f"{percentile(ms, 99):.1f}",
            f"{max(ms):.1f}",
        ]

    out = [
        row("SIGHUP -> first intel.swap.sent", [min(r.swap_sent.values()) - r.sent for r in measured]),
        row("SIGHUP -> last intel.swap.sent", [max(r.swap_sent.values()) - r.sent for r in measured]),
        row("SIGHUP -> config.reload logged", [r.reload_logged - r.sent for r in measured if r.reload_logged]),
    ]
    if watch_acks:
        out.append(row("SIGHUP -> first SwapAck", [min(r.acked.values()) - r.sent for r in measured]))
        out.append(row("SIGHUP -> all SwapAck (intel.swap.acked)", [max(r.acked.values()) - r.sent for r in measured]))
    out.append(row("SIGHUP -> all parked (intel.swap.parked)", [max(r.parked.values()) - r.sent for r in measured]))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1,10,50", help="comma-separated session counts (default 1,10,50)")
    parser.add_argument("--reloads", type=int, default=20, help="measured reloads per size (default 20)")
    parser.add_argument(
        "--log-level",
        choices=["debug", "info"],
        default="debug",
        help="daemon log level; debug adds the intel.swap.acked observations (default debug)",
    )
    parser.add_argument(
        "--hold",
        choices=["file", "delay"],
        default="file",
        help="how a model call is held in flight: wait on a hold_file that never exists (the scripted "
        "model polls it every 20 ms), or one long delay_ms sleep (no wake-ups); default file",
    )
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--sizes: not a list of integers: {args.sizes!r}")
    if not sizes or min(sizes) < 1 or args.reloads < 1:
        parser.error("sizes and --reloads must be at least 1")

    watch_acks = args.log_level == "debug"
    print(f"agentd swap latency — python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {loadavg()}")
    began = time.monotonic()
    rows: list[list[str]] = []
    notes: list[str] = []
    for size in sizes:
        run = measure(size, args.reloads, args.log_level, args.hold)
        rows += rows_for(size, run.reloads, watch_acks)
        notes.append(
            f"{size} session(s): {size} children ready, turns in flight, after {run.ready_seconds:.1f}s; "
            f"swaps applied while measuring: {run.swaps_applied} (0 = every turn stayed in flight); "
            f"agentd exit code after SIGTERM: {run.exit_code}; CPU while measuring: "
            f"children {run.children_cores:.2f} cores, supervisor {run.supervisor_cores:.2f} cores"
        )
    print_table(
        f"Swap fan-out, ms ({args.reloads} reloads per size after one warm-up; every session has a turn in flight; "
        f"hold: {args.hold})",
        ["sessions", "figure", "n", "p50", "p99", "max"],
        rows,
        left=(1,),
    )
    print()
    for note in notes:
        print(note)
    print(f"total {time.monotonic() - began:.1f}s; load average {loadavg()}; no child left running")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
