"""Usage and observability figures (RFC 0011 §2, §5): ``GET /v1/usage`` over many sessions, and
what OpenTelemetry costs a busy daemon.

    .venv/bin/python bench/usage.py [--sessions 100000] [--turns 2] [--repeat 5]
        [--clients 32] [--seconds 10] [--rounds 2] [--skip-usage] [--skip-otel]

1. ``GET /v1/usage`` at ``--sessions`` sessions: a SQLite store filled directly (through the
   schema's own migrations) with ``--turns`` ended turns per session, each with its per-model
   spend row (10 assistants, 4 models, one of them unpriced, ended over 30 days), then served by
   a real ``agentd run``. Timed: the store's sum alone (``Store.usage_report``, in process, and
   the exact pricing of its rows), and the whole request over the unix socket for each
   ``group_by``, with and without a one-day time range. ``--repeat`` requests each, after one
   warm-up; nearest-rank percentiles.
2. Turns/s at ``--clients`` clients (one session each, the scripted model with no delay, back to
   back for ``--seconds`` after a 1 s warm-up), tracing off and on: on, every child exports its
   spans over OTLP/HTTP to a loopback receiver that reads and discards them (a collector's cost is
   not agentd's). ``--rounds`` alternating off/on rounds, each on a fresh daemon; the drop is the
   mean of on against the mean of off.

Nothing passes or fails on a number.
"""

from __future__ import annotations

import argparse
import random
import sqlite3
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio
from scale import Agentd, Http, loadavg, open_sessions, print_run_end, source_fingerprint, throughput
from tables import percentile, print_table

from agentd.apicommon import USAGE_PAGE
from agentd.store import SqliteStore, Store
from agentd.store.postgres import PostgresStore
from agentd.usage import report

ASSISTANTS = [f"assistant-{n}" for n in range(10)]
MODELS = [
    ("gpt-4o-mini", "0.15", "0.60", "0.075"),
    ("gpt-4o", "2.5", "10", "1.25"),
    ("claude-haiku", "0.8", "4", None),
    ("local-llama", None, None, None),  # unpriced
]
DAY = 86400.0
GROUPS = ("model", "assistant", "session")


# --------------------------------------------------------------------------- 1. GET /v1/usage


SESSION_COLUMNS = "id, assistant, state, generation, model, created_at, updated_at"
TURN_COLUMNS = "session, id, status, started_at, ended_at, input_tokens, output_tokens"
SPEND_COLUMNS = (
    "session, turn, assistant, model, ended_at, input_tokens, output_tokens, cached_input_tokens,"
    " reasoning_tokens, requests, unreported, currency, input_price, output_price, cached_input_price"
)


def rows(
    sessions: int, turns: int, now: float
) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """The sessions, their ``turns`` ended turns each and their spend rows (the same on every run)."""
    rng = random.Random(7)
    session_rows = [
        (f"s_{i:08x}", ASSISTANTS[i % len(ASSISTANTS)], "idle", 1, MODELS[i % len(MODELS)][0], now - 30 * DAY, now)
        for i in range(sessions)
    ]
    spend, turn_rows = [], []
    for i in range(sessions):
        model, pin, pout, pcached = MODELS[i % len(MODELS)]
        for t in range(turns):
            ended = now - rng.random() * 30 * DAY
            inp, out = rng.randrange(100, 20000), rng.randrange(10, 2000)
            cached = inp // 4 if pcached else 0
            turn_rows.append((f"s_{i:08x}", f"t_{t}", "completed", ended - 1, ended, inp, out))
            spend.append(
                (f"s_{i:08x}", f"t_{t}", ASSISTANTS[i % len(ASSISTANTS)], model, ended, inp, out, cached, 0, 1, 0)
                + (("USD", pin, pout, pcached) if pin else (None, None, None, None))
            )
    return session_rows, turn_rows, spend


def fill_postgres(url: str, sessions: int, turns: int, now: float) -> int:
    """As ``fill``, into a migrated PostgreSQL database (COPY)."""
    import psycopg

    session_rows, turn_rows, spend = rows(sessions, turns, now)
    with psycopg.connect(url, autocommit=True) as conn:
        for table, columns, data in (
            ("sessions", SESSION_COLUMNS, session_rows),
            ("turns", TURN_COLUMNS, turn_rows),
            ("turn_spend", SPEND_COLUMNS, spend),
        ):
            with conn.cursor().copy(f"COPY {table} ({columns}) FROM STDIN") as copy:
                for row in data:
                    copy.write_row(row)
        conn.execute("ANALYZE")
    return len(spend)


