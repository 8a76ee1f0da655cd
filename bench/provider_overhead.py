"""Provider figures: overhead per step against a fake server, and time to fail over.

    .venv/bin/python bench/provider_overhead.py [--steps 300] [--trials 60]

1. Overhead per step: sequential ``complete()`` calls (an answer of 24 content deltas, 21
   thinking deltas and a tool call, over a 12-message history; streamed, then as one body) against the fake Ollama and
   OpenAI-compatible servers. The fake runs in its own process so it does not share our GIL; it
   logs how long it spent on each request (request read → last byte written). Overhead = agentd's
   wall time for the call minus the server's time for it: request building and encoding, HTTP on
   loopback, stream parsing, conversion.
2. Failover time: a fresh provider (fresh breaker) whose primary endpoint refuses connections and
   whose secondary is the fake; the extra time over the same call made straight to the secondary.

Only loopback addresses are used; every loop is bounded.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anyio

from agentd.config import Intelligence
from agentd.intel.base import CompletionRequest
from agentd.intel.http import HTTPProvider
from agentd.intel.ollama import OllamaProvider
from agentd.intel.openai import OpenAIProvider
from agentd.messages import AssistantMessage, Message, SystemMessage, ToolCall, ToolResult, UserMessage
from agentd.tools import ToolSpec

REPLY_TEXT = "The quick brown fox jumps over the lazy dog. " * 6


def _serve(kind: str, conn: Connection) -> None:
    """Child process: run one fake server until told to stop; then send its per-request times."""
    import logging

    logging.disable(logging.CRITICAL)
    from tests.fakes import FakeCall, FakeOllama, FakeOpenAI, Reply

    reply = Reply(
        content=REPLY_TEXT,
        thinking="Consider the request.",
        pieces=24,
        tool_calls=(FakeCall("lookup", {"word": "fox"}),),
    )
    server = (FakeOllama if kind == "ollama" else FakeOpenAI)(default=reply, split_writes=False).start()
    conn.send(server.url)
    conn.recv()  # "dump"
    conn.send([r.server_seconds for r in server.chat_requests])
    server.stop()


class ServerProcess:
    def __init__(self, kind: str) -> None:
        self._conn, child = mp.Pipe()
        self._process = mp.get_context("spawn").Process(target=_serve, args=(kind, child), daemon=True)
        self._process.start()
        self.url: str = self._conn.recv()

    def server_times(self) -> list[float]:
        self._conn.send("dump")
        times: list[float] = self._conn.recv()
        self._process.join(10)
        return times


def history() -> list[Message]:
    messages: list[Message] = [
        SystemMessage(content="You are terse.", name="bench"),
        UserMessage(content="Define fox."),
    ]
    for n in range(5):
        call = ToolCall(id=f"call_{n}", name="lookup", arguments={"word": f"w{n}"})
        messages += [
            AssistantMessage(content="", thinking="look it up", tool_calls=(call,)),
            ToolResult(name="lookup", content="a small wild canid " * 5, call_id=call.id),
        ]
    return messages


TOOLS = [
    ToolSpec(
        name="lookup",
        description="Look a word up",
        parameters={"type": "object", "properties": {"word": {"type": "string"}}},
    )
]


def provider(kind: str, urls: tuple[str, ...], options: dict[str, Any] | None = None) -> HTTPProvider:
    endpoints = tuple(u + "/v1" if kind == "openai" and not u.endswith("/v1") else u for u in urls)
    intelligence = Intelligence(provider=kind, endpoints=endpoints, model="bench-model", options=options or {})  # type: ignore[arg-type]
    return (OllamaProvider if kind == "ollama" else OpenAIProvider)(intelligence)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def overhead(kind: str, steps: int, stream: bool) -> dict[str, Any]:
    server = ServerProcess(kind)
    client = provider(kind, (server.url,), {"stream": stream})
    request = CompletionRequest(messages=history(), tools=TOOLS)
    walls: list[float] = []
    try:
        for _ in range(steps + 10):
            start = time.perf_counter()
            completion = await client.complete(request)
            walls.append(time.perf_counter() - start)
            assert completion.message.tool_calls, "the fake's tool call must come back"
    finally:
        await client.aclose()
    served = server.server_times()
    pairs = list(zip(walls, served, strict=True))[10:]  # first 10 warm up connections and caches
    over = [(wall - srv) * 1000 for wall, srv in pairs]
    return {
        "kind": kind,
        "steps": len(pairs),
        "wall_ms_median": statistics.median(w * 1000 for w, _ in pairs),
        "server_ms_median": statistics.median(s * 1000 for _, s in pairs),
        "overhead_ms_median": statistics.median(over),
        "overhead_ms_p95": pct(over, 0.95),
    }


async def failover(kind: str, trials: int) -> dict[str, Any]:
    from tests.fakes import refused_url

    server = ServerProcess(kind)
    request = CompletionRequest(messages=history(), tools=TOOLS)
    direct: list[float] = []
    via_failover: list[float] = []
    try:
        for _ in range(trials):
            for urls, bucket in (((server.url,), direct), ((refused_url(), server.url), via_failover)):
                client = provider(kind, urls)  # fresh: breaker closed, no pooled connection
                start = time.perf_counter()
                await client.complete(request)
                bucket.append(time.perf_counter() - start)
                await client.aclose()
    finally:
        server.server_times()
    extra = [(f - d) * 1000 for f, d in zip(via_failover, direct, strict=True)]
    return {
        "kind": kind,
        "trials": trials,
        "direct_ms_median": statistics.median(d * 1000 for d in direct),
        "failover_ms_median": statistics.median(f * 1000 for f in via_failover),
        "extra_ms_median": statistics.median(extra),
        "extra_ms_p95": pct(extra, 0.95),
    }


async def main(steps: int, trials: int) -> None:
    import logging

    import structlog

    logging.disable(logging.CRITICAL)
    structlog.configure(logger_factory=structlog.ReturnLoggerFactory())  # keep failover logs off the figures
    for kind, stream in (("ollama", True), ("openai", True), ("ollama", False), ("openai", False)):
        o = await overhead(kind, steps, stream)
        mode = "streamed, ~48 chunks" if stream else "one JSON body"
        print(
            f"{kind:7s} ({mode}) overhead per step: median {o['overhead_ms_median']:.2f} ms, p95 {o['overhead_ms_p95']:.2f} ms "
            f"(call {o['wall_ms_median']:.2f} ms, server {o['server_ms_median']:.2f} ms; {o['steps']} steps)"
        )
    for kind in ("ollama", "openai"):
        f = await failover(kind, trials)
        print(
            f"{kind:7s} fail over from a refusing primary: +{f['extra_ms_median']:.2f} ms median, "
            f"+{f['extra_ms_p95']:.2f} ms p95 (direct {f['direct_ms_median']:.2f} ms, via failover "
            f"{f['failover_ms_median']:.2f} ms; {f['trials']} trials)"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--trials", type=int, default=60)
    args = parser.parse_args()
    anyio.run(main, args.steps, args.trials)
