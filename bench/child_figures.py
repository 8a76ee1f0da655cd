"""Child figures: cold start, memory, control-channel latency, frame codec cost.

    .venv/bin/python bench/child_figures.py [--repeat 20] [--pings 500] [--codec-batches 200]

Every figure is measured on this machine with the supervisor's own ``ChildProcess`` talking to a
real ``python -m agentd.child`` over its real control channel (no mocks):

1. Cold start: ``ChildProcess.start()`` → ``Ready`` received (spawn + interpreter start + imports +
   the Spawn/Ready handshake with the quickstart config), and the child's resident set size
   (``VmRSS`` from ``/proc/PID/status``) right after Ready. ``--repeat`` children, one at a time.
2. Ping → Pong round trip, sequential pings, on one child hosting one session:
   - idle: the session is open but runs no turn;
   - model call in flight: the session runs a turn whose scripted model call is held on a
     ``hold_file`` that never exists; pings start only after the child's ``step.started`` Event.
   ``--repeat`` children × ``--pings`` pings each.
3. Frame codec: ``encode_frame`` + ``decode_payload`` (what ``FrameChannel.receive`` runs on each
   payload once the length prefix has been read and checked) for a SwapIntel carrying the
   quickstart config's intelligence map and for a TurnDone carrying 20 messages (assistant
   messages with tool calls and thinking, tool results, a final answer).
   ``--codec-batches`` batches of ``--codec-batch`` iterations; per-operation time = batch time /
   iterations; the percentiles are over batches.

Percentiles are nearest-rank over the samples. Children are stopped with the kill ladder and the
script checks /proc that none is left.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio
from tables import percentile, print_table

from agentd import events
from agentd.budget import TurnStatus, Usage
from agentd.config import Config, SwapPolicy, intelligence_map, parse_config, quickstart_config
from agentd.messages import AssistantMessage, Message, ToolCall, ToolResult, UserMessage
from agentd.protocol import (
    Close,
    Event,
    Frame,
    Input,
    Open,
    Ping,
    Pong,
    Spawn,
    SwapIntel,
    TurnDone,
    decode_payload,
    encode_frame,
)
from agentd.records import TurnRecord
from agentd.supervisor.child import ChildProcess

REPO = Path(__file__).resolve().parent.parent
HANDSHAKE_TIMEOUT = 30.0
FRAME_TIMEOUT = 30.0


# --------------------------------------------------------------------------- statistics and tables


def summary_row(label: str, samples: Sequence[float], unit: str, fmt: str = "{:.2f}") -> list[str]:
    return [
        label,
        unit,
        str(len(samples)),
        fmt.format(percentile(samples, 50)),
        fmt.format(percentile(samples, 95)),
        fmt.format(max(samples)),
    ]


SUMMARY_HEADER = ["figure", "unit", "n", "p50", "p95", "max"]


# --------------------------------------------------------------------------- children


def loadavg() -> str:
    """The 1/5/15-minute load averages (the figures are only as quiet as the machine)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def child_env() -> dict[str, str]:
    """The environment a supervisor gives its children (the checkout importable, info logs)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env["AGENTD_LOG_LEVEL"] = "info"
    return env


def rss_mib(pid: int) -> float:
    """Resident set size of ``pid`` in MiB (VmRSS in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


class BenchChild:
    """One started child: its stderr drained in the background, frames read by the caller."""

    def __init__(self, child: ChildProcess, stderr: list[str]) -> None:
        self.child = child
        self.stderr = stderr

    async def next_frame(self, kind: type[Frame], where: Callable[[Frame], bool] = lambda _: True) -> Frame:
        """Read frames until one of ``kind`` matching ``where`` arrives (others are dropped)."""
        with anyio.fail_after(FRAME_TIMEOUT):
            while True:
                frame = await self.child.receive()
                if frame is None:
                    raise RuntimeError(f"child {self.child.pid} closed its channel; stderr: {self.stderr[-5:]}")
                if isinstance(frame, kind) and where(frame):
                    return frame


async def start_child(tg: anyio.abc.TaskGroup, child_id: str, config: Config) -> tuple[BenchChild, float]:
    """Start a child and complete the handshake; return it and the seconds from start() to Ready."""
    stderr: list[str] = []
    began = time.perf_counter()
    child = await ChildProcess.start(child_id, env=child_env())
    tg.start_soon(child.pump_stderr, stderr.append)
    await child.handshake(
        Spawn(child_id=child_id, generation=1, policy=SwapPolicy.FINISH_ON_OLD, config=config), HANDSHAKE_TIMEOUT
    )
    return BenchChild(child, stderr), time.perf_counter() - began


async def ping_round_trips(bench: BenchChild, count: int, first_seq: int) -> list[float]:
    """``count`` sequential Ping → Pong round trips, in microseconds."""
    samples: list[float] = []
    for seq in range(first_seq, first_seq + count):
        began = time.perf_counter_ns()
        await bench.child.send(Ping(seq=seq))
        await bench.next_frame(Pong, lambda f, s=seq: isinstance(f, Pong) and f.seq == s)  # type: ignore[misc]
        samples.append((time.perf_counter_ns() - began) / 1000)
    return samples


def held_config(hold_file: Path) -> Config:
    """A scripted config whose every model call waits for ``hold_file`` (which the bench never creates)."""
    return parse_config(
        f"""
[intelligence]
provider = "scripted"
model = "bench-held"
options = {{ hold_file = "{hold_file}" }}

[limits]
deadline = "600s"

[[assistants]]
name = "bench"
first_message_mode = "assistant-waits-for-user"
""",
        "<bench>",
    )


async def measure_children(repeat: int, pings: int, hold_file: Path) -> dict[str, list[float]]:
    """Cold start, RSS and ping figures over ``repeat`` children."""
    figures: dict[str, list[float]] = {"start": [], "rss": [], "rss_inflight": [], "idle": [], "inflight": []}
    started_pids: list[int] = []
    quickstart = quickstart_config()
    held = held_config(hold_file)
    async with anyio.create_task_group() as tg:
        # 1. cold start to Ready, RSS after Ready (quickstart config, as `agentd run` with no file)
        for n in range(repeat):
            bench, seconds = await start_child(tg, f"cold-{n}", quickstart)
            started_pids.append(bench.child.pid)
            figures["start"].append(seconds * 1000)
            figures["rss"].append(rss_mib(bench.child.pid))
            await bench.child.stop(grace=2)
        # 2. pings: idle, then with a model call held in flight
        for n in range(repeat):
            bench, _ = await start_child(tg, f"ping-{n}", held)
            started_pids.append(bench.child.pid)
            await bench.child.send(Open(session="s1", assistant="bench"))
            await ping_round_trips(bench, 20, 1_000_000)  # warm-up: first frames touch cold code paths
            figures["idle"] += await ping_round_trips(bench, pings, 0)
            await bench.child.send(Input(session="s1", turn="t1", message=UserMessage(content="hold this", turn="t1")))
            await bench.next_frame(Event, lambda f: isinstance(f, Event) and f.name == events.STEP_STARTED)
            figures["inflight"] += await ping_round_trips(bench, pings, pings)
            figures["rss_inflight"].append(rss_mib(bench.child.pid))
            await bench.child.send(Close(session="s1"))
            await bench.child.stop(grace=2)
        tg.cancel_scope.cancel()
    left = [pid for pid in started_pids if pid_alive(pid)]
    if left:
        raise RuntimeError(f"children left running: {left}")
    return figures


# --------------------------------------------------------------------------- frame codec


def swap_frame() -> SwapIntel:
    """The SwapIntel a reload of the quickstart config sends."""
    config = quickstart_config()
    return SwapIntel(
        generation=2, policy=SwapPolicy.FINISH_ON_OLD, intelligence=intelligence_map(config), limits=config.limits
    )


def turn_done_frame(count: int = 20) -> TurnDone:
    """A TurnDone whose turn appended ``count`` messages: tool-calling steps, their results, a final answer."""
    turn = "turn-0123456789abcdef"
    messages: list[Message] = []
    step = 0
    while len(messages) < count - 1:
        calls = tuple(
            ToolCall(
                id=f"call_{step}_{i}",
                name=("lookup", "clock")[i],
                arguments={"query": f"invoice {step}-{i}", "page": i},
            )
            for i in range(1 + step % 2)
        )
        messages.append(
            AssistantMessage(
                content="" if step % 3 else "Let me check that.",
                thinking=f"step {step + 1}: look it up",
                tool_calls=calls,
                model="echo-large",
                assistant="billing",
                turn=turn,
            )
        )
        for call in calls:
            if len(messages) < count - 1:
                messages.append(
                    ToolResult(
                        name=call.name,
                        content=f"result for {call.arguments['query']}: " + "paid in full. " * 4,
                        call_id=call.id,
                        turn=turn,
                    )
                )
        step += 1
    messages.append(
        AssistantMessage(
            content="[echo-large] Your invoices are all paid. " * 3, model="echo-large", assistant="billing", turn=turn
        )
    )
    assert len(messages) == count
    record = TurnRecord(
        id=turn,
        status=TurnStatus.COMPLETED,
        models=("echo-large",),
        steps=step + 1,
        usage=Usage(input_tokens=1234, output_tokens=321),
        started_at=1_700_000_000.0,
        ended_at=1_700_000_004.5,
    )
    return TurnDone(session="session-0123456789abcdef", assistant="billing", record=record, messages=messages)


def codec_figures(frame: Frame, batches: int, batch: int) -> dict[str, list[float]]:
    """Per-operation µs for encode, decode and both, one sample per batch.

    Decoding is timed on the payload, without its 4-byte length prefix: that is the part of
    ``FrameChannel.receive`` that costs anything (reading the prefix is one ``struct`` unpack).
    """
    data = encode_frame(frame)
    payload = data[4:]
    assert decode_payload(payload) == frame, "the frame must survive a round trip"
    for _ in range(batch):  # warm-up
        decode_payload(encode_frame(frame)[4:])
    out: dict[str, list[float]] = {"encode": [], "decode": [], "both": [], "bytes": [float(len(data))]}
    for _ in range(batches):
        began = time.perf_counter_ns()
        for _ in range(batch):
            encode_frame(frame)
        out["encode"].append((time.perf_counter_ns() - began) / 1000 / batch)
        began = time.perf_counter_ns()
        for _ in range(batch):
            decode_payload(payload)
        out["decode"].append((time.perf_counter_ns() - began) / 1000 / batch)
        began = time.perf_counter_ns()
        for _ in range(batch):
            decode_payload(encode_frame(frame)[4:])
        out["both"].append((time.perf_counter_ns() - began) / 1000 / batch)
    return out


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--repeat", type=int, default=20, help="children started for the cold-start and ping figures (default 20)"
    )
    parser.add_argument("--pings", type=int, default=500, help="sequential pings per child and state (default 500)")
    parser.add_argument("--codec-batches", type=int, default=200, help="timed batches per frame type (default 200)")
    parser.add_argument("--codec-batch", type=int, default=200, help="iterations per codec batch (default 200)")
    args = parser.parse_args(argv)
    if min(args.repeat, args.pings, args.codec_batches, args.codec_batch) < 1:
        parser.error("every count must be at least 1")

    print(f"agentd child figures — python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {loadavg()}")
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="agentd-bench-") as tmp:
        hold_file = Path(tmp) / "never-created"
        figures = anyio.run(measure_children, args.repeat, args.pings, hold_file)
    print_table(
        f"Child process ({args.repeat} children; pings: {args.repeat} children x {args.pings} sequential pings per state)",
        SUMMARY_HEADER,
        [
            summary_row("cold start: start() -> Ready", figures["start"], "ms", "{:.1f}"),
            summary_row("RSS after Ready (quickstart config)", figures["rss"], "MiB", "{:.1f}"),
            summary_row("RSS, one session, model call in flight", figures["rss_inflight"], "MiB", "{:.1f}"),
            summary_row("Ping -> Pong, child idle", figures["idle"], "us", "{:.0f}"),
            summary_row("Ping -> Pong, model call in flight", figures["inflight"], "us", "{:.0f}"),
        ],
    )

    rows: list[list[str]] = []
    for name, frame in (("SwapIntel (quickstart map)", swap_frame()), ("TurnDone (20 messages)", turn_done_frame())):
        codec = codec_figures(frame, args.codec_batches, args.codec_batch)
        size = f"{int(codec['bytes'][0])} B"
        for op, label in (("encode", "encode_frame"), ("decode", "decode_payload"), ("both", "encode + decode")):
            rows.append(
                [
                    f"{name}: {label}",
                    "us",
                    str(len(codec[op])),
                    *(f"{v:.2f}" for v in (percentile(codec[op], 50), percentile(codec[op], 95), max(codec[op]))),
                    size,
                ]
            )
    print_table(
        f"Frame codec ({args.codec_batches} batches x {args.codec_batch} iterations; per operation)",
        [*SUMMARY_HEADER, "frame"],
        rows,
    )
    print(f"\ntotal {time.monotonic() - began:.1f}s; load average {loadavg()}; no child left running")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
