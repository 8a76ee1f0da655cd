"""The control protocol between supervisor and child: the one definition of every frame.

Framing: a u32 big-endian payload length, then the payload — one msgpack-encoded frame. Frames
are msgspec Structs tagged by ``type``. The length is checked against ``MAX_FRAME_BYTES`` before
anything is allocated for the payload; an oversize or undecodable frame raises ``ProtocolError``.

Direction: ``→`` supervisor to child, ``←`` child to supervisor. See RFC 0001.
"""

from __future__ import annotations

import enum
import struct
from typing import Any

import anyio
import msgspec
from anyio.abc import ByteStream
from anyio.streams.buffered import BufferedByteReceiveStream

from agentd.approvals import ApprovalRequest, Decision, ParkedRun
from agentd.config import Config, Intelligence, Limits, SwapPolicy
from agentd.messages import Message, UserMessage
from agentd.records import Discarded, JournalEntry, TurnRecord

__all__ = [
    "MAX_FRAME_BYTES",
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "AppliedSwap",
    "Cancel",
    "Close",
    "Event",
    "Failed",
    "Frame",
    "FrameChannel",
    "Input",
    "JournalAck",
    "JournalFinish",
    "JournalStart",
    "Open",
    "Part",
    "Ping",
    "Pong",
    "ProtocolError",
    "Ready",
    "Shutdown",
    "Spawn",
    "SwapAck",
    "SwapApplied",
    "SwapIntel",
    "SwapKind",
    "SwapPolicy",
    "SwapsApplied",
    "TurnDiscarded",
    "TurnDone",
    "TurnParked",
    "Watch",
    "decode_payload",
    "encode_frame",
    "encode_frames",
]

PROTOCOL_VERSION = 6
MAX_FRAME_BYTES = 16 * 1024 * 1024
#: The most one logical frame may hold once its parts are joined (a long conversation's ``Open``).
MAX_MESSAGE_BYTES = 1024 * 1024 * 1024
# Room for a Part's own msgpack keys around its data.
_PART_OVERHEAD = 64
_HEADER = struct.Struct(">I")


class ProtocolError(Exception):
    """A frame that cannot be read: oversize, truncated, or not a valid frame."""


class SwapKind(enum.StrEnum):
    """``model``: the model (or provider) changed. ``repoint``: only endpoints/options changed."""

    MODEL = "model"
    REPOINT = "repoint"


