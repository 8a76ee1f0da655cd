"""A streamed Response (RFC 0010 §7): the turn as Responses stream events.

``response.created``, ``response.in_progress``; then, in the order the turn makes them, a
``message`` item per step with text (``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``…, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``) and an ``mcp_call`` item per tool
agentd runs (added when it starts, done with its result); items the stream did not carry (a
transfer's opener) follow once the turn ended; last ``response.completed`` (or
``response.incomplete``, or ``response.failed`` for a failed or cancelled turn) with the
Response as ``GET /v1/responses/{id}`` shows it. A turn that parks for approvals ends the stream
with an ``mcp_approval_request`` item per call that waits and ``response.completed`` (RFC 0010 §8). Items carry the ids of that Response's
items. Every event has ``sequence_number`` (0, 1, 2, … per stream). Output that must be taken
back ends the stream with an ``error`` event, code ``stream_reset``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec

from agentd.budget import TurnStatus
from agentd.door.chatstream import reset_error
from agentd.door.follow import Rerun, StepEnded, TakenBack, Text, ToolEnded, ToolStarted
from agentd.door.outcome import call_id, message_id, response_id, response_object, server_label
from agentd.door.parked import Parked, parked_response
from agentd.door.shapes import Item, McpCall, OutputMessage, OutputText, ResponseConversation, ResponseObject
from agentd.door.stream import KEEP_ALIVE, Ended, Followed, followed, sse
from agentd.service import Service

__all__ = ["STREAM_EVENTS", "TERMINAL", "ItemWriter", "Numbered", "response_stream", "stream_end"]

#: Every event a streamed Response sends (its OpenAPI document lists them).
STREAM_EVENTS = (
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
    "response.incomplete",
    "response.failed",
    "error",
)
#: The event that ends a stream, by the Response's status.
TERMINAL = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
    "cancelled": "response.failed",
}


class _Shown(msgspec.Struct, kw_only=True):
    """An output item the stream showed: its index, id, and (a message) the text sent, open until done."""

    index: int
    id: str
    text: str = ""
    open: bool = True


class Numbered:
    """Numbers the events of one stream (``sequence_number``)."""

    def __init__(self) -> None:
        self.number = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, **fields, "sequence_number": self.number}
        self.number += 1
        return sse(event, event=kind)


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


class ItemWriter:
    """The events of one stream's output items."""

    def __init__(self, emit: Numbered) -> None:
        self.emit = emit
        self.items: dict[str, _Shown] = {}  # item id -> what was shown

    def open_message(self, item_id: str) -> list[bytes]:
        shown = self.items[item_id] = _Shown(index=len(self.items), id=item_id)
        item = OutputMessage(id=item_id, role="assistant", status="in_progress", content=[])
        where = {"item_id": item_id, "output_index": shown.index, "content_index": 0}
        return [
            self.emit("response.output_item.added", output_index=shown.index, item=item),
            self.emit("response.content_part.added", **where, part=_text_part("")),
        ]

    def text(self, item_id: str, delta: str) -> bytes:
        shown = self.items[item_id]
        shown.text += delta
        where = {"item_id": item_id, "output_index": shown.index, "content_index": 0}
        return self.emit("response.output_text.delta", **where, delta=delta, logprobs=[])

    def close_message(self, item_id: str, text: str) -> list[bytes]:
        shown = self.items[item_id]
        shown.open = False
        where = {"item_id": item_id, "output_index": shown.index, "content_index": 0}
        item = OutputMessage(id=item_id, role="assistant", content=[OutputText(text=text)])
        return [
            self.emit("response.output_text.done", **where, text=text, logprobs=[]),
            self.emit("response.content_part.done", **where, part=_text_part(text)),
            self.emit("response.output_item.done", output_index=shown.index, item=item),
        ]

    def tool(self, item: Item, *, done: bool) -> bytes:
        if not done:
            self.items[item.id] = _Shown(index=len(self.items), id=item.id)
        shown = self.items[item.id]
        shown.open = not done
        kind = "response.output_item.done" if done else "response.output_item.added"
        return self.emit(kind, output_index=shown.index, item=item)


