"""Footprint: what the default pool costs before the first session, and how it grows and shrinks.

    .venv/bin/python bench/footprint.py [--cpus real,32] [--new-sessions 20] [--clients 64] [--seconds 10]

For each CPU count (``real``: this machine's; a number: the daemon is made to believe it may use
that many CPUs through ``tests/fake_cpus/sitecustomize.py``, which fakes ``os.sched_getaffinity``
and ``os.cpu_count`` and nothing of agentd), one real ``agentd run`` with every ``[supervisor]``
key at its default (the scripted model, ``delay_ms = 0``) is measured:

1. Idle, right after start: once ``/v1/status`` shows no child starting, the summed ``VmRSS`` of
   the daemon and all its descendants (from /proc), the process count, and the pool's children.
2. New session → first answer, right after that: ``POST /v1/sessions`` then ``POST …/messages``
   with ``wait: true``; the first session of the daemon on its own (it must not pay a child's cold
   start: a spare is kept warm), then ``--new-sessions`` more one after another.
3. Turns/s at ``--clients`` clients once the pool has grown: ``--clients`` sessions are opened
   (8 at a time, one turn each), then one thread per session posts messages back to back for
   ``--seconds`` after a 1 s warm-up (``bench/scale.py`` figure 6). The children and RSS shown
   are those at the end of the window.
4. Shrink: a reload sets ``idle_unload = "1s"`` (every other key unchanged); the script waits
   until no session is loaded and the number of children has not changed for 3 s, then reads the
   memory and the children again. The seconds it took are shown, not judged.

Timing is measured, never asserted. Every daemon is stopped with SIGTERM; the script checks /proc
that none of its children is left.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale import (
    MB,
    PROBLEMS,
    Agentd,
    Memory,
    Throughput,
    new_session_latency,
    open_sessions,
    print_run_end,
    source_fingerprint,
    step,
    throughput,
)
from swap_latency import loadavg, write_atomically
from tables import percentile, print_table

REPO = Path(__file__).resolve().parent.parent
FAKE_CPUS_DIR = REPO / "tests" / "fake_cpus"
SHRINK_STABLE = 3.0  # seconds the child count must hold still to call the pool shrunk
SHRINK_TIMEOUT = 120.0


def footprint_config(idle_unload: str | None = None) -> str:
    """Every ``[supervisor]`` key at its default (``idle_unload`` aside, when given)."""
    supervisor = f'[supervisor]\nidle_unload = "{idle_unload}"\n' if idle_unload else ""
    return f"""
[intelligence]
provider = "scripted"
model = "echo-a"
options = {{ delay_ms = 0 }}

