"""Ollama ``/api/chat`` ⇄ agentd messages (RFC 0005 §2, "Ollama native"). Pure: no I/O.

Choices (RFC 0005 §3): tool calls go out with their ids and tool results with
``tool_call_id`` as well as ``tool_name`` — servers before 0.12.10 ignore both and pair by name and
order, which the order we keep preserves. Thinking goes back in ``thinking``. A system message's
``name`` is agentd bookkeeping and is not sent; user and assistant names are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from agentd.intel.base import StreamSink
from agentd.intel.wire import (
    ChatResult,
    IncompleteStream,
    RemoteError,
    WireError,
    assistant_from_parts,
    build_tool_calls,
    convert,
    decode_json,
    pair_tool_results,
    tool_to_wire,
    usage_of,
    wire_options,
)
from agentd.messages import AssistantMessage, Message, SystemMessage, ToolCall, ToolResult, UserMessage
from agentd.tools import ToolSpec

__all__ = [
    "OllamaChunk",
    "OllamaStream",
    "message_from_ollama",
    "message_to_ollama",
    "messages_from_ollama",
    "messages_to_ollama",
    "ollama_chat_request",
    "ollama_error_message",
    "ollama_model_names",
    "ollama_response",
]

# Request keys Ollama takes at the top level; every other option goes into ``options``.
TOP_LEVEL_OPTIONS = frozenset({"think", "format", "keep_alive"})


# --------------------------------------------------------------------------- wire shapes (decoding)


class OllamaFunction(msgspec.Struct, frozen=True):
    name: str = ""
    arguments: Any = None  # an object; some servers send a JSON string
    index: int | None = None


class OllamaToolCall(msgspec.Struct, frozen=True):
    function: OllamaFunction
    id: str | None = None


class OllamaMessage(msgspec.Struct, frozen=True):
    role: str = "assistant"
    content: str | None = None
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None
    name: str | None = None


class OllamaChunk(msgspec.Struct, frozen=True):
    """One NDJSON line of a stream, or a whole non-stream response."""

    model: str | None = None
    message: OllamaMessage | None = None
    done: bool = False
    done_reason: str | None = None
    prompt_eval_count: int | None = None
    eval_count: int | None = None
    error: Any = None


_CHUNK_DECODER = msgspec.json.Decoder(OllamaChunk)


# --------------------------------------------------------------------------- requests


def message_to_ollama(message: Message) -> dict[str, Any]:
    """One agentd message in the ``/api/chat`` message shape (bookkeeping fields dropped)."""
    if isinstance(message, ToolResult):
        out: dict[str, Any] = {"role": "tool", "content": message.content, "tool_name": message.name}
        if message.call_id:
            out["tool_call_id"] = message.call_id
        return out
    out = {"role": message_role(message), "content": message.content}
    if isinstance(message, AssistantMessage):
        if message.thinking:
            out["thinking"] = message.thinking
        if message.tool_calls:
            out["tool_calls"] = [_call_to_ollama(call, k) for k, call in enumerate(message.tool_calls)]
    if message.images:
        out["images"] = [_bare_base64(image) for image in message.images]
    if message.name and not isinstance(message, SystemMessage):
        out["name"] = message.name
    return out


def message_role(message: Message) -> str:
    """The wire role of a message kind."""
    return {UserMessage: "user", AssistantMessage: "assistant", SystemMessage: "system", ToolResult: "tool"}[
        type(message)
    ]


def _call_to_ollama(call: ToolCall, index: int) -> dict[str, Any]:
    # Arguments that were invalid are {} here: the invalid text is never replayed.
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": call.arguments}}


def _bare_base64(image: str) -> str:
    """Ollama wants bare base64; a ``data:`` URL (from an OpenAI history) is cut to its payload."""
    if image.startswith("data:") and "," in image:
        return image.split(",", 1)[1]
    return image


def messages_to_ollama(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """A history in the ``/api/chat`` shape, tool results paired with their calls."""
    return [message_to_ollama(message) for message in pair_tool_results(messages)]


def ollama_chat_request(
    model: str,
    messages: Sequence[Message],
    tools: Sequence[ToolSpec],
    options: Mapping[str, Any],
    *,
    stream: bool,
) -> dict[str, Any]:
    """The ``POST /api/chat`` body. ``think``/``format``/``keep_alive`` go top-level, the rest into
    ``options``; agentd's own keys (``stream``, timeouts) are not sent."""
    body: dict[str, Any] = {"model": model, "messages": messages_to_ollama(messages), "stream": stream}
    if tools:
        body["tools"] = [tool_to_wire(spec) for spec in tools]
    model_options: dict[str, Any] = {}
    for key, value in wire_options(options).items():
        if key in TOP_LEVEL_OPTIONS:
            body[key] = value
        else:
            model_options[key] = value
    if model_options:
        body["options"] = model_options
    return body


# --------------------------------------------------------------------------- histories from the wire