class _Frame(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", omit_defaults=True):
    pass


# --------------------------------------------------------------------------- lifecycle


class ChildEnv(msgspec.Struct, frozen=True, kw_only=True):
    """Environment variables handed to a running child. Values may be secrets: the repr shows names only."""

    values: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"ChildEnv(names={sorted(self.values)!r})"


class Spawn(_Frame, frozen=True, tag="spawn", kw_only=True):
    """→ First frame to a new child: who it is and the config generation it starts on."""

    child_id: str
    # A default factory makes msgspec always write the field (omit_defaults would drop a plain default).
    protocol_version: int = msgspec.field(default_factory=lambda: PROTOCOL_VERSION)
    generation: int
    policy: SwapPolicy
    config: Config
    # The values of the env vars the config names for its MCP servers (``env_from``,
    # ``headers_from``; RFC 0008 §3): the child reads secrets from here, not from its own
    # environment, so they reach it whatever environment it was started with, and after a reload.
    secrets: ChildEnv | None = None
    # The supervisor's ``OTEL_*`` variables when tracing is on (RFC 0011 §4): the child builds its
    # exporter from them without putting them in its environment (headers may hold credentials).
    telemetry: ChildEnv | None = None


class Ready(_Frame, frozen=True, tag="ready", kw_only=True):
    """← The child accepted Spawn and reads control frames."""

    child_id: str
    pid: int
    # A default factory makes msgspec always write the field (omit_defaults would drop a plain default).
    protocol_version: int = msgspec.field(default_factory=lambda: PROTOCOL_VERSION)


class Ping(_Frame, frozen=True, tag="ping", kw_only=True):
    """→ Liveness probe; answered by Pong with the same ``seq`` even while a model call runs."""

    seq: int


class Pong(_Frame, frozen=True, tag="pong", kw_only=True):
    """← Answer to Ping."""

    seq: int


class Shutdown(_Frame, frozen=True, tag="shutdown", kw_only=True):
    """→ Start nothing new; let running turns end within ``grace`` seconds; then exit 0."""

    grace: float


class Failed(_Frame, frozen=True, tag="failed", kw_only=True):
    """← Something the child could not do. ``session`` unset = the child itself is failing."""

    error: str
    session: str | None = None
    turn: str | None = None


# --------------------------------------------------------------------------- sessions and turns


class Open(_Frame, frozen=True, tag="open", kw_only=True):
    """→ Host a session in this child, restored from its committed transcript."""

    session: str
    assistant: str
    transcript: list[Message] = []


class Close(_Frame, frozen=True, tag="close", kw_only=True):
    """→ Stop hosting a session (unloaded or closed); its in-flight turn, if any, is cancelled."""

    session: str


class Input(_Frame, frozen=True, tag="input", kw_only=True):
    """→ Run one turn. ``message`` unset = an opener turn (the assistant speaks first)."""

    session: str
    turn: str
    message: UserMessage | None = None
    # Epoch seconds the supervisor accepted the turn. The deadline counts from here across every
    # re-run on another child (RFC 0006 §6); unset = from now.
    started_at: float | None = None
    # Whether anyone watches the session's events. Unwatched, the child sends only the events the
    # supervisor itself needs (intel.waiting/recovered); a Watch frame turns them on mid-turn.
    watched: bool = True
    # Which run of the turn this is (RFC 0005 §7): 0 first, +1 for every earlier run (a child that
    # died, a restart-turn re-run). Deltas and step events carry it so clients drop a void run's text.
    run: int = 0
    # What earlier runs of this turn journaled (RFC 0008 §5): reused, never run again.
    journal: list[JournalEntry] = []
    # The W3C trace context (``traceparent``, ``tracestate``) the turn's spans are children of,
    # when tracing is on (RFC 0011 §4): the child's model and tool spans join the request's trace.
    trace: dict[str, str] = {}
    # Whether the turn resumed from the store (a daemon restart or a failover) rather than being
    # accepted here (a span event; ``run`` above is ``agentd.turn.run``).
    resumed: bool = False
    # A run that stopped for approvals goes on from where it stopped, with what was decided for
    # the calls it waited on (RFC 0012 §3). Unset: the turn runs from its start.
    resume: ParkedRun | None = None
    decisions: list[Decision] = []


class Watch(_Frame, tag="watch", frozen=True, kw_only=True):
    """→ Someone subscribed to (or left) the session's events: stream its progress events, or stop."""

    session: str
    watched: bool = True


class Cancel(_Frame, frozen=True, tag="cancel", kw_only=True):
    """→ Cancel the session's in-flight turn (``turn`` unset = whatever turn is running)."""

    session: str
    turn: str | None = None


class Event(_Frame, frozen=True, tag="event", kw_only=True):
    """← A progress event for streaming (names in agentd.events)."""

    session: str
    name: str
    turn: str | None = None
    data: dict[str, Any] = {}


class TurnDiscarded(_Frame, frozen=True, tag="turn_discarded", kw_only=True):
    """← A turn attempt was discarded (restart-turn); the turn re-runs on the new model."""

    session: str
    turn: str
    attempt: Discarded


class TurnDone(_Frame, frozen=True, tag="turn_done", kw_only=True):
    """← A turn ended: its record (``record.id`` is the turn), and the session it leaves behind.

    ``messages`` are what the turn appended (the input message excluded); ``assistant`` is the one
    the session is on afterwards (a transfer changes it).
    """

    session: str
    assistant: str
    record: TurnRecord
    messages: list[Message] = []
    # Set when the turn rewrote history (a transfer): the session's whole new transcript.
    transcript: list[Message] | None = None


class TurnParked(_Frame, frozen=True, tag="turn_parked", kw_only=True):
    """← The turn's run stopped at a step boundary: ``requests`` are calls of its last step that
    wait for a human's approval (RFC 0012 §3). The turn has not ended; the session is idle here."""

    session: str
    turn: str
    run: ParkedRun
    requests: list[ApprovalRequest]


# --------------------------------------------------------------------------- the tool journal


class JournalStart(_Frame, frozen=True, tag="journal_start", kw_only=True):
    """← A side-effecting tool call is about to run: journal it. The tool runs only after the ack."""

    session: str
    turn: str
    entry: JournalEntry


class JournalFinish(_Frame, frozen=True, tag="journal_finish", kw_only=True):
    """← The call journaled as ``entry.seq`` returned: journal its result before the turn goes on."""

    session: str
    turn: str
    entry: JournalEntry


class JournalAck(_Frame, frozen=True, tag="journal_ack", kw_only=True):
    """→ A JournalStart or JournalFinish is durable (``error`` unset), or could not be written."""

    session: str
    turn: str
    seq: int
    finished: bool = False  # which of the two it answers
    error: str | None = None


# --------------------------------------------------------------------------- swaps


class SwapIntel(_Frame, frozen=True, tag="swap_intel", kw_only=True):
    """→ A reload changed intelligence. Carries every assistant's effective intelligence."""

    generation: int
    policy: SwapPolicy
    intelligence: dict[str, Intelligence]
    limits: Limits = Limits()
    # The whole config of the generation (prompts, tools, transfers): a pooled child lives across
    # reloads, so each session takes it at its next turn. Unset = only intelligence and limits changed.
    config: Config | None = None
    # Environment variables the generation names (api_key_env, pass_env) for children started earlier.
    env: ChildEnv | None = None
    # As Spawn.secrets, for ``config``.
    secrets: ChildEnv | None = None


class SwapAck(_Frame, frozen=True, tag="swap_ack", kw_only=True):
    """← SwapIntel received and parked (sent at once, before it is applied)."""

    generation: int


class SwapApplied(_Frame, frozen=True, tag="swap_applied", kw_only=True):
    """← A session adopted a parked swap at a turn boundary."""

    session: str
    generation: int
    kind: SwapKind
    model_from: str
    model_to: str
    policy: SwapPolicy
    turn: str | None = None


class AppliedSwap(msgspec.Struct, frozen=True, kw_only=True):
    """One assistant's swap and the idle sessions on it that took it, inside ``SwapsApplied``."""

    assistant: str
    kind: SwapKind
    model_from: str
    model_to: str
    sessions: tuple[str, ...]


class SwapsApplied(_Frame, frozen=True, tag="swaps_applied", kw_only=True):
    """← The idle sessions that swapped at once on a SwapIntel, per assistant: one frame per child per reload."""

    generation: int
    policy: SwapPolicy
    applied: tuple[AppliedSwap, ...]


class Part(_Frame, tag="part", frozen=True, kw_only=True):
    """↔ One piece of a frame whose payload exceeds ``MAX_FRAME_BYTES``; ``last`` ends it.

    The sender writes all parts of a frame back to back (under its send lock), so a receiver joins
    consecutive parts and decodes the payload they form as one frame.
    """

    data: bytes
    last: bool = False


Frame = (
    Spawn
    | Ready
    | Ping
    | Pong
    | Shutdown
    | Failed
    | Open
    | Close
    | Input
    | Cancel
    | Watch
    | Event
    | TurnDiscarded
    | TurnDone
    | TurnParked
    | SwapIntel
    | SwapAck
    | SwapApplied
    | SwapsApplied
    | JournalStart
    | JournalFinish
    | JournalAck
    | Part
)

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Frame] = msgspec.msgpack.Decoder(Frame)