def fill(db: Path, sessions: int, turns: int, now: float) -> int:
    """``sessions`` sessions with ``turns`` ended turns each and their spend rows; the row count."""
    session_rows, turn_rows, spend = rows(sessions, turns, now)
    conn = sqlite3.connect(db)
    with conn:
        conn.executemany(f"INSERT INTO sessions ({SESSION_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)", session_rows)
        conn.executemany(
            f"INSERT INTO turns ({TURN_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
            turn_rows,
        )
        conn.executemany(f"INSERT INTO turn_spend ({SPEND_COLUMNS}) VALUES ({', '.join('?' * 15)})", spend)
    conn.execute("ANALYZE")
    conn.close()
    return len(spend)


async def _store_figures(db: Path | str, repeat: int, now: float) -> list[list[str]]:
    store: Store = await SqliteStore.open(db) if isinstance(db, Path) else await PostgresStore.open(db)
    table = []
    try:
        for group in GROUPS:
            for since in (None, now - DAY):
                samples, groups = [], 0
                for n in range(repeat + 1):
                    began = time.perf_counter()
                    lines = await store.usage_report(group, since=since, until=None)
                    summed = time.perf_counter() - began
                    groups = len(report(group, lines, since, None).groups)
                    if n:
                        samples.append((summed, time.perf_counter() - began))
                table.append(
                    [
                        group,
                        "1 day" if since else "all",
                        str(groups),
                        f"{percentile([s for s, _ in samples], 50) * 1000:.0f}",
                        f"{percentile([t for _, t in samples], 50) * 1000:.0f}",
                        f"{max(t for _, t in samples) * 1000:.0f}",
                    ]
                )
        # GET /v1/usage pages a report (USAGE_PAGE groups without ?limit=): by session, all time, the
        # first page and one from the middle of the key range.
        for label, after in (("first page", None), ("middle page", "s_00008000")):
            samples = []
            for n in range(repeat + 1):
                began = time.perf_counter()
                lines = await store.usage_report("session", limit=USAGE_PAGE, after=after)
                summed = time.perf_counter() - began
                groups = len(report("session", lines, None, None).groups)
                if n:
                    samples.append((summed, time.perf_counter() - began))
            table.append(
                [
                    f"session ({label}, limit {USAGE_PAGE})",
                    "all",
                    str(groups),
                    f"{percentile([s for s, _ in samples], 50) * 1000:.0f}",
                    f"{percentile([t for _, t in samples], 50) * 1000:.0f}",
                    f"{max(t for _, t in samples) * 1000:.0f}",
                ]
            )
    finally:
        await store.close()
    return table


def postgres_figures(sessions: int, turns: int, repeat: int) -> None:
    """Figure 1c: the store's sum and the pricing on PostgreSQL (the test suite's server)."""
    from tests.pg_harness import pg_server

    with pg_server() as server, server.database() as url:
        anyio.run(_migrate_postgres, url)
        now = time.time()
        began = time.monotonic()
        count = fill_postgres(url, sessions, turns, now)
        print(f"filled PostgreSQL with {sessions:,} sessions, {count:,} spend rows in {time.monotonic() - began:.1f}s")
        figures = anyio.run(_store_figures, url, repeat, now)
    print_table(
        f"1c. Store.usage_report + exact pricing, in process ({sessions:,} sessions, PostgreSQL; ms)",
        ["group_by", "range", "groups", "sum p50", "sum+price p50", "max"],
        figures,
        left=(0, 1),
    )


async def _migrate_postgres(url: str) -> None:
    store = await PostgresStore.open(url)
    await store.close()