{supervisor}
[[assistants]]
name = "bench"
system = "You are the footprint benchmark."
first_message_mode = "assistant-waits-for-user"
"""


@dataclass
class Pool:
    """The pool as ``/v1/status`` shows it, with the memory of the whole process tree."""

    children: int
    states: str
    memory: Memory

    @property
    def rss_mib(self) -> float:
        return self.memory.rss_kib / 1024


def pool_now(daemon: Agentd) -> Pool:
    status: Any = daemon.status()
    states: dict[str, int] = {}
    for child in status["children"]:
        states[child["state"]] = states.get(child["state"], 0) + 1
    return Pool(len(status["children"]), " ".join(f"{n} {s}" for s, n in sorted(states.items())), daemon.memory())


@dataclass
class Run:
    cpus: str
    idle: Pool
    first: float
    next_first: list[float]
    load: Throughput
    grown: Pool
    shrunk: Pool
    shrink_seconds: float
    exit_code: int | None


def wait_shrunk(daemon: Agentd) -> float:
    """Seconds until no session is loaded and the child count held still for ``SHRINK_STABLE``."""
    began = time.monotonic()
    last, since = -1, time.monotonic()
    while time.monotonic() - began < SHRINK_TIMEOUT:
        status = daemon.status()
        count = len(status["children"])
        if count != last or status["sessions"]["loaded"]:
            last, since = count, time.monotonic()
        elif time.monotonic() - since >= SHRINK_STABLE:
            return since - began
        time.sleep(0.1)
    PROBLEMS.add("the pool did not settle after the reload", f"{last} children")
    return time.monotonic() - began


def run_one(workdir: Path, cpus: str, args: argparse.Namespace) -> Run:
    """Figures 1-4 on one fresh daemon."""
    state = workdir / f"state-{cpus}"
    state.mkdir()
    daemon = Agentd(workdir, state, f"footprint-{cpus}")
    if cpus != "real":
        daemon.env["AGENTD_TEST_FAKE_CPUS"] = cpus
        daemon.env["PYTHONPATH"] = os.pathsep.join([str(FAKE_CPUS_DIR), daemon.env["PYTHONPATH"]])
    write_atomically(daemon.config_path, footprint_config())
    daemon.start()
    try:
        daemon.settle()
        idle = pool_now(daemon)
        step(f"{cpus} CPUs: idle {idle.children} children ({idle.states}), {idle.rss_mib:.1f} MiB")
        news = new_session_latency(daemon, 1 + args.new_sessions)
        sessions, _ = open_sessions(daemon, args.clients, assistant="bench", wait=True)
        step(f"{cpus} CPUs: {len(sessions)} sessions open; {args.clients} clients for {args.seconds:g}s")
        load = throughput(daemon, sessions, args.seconds)
        grown = pool_now(daemon)
        write_atomically(daemon.config_path, footprint_config(idle_unload="1s"))
        daemon.http.call("POST", "/v1/reload")
        shrink = wait_shrunk(daemon)
        shrunk = pool_now(daemon)
    finally:
        code = daemon.stop()
    return Run(cpus, idle, news.first[0], news.first[1:], load, grown, shrunk, shrink, code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpus", default="real,32", help="CPU counts: 'real' and/or numbers to fake (default real,32)")
    parser.add_argument("--new-sessions", type=int, default=20, help="new sessions after the first (default 20)")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients, one session each (default 64)")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds of load (default 10)")
    args = parser.parse_args(argv)
    counts = [c.strip() for c in args.cpus.split(",") if c.strip()]
    if not counts or any(c != "real" and not (c.isdigit() and int(c) > 0) for c in counts):
        parser.error("--cpus takes 'real' and positive numbers, comma-separated")
    if args.new_sessions < 1 or args.clients < 1 or args.seconds <= 0:
        parser.error("--new-sessions and --clients must be at least 1, --seconds positive")

    fingerprint = source_fingerprint()
    print(
        f"agentd footprint — python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {loadavg()}, "
        f"agentd sources {fingerprint}"
    )
    began = time.monotonic()
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="agentd-footprint-") as tmp:
        for cpus in counts:
            runs.append(run_one(Path(tmp), cpus, args))

    rows: list[list[str]] = []
    for run in runs:
        label = f"{os.cpu_count()} (real)" if run.cpus == "real" else f"{run.cpus} (faked)"
        rows.append(
            [
                label,
                f"{run.idle.rss_mib:.1f}",
                str(run.idle.memory.processes),
                run.idle.states,
                f"{run.first * 1000:.0f}",
                f"{percentile(run.next_first, 50) * 1000:.1f}",
                f"{max(run.next_first) * 1000:.1f}",
                f"{run.load.turns / run.load.seconds:.0f}",
                f"{run.grown.children} / {run.grown.rss_mib:.0f}",
                f"{run.shrunk.children} / {run.shrunk.rss_mib:.0f}",
            ]
        )
    print_table(
        "Default pool: idle, first answer, load, shrink",
        [
            "CPUs",
            "idle RSS MiB",
            "processes",
            "idle children",
            "1st answer ms",
            "next p50 ms",
            "next max ms",
            f"turns/s @{args.clients}",
            "grown: children / MiB",
            "shrunk: children / MiB",
        ],
        rows,
        left=(0, 3),
    )
    print()
    for run in runs:
        cores = ", ".join(f"{k} {v:.2f}" for k, v in run.load.cores.items())
        print(
            f"{run.cpus} CPUs: idle = supervisor {run.idle.memory.supervisor_rss_kib / MB:.1f} MB + "
            f"{run.idle.memory.processes - 1} other processes; grown: {run.grown.states}; "
            f"load CPU in cores: {cores}; {run.load.errors} failed turns; shrunk {run.shrink_seconds:.1f}s "
            f"after the reload to {run.shrunk.states or 'no child'}; exit code {run.exit_code}"
        )
    print_run_end(began, fingerprint)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
