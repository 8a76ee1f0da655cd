"""Token deltas end to end (RFC 0005 §7, RFC 0000 §7): ``agentd run`` as a subprocess, its SSE
events read over the socket, the model either the scripted one or a fake Ollama/OpenAI server
streaming in small chunks over real HTTP.

The rule every test checks: concatenating the ``content`` of one ``(turn, run, step)``'s deltas
(after its last ``step.reset``) gives exactly that step's ``content`` in ``step.done`` and in the
stored assistant entry. "Mid-stream" is an event, never a timing guess: the fake server holds the
rest of an answer (``Reply(midway=…)``) until the test has seen the first part arrive.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_harness import Daemon, EventStream, running_daemon, wait_until
from tests.fakes import FakeOllama, FakeOpenAI, Fault, Reply

pytestmark = pytest.mark.e2e

Event = tuple[str, dict[str, Any]]


def scripted_config(model: str = "streamer", *, options: str = "chunk_ms = 2, think = true") -> str:
    return f"""
[intelligence]
provider = "scripted"
model = "{model}"
options = {{ {options} }}

[[assistants]]
name = "main"
first_message_mode = "assistant-waits-for-user"
"""


def http_config(provider: str, endpoints: list[str], model: str = "fake-model") -> str:
    key = 'api_key_env = "STREAM_TEST_KEY"' if provider == "openai" else ""
    return f"""
[intelligence]
provider = "{provider}"
endpoints = {json.dumps(endpoints)}
model = "{model}"
{key}

[limits]
deadline = "60s"

[[assistants]]
name = "main"
system = "You are a test assistant."
first_message_mode = "assistant-waits-for-user"
"""


def turn_events(stream: EventStream, turn: str) -> list[Event]:
    """Every event of ``turn``, in order, once its ``turn.done`` has arrived."""
    stream.wait("turn.done", lambda d: d["turn"] == turn)
    return [(name, data) for name, data in stream.seen if data.get("turn") == turn]


def streamed_steps(evts: list[Event]) -> dict[tuple[int, int], dict[str, str]]:
    """(run, step) → the content and thinking its deltas add up to, after its last step.reset."""
    steps: dict[tuple[int, int], dict[str, str]] = {}
    for name, data in evts:
        if name == "delta":
            text = steps.setdefault((data["run"], data["step"]), {"content": "", "thinking": ""})
            text["content"] += data.get("content", "")
            text["thinking"] += data.get("thinking", "")
        elif name == "step.reset":
            steps[(data["run"], data["step"])] = {"content": "", "thinking": ""}
    return steps


def done_steps(evts: list[Event]) -> dict[tuple[int, int], dict[str, Any]]:
    return {(d["run"], d["step"]): d for name, d in evts if name == "step.done"}


def assert_deltas_add_up(evts: list[Event]) -> dict[tuple[int, int], dict[str, str]]:
    """Every step.done's content is exactly what its deltas add up to (and each delta precedes it)."""
    streamed, done = streamed_steps(evts), done_steps(evts)
    for key, step in done.items():
        assert streamed.get(key, {"content": ""})["content"] == step["content"], (key, step, streamed.get(key))
    names = [name for name, _ in evts]
    last_delta = max((i for i, n in enumerate(names) if n == "delta"), default=-1)
    assert last_delta < names.index("turn.done")
    return streamed


def assistant_contents(daemon: Daemon, session: str, turn: str) -> list[str]:
    return [e["content"] for e in daemon.entries(session, turn) if e["role"] == "assistant"]


