"""Streaming pieces (RFC 0005 §7), unit level: the providers' stream parsers hand content and
thinking to a sink as they read it, the think-tag split agrees with the whole answer's, the
child's coalescer keeps order and exactness, and the CLI's printer marks text taken back.
"""

from __future__ import annotations

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentd import events
from agentd.child.deltas import DeltaBuffer, DeltaStream
from agentd.cli.streaming import DeltaPrinter
from agentd.config import Intelligence
from agentd.intel.base import CompletionRequest
from agentd.intel.ollama import NDJSONReader
from agentd.intel.openai import SSEReader
from agentd.intel.pieces import TaggedSink, ThinkTagSplitter
from agentd.intel.scripted import ScriptedProvider, word_pieces
from agentd.intel.wire import IncompleteStream, split_think
from agentd.intel.wire_ollama import OllamaStream
from agentd.intel.wire_openai import OpenAIStream
from agentd.messages import UserMessage
from agentd.protocol import Event, Frame
from tests.fakes.render import OpenAILayout, ollama_records, openai_events
from tests.fakes.script import Reply


class Sink:
    """Records what a provider hands out, resets included."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def content(self, text: str) -> None:
        self.calls.append(("content", text))

    def thinking(self, text: str) -> None:
        self.calls.append(("thinking", text))

    def reset(self, reason: str) -> None:
        self.calls.append(("reset", reason))

    def text(self, kind: str) -> str:
        return "".join(t for k, t in self.calls if k == kind)


# --------------------------------------------------------------------------- Ollama lines


def test_ollama_lines_hand_each_piece_to_the_sink_as_it_is_read() -> None:
    sink = Sink()
    reader = NDJSONReader("c_", sink)
    lines = ollama_records(Reply(content="one two three", thinking="hmm ok", pieces=3), "m")
    seen: list[int] = []
    for line in lines[:-1]:
        reader.feed(line + b"\n")
        seen.append(len(sink.calls))
    assert seen == sorted(seen) and seen[0] == 1  # a piece per line, as each line arrives
    assert sink.text("thinking") == "hmm ok" and sink.text("content") == "one two three"
    reader.feed(lines[-1] + b"\n")
    assert reader.finish().message.content == "one two three"


def test_an_ollama_stream_without_its_done_line_fails_even_after_pieces_went_out() -> None:
    sink = Sink()
    reader = NDJSONReader("c_", sink)
    for line in ollama_records(Reply(content="cut short here", pieces=3), "m")[:-1]:
        reader.feed(line + b"\n")
    assert sink.text("content") == "cut short here"
    with pytest.raises(IncompleteStream):
        reader.finish()


# --------------------------------------------------------------------------- OpenAI SSE chunks


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_openai_chunks_hand_content_and_reasoning_to_the_sink(field: str) -> None:
    sink = Sink()
    reader = SSEReader("c_", sink)
    data = openai_events(
        Reply(content="the answer", thinking="the reasoning", pieces=4), "m", layout=OpenAILayout(reasoning_field=field)
    )
    for event in data:
        reader.feed(event)
    assert sink.text("thinking") == "the reasoning" and sink.text("content") == "the answer"
    assert reader.finish().message.content == "the answer"


def test_an_openai_stream_without_finish_or_done_fails_even_after_pieces_went_out() -> None:
    sink = Sink()
    stream = OpenAIStream(sink=sink)
    stream.feed_data('{"choices":[{"index":0,"delta":{"role":"assistant","content":"half an "}}]}')
    stream.feed_data('{"choices":[{"index":0,"delta":{"content":"answer"}}]}')
    assert sink.text("content") == "half an answer"
    with pytest.raises(IncompleteStream):
        stream.result()


def test_an_openai_refusal_streams_as_content() -> None:
    sink = Sink()
    stream = OpenAIStream(sink=sink)
    stream.feed_data('{"choices":[{"index":0,"delta":{"refusal":"I cannot"},"finish_reason":"stop"}]}')
    assert sink.text("content") == stream.result().message.content == "I cannot"


def test_ollama_stream_hands_nothing_for_a_tool_call_only_answer() -> None:
    sink = Sink()
    stream = OllamaStream(sink=sink)
    stream.feed_line(b'{"message":{"role":"assistant","content":"","tool_calls":[{"function":{"name":"x"}}]}}')
    stream.feed_line(b'{"done":true}')
    assert sink.calls == [] and stream.result().message.tool_calls[0].name == "x"


# --------------------------------------------------------------------------- think tags, incrementally


CONTENTS = st.sampled_from(
    [
        "<think>reason</think>answer",
        "  <THINK>\nsome reasoning\n</think>\n\n  the answer ",
        "<think>never closed",
        "<thi",
        "   ",
        "plain answer <think>not at the start</think>",
        "<think></think>",
        "<think>a</think>   ",
        "<thinking>is not the tag</thinking>",
        "</think> leading close",
        "<think>x</thin</think>y",
    ]
)


@settings(max_examples=200)
@given(CONTENTS | st.text(alphabet="<>/thinkTHINK \nab", max_size=40), st.lists(st.integers(0, 60), max_size=8))
def test_streamed_content_adds_up_to_what_split_think_keeps(content: str, cuts: list[int]) -> None:
    sink = Sink()
    tagged = TaggedSink(sink)
    points = sorted({c % (len(content) + 1) for c in cuts})
    for a, b in zip([0, *points], [*points, len(content)], strict=True):
        tagged.content(content[a:b])
    tagged.finish()
    thinking, kept = split_think(content)
    assert sink.text("content") == kept
    assert sink.text("thinking").strip() == (thinking or "")


def test_the_splitter_routes_as_soon_as_it_can_tell() -> None:
    splitter = ThinkTagSplitter()
    assert splitter.feed("  <th") == []  # could still be a think block
    assert splitter.feed("ink>why") == [("thinking", "why")]
    assert splitter.feed(" so</thi") == [("thinking", " so")]  # a partial close tag is held
    assert splitter.feed("nk>\n  Yes") == [("content", "Yes")]
    assert splitter.feed(" indeed") == [("content", " indeed")]
    plain = ThinkTagSplitter()
    assert plain.feed("Hello") == [("content", "Hello")]


def test_a_reset_starts_the_split_over() -> None:
    sink = Sink()
    tagged = TaggedSink(sink)
    tagged.content("<think>first try")
    tagged.reset("retry")
    tagged.content("plain second try")
    tagged.finish()
    assert sink.calls == [("thinking", "first try"), ("reset", "retry"), ("content", "plain second try")]


# --------------------------------------------------------------------------- the scripted model


@given(st.text(max_size=60))
def test_word_pieces_join_back_exactly(text: str) -> None:
    assert "".join(word_pieces(text)) == text


@pytest.mark.anyio
async def test_the_scripted_model_streams_word_sized_pieces() -> None:
    provider = ScriptedProvider(Intelligence(provider="scripted", model="m", options={"think": True}))
    sink = Sink()
    completion = await provider.complete(
        CompletionRequest(messages=[UserMessage(content="hello there you")], sink=sink)
    )
    assert sink.text("content") == completion.message.content == "[m] You said: hello there you"
    assert sink.text("thinking") == completion.message.thinking
    assert [t for k, t in sink.calls if k == "content"] == ["[m] ", "You ", "said: ", "hello ", "there ", "you"]


@pytest.mark.anyio
async def test_chunk_ms_waits_between_the_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    provider = ScriptedProvider(Intelligence(provider="scripted", model="m", options={"chunk_ms": 30}))
    timeline: list[object] = []

    async def sleep(seconds: float) -> None:
        timeline.append(seconds)

    class Timed(Sink):
        def content(self, text: str) -> None:
            timeline.append(text)

    monkeypatch.setattr("agentd.intel.scripted.anyio.sleep", sleep)
    await provider.complete(CompletionRequest(messages=[UserMessage(content="a b")], sink=Timed()))
    assert timeline == ["[m] ", 0.03, "You ", 0.03, "said: ", 0.03, "a ", 0.03, "b"]


# --------------------------------------------------------------------------- the coalescer (pure)


def test_pieces_between_flushes_go_out_as_one_delta_in_order() -> None:
    buffer = DeltaBuffer(0.02)
    buffer.begin(0, 1, "m")
    for piece in ["Hel", "lo", " wor"]:
        buffer.content(piece)
    buffer.thinking("hmm")
    assert buffer.due_at() < 0  # nothing sent yet: may go at once
    assert buffer.take(10.0) == [
        (events.DELTA, {"run": 0, "step": 1, "model": "m", "content": "Hello wor", "thinking": "hmm"})
    ]
    assert buffer.due_at() == pytest.approx(10.02)  # the next frame no sooner than 20 ms later
    buffer.content("ld")
    assert buffer.take(10.03) == [(events.DELTA, {"run": 0, "step": 1, "model": "m", "content": "ld"})]
    assert buffer.take(10.06) == []  # nothing waiting, nothing sent
    assert buffer.finish("Hello world", "hmm", 10.07) == []  # already whole


def test_finish_sends_what_is_missing_so_the_deltas_add_up() -> None:
    buffer = DeltaBuffer()
    buffer.begin(2, 3, "m")
    buffer.content("The ans")
    buffer.take(1.0)
    buffer.content("wer")
    ops = buffer.finish("The answer.", None, 1.001)  # a non-streaming tail: the rest comes here
    assert ops == [(events.DELTA, {"run": 2, "step": 3, "model": "m", "content": "wer."})]


def test_a_reset_after_text_went_out_is_announced_before_the_new_text() -> None:
    buffer = DeltaBuffer()
    buffer.begin(0, 1, "m")
    buffer.content("doomed")
    buffer.take(1.0)
    buffer.reset("retried")
    buffer.content("fresh")
    assert buffer.take(2.0) == [
        (events.STEP_RESET, {"run": 0, "step": 1, "reason": "retried"}),
        (events.DELTA, {"run": 0, "step": 1, "model": "m", "content": "fresh"}),
    ]


def test_a_reset_before_anything_went_out_costs_no_frame() -> None:
    buffer = DeltaBuffer()
    buffer.begin(0, 1, "m")
    buffer.content("never sent")
    buffer.reset("retried")
    buffer.content("sent")
    assert buffer.take(1.0) == [(events.DELTA, {"run": 0, "step": 1, "model": "m", "content": "sent"})]


def test_text_the_answer_does_not_start_with_is_taken_back_at_the_end() -> None:
    buffer = DeltaBuffer()
    buffer.begin(0, 1, "m")
    buffer.content("<thin")
    buffer.take(1.0)
    assert buffer.finish("answer", "reasoning", 2.0) == [
        (events.STEP_RESET, {"run": 0, "step": 1, "reason": "the answer differs from the text streamed"}),
        (events.DELTA, {"run": 0, "step": 1, "model": "m", "content": "answer", "thinking": "reasoning"}),
    ]


def test_a_dropped_step_sends_nothing() -> None:
    buffer = DeltaBuffer()
    buffer.begin(0, 1, "m")
    buffer.content("unwatched")
    buffer.drop()
    assert buffer.take(1.0) == [] and not buffer.waiting


@settings(max_examples=100)
@given(
    st.lists(st.tuples(st.sampled_from(["c", "t", "take", "reset"]), st.text(max_size=5)), max_size=30),
    st.text(max_size=20),
)
def test_whatever_happens_the_deltas_after_the_last_reset_add_up_to_the_content(
    script: list[tuple[str, str]], content: str
) -> None:
    buffer = DeltaBuffer()
    buffer.begin(0, 1, "m")
    ops = []
    for n, (action, text) in enumerate(script):
        if action == "c":
            buffer.content(text)
        elif action == "t":
            buffer.thinking(text)
        elif action == "take":
            ops += buffer.take(float(n))
        else:
            buffer.reset(text)
    ops += buffer.finish(content, None, 100.0)
    streamed = ""
    for name, data in ops:
        streamed = "" if name == events.STEP_RESET else streamed + data.get("content", "")
    assert streamed == content


# --------------------------------------------------------------------------- the CLI's printer


def _delta(run: int, step: int, content: str) -> dict[str, object]:
    return {"run": run, "step": step, "model": "m", "content": content}


def test_the_printer_writes_deltas_and_marks_what_was_taken_back() -> None:
    printer = DeltaPrinter(lambda d: f"bot ({d['model']}): ")
    feed = printer.feed
    text = feed(events.DELTA, _delta(0, 1, "Hel")) + feed(events.DELTA, _delta(0, 1, "lo"))
    assert text == "bot (m): Hello"
    assert feed(events.STEP_RESET, {"run": 0, "step": 1, "reason": "retried"}) == "\n  [discarded: retried]\n"
    assert feed(events.DELTA, _delta(0, 1, "Hi")) == "bot (m): Hi"
    assert feed(events.STEP_DONE, {"run": 0, "step": 1, "content": "Hi"}) == "\n"
    assert printer.streamed({"content": "Hi"}) and printer.take_shown("Hi") and not printer.take_shown("Hi")
    assert feed(events.DELTA, _delta(0, 2, "half")) == "bot (m): half"
    restarted = feed(events.TURN_RESTARTED, {"run": 1, "model_to": "new"})
    assert restarted == "\n  [discarded: the turn restarts on new]\n"
    assert feed(events.DELTA, _delta(0, 2, "late")) == ""  # a void run's straggler
    assert feed(events.DELTA, _delta(1, 1, "again")) == "bot (m): again"
    assert feed(events.DELTA, _delta(2, 1, "crash")) == "\n  [discarded: the turn re-runs (run 2)]\nbot (m): crash"


# --------------------------------------------------------------------------- the child's DeltaStream


class _Session:
    """What DeltaStream needs of a ChildSession: an id, ``watched``, and ``send``."""

    def __init__(self, watched: bool) -> None:
        self.id = "s"
        self.watched = watched
        self.sent: list[Frame] = []

    async def send(self, frame: Frame) -> None:
        self.sent.append(frame)


@pytest.mark.anyio
async def test_an_unwatched_turn_sends_no_delta_frame() -> None:
    session = _Session(watched=False)
    spawned: list[object] = []
    stream = DeltaStream(session, "t", spawned.append)  # type: ignore[arg-type]
    stream.begin(0, 1, "m")
    for word in ["nobody ", "is ", "listening"]:
        stream.content(word)
    await stream.end_step("nobody is listening", None)
    stream.close()
    assert session.sent == [] and stream.frames == 0
    assert spawned == []  # no flusher task either: an unwatched turn costs none


@pytest.mark.anyio
async def test_a_subscriber_arriving_mid_step_gets_the_step_text_so_far_then_the_rest_before_step_done() -> None:
    session = _Session(watched=False)
    async with anyio.create_task_group() as tg:
        stream = DeltaStream(session, "t", tg.start_soon)  # type: ignore[arg-type]
        stream.begin(1, 2, "m")
        stream.content("said before ")
        session.watched = True  # a Watch frame arrived
        stream.content("the watch, ")
        with anyio.fail_after(10):
            while not session.sent:
                await anyio.sleep(0.001)
        stream.content("and after")
        await stream.end_step("said before the watch, and after", None)
        stream.close()
    frames = [f for f in session.sent if isinstance(f, Event)]
    assert all(f.name == events.DELTA and f.turn == "t" and f.data["run"] == 1 for f in frames)
    assert "".join(f.data["content"] for f in frames) == "said before the watch, and after"
    assert frames[0].data["content"].startswith("said before the watch, ")