def encode_frame(frame: Frame) -> bytes:
    """Length prefix + msgpack payload. Raises ProtocolError when the payload exceeds the cap."""
    payload = _encoder.encode(frame)
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame {type(frame).__name__} is {len(payload)} bytes; the cap is {MAX_FRAME_BYTES}")
    return _HEADER.pack(len(payload)) + payload


def encode_frames(frame: Frame) -> list[bytes]:
    """``frame`` framed for the wire: one frame, or ``Part`` frames when its payload exceeds the cap.

    ProtocolError when even the parts would exceed ``MAX_MESSAGE_BYTES``.
    """
    payload = _encoder.encode(frame)
    if len(payload) <= MAX_FRAME_BYTES:
        return [_HEADER.pack(len(payload)) + payload]
    if len(payload) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"frame {type(frame).__name__} is {len(payload)} bytes; the cap is {MAX_MESSAGE_BYTES}")
    step = MAX_FRAME_BYTES - _PART_OVERHEAD
    view = memoryview(payload)
    return [
        encode_frame(Part(data=bytes(view[i : i + step]), last=i + step >= len(payload)))
        for i in range(0, len(payload), step)
    ]


def decode_payload(payload: bytes) -> Frame:
    """One payload (without its length prefix) → a frame, or ProtocolError."""
    try:
        return _decoder.decode(payload)
    except (msgspec.MsgspecError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"undecodable frame: {exc}") from None