def usage_figures(workdir: Path, sessions: int, turns: int, repeat: int) -> None:
    state = workdir / "usage-state"
    state.mkdir()
    daemon = Agentd(workdir, state, "usage")
    daemon.config_path.write_text(
        '[intelligence]\nprovider = "scripted"\nmodel = "gpt-4o-mini"\n\n'
        + "".join(f'[[assistants]]\nname = "{name}"\n\n' for name in ASSISTANTS)
        + "".join(
            f'[[prices]]\nmodel = "{m}"\ninput_per_mtok = "{i}"\noutput_per_mtok = "{o}"\n'
            + (f'cached_input_per_mtok = "{c}"\n' if c else "")
            for m, i, o, c in MODELS
            if i
        )
    )
    daemon.start()  # creates and migrates the database
    daemon.stop()
    now = time.time()
    began = time.monotonic()
    count = fill(daemon.db, sessions, turns, now)
    print(f"filled {sessions:,} sessions, {count:,} turns with their spend rows in {time.monotonic() - began:.1f}s")

    store_rows = anyio.run(_store_figures, daemon.db, repeat, now)
    print_table(
        f"1a. Store.usage_report + exact pricing, in process ({sessions:,} sessions, SQLite; ms)",
        ["group_by", "range", "groups", "sum p50", "sum+price p50", "max"],
        store_rows,
        left=(0, 1),
    )

    daemon.start()
    rows = []
    try:
        http = Http(daemon.socket)
        for group in GROUPS:
            for since in (None, now - DAY):
                target = f"/v1/usage?group_by={group}" + (f"&since={since:.3f}" if since else "")
                samples, size = [], 0
                for n in range(repeat + 1):
                    began_at = time.perf_counter()
                    status, body = http.request("GET", target)
                    if status != 200:
                        raise RuntimeError(f"GET {target} → {status}: {body[:300]!r}")
                    if n:
                        samples.append(time.perf_counter() - began_at)
                    size = len(body)
                rows.append(
                    [
                        group,
                        "1 day" if since else "all",
                        f"{size / 1e6:.2f}",
                        f"{percentile(samples, 50) * 1000:.0f}",
                        f"{max(samples) * 1000:.0f}",
                    ]
                )
        http.close()
    finally:
        daemon.stop()
    print_table(
        f"1b. GET /v1/usage over the unix socket ({sessions:,} sessions, SQLite; ms)",
        ["group_by", "range", "body MB", "p50", "max"],
        rows,
        left=(0, 1),
    )


# --------------------------------------------------------------------------- 2. OpenTelemetry on/off


class Sink:
    """A loopback OTLP/HTTP endpoint that reads each export and answers 200 (nothing decoded)."""

    def __init__(self) -> None:
        self.exports = 0
        self.bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                sink.exports += 1
                sink.bytes += len(body)
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def otel_round(workdir: Path, name: str, clients: int, seconds: float, sink: Sink | None) -> tuple[float, float]:
    daemon = Agentd(workdir, workdir / f"{name}-state", name)
    daemon.config_path.write_text(
        '[intelligence]\nprovider = "scripted"\nmodel = "echo-small"\n\n'
        '[[assistants]]\nname = "a"\nsystem = "You help."\nfirst_message_mode = "assistant-waits-for-user"\n'
    )
    if sink is not None:
        daemon.env["OTEL_EXPORTER_OTLP_ENDPOINT"] = sink.endpoint
        daemon.env["OTEL_SERVICE_NAME"] = "agentd-bench"
    else:
        for key in [k for k in daemon.env if k.startswith("OTEL_")]:
            del daemon.env[key]
    daemon.start()
    try:
        sessions, _ = open_sessions(daemon, clients, assistant="a", wait=True)
        result = throughput(daemon, sessions, seconds)
    finally:
        daemon.stop()
    return result.turns / result.seconds, percentile(result.latencies, 50) * 1000


def otel_figures(workdir: Path, clients: int, seconds: float, rounds: int) -> None:
    sink = Sink()
    rows, off, on = [], [], []
    try:
        for n in range(rounds):
            for label in ("off", "on"):
                rate, p50 = otel_round(workdir, f"otel-{label}-{n}", clients, seconds, sink if label == "on" else None)
                (on if label == "on" else off).append(rate)
                rows.append([f"{n + 1}", label, f"{rate:.0f}", f"{p50:.1f}"])
    finally:
        sink.close()
    print_table(
        f"2. Turns/s at {clients} clients, OpenTelemetry off and on (OTLP/HTTP to a loopback sink)",
        ["round", "otel", "turns/s", "p50 ms"],
        rows,
        left=(1,),
    )
    mean_off, mean_on = sum(off) / len(off), sum(on) / len(on)
    print(
        f"mean off {mean_off:.0f} turns/s, on {mean_on:.0f} turns/s: {100 * (1 - mean_on / mean_off):+.1f} % drop"
        f"; the sink took {sink.exports} exports, {sink.bytes / 1e6:.1f} MB"
    )


