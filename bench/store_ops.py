"""Store calls: how long the store's busiest calls take, on both backends, in this process.

    .venv/bin/python bench/store_ops.py [--sessions 200] [--turns 5] [--concurrency 8] [--repeat 3] [--dir DIR]

No daemon: the script opens the store directly (SQLite in a temp dir; PostgreSQL on the test
suite's own server, ``tests/pg_harness.py``, or ``AGENTD_TEST_PG_URL``) and, per backend:
(``--dir``: where the SQLite file goes, e.g. ``/dev/shm`` to leave the disk's syncs out of the
figures and see the store's own cost)

1. ``serial``: ``--sessions`` sessions one after another, each ``create_session`` then
   ``--turns`` times ``begin_turn`` + ``commit_turn`` (two replies), then a ``load_session``;
   the time per call (µs, median and p95 over every call of its kind).
2. ``concurrent``: the same work spread over ``--concurrency`` tasks at once (SQLite group-commits
   them; PostgreSQL spreads them over its pool): the wall time and calls per second.

Each figure is the best of ``--repeat`` runs, each on a new, empty database. The figures are for
comparing one version of the store with another on the same machine under similar load.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio
from tables import percentile, print_table

from agentd.budget import TurnStatus, Usage
from agentd.messages import AssistantMessage, UserMessage
from agentd.records import TurnRecord
from agentd.store import SqliteStore, Store
from tests.pg_harness import pg_server

SQLITE_DIR: str | None = None  # --dir


@asynccontextmanager
async def sqlite_store() -> AsyncIterator[Store]:
    with tempfile.TemporaryDirectory(prefix="agentd-bench-", dir=SQLITE_DIR) as tmp:
        store = await SqliteStore.open(Path(tmp) / "agentd.db")
        try:
            yield store
        finally:
            await store.close()


async def one_session(store: Store, index: int, turns: int, timings: dict[str, list[float]]) -> None:
    """One session's life: create, ``turns`` turns, load; each call's time into ``timings``."""
    session = f"s{index}"

    async def timed(kind: str, call: Awaitable[object]) -> object:
        began = time.perf_counter()
        result = await call
        timings[kind].append(time.perf_counter() - began)
        return result

    await timed(
        "create_session",
        store.create_session(session, assistant="a", generation=1, model="m", created_at=time.time()),
    )
    for n in range(turns):
        turn = f"t{n}"
        now = time.time()
        await timed("begin_turn", store.begin_turn(session, turn, UserMessage(content=f"hello {n}"), now))
        record = TurnRecord(
            id=turn,
            status=TurnStatus.COMPLETED,
            models=("m",),
            steps=1,
            restarts=0,
            discarded=(),
            usage=Usage(10, 20),
            started_at=now,
            ended_at=time.time(),
        )
        replies = [AssistantMessage(content=f"answer {n}.{k}", turn=turn) for k in range(2)]
        await timed("commit_turn", store.commit_turn(session, record, assistant="a", messages=replies))
    await timed("load_session", store.load_session(session))


Opener = Callable[[], AbstractAsyncContextManager[Store]]


async def run(open_store: Opener, sessions: int, turns: int, concurrency: int) -> dict[str, Any]:
    kinds = ("create_session", "begin_turn", "commit_turn", "load_session")
    serial: dict[str, list[float]] = {kind: [] for kind in kinds}
    async with open_store() as store:
        for index in range(sessions):
            await one_session(store, index, turns, serial)
    concurrent: dict[str, list[float]] = {kind: [] for kind in kinds}
    async with open_store() as store:
        began = time.perf_counter()
        next_index = iter(range(sessions))

        async def worker() -> None:
            for index in next_index:
                await one_session(store, index, turns, concurrent)

        async with anyio.create_task_group() as tg:
            for _ in range(concurrency):
                tg.start_soon(worker)
        wall = time.perf_counter() - began
    calls = sum(len(v) for v in concurrent.values())
    return {"serial": serial, "wall": wall, "calls": calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the SQLite file goes (default: the temp dir)")
    args = parser.parse_args()
    global SQLITE_DIR
    SQLITE_DIR = args.dir
    print(f"load average at start: {os.getloadavg()}")
    with pg_server() as server:

        @asynccontextmanager
        async def postgres_store() -> AsyncIterator[Store]:
            from agentd.store.postgres import PostgresStore

            with server.database() as url:
                store = await PostgresStore.open(url)
                try:
                    yield store
                finally:
                    await store.close()

        rows = []
        openers: tuple[tuple[str, Opener], ...] = (("sqlite", sqlite_store), ("postgres", postgres_store))
        for name, opener in openers:
            best: dict[str, Any] | None = None
            for _ in range(args.repeat):
                result = anyio.run(run, opener, args.sessions, args.turns, args.concurrency)
                if best is None or result["wall"] < best["wall"]:
                    best = result
                if best is not None:  # the serial figures: the best median per kind over the runs
                    for kind, samples in result["serial"].items():
                        if percentile(sorted(samples), 50) < percentile(sorted(best["serial"][kind]), 50):
                            best["serial"][kind] = samples
            assert best is not None
            for kind, samples in best["serial"].items():
                ordered = sorted(samples)
                rows.append(
                    [
                        name,
                        f"serial {kind}",
                        f"{percentile(ordered, 50) * 1e6:.0f}",
                        f"{percentile(ordered, 95) * 1e6:.0f}",
                    ]
                )
            rate = best["calls"] / best["wall"]
            rows.append(
                [
                    name,
                    f"concurrent ×{args.concurrency}: {best['calls']} calls",
                    f"{best['wall']:.2f} s",
                    f"{rate:.0f}/s",
                ]
            )
    print_table("store calls", ["backend", "figure", "p50 µs / wall", "p95 µs / rate"], rows, left=(0, 1))
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
