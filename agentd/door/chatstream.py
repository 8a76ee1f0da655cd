"""A streamed chat completion (RFC 0010 §7): the turn's text as ``chat.completion.chunk``s.

The first chunk says ``role: "assistant"``; then the content of every step as it streams, a
blank line (``"\\n\\n"``) before a step's text when text went out before — so the chunks join to
exactly the non-streamed ``content`` (the assistant's texts joined by a blank line); text the
stream did not carry (a transfer's opener does not stream) follows once the turn ended. Then a
chunk with ``finish_reason``, a chunk with ``usage`` and no ``choices`` when
``stream_options.include_usage``, and ``data: [DONE]``. A turn that ended without an answer, one
that waits for approvals (``approval_required``, RFC 0010 §8), or text that must be taken back
(``stream_reset``), ends the stream with ``data: {"error": …}``, which the SDK raises as ``APIError``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Literal

from agentd.budget import TurnStatus
from agentd.door.errors import type_of
from agentd.door.follow import Rerun, TakenBack, Text
from agentd.door.outcome import CHAT_PREFIX, chat_completion
from agentd.door.parked import Parked, approval_required, waiting
from agentd.door.shapes import ChatChunk, ChatUsage, ChunkChoice, ChunkDelta, DoorError, StreamErrorBody
from agentd.door.stream import KEEP_ALIVE, Ended, Followed, followed, sse
from agentd.errors import ServiceError
from agentd.service import Service

__all__ = ["DONE", "STREAM_EVENTS", "STREAM_RESET", "chat_stream", "reset_error"]

DONE = b"data: [DONE]\n\n"
#: What a streamed chat completion sends (data-only events: the chunks, an error, the end mark).
STREAM_EVENTS = ("chat.completion.chunk", "error", "[DONE]")
#: The code of the error that ends a stream whose text the turn took back.
STREAM_RESET = "stream_reset"
SEPARATOR = "\n\n"


def reset_error(why: str, *, ended: bool = False) -> DoorError:
    """The ``stream_reset`` error: what was sent is not the answer; the turn goes on (``ended``:
    it has ended, and its stored answer differs from what was sent)."""
    going = "the turn ended" if ended else "the turn goes on"
    return DoorError(
        message=f"the answer streamed so far is taken back: {why}; {going} — ask for its result"
        " (GET /v1/responses/resp_<turn id>, or the session)",
        type="server_error",
        code=STREAM_RESET,
    )


async def chat_stream(service: Service, turn: Followed, *, model: str, include_usage: bool) -> AsyncIterator[bytes]:
    """The SSE body of a streamed chat completion of ``turn``."""

    def chunk(delta: ChunkDelta, finish: Literal["stop", "length"] | None = None, *, asked: str = model) -> bytes:
        choice = ChunkChoice(delta=delta, finish_reason=finish)
        return sse(ChatChunk(id=CHAT_PREFIX + turn.turn, created=turn.created, model=asked, choices=[choice]))

    yield chunk(ChunkDelta(role="assistant", content=""))
    sent = ""
    texted: set[int] = set()
    async for happening in followed(service, turn, shows_tools=False):
        if happening is None:
            yield KEEP_ALIVE
        elif isinstance(happening, Text):
            piece = happening.text
            if happening.step not in texted:
                texted.add(happening.step)
                piece = (SEPARATOR if sent else "") + piece
            sent += piece
            yield chunk(ChunkDelta(content=piece))
        elif isinstance(happening, Rerun):
            texted.clear()  # nothing of the run before went out
        elif isinstance(happening, TakenBack):
            yield sse(StreamErrorBody(error=reset_error(happening.reason)))
            return
        elif isinstance(happening, Ended):
            async for tail in _ending(happening, turn.speaker, sent, chunk, model, include_usage):
                yield tail
            return
        elif isinstance(happening, Parked):  # a chat completion cannot show the approvals it waits for
            error = approval_required(turn.turn, waiting(happening.parked))
            yield sse(StreamErrorBody(error=DoorError(message=error.message, type=type_of(error), code=error.code)))
            return


def removed_by_transfer(ended: Ended, speaker: str) -> bool:
    """The turn transferred and kept nothing its streaming assistant said (``delete-history``,
    RFC 0004 §3): the text the stream sent was said, and is not in the stored answer."""
    said = any(e.role == "assistant" and e.assistant == speaker for e in ended.entries)
    return ended.turn.status == TurnStatus.TRANSFERRED and bool(speaker) and not said


async def _ending(
    ended: Ended, speaker: str, sent: str, chunk: Callable[..., bytes], model: str, include_usage: bool
) -> AsyncIterator[bytes]:
    """The end of the stream: the text it did not carry, ``finish_reason``, ``usage``, ``[DONE]``.
    Text a transfer removed from the answer (``removed_by_transfer``) stays as sent: the answer
    follows it, after a blank line, as a later step's text does (RFC 0010 §9)."""
    try:
        completion = chat_completion(ended.turn, ended.entries, model=model)
    except ServiceError as exc:  # the turn gave no answer (cancelled, failed): its error, as non-streamed
        yield sse(StreamErrorBody(error=DoorError(message=exc.message, type=type_of(exc), code=exc.code)))
        return
    answer = completion.choices[0].message.content or ""
    if sent and not answer.startswith(sent) and removed_by_transfer(ended, speaker):
        answer = sent + (SEPARATOR + answer if answer else "")
    if not answer.startswith(sent):
        yield sse(StreamErrorBody(error=reset_error("the turn's answer is not the text streamed", ended=True)))
        return
    if answer[len(sent) :]:
        yield chunk(ChunkDelta(content=answer[len(sent) :]))
    yield chunk(ChunkDelta(), completion.choices[0].finish_reason, asked=completion.model)
    if include_usage:
        usage = ChatUsage(
            prompt_tokens=completion.usage.prompt_tokens,
            completion_tokens=completion.usage.completion_tokens,
            total_tokens=completion.usage.total_tokens,
        )
        yield sse(
            ChatChunk(id=completion.id, created=completion.created, model=completion.model, choices=[], usage=usage)
        )
    yield DONE