def delta_frames(daemon: Daemon) -> float:
    """The supervisor's count of delta frames received from children (0 when none yet)."""
    text = daemon.api("GET", "/metrics").text
    found = re.search(r'^agentd_delta_frames_total\{event="delta"\} ([0-9.e+]+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


# --------------------------------------------------------------------------- the scripted model


def test_the_scripted_model_streams_deltas_that_add_up_to_each_step(tmp_path: Path) -> None:
    text = "tell me about streaming " + " ".join(f"word{i}" for i in range(40))
    with running_daemon(tmp_path, scripted_config()) as daemon:
        session = daemon.new_session()
        stream = daemon.events(session)
        turn = daemon.send(session, text, wait=False)["turn_id"]
        evts = turn_events(stream, turn)
        streamed = assert_deltas_add_up(evts)
        [(key, step)] = done_steps(evts).items()
        assert key == (0, 1)
        assert step["content"] == f"[streamer] You said: {text}"
        assert streamed[key]["thinking"] == step["thinking"]  # the scripted thinking is streamed as is
        deltas = [d for name, d in evts if name == "delta"]
        assert all(d["session"] == session and d["model"] == "streamer" for d in deltas)
        # The stored entry is what streamed.
        assert assistant_contents(daemon, session, turn) == [streamed[key]["content"]]


def test_an_unwatched_session_sends_no_delta_frame(tmp_path: Path) -> None:
    with running_daemon(tmp_path, scripted_config()) as daemon:
        quiet = daemon.new_session()
        result = daemon.send(quiet, "nobody listens to this long enough answer of many words")
        assert result["turn"]["status"] == "completed"
        assert delta_frames(daemon) == 0
        # The counter is real: a watched session's turn moves it.
        watched = daemon.new_session()
        stream = daemon.events(watched)
        turn = daemon.send(watched, "somebody listens", wait=False)["turn_id"]
        assert_deltas_add_up(turn_events(stream, turn))
        assert delta_frames(daemon) > 0
        before = delta_frames(daemon)
        assert daemon.send(quiet, "still nobody listens here")["turn"]["status"] == "completed"
        assert delta_frames(daemon) == before


def test_a_subscriber_leaving_mid_turn_stops_the_deltas(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    with running_daemon(tmp_path, scripted_config(options=f'chunk_ms = 1, hold_file = "{hold}"')) as daemon:
        assert daemon.client is not None
        session = daemon.new_session()
        with daemon.client.stream("GET", f"/v1/sessions/{session}/events", timeout=None) as response:
            turn = daemon.send(session, "said to nobody in the end", wait=False)["turn_id"]
            for line in response.iter_lines():
                if line.startswith("event: step.started"):
                    break  # the model call is in flight (held), watched; now the subscriber leaves
        daemon.wait_log("session.unwatched", lambda r: r.get("turn") == turn)
        hold.touch()
        assert daemon.turn(session, turn)["status"] == "completed"
        assert delta_frames(daemon) == 0  # watched while held, nothing streamed before it left
        assert assistant_contents(daemon, session, turn) == ["[streamer] You said: said to nobody in the end"]


def test_a_restart_turn_swap_discards_the_run_and_the_rerun_streams_as_the_next(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    options = f'chunk_ms = 1, hold_file = "{hold}"'
    with running_daemon(
        tmp_path, scripted_config("old-model", options=options), args=["--model-swap", "restart-turn"]
    ) as daemon:
        session = daemon.new_session()
        stream = daemon.events(session)
        turn = daemon.send(session, "say this twice", wait=False)["turn_id"]
        stream.wait("step.started", lambda d: d["turn"] == turn)
        daemon.write_config(scripted_config("new-model", options=options))
        daemon.signal(signal.SIGHUP)
        stream.wait("swap.parked", lambda d: d["turn"] == turn)
        hold.touch()
        evts = turn_events(stream, turn)
        assert_deltas_add_up(evts)
        names = [name for name, _ in evts]
        restarted = names.index("turn.restarted")
        assert evts[restarted][1]["run"] == 1
        before = [d for name, d in evts[:restarted] if name in ("delta", "step.done")]
        after = [d for name, d in evts[restarted:] if name in ("delta", "step.done")]
        assert before and {d["run"] for d in before} == {0}
        assert after and {d["run"] for d in after} == {1}
        assert (
            "".join(d.get("content", "") for d in before if "usage" not in d) == "[old-model] You said: say this twice"
        )
        assert done_steps(evts)[(1, 1)]["content"] == "[new-model] You said: say this twice"
        assert assistant_contents(daemon, session, turn) == ["[new-model] You said: say this twice"]


def test_a_rerun_after_a_child_crash_streams_as_the_next_run(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    with running_daemon(tmp_path, scripted_config(options=f'chunk_ms = 1, hold_file = "{hold}"')) as daemon:
        session = daemon.new_session()
        stream = daemon.events(session)
        turn = daemon.send(session, "survive a crash", wait=False)["turn_id"]
        first = stream.wait("step.started", lambda d: d["turn"] == turn)
        assert first["run"] == 0
        pid = wait_until(lambda: daemon.session(session)["child"], "the session's child")
        os.kill(pid, signal.SIGKILL)
        assert stream.wait("step.started", lambda d: d["turn"] == turn)["run"] == 1
        hold.touch()
        evts = turn_events(stream, turn)
        assert_deltas_add_up(evts)
        assert {d["run"] for name, d in evts if name in ("delta", "step.done")} == {1}


# --------------------------------------------------------------------------- real wire: Ollama, OpenAI


@pytest.mark.parametrize("server_type", [FakeOllama, FakeOpenAI], ids=["ollama", "openai"])
def test_deltas_arrive_while_the_server_still_holds_the_rest(tmp_path: Path, server_type: type[Any]) -> None:
    midway = threading.Event()
    answer = "The first half arrives early; the second half only once the test saw the first."
    reply = Reply(content=answer, thinking="let me think it over", pieces=12, midway=midway, midway_after=14)
    provider = "ollama" if server_type is FakeOllama else "openai"
    with (
        server_type(default=reply, split_writes=True) as server,
        running_daemon(tmp_path, http_config(provider, [server.url]), env={"STREAM_TEST_KEY": "k"}) as daemon,
    ):
        try:
            session = daemon.new_session()
            stream = daemon.events(session)
            turn = daemon.send(session, "stream please", wait=False)["turn_id"]
            # Part of the content streamed while the server holds the rest back.
            stream.wait("delta", lambda d: d["turn"] == turn and "content" in d)
            assert server.chat_requests[0].finished_at is None
        finally:
            midway.set()
        evts = turn_events(stream, turn)
        streamed = assert_deltas_add_up(evts)
        assert streamed[(0, 1)]["content"] == answer
        assert streamed[(0, 1)]["thinking"] == "let me think it over"  # reasoning streams too
        assert assistant_contents(daemon, session, turn) == [answer]


def test_think_tags_in_content_stream_as_thinking(tmp_path: Path) -> None:
    reply = Reply(content="The answer itself.", thinking="hidden reasoning", think_tags=True, pieces=9)
    with (
        FakeOllama(default=reply, split_writes=True) as server,
        running_daemon(tmp_path, http_config("ollama", [server.url])) as daemon,
    ):
        session = daemon.new_session()
        stream = daemon.events(session)
        turn = daemon.send(session, "think first", wait=False)["turn_id"]
        evts = turn_events(stream, turn)
        streamed = assert_deltas_add_up(evts)
        assert streamed[(0, 1)]["content"] == "The answer itself."
        assert "hidden reasoning" in streamed[(0, 1)]["thinking"]
        assert not any(name == "step.reset" for name, _ in evts)  # no text had to be taken back


@pytest.mark.parametrize("server_type", [FakeOllama, FakeOpenAI], ids=["ollama", "openai"])
def test_a_failover_after_text_went_out_is_announced_by_step_reset(tmp_path: Path, server_type: type[Any]) -> None:
    midway = threading.Event()
    partial = Reply(content="this text goes out and is then taken back", pieces=8, midway=midway)
    answer = "the second endpoint's whole answer"
    provider = "ollama" if server_type is FakeOllama else "openai"
    with (
        server_type(default=Reply(content=answer, pieces=5)) as dying,
        server_type(default=Reply(content=answer, pieces=5)) as healthy,
        running_daemon(
            tmp_path, http_config(provider, [dying.url, healthy.url]), env={"STREAM_TEST_KEY": "k"}
        ) as daemon,
    ):
        dying.script(Fault("drop", after=4, reply=partial))
        try:
            session = daemon.new_session()
            stream = daemon.events(session)
            turn = daemon.send(session, "fail over", wait=False)["turn_id"]
            stream.wait("delta", lambda d: d["turn"] == turn and "content" in d)
        finally:
            midway.set()  # the first endpoint dies mid-stream now
        evts = turn_events(stream, turn)
        names = [name for name, _ in evts]
        assert names.count("step.reset") == 1
        reset = names.index("step.reset")
        assert evts[reset][1]["run"] == 0 and evts[reset][1]["step"] == 1 and evts[reset][1]["reason"]
        assert any(name == "delta" for name in names[:reset]) and any(name == "delta" for name in names[reset:])
        streamed = assert_deltas_add_up(evts)
        assert streamed[(0, 1)]["content"] == answer
        assert assistant_contents(daemon, session, turn) == [answer]
        assert healthy.chat_requests and dying.chat_requests[0].outcome == "drop"


# --------------------------------------------------------------------------- the CLI


class Output:
    """A CLI process's stdout, read on a thread as it comes."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process
        self.data = b""
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        while chunk := self.process.stdout.read1(4096):
            self.data += chunk

    def text(self) -> str:
        return self.data.decode()

    def finish(self) -> tuple[int, str]:
        try:
            code = self.process.wait(timeout=60)
            self._thread.join(10)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            assert self.process.stdout is not None
            self.process.stdout.close()
        return code, self.text()


def cli(daemon: Daemon, *args: str, stdin: bytes | None = None) -> Output:
    process = subprocess.Popen(
        [sys.executable, "-m", "agentd", *args],
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**daemon.env, "AGENTD_STATE_DIR": str(daemon.state_dir)},
        cwd=daemon.tmp,
    )
    if stdin is not None:
        assert process.stdin is not None
        process.stdin.write(stdin)
        process.stdin.close()
    return Output(process)


def test_agentd_send_prints_text_as_it_streams(tmp_path: Path) -> None:
    midway = threading.Event()
    answer = "Printed in two halves: this one first, and this one once the server lets go."
    with (
        FakeOllama(default=Reply(content=answer, pieces=10, midway=midway, midway_after=4)) as server,
        running_daemon(tmp_path, http_config("ollama", [server.url])) as daemon,
    ):
        try:
            output = cli(daemon, "send", "--stream", "go")
            wait_until(lambda: output.text(), "the first streamed text on stdout")
            assert answer.startswith(output.text()) and output.text() != answer
            assert server.chat_requests[0].finished_at is None  # the rest is still held by the server
        finally:
            midway.set()
        code, text = output.finish()
        assert code == 0
        assert text == answer + "\n"  # streamed once, not printed again at the end


def test_agentd_chat_marks_text_taken_back_by_a_failover(tmp_path: Path) -> None:
    midway = threading.Event()
    partial = Reply(content="doomed words that the failover takes back", pieces=8, midway=midway)
    answer = "the answer that stands"
    with (
        FakeOpenAI(default=Reply(content=answer)) as dying,
        FakeOpenAI(default=Reply(content=answer, pieces=4)) as healthy,
        running_daemon(
            tmp_path, http_config("openai", [dying.url, healthy.url]), env={"STREAM_TEST_KEY": "k"}
        ) as daemon,
    ):
        dying.script(Fault("drop", after=4, reply=partial))
        try:
            output = cli(daemon, "chat", stdin=b"fail over please\n")
            wait_until(lambda: "doomed" in output.text(), "the doomed text on stdout")
        finally:
            midway.set()
        code, text = output.finish()
        assert code == 0
        lines = text.splitlines()
        doomed = next(i for i, line in enumerate(lines) if line.startswith("main (fake-model): doomed"))
        assert lines[doomed + 1].startswith("  [discarded: ")
        assert lines[doomed + 2] == f"main (fake-model): {answer}"
        assert sum(answer in line for line in lines) == 1  # the reply streamed; not printed twice
