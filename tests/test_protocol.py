"""The control protocol (agentd.protocol): golden fixtures for every frame, framing, fuzzing, channels.

Golden fixtures live in tests/fixtures/frames/<tag>.bin and hold ``encode_frame(sample)`` for one
deterministic sample of each frame type. They pin the wire format: a change that alters the bytes
must be deliberate. Regenerate with ``AGENTD_REGEN_FIXTURES=1 pytest tests/test_protocol.py``.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import typing
from collections import deque
from collections.abc import Iterable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentd.approvals import ApprovalRequest, ApprovalStatus, Decision, ParkedRun
from agentd.budget import TurnStatus, Usage
from agentd.config import Intelligence, Limits, Price, SwapPolicy, intelligence_map, parse_config, quickstart_config
from agentd.messages import AssistantMessage, SystemMessage, ToolCall, ToolResult, UserMessage
from agentd.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    AppliedSwap,
    Cancel,
    ChildEnv,
    Close,
    Event,
    Failed,
    Frame,
    FrameChannel,
    Input,
    JournalAck,
    JournalFinish,
    JournalStart,
    Open,
    Part,
    Ping,
    Pong,
    ProtocolError,
    Ready,
    Shutdown,
    Spawn,
    SwapAck,
    SwapApplied,
    SwapIntel,
    SwapKind,
    SwapsApplied,
    TurnDiscarded,
    TurnDone,
    TurnParked,
    Watch,
    decode_payload,
    encode_frame,
    encode_frames,
)
from agentd.records import Cost, Discarded, JournalEntry, ModelSpend, TurnRecord

FIXTURES = Path(__file__).parent / "fixtures" / "frames"
REGEN = os.environ.get("AGENTD_REGEN_FIXTURES") == "1"
FRAME_TYPES: tuple[type[Any], ...] = typing.get_args(Frame)


def tag_of(cls: type[Any]) -> str:
    tag = cls.__struct_config__.tag
    assert isinstance(tag, str)
    return tag


# --------------------------------------------------------------------------- samples

_SWAP_CONFIG = parse_config(
    """
model_swap = "restart-turn"

[intelligence]
provider = "openai"
endpoints = ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]
model = "qwen3-8b"
api_key_env = "OPENAI_API_KEY"
options = { temperature = 0.2, top_p = 0.9 }

[[mcp_servers]]
name = "time"
url = "http://127.0.0.1:8931/mcp"
headers_from = { Authorization = "TIME_AUTH" }
call_timeout = "30s"

[[mcp_servers]]
name = "files"
command = ["python", "-m", "files_server"]
env = { TZ = "UTC" }
env_from = ["FILES_TOKEN"]

[[assistants]]
name = "triage"
tools = ["clock", "time:*", "files:read_file"]