def message_from_ollama(raw: Any, *, id_prefix: str = "call_") -> Message:
    """One ``/api/chat`` message → an agentd message. Raises WireError for an unknown shape."""
    wire = convert(raw, OllamaMessage, "an Ollama message")
    content = wire.content or ""
    images = tuple(wire.images) if wire.images else None
    if wire.role == "user":
        return UserMessage(content=content, images=images, name=wire.name)
    if wire.role == "system":
        return SystemMessage(content=content, images=images)
    if wire.role == "tool":
        return ToolResult(name=wire.tool_name or wire.name or "", content=content, call_id=wire.tool_call_id or "")
    if wire.role == "assistant":
        return assistant_from_parts(
            content, wire.thinking, _calls_from_ollama(wire.tool_calls or [], id_prefix), name=wire.name, images=images
        )
    raise WireError(f"an Ollama message has unknown role {wire.role!r}")


def _calls_from_ollama(calls: Sequence[OllamaToolCall], id_prefix: str) -> tuple[ToolCall, ...]:
    return build_tool_calls([(call.id, call.function.name, call.function.arguments) for call in calls], id_prefix)


def messages_from_ollama(raw: Sequence[Any]) -> list[Message]:
    """A ``/api/chat`` history → agentd messages; ids generated per message, results paired by
    name and order where the history carries no ``tool_call_id``."""
    messages = [message_from_ollama(item, id_prefix=f"call_{n}_") for n, item in enumerate(raw)]
    return pair_tool_results(messages)


# --------------------------------------------------------------------------- responses


class OllamaStream:
    """Accumulates NDJSON stream lines into one answer.

    Content and thinking arrive in pieces; tool calls arrive whole, possibly over several lines, and
    keep their order. The stream must end with a ``done: true`` line; ``result()`` before that
    raises IncompleteStream. An ``{"error": …}`` line (sent with HTTP 200) raises RemoteError.
    """

    def __init__(self, *, id_prefix: str = "call_", sink: StreamSink | None = None) -> None:
        self._id_prefix = id_prefix
        self._sink = sink  # handed each piece of content and thinking as it arrives
        self._content: list[str] = []
        self._thinking: list[str] = []
        self._calls: list[OllamaToolCall] = []
        self._final: OllamaChunk | None = None
        self._model: str | None = None

    @property
    def done(self) -> bool:
        """Whether the ``done: true`` line has been seen."""
        return self._final is not None

    def feed_line(self, line: bytes) -> None:
        """Take one NDJSON line (decoded straight into the wire Struct: this runs per token)."""
        try:
            chunk = _CHUNK_DECODER.decode(line)
        except msgspec.ValidationError:
            self.feed(decode_json(line, "an Ollama stream line"))  # JSON of the wrong shape: say where
            return
        except msgspec.DecodeError as exc:
            raise WireError(f"an Ollama stream line is not JSON: {exc}") from None
        self._take(chunk)

    def feed(self, raw: Any) -> None:
        """Take one decoded stream object."""
        self._take(convert(raw, OllamaChunk, "an Ollama stream line"))

    def _take(self, chunk: OllamaChunk) -> None:
        if self._final is not None:
            return  # nothing follows done:true; ignore trailing noise (even an error) rather than fail a good answer
        if chunk.error is not None:
            raise RemoteError(ollama_error_message(chunk.error))
        self._model = chunk.model or self._model
        if chunk.message is not None:
            if chunk.message.content:
                self._content.append(chunk.message.content)
                if self._sink is not None:
                    self._sink.content(chunk.message.content)
            if chunk.message.thinking:
                self._thinking.append(chunk.message.thinking)
                if self._sink is not None:
                    self._sink.thinking(chunk.message.thinking)
            self._calls.extend(chunk.message.tool_calls or [])
        if chunk.done:
            self._final = chunk

    def result(self) -> ChatResult:
        """The whole answer. Raises IncompleteStream when no ``done: true`` line came."""
        if self._final is None:
            raise IncompleteStream("the Ollama stream ended without its done:true line")
        message = assistant_from_parts(
            "".join(self._content), "".join(self._thinking), _calls_from_ollama(self._calls, self._id_prefix)
        )
        return ChatResult(
            message=message,
            usage=usage_of(self._final.prompt_eval_count, self._final.eval_count),
            model=self._model,
            finish_reason=self._final.done_reason,
        )


def ollama_response(raw: Any, *, id_prefix: str = "call_") -> ChatResult:
    """A non-stream ``/api/chat`` response body (decoded JSON) → the answer."""
    if not isinstance(raw, dict):
        raise WireError("an Ollama response is not a JSON object")
    stream = OllamaStream(id_prefix=id_prefix)
    stream.feed({**raw, "done": True} if "message" in raw else raw)
    if not stream.done:
        raise WireError("an Ollama response has no message")
    return stream.result()


def ollama_error_message(error: Any) -> str:
    """The text of an Ollama ``error`` value (a string; tolerate an OpenAI-style object)."""
    if isinstance(error, str):
        return error
    if isinstance(error, dict):
        message = error.get("message")
        if isinstance(message, str):
            return message
    return msgspec.json.encode(error).decode()


def ollama_model_names(raw: Any) -> list[str]:
    """``GET /api/tags`` → the model names it lists."""
    if not isinstance(raw, dict) or not isinstance(raw.get("models"), list):
        raise WireError("an /api/tags response has no models list")
    names: list[str] = []
    for entry in raw["models"]:
        if isinstance(entry, dict):
            name = entry.get("name") or entry.get("model")
            if isinstance(name, str):
                names.append(name)
    return names
