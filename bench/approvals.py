"""Approvals (RFC 0012): what turns waiting for a human cost, and how soon an approved call starts.

    .venv/bin/python bench/approvals.py [--sessions 10000] [--approvals 200]

Two real ``agentd run`` daemons (the scripted model, ``delay_ms = 0``; a fixed pool of
``ceil(sessions / 1000)`` children and no spare, so that every session stays loaded and both
daemons hold them in the same number of processes — the default pool may spread a fill's
concurrent turns over one more child in one run and not the other, which would swamp the figure;
``idle_unload = "24h"``), each filled with
``--sessions`` sessions over the unix socket, 8 clients at a time:

- ``idle``: each session completed one turn without a tool call;
- ``awaiting``: each session's one turn asked for the side-effecting ``tests.tooling:stamp``,
  which its assistant's ``require_approval`` names, so every turn waits for approval.

1. Summed ``VmRSS`` (and ``Pss``) of each daemon and all its descendants, and the supervisor's own
   RSS; the difference is what ``--sessions`` waiting turns cost over the same sessions idle
   (target ≤ +50 MB for 10,000).
2. Approve → tool started: ``--approvals`` of the waiting calls approved one after another; the
   time from sending ``POST /v1/approvals/{id}`` to the epoch time the tool itself wrote when it
   started (``tools.log``), p50/p99. The daemon had all its sessions waiting when this began.

Timing is measured, never asserted. Both daemons are stopped with SIGTERM; the script checks
/proc that none of their children is left.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale import FILL_WORKERS, MB, PROBLEMS, Agentd, Http, HttpError, parallel, print_run_end, source_fingerprint
from tables import percentile, print_table

APPROVE_TIMEOUT = 60.0
SESSIONS_PER_CHILD = 1000  # the default


def bench_config(children: int) -> str:
    return f"""
[intelligence]
provider = "scripted"
model = "echo-small"
options = {{ delay_ms = 0 }}

[limits]
deadline = "3600s"
approval_timeout = "0s"

[supervisor]
children = {children}
max_children = {children}
spare_children = 0
idle_unload = "24h"
spawn_timeout = "120s"
stop_grace = "30s"
pass_env = ["AGENTD_TEST_TOOL_LOG"]

[[assistants]]
name = "bench"
first_message_mode = "assistant-waits-for-user"
tools = ["tests.tooling:stamp"]
require_approval = ["tests.tooling:stamp"]
"""


def fill(daemon: Agentd, count: int, *, awaiting: bool) -> tuple[list[str], float]:
    """``count`` sessions with one turn each: a plain answer, or a call that waits for approval.
    The approval ids (awaiting), and the seconds it took."""
    ids: list[str] = [""] * count

    def one(http: Http, i: int) -> None:
        text = f'call tool stamp {{"label": "s{i}"}}' if awaiting else "hello"
        try:
            session = http.call("POST", "/v1/sessions", {"assistant": "bench"}, expect=201)["id"]
            answer = http.call("POST", f"/v1/sessions/{session}/messages", {"content": text, "wait": True})
        except HttpError as exc:
            PROBLEMS.add(f"{daemon.name}: opening a session: {exc.status}", str(exc))
            return
        if awaiting:
            waiting = answer.get("approvals") or []
            if len(waiting) != 1:
                PROBLEMS.add(f"{daemon.name}: a turn did not wait for one approval", str(answer)[:200])
                return
            ids[i] = waiting[0]["id"]
        else:
            ids[i] = session

    seconds = parallel(count, FILL_WORKERS, daemon.socket, one)
    return [i for i in ids if i], seconds


def stamps(tool_log: Path) -> dict[str, float]:
    """label → the epoch time the tool started, from ``tools.log``."""
    found: dict[str, float] = {}
    if tool_log.exists():
        for line in tool_log.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == "stamp":
                found[parts[1]] = float(parts[2])
    return found


def approve_latencies(daemon: Agentd, approvals: list[str], tool_log: Path) -> list[float]:
    """Approve each in turn; seconds from sending the POST to the tool's own start stamp."""
    http = Http(daemon.socket)
    latencies: list[float] = []
    try:
        for approval in approvals:
            label = http.call("GET", f"/v1/approvals/{approval}")["arguments"]["label"]
            began = time.time()
            http.call("POST", f"/v1/approvals/{approval}", {"decision": "approve"})
            deadline = time.monotonic() + APPROVE_TIMEOUT
            while (started := stamps(tool_log).get(label)) is None:
                if time.monotonic() > deadline:
                    PROBLEMS.add(f"approval {approval}: its tool did not start within {APPROVE_TIMEOUT:g}s")
                    break
                time.sleep(0.001)
            if started is not None:
                latencies.append(started - began)
    finally:
        http.close()
    return latencies


