"""Replicas on PostgreSQL (RFC 0009 §7): failover time after a kill -9, and turns/s by store and replicas.

    .venv/bin/python bench/replicas.py [--failovers 10] [--lease 2s] [--clients 8] [--seconds 10]

Real ``agentd run`` processes (JSON logs, temp state dirs, the scripted model, one child each plus
no spare), on the suite's own PostgreSQL (``tests/pg_harness.py``: a temp cluster on a unix
socket, durability off — so the PostgreSQL figures leave out fsync, while SQLite's include it) or
``AGENTD_TEST_PG_URL``.

1. Failover: 3 replicas, lease ``--lease``. Each round holds a turn mid model call on replica A
   (the ``held`` assistant's hold file), kills A and its children with SIGKILL, and measures kill →
   another replica's ``session.adopted`` log line (the interrupted turn claimed and re-run there)
   and kill → the turn committed (seen in the store through the API). A is then started again as
   a new replica. The expected figure is between one lease and 1.5 leases: the lease must expire,
   and the failover scan runs every half lease. Then one replica killed mid-turn and started again
   under the same ``AGENTD_REPLICA_ID`` (a pod's container restart): its start → its adoption of
   the interrupted turn, at most 1.5 leases (RFC 0009 §7).
2. Turns/s: ``--clients`` threads, each on a session of its own, posting messages back to back
   (``wait: true``) for ``--seconds`` after a 1 s warm-up, on SQLite with 1 replica and on
   PostgreSQL with 1 and 3 replicas (the clients spread round-robin over the replicas, as a
   Service spreads connections). Every turn claims and releases its session's lease on PostgreSQL.
   A last row runs 3 replicas with every session also streamed (SSE) on the next replica, so each
   turn's events are relayed to another replica through the database.

Everything — replicas, their children, PostgreSQL and the clients — shares this machine's cores
(2 here), so the 3-replica figure shows the cost of coordination, not extra capacity.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tables import percentile, print_table

from tests.daemon_harness import Daemon, child_pids_of, two_assistant_config, wait_until
from tests.pg_harness import PgServer, pg_server

ONE_CHILD = "children = 1\nspare_children = 0"


def config(hold: Path, url: str, lease: str) -> str:
    top = f'[store]\nurl = "{url}"\nlease = "{lease}"\n' if url else ""
    return two_assistant_config(hold, top=top, supervisor=ONE_CHILD)


def start(home: Path, text: str, name: str) -> Daemon:
    home.mkdir(parents=True, exist_ok=True)
    return Daemon(home, text, env={"AGENTD_REPLICA_ID": name}, state_dir=home / "state").start()


@contextlib.contextmanager
def stopping(daemons: list[Daemon]) -> Iterator[list[Daemon]]:
    try:
        yield daemons
    finally:
        for daemon in daemons:
            daemon.stop()


def kill(daemon: Daemon) -> float:
    """SIGKILL the replica and its children; the time of the kill (epoch seconds)."""
    assert daemon.process is not None
    children = child_pids_of(daemon.process.pid)
    at = time.time()
    daemon.process.kill()
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    daemon.process.wait()
    daemon.stop()
    return at


def epoch(record: dict[str, object]) -> float:
    return datetime.fromisoformat(str(record["timestamp"]).replace("Z", "+00:00")).timestamp()


def failover(pg: PgServer, tmp: Path, rounds: int, lease: str) -> None:
    hold = tmp / "hold"
    adopted_after: list[float] = []
    committed_after: list[float] = []
    with pg.database() as url:
        text = config(hold, url, lease)
        with stopping([start(tmp / f"r{i}", text, f"r{i}") for i in range(3)]) as replicas:
            for index in range(rounds):
                hold.unlink(missing_ok=True)
                victim = replicas[0]
                session = victim.new_session("held")
                turn = victim.send(session, "hold this", wait=False)["turn_id"]
                victim.wait_log("session.loaded", lambda r, s=session: r.get("session") == s)
                killed = kill(victim)
                others = replicas[1:]
                [event] = wait_until(
                    lambda s=session, o=others: [
                        e for d in o for e in d.log_events("session.adopted") if e["session"] == s
                    ],
                    "another replica to adopt the turn",
                )
                adopted_after.append(epoch(event) - killed)
                hold.touch()
                others[0].turn(session, turn)
                committed_after.append(time.time() - killed)
                replicas[0] = start(tmp / f"r0-{index + 1}", text, f"r0-{index + 1}")
                replicas.append(replicas.pop(0))  # the next round kills another replica
    rows = [
        [what, str(len(xs)), f"{percentile(xs, 50):.2f}", f"{percentile(xs, 99):.2f}", f"{max(xs):.2f}"]
        for what, xs in (("kill -9 → turn adopted", adopted_after), ("kill -9 → turn committed", committed_after))
    ]
    print_table(f"Failover, 3 replicas, lease {lease} (seconds)", ["", "n", "p50", "p99", "max"], rows)


def restart_in_place(pg: PgServer, tmp: Path, rounds: int, lease: str) -> None:
    """One replica killed mid-turn and started again under the same id (a pod's container restart):
    start of the new process → its ``session.adopted`` of the interrupted turn, and → committed."""
    hold = tmp / "hold"
    adopted_after: list[float] = []
    committed_after: list[float] = []
    with pg.database() as url:
        text = config(hold, url, lease)
        replica = start(tmp / "pod-0", text, "pod-0")
        try:
            for _ in range(rounds):
                hold.unlink(missing_ok=True)
                session = replica.new_session("held")
                turn = replica.send(session, "hold this", wait=False)["turn_id"]
                replica.wait_log("session.loaded", lambda r, s=session: r.get("session") == s)
                kill(replica)
                hold.touch()
                replica = Daemon(replica.tmp, env={"AGENTD_REPLICA_ID": "pod-0"}, state_dir=replica.state_dir)
                started = time.time()
                replica.start()
                [event] = wait_until(
                    lambda s=session, r=replica: [e for e in r.log_events("session.adopted") if e["session"] == s],
                    "the restarted replica to adopt the turn",
                )
                adopted_after.append(epoch(event) - started)
                replica.turn(session, turn)
                committed_after.append(time.time() - started)
        finally:
            replica.stop()
    rows = [
        [what, str(len(xs)), f"{percentile(xs, 50):.2f}", f"{percentile(xs, 99):.2f}", f"{max(xs):.2f}"]
        for what, xs in (("restart → turn adopted", adopted_after), ("restart → turn committed", committed_after))
    ]
    print_table(f"Restart under the same id, 1 replica, lease {lease} (seconds)", ["", "n", "p50", "p99", "max"], rows)


def turns_per_second(replicas: list[Daemon], clients: int, seconds: float, *, watched: bool = False) -> float:
    """Turns/s of ``clients`` threads posting back to back; with ``watched``, each session is also
    streamed (SSE) on the next replica, so every event of every turn is relayed there."""
    sessions = [(replicas[i % len(replicas)], replicas[i % len(replicas)].new_session("main")) for i in range(clients)]
    streams = (
        [replicas[(i + 1) % len(replicas)].events(session) for i, (_, session) in enumerate(sessions)]
        if watched
        else []
    )
    counts = [0] * clients
    measuring = threading.Event()
    stop = threading.Event()

    def client(index: int) -> None:
        daemon, session = sessions[index]
        while not stop.is_set():
            reply = daemon.send(session, f"turn {counts[index]}")
            assert reply["turn"]["status"] == "completed", json.dumps(reply)
            if measuring.is_set():
                counts[index] += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    measuring.set()
    began = time.monotonic()
    time.sleep(seconds)
    total, elapsed = sum(counts), time.monotonic() - began
    stop.set()
    for thread in threads:
        thread.join(60)
    if streams:  # the relayed events arrived: the last turn's turn.done on every remote stream
        for (daemon, session), stream in zip(sessions, streams, strict=True):
            last = daemon.session(session)["turns"][-1]["id"]
            stream.wait("turn.done", lambda data, last=last: data.get("turn") == last)
    return total / elapsed


def throughput(pg: PgServer, tmp: Path, clients: int, seconds: float, lease: str) -> None:
    hold = tmp / "hold"
    rows = []
    with stopping([start(tmp / "sqlite", config(hold, "", lease), "sqlite")]) as one:
        rows.append(["SQLite", "1", "", f"{turns_per_second(one, clients, seconds):.0f}"])
    for count in (1, 3):
        with pg.database() as url:
            text = config(hold, url, lease)
            with stopping([start(tmp / f"pg{count}-{i}", text, f"pg{count}-{i}") for i in range(count)]) as replicas:
                rows.append(["PostgreSQL", str(count), "", f"{turns_per_second(replicas, clients, seconds):.0f}"])
    with pg.database() as url:
        text = config(hold, url, lease)
        with stopping([start(tmp / f"watched-{i}", text, f"watched-{i}") for i in range(3)]) as replicas:
            rate = turns_per_second(replicas, clients, seconds, watched=True)
            rows.append(["PostgreSQL", "3", "each session on the next replica", f"{rate:.0f}"])
    print_table(
        f"Turns/s, {clients} clients, wait: true, scripted model",
        ["store", "replicas", "SSE subscriber", "turns/s"],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--failovers", type=int, default=10)
    parser.add_argument("--lease", default="2s")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}, cores: {os.cpu_count()}")
    with tempfile.TemporaryDirectory(prefix="agentd-bench-replicas-") as tmp, pg_server() as pg:
        if args.failovers:
            failover(pg, Path(tmp) / "failover", args.failovers, args.lease)
            restart_in_place(pg, Path(tmp) / "restart", args.failovers, args.lease)
        throughput(pg, Path(tmp) / "throughput", args.clients, args.seconds, args.lease)
    print(f"\nload average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
