"""Tool figures: MCP call overhead against a Python tool, the journal's cost, a stdio server's first call.

    .venv/bin/python bench/tools.py [--calls 300] [--journal 300] [--cold 5]

Everything is real: the SDK-built fault server (``tests/mcp_fault_server.py``) in a process of its
own, over stdio and over streamable HTTP on loopback; ``mcp-server-time`` from PyPI for the cold
start; the store on a file in a temp dir with ``synchronous=FULL``.

1. Call overhead: ``echo`` as a Python tool (``Tool.invoke``, argument validation included), and
   the same ``echo`` on the MCP server (``McpConnection.call`` → the SDK → the server → back), over
   stdio and HTTP, sequential calls on one warm connection. The difference is what MCP costs.
2. Journal cost per side-effecting call: ``journal_start`` + ``journal_finish`` (two durable
   writes, each a group-commit transaction with fsync) for one call, sequentially; and the same
   with 8 turns journaling at once (group commit shares the fsyncs).
3. First call on a cold child: a new ``McpHub`` → ``mcp-server-time`` started, handshake,
   ``tools/list``, then ``get_current_time`` answered — what the first turn of a fresh child
   waits for. ``--cold`` times, one at a time.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import anyio

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agentd.config import McpServer  # noqa: E402
from agentd.mcp import McpHub  # noqa: E402
from agentd.messages import UserMessage  # noqa: E402
from agentd.records import JournalEntry  # noqa: E402
from agentd.store import Store  # noqa: E402
from agentd.tools import Tool  # noqa: E402
from bench.tables import percentile, print_table  # noqa: E402
from tests.mcp_servers import fault_server  # noqa: E402

SERVER = str(REPO / "tests" / "mcp_fault_server.py")


def echo(text: str) -> str:
    """Answer the text."""
    return f"faults:{text}"


def row(name: str, samples: list[float]) -> list[str]:
    ms = [s * 1000 for s in samples]
    return [name, str(len(ms)), f"{percentile(ms, 50):.3f}", f"{percentile(ms, 95):.3f}", f"{max(ms):.3f}"]


async def timed_calls(call: object, n: int) -> list[float]:
    samples = []
    for i in range(n + 10):
        start = time.perf_counter()
        outcome = await call({"text": f"t{i}"})  # type: ignore[operator]
        elapsed = time.perf_counter() - start
        assert not outcome.is_error, outcome.content
        if i >= 10:  # the first calls warm caches up
            samples.append(elapsed)
    return samples


async def call_overhead(n: int, url: str) -> None:
    python_tool = Tool(echo, "echo")
    rows = [row("python tool (Tool.invoke)", await timed_calls(python_tool.invoke, n))]
    servers = {
        "MCP stdio (fault server)": McpServer(name="faults", command=(sys.executable, SERVER, "--stdio")),
        "MCP HTTP (fault server)": McpServer(name="faults", url=url),
    }
    for label, server in servers.items():
        async with anyio.create_task_group() as tg:
            hub = McpHub(tg)
            connection = hub.connection(server)
            await connection.settled(30)
            assert connection.listing is not None, connection.error

            async def call(arguments: dict[str, str], connection: object = connection) -> object:
                return await connection.call("echo", arguments)  # type: ignore[attr-defined]

            rows.append(row(label, await timed_calls(call, n)))
            hub.close()
    print_table("Tool call, sequential, one warm connection (ms)", ["tool", "n", "p50", "p95", "max"], rows)


async def journal_cost(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = await Store.open(Path(tmp) / "agentd.db")
        try:
            for i in range(8):
                await store.create_session(f"s{i}", assistant="a", generation=1, model="m", created_at=time.time())
                await store.begin_turn(f"s{i}", "t1", UserMessage(content="go"), time.time())

            async def one(session: str, seq: int) -> float:
                start = time.perf_counter()
                entry = JournalEntry(seq=seq, call=f"c{seq}", tool="refund", arguments={"order": seq, "amount": 12.5})
                await store.journal_start(session, "t1", entry)
                await store.journal_finish(session, "t1", seq, content="refunded", is_error=False)
                return time.perf_counter() - start

            sequential = [await one("s0", seq) for seq in range(1, n + 1)]
            concurrent: list[float] = []

            async def turn(session: str) -> None:
                for seq in range(1, n // 8 + 1):
                    concurrent.append(await one(session, seq))

            async with anyio.create_task_group() as tg:
                for i in range(1, 8):
                    tg.start_soon(turn, f"s{i}")
        finally:
            await store.close()
    print_table(
        "Journal per side-effecting call: journal_start + journal_finish, synchronous=FULL (ms)",
        ["how", "n", "p50", "p95", "max"],
        [row("one turn at a time", sequential), row("7 turns at once (group commit)", concurrent)],
    )


async def cold_first_call(repeat: int) -> None:
    server = McpServer(
        name="time", command=(sys.executable, "-m", "mcp_server_time", "--local-timezone", "UTC"), connect_timeout=60
    )
    samples = []
    for _ in range(repeat):
        async with anyio.create_task_group() as tg:
            start = time.perf_counter()
            hub = McpHub(tg)
            connection = hub.connection(server)
            await connection.settled(60)
            outcome = await connection.call("get_current_time", {"timezone": "UTC"})
            samples.append(time.perf_counter() - start)
            assert not outcome.is_error, outcome.content
            hub.close()
    print_table(
        "First call on a cold child: start mcp-server-time, handshake, tools/list, get_current_time (ms)",
        ["server", "n", "p50", "p95", "max"],
        [row("mcp-server-time (stdio)", samples)],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--journal", type=int, default=300)
    parser.add_argument("--cold", type=int, default=5)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp, fault_server(Path(tmp)) as http:
        anyio.run(call_overhead, args.calls, http.url)
    anyio.run(journal_cost, args.journal)
    anyio.run(cold_first_call, args.cold)
    print(f"\nload average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