# --------------------------------------------------------------------------- 3. the loop's own cost

LOOP_CONFIG = """
[intelligence]
provider = "scripted"
model = "echo-small"

[[assistants]]
name = "a"
system = "You help."
tools = ["clock"]
"""


async def _turns(count: int) -> None:
    """``count`` turns of the child's loop in process (as ``agentd.child.runtime`` runs them), each
    with one tool call and two model calls: with tracing on, 4 spans a turn."""
    from agentd.child.session import ChildSession
    from agentd.child.spans import turn_done
    from agentd.child.turn import run_turn
    from agentd.config import SwapPolicy, intelligence_map, parse_config
    from agentd.messages import UserMessage
    from agentd.otel import tracing
    from agentd.tools import resolve_tools

    config = parse_config(LOOP_CONFIG)
    tools = resolve_tools(["clock"])

    async def send(_: Any) -> None:
        return None

    session = None
    for n in range(count):
        if n % 10 == 0:  # short transcripts: the figure is per turn, not per history length
            session = ChildSession(
                "s", "a", [], config, intelligence_map(config), config.limits, 1, SwapPolicy.RESTART_TURN, send
            )
        assert session is not None
        turn = f"t{n}"
        with tracing().invoke_agent(assistant="a", session="s", turn=turn, generation=1, run=1, carrier={}) as span:
            done = await run_turn(session, turn, UserMessage(content="use clock", turn=turn), tools)
            turn_done(span, done.record)


def loop_figures(turns: int, rounds: int) -> None:
    """Figure 3: the turn loop's CPU per turn in this process, tracing off, then on (OTLP/HTTP, batched, to the sink)."""
    from agentd import otel
    from agentd.obs import configure_logging
    from agentd.otel_sdk import SdkTracing

    configure_logging(level="warning")  # the loop logs each turn at debug: not what is measured
    sink = Sink()
    rows, off, on = [], [], []
    try:
        anyio.run(_turns, 200)  # warm-up: imports, caches
        for n in range(rounds):
            for label in ("off", "on"):
                previous = None
                if label == "on":
                    previous = otel.install(SdkTracing({"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint}))
                # CPU of every thread of this process — the exporter's too, its final flush included.
                began = time.process_time()
                try:
                    anyio.run(_turns, turns)
                finally:
                    if previous is not None:
                        otel.tracing().shutdown()
                        otel.install(previous)
                seconds = time.process_time() - began
                (on if label == "on" else off).append(seconds / turns)
                rows.append([f"{n + 1}", label, f"{seconds / turns * 1e6:.0f}"])
    finally:
        sink.close()
    print_table(
        f"3. The child's turn loop in process: CPU per turn (µs; {turns} turns, 2 model calls and 1 tool call each)",
        ["round", "otel", "CPU µs/turn"],
        rows,
        left=(1,),
    )
    mean_off, mean_on = sum(off) / len(off), sum(on) / len(on)
    print(
        f"mean off {mean_off * 1e6:.0f} µs, on {mean_on * 1e6:.0f} µs per turn: {100 * (mean_on / mean_off - 1):+.1f} %"
        f" CPU; the sink took {sink.exports} exports"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=100_000)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-usage", action="store_true")
    parser.add_argument("--skip-otel", action="store_true")
    parser.add_argument("--loop-turns", type=int, default=2000)
    parser.add_argument("--postgres", action="store_true", help="also figure 1c, on the test suite's PostgreSQL")
    args = parser.parse_args()
    began, fingerprint = time.monotonic(), source_fingerprint()
    print(f"bench/usage.py; load average {loadavg()}; sources {fingerprint}")
    with tempfile.TemporaryDirectory(prefix="agentd-usage-") as tmp:
        workdir = Path(tmp)
        if not args.skip_usage:
            usage_figures(workdir, args.sessions, args.turns, args.repeat)
            if args.postgres:
                postgres_figures(args.sessions, args.turns, args.repeat)
        if not args.skip_otel:
            loop_figures(args.loop_turns, args.rounds)
            otel_figures(workdir, args.clients, args.seconds, args.rounds)
    print_run_end(began, fingerprint)


if __name__ == "__main__":
    main()
