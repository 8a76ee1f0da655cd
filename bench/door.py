"""The door's cost: server CPU per turn through the OpenAI-compatible routes against the native ones.

    .venv/bin/python bench/door.py [--turns 300] [--rounds 3]

One ``agentd run`` (scripted model, no tool calls: the turn itself is as cheap as a turn gets, so
the door's share shows) is driven over its unix socket by one client in this process. Each kind
of request makes a new session and one turn in it, waited for:

- a turn on a session made beforehand (outside the measure; one turn per session, so every
  transcript is as short): ``native`` ``POST /v1/sessions/{id}/messages``, ``chat``
  ``POST /v1/chat/completions`` with ``X-Agentd-Session``, ``responses`` ``POST /v1/responses``
  with ``conversation``; ``native+key``, ``chat+key``: the same with an ``Idempotency-Key`` (its
  claim and its answer in the store);
- a new session and its first turn: ``native new`` (``POST /v1/sessions``, then the message: two
  requests), ``chat new`` and ``responses new`` (one request each).

CPU is user+system time from /proc of the daemon (the supervisor, where the door runs) and of
its children, read before and after each block of ``--turns`` turns; the kinds take turns in
``--rounds`` rounds so that drift (another process on the 2 cores) spreads over all of them.
Figures are printed, never asserted (the target for the door: at most +10 % over native).

Time to the first streamed token (``--ttft`` turns per kind, ``--cpu-turns 0`` to skip the CPU
part): a second daemon whose scripted model streams (``chunk_ms``), each turn on a session made
beforehand, measured from the request to the first text: ``native`` opens
``GET /v1/sessions/{id}/events`` then posts the message (``wait: false``) and reads to the first
``delta`` with content; ``chat stream`` posts ``stream: true`` and reads to the first chunk with
content; ``responses stream`` to the first ``response.output_text.delta``. Every stream is read to
its end before the next turn. p50 and p99 are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from tables import print_table

from tests.daemon_harness import Daemon

CONFIG = """
[intelligence]
provider = "scripted"
model = "echo-small"

[[assistants]]
name = "main"
first_message_mode = "assistant-waits-for-user"
"""
TICK = os.sysconf("SC_CLK_TCK")
STREAMING_CONFIG = CONFIG.replace('model = "echo-small"', 'model = "echo-small"\noptions = { chunk_ms = 5 }')


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(the process's CPU seconds, its live children's), from /proc."""
    own = _stat_cpu(pid)
    children = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[1]) == pid:
            children += (int(fields[11]) + int(fields[12])) / TICK
    return own, children


def _stat_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def kinds(client: httpx.Client) -> dict[str, Callable[[str, int], None]]:
    """Each kind: send turn ``n`` (to ``session`` when it continues one)."""

    def key(keyed: bool) -> dict[str, str]:
        return {"Idempotency-Key": uuid.uuid4().hex} if keyed else {}

    def expect(answer: httpx.Response) -> None:
        assert answer.status_code == 200, answer.text

    def native(session: str, n: int, keyed: bool = False) -> None:
        path = f"/v1/sessions/{session}/messages"
        expect(client.post(path, json={"content": f"hello {n}"}, headers=key(keyed)))

    def chat(session: str, n: int, keyed: bool = False) -> None:
        body = {"model": "main", "messages": [{"role": "user", "content": f"hello {n}"}]}
        headers = {**key(keyed), **({"X-Agentd-Session": session} if session else {})}
        expect(client.post("/v1/chat/completions", json=body, headers=headers))

    def responses(session: str, n: int) -> None:
        body = {"model": "main", "input": f"hello {n}", **({"conversation": session} if session else {})}
        expect(client.post("/v1/responses", json=body))

    def native_new(_: str, n: int) -> None:
        native(client.post("/v1/sessions", json={"assistant": "main"}).json()["id"], n)

    return {
        "native": native,
        "chat": chat,
        "responses": responses,
        "native+key": lambda session, n: native(session, n, keyed=True),
        "chat+key": lambda session, n: chat(session, n, keyed=True),
        "native new": native_new,
        "chat new": lambda _, n: chat("", n),
        "responses new": lambda _, n: responses("", n),
    }


def sessions(client: httpx.Client, name: str, count: int) -> list[str]:
    """Sessions for ``count`` turns of kind ``name`` (none for the kinds that make their own)."""
    if name.endswith(" new"):
        return [""] * count
    return [client.post("/v1/sessions", json={"assistant": "main"}).json()["id"] for _ in range(count)]


def _first_text(lines: Iterator[str], marks: Callable[[str, str], bool]) -> float:
    """Read ``lines`` (SSE) to the first data line ``marks`` (event name, data) says is text; its time."""
    event = ""
    for line in lines:
        if line.startswith("event: "):
            event = line.removeprefix("event: ")
        elif line.startswith("data: ") and marks(event, line.removeprefix("data: ")):
            return time.perf_counter()
    raise RuntimeError("the stream ended without text")


def _drain(lines: Iterator[str], last: Callable[[str], bool]) -> None:
    for line in lines:
        if last(line):
            return