def _check_length(length: int) -> None:
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame length {length} exceeds the cap of {MAX_FRAME_BYTES} bytes")


class FrameChannel:
    """Frames over a byte stream (a unix socket on a dedicated fd). Sends are serialized.

    ``receive`` is the one decode path: it reads the header, checks the length against the cap
    before reading (or allocating) any payload, then decodes exactly that many bytes.
    """

    def __init__(self, stream: ByteStream) -> None:
        self._stream = stream
        self._receiver = BufferedByteReceiveStream(stream)
        self._send_lock = anyio.Lock()

    async def send(self, frame: Frame) -> None:
        """Send one frame; a payload beyond ``MAX_FRAME_BYTES`` goes as consecutive ``Part`` frames."""
        chunks = encode_frames(frame)
        async with self._send_lock:
            for chunk in chunks:
                await self._stream.send(chunk)

    async def receive(self) -> Frame | None:
        """The next frame (parts joined); None at a clean end of stream. ProtocolError when truncated or invalid."""
        frame = await self._receive_one()
        if not isinstance(frame, Part):
            return frame
        parts, size = [frame.data], len(frame.data)
        while not frame.last:
            frame = await self._receive_one()
            if not isinstance(frame, Part):
                raise ProtocolError("a frame in parts was cut off by another frame or the end of the stream")
            size += len(frame.data)
            if size > MAX_MESSAGE_BYTES:
                raise ProtocolError(f"a frame in parts exceeds the cap of {MAX_MESSAGE_BYTES} bytes")
            parts.append(frame.data)
        joined = decode_payload(b"".join(parts))
        if isinstance(joined, Part):
            raise ProtocolError("a frame in parts holds another part")
        return joined

    async def _receive_one(self) -> Frame | None:
        try:
            header = await self._receiver.receive_exactly(_HEADER.size)
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, anyio.ClosedResourceError):
            if self._receiver.buffer:
                raise ProtocolError("stream ended inside a frame header") from None
            return None
        (length,) = _HEADER.unpack(header)
        _check_length(length)
        try:
            payload = await self._receiver.receive_exactly(length) if length else b""
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
            raise ProtocolError(f"stream ended inside a {length}-byte frame") from None
        return decode_payload(payload)

    async def aclose(self) -> None:
        await self._stream.aclose()