def run(workdir: Path, name: str, sessions: int, *, awaiting: bool) -> tuple[Agentd, list[str], float]:
    tool_log = workdir / f"{name}-tools.log"
    daemon = Agentd(workdir, workdir / f"{name}-state", name)
    daemon.env = {**daemon.env, "AGENTD_TEST_TOOL_LOG": str(tool_log)}
    children = max(1, -(-sessions // SESSIONS_PER_CHILD))  # every session loaded
    daemon.config_path.write_text(bench_config(children))
    daemon.state_dir.mkdir()
    daemon.start()
    ids, seconds = fill(daemon, sessions, awaiting=awaiting)
    daemon.settle()
    return daemon, ids, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--approvals", type=int, default=200)
    args = parser.parse_args(argv)
    began, fingerprint = time.monotonic(), source_fingerprint()
    print(f"approvals bench: {args.sessions} sessions, {args.approvals} approvals; cpus {os.cpu_count()}")
    with tempfile.TemporaryDirectory(prefix="agentd-approvals-") as tmp:
        workdir = Path(tmp)
        rows = []
        idle, _, idle_fill = run(workdir, "idle", args.sessions, awaiting=False)
        try:
            idle_memory = idle.memory()
            idle_status = idle.status()
        finally:
            idle.stop()
        waiting, approvals, waiting_fill = run(workdir, "awaiting", args.sessions, awaiting=True)
        try:
            waiting_memory = waiting.memory()
            status = waiting.status()
            latencies = approve_latencies(waiting, approvals[: args.approvals], workdir / "awaiting-tools.log")
        finally:
            waiting.stop()
        for label, memory, st, seconds in (
            ("idle (one turn each)", idle_memory, idle_status, idle_fill),
            ("awaiting approval", waiting_memory, status, waiting_fill),
        ):
            rows.append(
                [
                    label,
                    f"{memory.rss_kib / MB:.1f}",
                    f"{memory.pss_kib / MB:.1f}",
                    f"{memory.supervisor_rss_kib / MB:.1f}",
                    str(memory.processes),
                    str(st["sessions"]["loaded"]),
                    str(st["approvals"]["pending"]),
                    f"{seconds:.1f}",
                ]
            )
        header = ["sessions", "RSS MB", "PSS MB", "supervisor RSS MB", "processes", "loaded", "pending", "fill s"]
        print_table(f"1. memory with {args.sessions} sessions", header, rows)
        extra = (waiting_memory.rss_kib - idle_memory.rss_kib) / MB
        extra_pss = (waiting_memory.pss_kib - idle_memory.pss_kib) / MB
        print(f"awaiting − idle: RSS {extra:+.1f} MB, PSS {extra_pss:+.1f} MB (target ≤ +50 MB for 10,000)")
        if latencies:
            ms = [s * 1000 for s in latencies]
            print_table(
                "2. approve → tool started",
                ["approvals", "p50 ms", "p99 ms", "max ms"],
                [[str(len(ms)), f"{percentile(ms, 50):.1f}", f"{percentile(ms, 99):.1f}", f"{max(ms):.1f}"]],
            )
    print_run_end(began, fingerprint)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