def first_token_kinds(client: httpx.Client) -> dict[str, Callable[[str, int], float]]:
    """Each kind: the seconds from asking turn ``n`` on ``session`` to its first streamed text."""

    def native(session: str, n: int) -> float:
        began = time.perf_counter()
        with client.stream("GET", f"/v1/sessions/{session}/events") as events:
            lines = events.iter_lines()
            next(lines)  # ": connected": subscribed
            posted = client.post(f"/v1/sessions/{session}/messages", json={"content": f"hello {n}", "wait": False})
            assert posted.status_code == 202, posted.text
            first = _first_text(lines, lambda event, data: event == "delta" and '"content"' in data)
            _drain(lines, lambda line: line == "event: turn.done")
        return first - began

    def chat(session: str, n: int) -> float:
        body = {"model": "main", "messages": [{"role": "user", "content": f"hello {n}"}], "stream": True}
        began = time.perf_counter()
        with client.stream("POST", "/v1/chat/completions", json=body, headers={"X-Agentd-Session": session}) as got:
            lines = got.iter_lines()
            first = _first_text(lines, lambda _, data: '"content":"' in data and '"content":""' not in data)
            _drain(lines, lambda line: line == "data: [DONE]")
        return first - began

    def responses(session: str, n: int) -> float:
        body = {"model": "main", "input": f"hello {n}", "conversation": session, "stream": True}
        began = time.perf_counter()
        with client.stream("POST", "/v1/responses", json=body) as got:
            lines = got.iter_lines()
            first = _first_text(lines, lambda event, _: event == "response.output_text.delta")
            _drain(lines, lambda line: line == "event: response.completed")
        return first - began

    return {"native": native, "chat stream": chat, "responses stream": responses}


def first_tokens(turns: int, rounds: int) -> None:
    """Print p50/p99 of the time to the first streamed token, through the door and natively."""
    with tempfile.TemporaryDirectory(prefix="agentd-door-ttft-") as tmp:
        daemon = Daemon(Path(tmp), STREAMING_CONFIG).start()
        try:
            client = httpx.Client(
                transport=httpx.HTTPTransport(uds=str(daemon.socket)), base_url="http://agentd", timeout=60
            )
            measures = first_token_kinds(client)
            times: dict[str, list[float]] = {name: [] for name in measures}
            for round_ in range(rounds + 1):  # round 0 warms every path up
                for name, measure in measures.items():
                    made = sessions(client, "streamed", turns if round_ else 10)
                    got = [measure(session, n) for n, session in enumerate(made)]
                    if round_:
                        times[name] += got
            client.close()
        finally:
            daemon.stop()
    rows = []
    for name, got in times.items():
        cuts = statistics.quantiles(got, n=100)
        rows.append([name, str(len(got)), f"{statistics.median(got) * 1e3:.1f}", f"{cuts[98] * 1e3:.1f}"])
    print_table(
        "time to the first streamed token (unix socket, scripted model with chunk_ms = 5)",
        ["kind", "turns", "p50 ms", "p99 ms"],
        rows,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=300, help="turns per kind per round (0: no CPU measure)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ttft", type=int, default=200, help="streamed turns per kind per round (0: none)")
    args = parser.parse_args(argv)
    began = time.monotonic()
    if args.turns:
        cpu_per_turn(args.turns, args.rounds)
    if args.ttft:
        print()
        first_tokens(args.ttft, args.rounds)
    print(f"\ntotal {time.monotonic() - began:.0f}s; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def cpu_per_turn(turns: int, rounds: int) -> None:
    """Print the CPU per turn of every kind of request."""
    with tempfile.TemporaryDirectory(prefix="agentd-door-bench-") as tmp:
        daemon = Daemon(Path(tmp), CONFIG).start()
        try:
            assert daemon.process is not None
            pid = daemon.process.pid
            client = httpx.Client(
                transport=httpx.HTTPTransport(uds=str(daemon.socket)), base_url="http://agentd", timeout=60
            )
            requests = kinds(client)
            for name, send in requests.items():  # warm up every path once
                for n, session in enumerate(sessions(client, name, 20)):
                    send(session, n)
            samples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in requests}
            for _ in range(rounds):
                for name, send in requests.items():
                    made = sessions(client, name, turns)
                    own0, kids0 = cpu_seconds(pid)
                    wall0 = time.perf_counter()
                    for n, session in enumerate(made):
                        send(session, n)
                    wall = time.perf_counter() - wall0
                    own1, kids1 = cpu_seconds(pid)
                    samples[name].append(((own1 - own0) / turns, (kids1 - kids0) / turns, wall / turns))
            client.close()
        finally:
            daemon.stop()
    rows = []
    for name, got in samples.items():
        base = statistics.median(s[0] for s in samples["native new" if name.endswith(" new") else "native"])
        own = statistics.median(s[0] for s in got)
        kids = statistics.median(s[1] for s in got)
        wall = statistics.median(s[2] for s in got)
        rows.append(
            [
                name,
                f"{own * 1e3:.2f}",
                f"{(own / base - 1) * 100:+.1f} %",
                f"{kids * 1e3:.2f}",
                f"{wall * 1e3:.2f}",
            ]
        )
    print_table(
        f"CPU per turn (median of {rounds} rounds of {turns} turns; vs native, or native new)",
        ["kind", "supervisor ms", "vs native", "children ms", "wall ms"],
        rows,
    )


if __name__ == "__main__":
    main()