[[assistants]]
name = "billing"
intelligence = { model = "qwen3-32b", options = { temperature = 0.0 } }
"""
)

_SYSTEM = SystemMessage(content="You route customers to the right team.", name="triage", turn="t-0")
_USER = UserMessage(content="What time is it in Paris?", images=("aGVsbG8=",), name="alice", turn="t-1")
_ASSISTANT_CALLS = AssistantMessage(
    content="Let me check.",
    thinking="The user wants the time; call the clock tool.",
    tool_calls=(
        ToolCall(id="call-1", name="clock", arguments={"offset_hours": 1}),
        ToolCall(id="call-2", name="transfer_to_billing", arguments={}, arguments_error="not a JSON object: '[1'"),
    ),
    model="echo-small",
    assistant="triage",
    turn="t-1",
)
_TOOL = ToolResult(name="clock", content="2024-05-01T13:00:00+01:00", call_id="call-1", turn="t-1")
_TOOL_ERROR = ToolResult(
    name="transfer_to_billing",
    content="invalid arguments: not a JSON object",
    call_id="call-2",
    is_error=True,
    turn="t-1",
)
_TOOL_REPLAYED = ToolResult(name="refund", content="refunded", call_id="call-3", replayed=True, turn="t-1")
_TOOL_UNKNOWN = ToolResult(
    name="refund", content="outcome unknown", call_id="call-4", is_error=True, outcome_unknown=True, turn="t-1"
)
_JOURNALED = JournalEntry(
    seq=2, call="call-3", tool="refund", arguments={"order": 7}, finished=True, content="refunded", is_error=True
)
_ASSISTANT_ANSWER = AssistantMessage(
    content="It is 13:00 in Paris.",
    name="triage",
    images=("d29ybGQ=",),
    model="echo-large",
    assistant="triage",
    turn="t-1",
)


_PARKED = ParkedRun(
    messages=[_ASSISTANT_CALLS],
    steps=2,
    usage=Usage(input_tokens=30, output_tokens=8),
    elapsed=1.5,
    intelligence=Intelligence(model="echo-large"),
    calls=("call-1", "call-2"),
    spend=(ModelSpend(assistant="main", model="echo-large", usage=Usage(30, 8, requests=1)),),
)


def _samples() -> list[Any]:
    return [
        Spawn(
            child_id="child-7",
            generation=3,
            policy=SwapPolicy.RESTART_TURN,
            config=quickstart_config(),
            secrets=ChildEnv(values={"TIME_TOKEN": "not-a-real-secret"}),
            telemetry=ChildEnv(values={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}),
        ),
        Ready(child_id="child-7", pid=4242),
        Ping(seq=17),
        Pong(seq=17),
        Shutdown(grace=2.5),
        Failed(error="session store unreachable", session="s-1", turn="t-1"),
        Open(session="s-1", assistant="triage", transcript=[_SYSTEM, _USER, _ASSISTANT_CALLS, _TOOL]),
        Close(session="s-1"),
        Input(
            session="s-1",
            turn="t-2",
            message=UserMessage(content="Transfer me to billing", name="alice"),
            started_at=1764583200.5,
            watched=False,
            journal=[_JOURNALED, JournalEntry(seq=3, call="call-4", tool="refund")],
            trace={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
            run=2,
            resumed=True,
            resume=_PARKED,
            decisions=[
                Decision(call_id="call-1", status=ApprovalStatus.APPROVED, arguments={"order": 8}),
                Decision(call_id="call-2", status=ApprovalStatus.REJECTED, reason="not today"),
            ],
        ),
        Cancel(session="s-1", turn="t-2"),
        Watch(session="s-1", watched=False),
        Event(
            session="s-1",
            name="tool.call",
            turn="t-2",
            data={"name": "clock", "arguments": {"offset_hours": 1}, "step": 2, "ok": True, "ratio": 0.5, "none": None},
        ),
        TurnDiscarded(
            session="s-1",
            turn="t-2",
            attempt=Discarded(model="echo-small", steps=2, reason="model swap", usage=Usage(120, 45)),
        ),
        TurnParked(
            session="s-1",
            turn="t-2",
            run=_PARKED,
            requests=[
                ApprovalRequest(
                    call_id="call-1",
                    tool="refund",
                    arguments={"order": 7},
                    parameters={"type": "object", "properties": {"order": {"type": "integer"}}},
                )
            ],
        ),
        TurnDone(
            session="s-1",
            assistant="triage",
            record=TurnRecord(
                id="t-2",
                status=TurnStatus.LOOP_DETECTED,
                models=("echo-small", "echo-large"),
                steps=3,
                restarts=1,
                discarded=(Discarded(model="echo-small", steps=2, reason="model swap", usage=Usage(120, 45)),),
                usage=Usage(input_tokens=300, output_tokens=80, cached_input_tokens=100, requests=4, unreported=1),
                started_at=1714561200.25,
                ended_at=1714561203.5,
                error="tool 'clock' called 4 times with the same arguments",
                by_model=(
                    ModelSpend(assistant="triage", model="echo-small", usage=Usage(120, 45, requests=2)),
                    ModelSpend(
                        assistant="triage",
                        model="echo-large",
                        usage=Usage(180, 35, 100, requests=2, unreported=1),
                        price=Price(
                            model="echo-large",
                            input_per_mtok=Decimal("0.15"),
                            output_per_mtok=Decimal("0.6"),
                            cached_input_per_mtok=Decimal("0.075"),
                        ),
                        cost=Cost(amount="0.0000405", currency="USD"),
                    ),
                ),
            ),
            messages=[
                _SYSTEM,
                _USER,
                _ASSISTANT_CALLS,
                _TOOL,
                _TOOL_ERROR,
                _TOOL_REPLAYED,
                _TOOL_UNKNOWN,
                _ASSISTANT_ANSWER,
            ],
            transcript=[_SYSTEM, _USER, _ASSISTANT_ANSWER],
        ),
        SwapIntel(
            generation=4,
            policy=SwapPolicy.RESTART_TURN,
            intelligence=intelligence_map(_SWAP_CONFIG),
            limits=Limits(max_steps=5, max_tokens=4000, deadline=30.0, max_turn_restarts=1),
            config=_SWAP_CONFIG,
            env=ChildEnv(values={"PROVIDER_KEY": "not-a-real-key"}),
            secrets=ChildEnv(values={"TIME_AUTH": "Bearer not-a-real-secret"}),
        ),
        SwapAck(generation=4),
        JournalStart(
            session="s-1", turn="t-2", entry=JournalEntry(seq=1, call="call-1", tool="refund", arguments={"order": 7})
        ),
        JournalFinish(session="s-1", turn="t-2", entry=_JOURNALED),
        JournalAck(session="s-1", turn="t-2", seq=1, finished=True, error="the store is unavailable"),
        Part(data=b"\x00\x01 a slice of a payload", last=True),
        SwapApplied(
            session="s-1",
            generation=4,
            kind=SwapKind.MODEL,
            model_from="echo-small",
            model_to="echo-large",
            policy=SwapPolicy.RESTART_TURN,
            turn="t-3",
        ),
        SwapsApplied(
            generation=4,
            policy=SwapPolicy.RESTART_TURN,
            applied=(
                AppliedSwap(
                    assistant="triage",
                    kind=SwapKind.MODEL,
                    model_from="qwen3-8b",
                    model_to="qwen3-32b",
                    sessions=("s-2", "s-3"),
                ),
            ),
        ),
    ]


SAMPLES: list[Any] = _samples()
SAMPLE_IDS = [tag_of(type(s)) for s in SAMPLES]
# What a channel returns: every frame but a Part, which the channel joins into the frame it carries.
STREAMED: list[Any] = [s for s in SAMPLES if not isinstance(s, Part)]


def fixture_path(frame: Any) -> Path:
    return FIXTURES / f"{tag_of(type(frame))}.bin"


# --------------------------------------------------------------------------- golden fixtures


@pytest.mark.parametrize("sample", SAMPLES, ids=SAMPLE_IDS)
def test_golden_fixture(sample: Any) -> None:
    """encode(sample) is byte-identical to the fixture, and the fixture decodes back to the sample."""
    path = fixture_path(sample)
    encoded = encode_frame(sample)
    if REGEN:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encoded)
    if not path.exists():
        pytest.fail(f"missing golden fixture {path}; run with AGENTD_REGEN_FIXTURES=1 to create it")
    golden = path.read_bytes()
    assert encoded == golden, f"wire format of {type(sample).__name__} changed; see {path}"
    assert decode_payload(golden[4:]) == sample
    if isinstance(sample, Part):
        return  # a channel joins parts into the frame they carry: tested below, under "frames in parts"
    decoded, end = _read([golden])
    assert (decoded, end) == ([sample], "eof")
    assert type(decoded[0]) is type(sample)


def test_every_frame_type_has_a_sample_and_a_fixture() -> None:
    """Adding a frame to the Frame union without a sample and a golden fixture fails here."""
    assert len(FRAME_TYPES) == 23
    sampled = {type(s) for s in SAMPLES}
    missing_samples = [cls.__name__ for cls in FRAME_TYPES if cls not in sampled]
    assert not missing_samples, f"frame types without a golden sample: {missing_samples}"
    assert len(SAMPLES) == len(sampled), "one sample per frame type"
    missing_files = [tag_of(cls) for cls in FRAME_TYPES if not (FIXTURES / f"{tag_of(cls)}.bin").exists()]
    assert not missing_files, f"frame types without a fixture file: {missing_files}"


def test_no_stale_fixture_files() -> None:
    """Every fixture file belongs to a frame type that still exists."""
    tags = {tag_of(cls) for cls in FRAME_TYPES}
    stale = sorted(p.name for p in FIXTURES.glob("*.bin") if p.stem not in tags)
    assert not stale


def test_samples_use_non_default_values() -> None:
    """The golden samples exercise the optional fields (otherwise the fixtures would not pin them)."""
    for sample in SAMPLES:
        cls = type(sample)
        for field in msgspec.structs.fields(cls):
            if field.required or field.name == "protocol_version":
                continue
            default = field.default if field.default is not msgspec.NODEFAULT else field.default_factory()
            assert getattr(sample, field.name) != default, f"{cls.__name__}.{field.name} is left at its default"


def test_turn_done_sample_holds_all_message_kinds_and_tool_calls() -> None:
    done = next(s for s in SAMPLES if isinstance(s, TurnDone))
    kinds = {type(m) for m in done.messages}
    assert kinds == {SystemMessage, UserMessage, AssistantMessage, ToolResult}
    assert any(isinstance(m, AssistantMessage) and m.tool_calls for m in done.messages)


def test_frames_are_tagged_by_type_field() -> None:
    """Each payload is a msgpack map whose ``type`` names the frame."""
    for sample in SAMPLES:
        raw = msgspec.msgpack.decode(encode_frame(sample)[4:])
        assert raw["type"] == tag_of(type(sample))


@pytest.mark.parametrize(
    "frame",
    [
        Spawn(child_id="c", generation=1, policy=SwapPolicy.FINISH_ON_OLD, config=quickstart_config()),
        Ready(child_id="c", pid=1),
    ],
    ids=["spawn", "ready"],
)
def test_protocol_version_is_on_the_wire(frame: Any) -> None:
    raw = msgspec.msgpack.decode(encode_frame(frame)[4:])
    assert raw.get("protocol_version") == PROTOCOL_VERSION


def test_version_mismatch_is_visible_to_the_receiver() -> None:
    """A peer built with a newer PROTOCOL_VERSION must read *our* version from our Ready, not its own."""
    peer_version = PROTOCOL_VERSION + 1

    class NewerReady(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="ready"):
        child_id: str
        pid: int
        protocol_version: int = peer_version

    ours = encode_frame(Ready(child_id="c", pid=1))
    assert msgspec.msgpack.decode(ours[4:], type=NewerReady).protocol_version == PROTOCOL_VERSION


# --------------------------------------------------------------------------- wire values


def test_swap_policy_wire_values() -> None:
    assert [p.value for p in SwapPolicy] == ["finish-on-old", "restart-turn"]
    for policy in SwapPolicy:
        frame = SwapIntel(generation=1, policy=policy, intelligence={"a": Intelligence()})
        raw = msgspec.msgpack.decode(encode_frame(frame)[4:])
        assert raw["policy"] == policy.value


def test_unknown_policy_value_is_a_protocol_error() -> None:
    payload = msgspec.msgpack.encode(
        {"type": "swap_intel", "generation": 1, "policy": "finish_on_old", "intelligence": {}}
    )
    with pytest.raises(ProtocolError):
        decode_payload(payload)


def test_unknown_frame_type_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        decode_payload(msgspec.msgpack.encode({"type": "teleport", "seq": 1}))


def test_missing_required_field_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        decode_payload(msgspec.msgpack.encode({"type": "ping"}))


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    """A newer peer may add optional fields: an older reader ignores them."""
    payload = msgspec.msgpack.encode({"type": "ping", "seq": 3, "added_later": [1, 2]})
    assert decode_payload(payload) == Ping(seq=3)


# --------------------------------------------------------------------------- framing


def test_length_prefix_is_u32_big_endian() -> None:
    frame = Failed(error="x" * 300)  # payload > 255 bytes, so byte order matters
    data = encode_frame(frame)
    payload = msgspec.msgpack.encode(frame)
    assert data[4:] == payload
    assert data[:4] == struct.pack(">I", len(payload))
    assert data[:2] == b"\x00\x00"
    assert data[2] == len(payload) >> 8


# --------------------------------------------------------------------------- reading frames through FrameChannel
#
# FrameChannel.receive is the only decode path production has, so the framing tests feed their bytes
# through a real FrameChannel. _ChunkStream stands in for the socket only: it hands out exactly the
# chunks a test chose (never more than the reader asks for, as a socket does), then ends the stream.


class _ChunkStream(anyio.abc.ByteStream):
    """The receiving end of a connection that delivers ``chunks`` and then EOF (or, with
    ``then_block``, stays open and silent)."""

    def __init__(self, chunks: Iterable[bytes], *, then_block: bool = False) -> None:
        self._chunks = deque(chunk for chunk in chunks if chunk)  # a socket never delivers b"" before EOF
        self._then_block = then_block

    async def receive(self, max_bytes: int = 65536) -> bytes:
        await anyio.lowlevel.checkpoint()
        if not self._chunks:
            if self._then_block:
                await anyio.sleep_forever()
            raise anyio.EndOfStream
        chunk = self._chunks.popleft()
        if len(chunk) > max_bytes:
            self._chunks.appendleft(chunk[max_bytes:])
            chunk = chunk[:max_bytes]
        return chunk

    async def send(self, item: bytes) -> None:
        raise anyio.BrokenResourceError  # a receive-only double

    async def send_eof(self) -> None:
        pass

    async def aclose(self) -> None:
        self._chunks.clear()


async def _receive_all(channel: FrameChannel) -> tuple[list[Any], str]:
    """Every frame the channel returns, then how reading ended: "eof" (None) or "error" (ProtocolError)."""
    frames: list[Any] = []
    while True:
        try:
            frame = await channel.receive()
        except ProtocolError:
            return frames, "error"
        if frame is None:
            return frames, "eof"
        assert isinstance(frame, FRAME_TYPES)
        frames.append(frame)


def _read(chunks: Iterable[bytes]) -> tuple[list[Any], str]:
    async def main() -> tuple[list[Any], str]:
        with anyio.fail_after(10):  # the double never blocks, so reading can only end, never hang
            return await _receive_all(FrameChannel(_ChunkStream(chunks)))

    return anyio.run(main)


def _stream() -> bytes:
    return b"".join(encode_frame(s) for s in STREAMED)


def test_channel_reads_a_stream_split_at_every_byte_boundary() -> None:
    """Every frame kind, cut in two at every byte of it (its header included) and at both of its
    edges, between the frames before and after it: what the channel buffers at a cut is part of
    one frame and the whole of the ones before it, so the frames around it stand for the rest
    of a stream (and a cut costs three decodes, not one per frame of every sample)."""
    frames = [encode_frame(s) for s in STREAMED]

    async def main() -> None:
        for i, frame in enumerate(frames):
            around = STREAMED[max(0, i - 1) : i + 2]
            before = frames[i - 1] if i > 0 else b""
            stream = before + frame + (frames[i + 1] if i + 1 < len(frames) else b"")
            for cut in range(len(before), len(before) + len(frame) + 1):
                channel = FrameChannel(_ChunkStream([stream[:cut], stream[cut:]]))
                assert await _receive_all(channel) == (around, "eof"), f"{type(STREAMED[i]).__name__} cut at byte {cut}"

    anyio.run(main)


def test_channel_reads_a_stream_byte_by_byte() -> None:
    stream = _stream()
    assert _read(stream[i : i + 1] for i in range(len(stream))) == (STREAMED, "eof")


def test_channel_returns_each_frame_of_one_chunk() -> None:
    chunk = encode_frame(Ping(seq=1)) + encode_frame(Pong(seq=1)) + encode_frame(Ping(seq=2))
    assert _read([chunk]) == ([Ping(seq=1), Pong(seq=1), Ping(seq=2)], "eof")


def test_channel_completes_a_frame_from_the_next_chunk_and_eof_inside_one_is_an_error() -> None:
    first = len(encode_frame(Ping(seq=9)))
    data = encode_frame(Ping(seq=9)) + encode_frame(Pong(seq=9))
    assert _read([data[: first + 3], data[first + 3 :]]) == ([Ping(seq=9), Pong(seq=9)], "eof")
    assert _read([data[: first + 3]]) == ([Ping(seq=9)], "error")  # the stream ended 3 bytes into Pong's header
    assert _read([data[: first + 5]]) == ([Ping(seq=9)], "error")  # ... and inside its payload


def test_oversize_length_is_rejected_from_the_header_alone() -> None:
    async def main() -> None:
        channel = FrameChannel(_ChunkStream([struct.pack(">I", MAX_FRAME_BYTES + 1)], then_block=True))
        with anyio.fail_after(10), pytest.raises(ProtocolError, match="exceeds"):
            await channel.receive()  # the stream stays open: the error cannot come from waiting for bytes

    anyio.run(main)


def test_length_at_the_cap_waits_for_the_payload() -> None:
    async def main() -> None:
        channel = FrameChannel(_ChunkStream([struct.pack(">I", MAX_FRAME_BYTES)], then_block=True))
        with anyio.move_on_after(0.2) as scope:
            await channel.receive()
        assert scope.cancelled_caught  # still waiting for the payload, no error

    anyio.run(main)


def test_garbage_payload_is_a_protocol_error() -> None:
    assert _read([struct.pack(">I", 3) + b"\xc1\xc1\xc1"]) == ([], "error")


def test_zero_length_frame_is_a_protocol_error() -> None:
    assert _read([struct.pack(">I", 0)]) == ([], "error")


def _event_with_blob(size: int) -> Event:
    return Event(session="s", name="delta", data={"blob": "x" * size})


def test_encode_rejects_an_oversize_payload_and_accepts_one_at_the_cap() -> None:
    probe = 70_000  # same msgpack str32 header as a 16 MiB string
    overhead = len(msgspec.msgpack.encode(_event_with_blob(probe))) - probe
    at_cap = _event_with_blob(MAX_FRAME_BYTES - overhead)
    data = encode_frame(at_cap)
    assert len(data) == 4 + MAX_FRAME_BYTES
    with pytest.raises(ProtocolError):
        encode_frame(_event_with_blob(MAX_FRAME_BYTES - overhead + 1))


# --------------------------------------------------------------------------- fuzzing

_FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def _prefixed(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


@st.composite
def _inputs(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["raw", "prefixed", "mutated", "truncated"]))
    if kind == "raw":
        return draw(st.binary(max_size=512))
    if kind == "prefixed":
        return _prefixed(draw(st.binary(max_size=512)))
    frame = encode_frame(draw(st.sampled_from(STREAMED)))
    if kind == "truncated":
        return frame[: draw(st.integers(0, len(frame)))]
    out = bytearray(frame)
    for _ in range(draw(st.integers(1, 8))):
        out[draw(st.integers(0, len(out) - 1))] = draw(st.integers(0, 255))
    return bytes(out)


def _split(blob: bytes, cuts: list[int]) -> list[bytes]:
    return [blob[a:b] for a, b in itertools.pairwise([0, *sorted(cuts), len(blob)])]


def _comparable(outcome: tuple[list[Any], str]) -> tuple[list[bytes], str]:
    # Frames compare by their encoding: a mutated float may decode to NaN, which is not equal to itself.
    frames, end = outcome
    return [encode_frame(frame) for frame in frames], end


def _expected(blob: bytes) -> tuple[list[bytes], str]:
    """What the framing rules say ``blob`` holds, worked out on the whole blob at once: the frames
    before the first bad spot, then "eof" if the blob ends exactly after a frame, else "error"."""
    frames: list[bytes] = []
    pos = 0
    while pos < len(blob):
        if len(blob) - pos < 4:
            return frames, "error"  # the stream ended inside a header
        (length,) = struct.unpack_from(">I", blob, pos)
        payload = blob[pos + 4 : pos + 4 + length]
        if length > MAX_FRAME_BYTES or len(payload) < length:
            return frames, "error"  # over the cap, or the stream ended inside the payload
        try:
            frames.append(encode_frame(decode_payload(payload)))
        except ProtocolError:
            return frames, "error"
        pos += 4 + length
    return frames, "eof"


@_FUZZ
@given(_inputs())
def test_fuzz_one_chunk_yields_its_frames_then_eof_or_protocol_error(data: bytes) -> None:
    # _receive_all asserts that each result is a frame; any exception but ProtocolError fails the test.
    assert _comparable(_read([data])) == _expected(data)


@_FUZZ
@given(st.data())
def test_fuzz_random_splits_yield_what_the_whole_blob_holds(data: st.DataObject) -> None:
    blob = data.draw(_inputs()) + data.draw(_inputs())
    cuts = data.draw(st.lists(st.integers(0, len(blob)), max_size=6))
    assert _comparable(_read(_split(blob, cuts))) == _expected(blob)


@_FUZZ
@given(st.lists(st.sampled_from(STREAMED), max_size=6), st.lists(st.integers(0, 10**6), max_size=8))
def test_valid_frames_in_any_split_come_back_exactly_then_eof(frames: list[Any], cuts: list[int]) -> None:
    blob = b"".join(encode_frame(frame) for frame in frames)
    assert _read(_split(blob, [c % (len(blob) + 1) for c in cuts])) == (frames, "eof")


# --------------------------------------------------------------------------- FrameChannel over a socket pair


@pytest.fixture
def socket_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


async def _streams(pair: tuple[socket.socket, socket.socket]) -> tuple[anyio.abc.SocketStream, anyio.abc.SocketStream]:
    a, b = pair
    return await anyio.abc.SocketStream.from_socket(a), await anyio.abc.SocketStream.from_socket(b)


@pytest.mark.anyio
async def test_channel_sends_frames_both_ways(socket_pair: tuple[socket.socket, socket.socket]) -> None:
    left_stream, right_stream = await _streams(socket_pair)
    supervisor, child = FrameChannel(left_stream), FrameChannel(right_stream)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:

            async def send_all(channel: FrameChannel, frames: list[Any]) -> None:
                for frame in frames:
                    await channel.send(frame)

            tg.start_soon(send_all, supervisor, STREAMED)
            tg.start_soon(send_all, child, list(reversed(STREAMED)))
            at_child = [await child.receive() for _ in STREAMED]
            at_supervisor = [await supervisor.receive() for _ in STREAMED]
    assert at_child == STREAMED
    assert at_supervisor == list(reversed(STREAMED))
    await supervisor.aclose()
    assert await child.receive() is None
    await child.aclose()


@pytest.mark.anyio
async def test_channel_clean_eof_returns_none(socket_pair: tuple[socket.socket, socket.socket]) -> None:
    left_stream, right_stream = await _streams(socket_pair)
    sender, receiver = FrameChannel(left_stream), FrameChannel(right_stream)
    await sender.send(Ping(seq=1))
    await left_stream.send_eof()
    with anyio.fail_after(10):
        assert await receiver.receive() == Ping(seq=1)
        assert await receiver.receive() is None
    await sender.aclose()
    await receiver.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("cut", [2, 4, 7], ids=["inside-header", "after-header", "inside-payload"])
async def test_channel_eof_mid_frame_is_a_protocol_error(
    socket_pair: tuple[socket.socket, socket.socket], cut: int
) -> None:
    left_stream, right_stream = await _streams(socket_pair)
    receiver = FrameChannel(right_stream)
    data = encode_frame(Failed(error="a frame long enough to be cut"))
    assert len(data) > cut
    await left_stream.send(data[:cut])
    await left_stream.aclose()
    with anyio.fail_after(10), pytest.raises(ProtocolError):
        await receiver.receive()
    await receiver.aclose()


@pytest.mark.anyio
async def test_channel_garbage_payload_is_a_protocol_error(socket_pair: tuple[socket.socket, socket.socket]) -> None:
    left_stream, right_stream = await _streams(socket_pair)
    receiver = FrameChannel(right_stream)
    await left_stream.send(_prefixed(b"\x93\x01\x02\x03"))  # a msgpack array, not a frame
    with anyio.fail_after(10), pytest.raises(ProtocolError):
        await receiver.receive()
    await left_stream.aclose()
    await receiver.aclose()


@pytest.mark.anyio
async def test_channel_oversize_header_fails_before_the_payload(
    socket_pair: tuple[socket.socket, socket.socket],
) -> None:
    """Only the header is sent and the stream stays open: the error cannot come from waiting for bytes."""
    left_stream, right_stream = await _streams(socket_pair)
    receiver = FrameChannel(right_stream)
    await left_stream.send(struct.pack(">I", MAX_FRAME_BYTES + 1))
    with anyio.fail_after(10), pytest.raises(ProtocolError, match="exceeds"):
        await receiver.receive()
    await left_stream.aclose()
    await receiver.aclose()


# --------------------------------------------------------------------------- frames in parts


async def _over_socketpair(frames: list[Frame]) -> list[Frame | None]:
    """Send ``frames`` through a real FrameChannel on a unix socketpair and read them back."""
    import socket

    from anyio.abc import SocketStream

    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender = FrameChannel(await SocketStream.from_socket(left))
    receiver = FrameChannel(await SocketStream.from_socket(right))
    got: list[Frame | None] = []
    async with anyio.create_task_group() as tg:

        async def send_all() -> None:
            for frame in frames:
                await sender.send(frame)
            await sender.aclose()

        tg.start_soon(send_all)
        while (frame := await receiver.receive()) is not None:
            got.append(frame)
    await receiver.aclose()
    return got


@pytest.mark.anyio
async def test_a_frame_larger_than_the_cap_travels_in_parts_and_arrives_whole() -> None:
    big = "x" * (MAX_FRAME_BYTES + 5_000_000)  # a conversation that grew past one frame
    opened = Open(session="s", assistant="a", transcript=[UserMessage(content=big), UserMessage(content="end")])
    assert len(encode_frames(opened)) == 2
    frames = await _over_socketpair([Ping(seq=1), opened, Ping(seq=2)])
    assert frames == [Ping(seq=1), opened, Ping(seq=2)]


def test_only_an_oversize_payload_is_split() -> None:
    assert encode_frames(Ping(seq=1)) == [encode_frame(Ping(seq=1))]


@pytest.mark.anyio
async def test_a_part_cut_off_by_another_frame_is_a_protocol_error() -> None:
    stream = encode_frame(Part(data=b"half", last=False)) + encode_frame(Ping(seq=1))
    channel = FrameChannel(_ChunkStream([stream]))
    with pytest.raises(ProtocolError, match="cut off"):
        await channel.receive()