async def response_stream(
    service: Service,
    turn: Followed,
    *,
    model: str,
    previous: str | None,
    metadata: dict[str, str] | None,
) -> AsyncIterator[bytes]:
    """The SSE body of a streamed Response of ``turn``."""
    emit = Numbered()
    writer = ItemWriter(emit)
    start = ResponseObject(
        id=response_id(turn.turn),
        created_at=turn.created,
        status="in_progress",
        model=model,
        output=[],
        usage=None,
        conversation=ResponseConversation(id=turn.session),
        previous_response_id=previous,
        metadata=metadata or {},
    )
    yield emit("response.created", response=start)
    yield emit("response.in_progress", response=start)
    texts = turn.texts  # the speaker's texts of the turn so far: a message item's id counts them
    steps: dict[int, str] = {}  # step -> its message item's id
    calls: dict[str, McpCall] = {}
    async for happening in followed(service, turn, shows_tools=True):
        if happening is None:
            yield KEEP_ALIVE
        elif isinstance(happening, Text):
            if happening.step not in steps:
                steps[happening.step] = message_id(turn.turn, "a", turn.speaker, texts)
                for event in writer.open_message(steps[happening.step]):
                    yield event
            yield writer.text(steps[happening.step], happening.text)
        elif isinstance(happening, StepEnded):
            texts += 1 if happening.content else 0  # a step without text stores no message item
            if happening.step in steps and writer.items[steps[happening.step]].open:
                for event in writer.close_message(steps[happening.step], happening.content):
                    yield event
        elif isinstance(happening, ToolStarted):
            call = McpCall(
                id=call_id(turn.turn, happening.id),
                server_label=server_label(happening.name),
                name=happening.name,
                arguments=happening.arguments,
            )
            calls[happening.id] = call
            yield writer.tool(call, done=False)
        elif isinstance(happening, ToolEnded):
            started = calls.get(happening.id)
            if started is not None:
                result = {"error": happening.content} if happening.is_error else {"output": happening.content}
                yield writer.tool(msgspec.structs.replace(started, **result), done=True)
        elif isinstance(happening, Rerun):
            texts, steps = turn.texts, {}  # nothing of the run before went out
        elif isinstance(happening, TakenBack):
            yield emit("error", **_reset(happening.reason))
            return
        elif isinstance(happening, Ended):
            final = response_object(
                happening.turn,
                happening.entries,
                session=turn.session,
                model=model,
                base=turn.base,
                previous=previous,
                metadata=metadata,
            )
            for event in stream_end(writer, final, transferred=happening.turn.status == TurnStatus.TRANSFERRED):
                yield event
            return
        elif isinstance(happening, Parked):  # it waits for approvals: their requests end the answer
            final = parked_response(
                happening.turn,
                happening.parked,
                session=turn.session,
                model=model,
                base=turn.base,
                previous=previous,
                metadata=metadata,
            )
            for event in stream_end(writer, final):
                yield event
            return


def _reset(why: str, *, ended: bool = False) -> dict[str, Any]:
    error = reset_error(why, ended=ended)
    return {"code": error.code, "message": error.message, "param": None}


def stream_end(writer: ItemWriter, final: ResponseObject, *, transferred: bool = False) -> list[bytes]:
    """The end of the stream: what it did not show of the final Response, then its terminal event.

    ``transferred``: the turn ended in a transfer, whose history mode may remove items the stream
    showed (RFC 0004 §3): they were said, and stay as they were sent (one still open is closed with
    the text it had); the final Response is the stored one, without them (RFC 0010 §7)."""
    out: list[bytes] = []
    final_ids = {item.id: item for item in final.output}
    for shown in writer.items.values():
        item = final_ids.get(shown.id)
        text = _text(item) if isinstance(item, OutputMessage) else None
        if (item is None and not transferred) or (text is not None and not text.startswith(shown.text)):
            return [writer.emit("error", **_reset("the turn's output is not what was streamed", ended=True))]
        if item is None and shown.open and shown.id.startswith(MESSAGE_PREFIX):
            out += writer.close_message(shown.id, shown.text)
    for item in final.output:
        shown_item = writer.items.get(item.id)
        if isinstance(item, OutputMessage):
            text = _text(item)
            if shown_item is None:
                out += writer.open_message(item.id)
                shown_item = writer.items[item.id]
            if shown_item.open:
                if text[len(shown_item.text) :]:
                    out.append(writer.text(item.id, text[len(shown_item.text) :]))
                out += writer.close_message(item.id, text)
        elif shown_item is None or shown_item.open:
            if shown_item is None:
                out.append(writer.tool(item, done=False))
            out.append(writer.tool(item, done=True))
    out.append(writer.emit(TERMINAL[final.status], response=final))
    return out


MESSAGE_PREFIX = "msg_"


def _text(item: OutputMessage) -> str:
    return "".join(part.text for part in item.content if isinstance(part, OutputText))
