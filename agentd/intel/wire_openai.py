"""OpenAI ``/v1/chat/completions`` ⇄ agentd messages (RFC 0005 §2, "OpenAI-compatible"). Pure.

Choices (RFC 0005 §3): tool calls go out with ``arguments`` as a JSON string of the
parsed object (an invalid original is never replayed); tool results carry ``tool_call_id`` only,
and their name is recovered from the call on the way back. Thinking is read from
``reasoning_content`` (vLLM, DeepSeek) or ``reasoning`` (Ollama's compat layer, OpenRouter) but
not sent back: several servers reject it in requests and templates drop it anyway. Images are
``image_url`` content parts with ``data:`` URLs on user messages; the wire has no image parts for
system or assistant messages, so those are not sent.
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
    pair_tool_results,
    tool_names_by_id,
    tool_to_wire,
    usage_of,
    wire_options,
)
from agentd.messages import Message, SystemMessage, ToolCall, ToolResult, UserMessage
from agentd.tools import ToolSpec

__all__ = [
    "OpenAIChunk",
    "OpenAIStream",
    "image_url",
    "message_from_openai",
    "message_to_openai",
    "messages_from_openai",
    "messages_to_openai",
    "openai_chat_request",
    "openai_error_message",
    "openai_model_names",
    "openai_remote_error",
    "openai_response",
]

# Base64 prefixes of the image formats vision models take; anything else is sent as PNG.
_MIME_BY_PREFIX = (
    ("iVBORw0KGgo", "image/png"),
    ("/9j/", "image/jpeg"),
    ("R0lGOD", "image/gif"),
    ("UklGR", "image/webp"),
)


# --------------------------------------------------------------------------- wire shapes (decoding)


class OpenAIFunction(msgspec.Struct, frozen=True):
    name: str | None = None
    arguments: Any = None  # a JSON string; tolerate an object


class OpenAIToolCall(msgspec.Struct, frozen=True):
    index: int | None = None
    id: str | None = None
    type: str | None = None
    function: OpenAIFunction | None = None


class OpenAIMessage(msgspec.Struct, frozen=True):
    """A message, or a stream ``delta`` (every field optional)."""

    role: str | None = None
    content: Any = None  # a string, null, or a list of content parts
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None
    tool_calls: list[OpenAIToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class OpenAIChoice(msgspec.Struct, frozen=True):
    index: int = 0
    message: OpenAIMessage | None = None
    delta: OpenAIMessage | None = None
    finish_reason: str | None = None


class OpenAIUsage(msgspec.Struct, frozen=True):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class OpenAIChunk(msgspec.Struct, frozen=True):
    """A stream chunk, or a whole non-stream response."""

    id: str | None = None
    model: str | None = None
    choices: list[OpenAIChoice] | None = None
    usage: OpenAIUsage | None = None
    error: Any = None


_CHUNK_DECODER = msgspec.json.Decoder(OpenAIChunk)


# --------------------------------------------------------------------------- requests


def image_url(image: str) -> str:
    """A base64 image as a ``data:`` URL (URLs pass through: they came from an OpenAI history)."""
    if image.startswith(("data:", "http://", "https://")):
        return image
    mime = next((m for prefix, m in _MIME_BY_PREFIX if image.startswith(prefix)), "image/png")
    return f"data:{mime};base64,{image}"


def _image_from_url(url: str) -> str:
    """The inverse of ``image_url``: a base64 ``data:`` URL back to its payload."""
    head, sep, payload = url.partition(",")
    if sep and head.startswith("data:") and head.endswith(";base64"):
        return payload
    return url


def message_to_openai(message: Message) -> dict[str, Any]:
    """One agentd message in the chat-completions shape (bookkeeping and thinking dropped)."""
    if isinstance(message, ToolResult):
        return {"role": "tool", "tool_call_id": message.call_id, "content": message.content}
    if isinstance(message, UserMessage):
        out: dict[str, Any] = {"role": "user", "content": _user_content(message)}
    elif isinstance(message, SystemMessage):
        out = {"role": "system", "content": message.content}
    else:
        out = {"role": "assistant", "content": message.content}
        if message.tool_calls:
            out["tool_calls"] = [_call_to_openai(call) for call in message.tool_calls]
            out["content"] = message.content or None
    if message.name and not isinstance(message, SystemMessage):
        out["name"] = message.name
    return out


def _user_content(message: UserMessage) -> str | list[dict[str, Any]]:
    if not message.images:
        return message.content
    parts: list[dict[str, Any]] = [{"type": "text", "text": message.content}] if message.content else []
    parts += [{"type": "image_url", "image_url": {"url": image_url(image)}} for image in message.images]
    return parts


def _call_to_openai(call: ToolCall) -> dict[str, Any]:
    # The parsed object is re-encoded; invalid original text is never replayed.
    arguments = msgspec.json.encode(call.arguments).decode()
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def messages_to_openai(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """A history in the chat-completions shape; tool results without an id get their call's."""
    return [message_to_openai(message) for message in pair_tool_results(messages)]


def openai_chat_request(
    model: str,
    messages: Sequence[Message],
    tools: Sequence[ToolSpec],
    options: Mapping[str, Any],
    *,
    stream: bool,
) -> dict[str, Any]:
    """The ``POST /v1/chat/completions`` body. Options become top-level parameters; a stream asks
    for the usage chunk unless the options say otherwise."""
    body: dict[str, Any] = {"model": model, "messages": messages_to_openai(messages), "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if tools:
        body["tools"] = [tool_to_wire(spec) for spec in tools]
    body.update(wire_options(options))
    return body


# --------------------------------------------------------------------------- histories from the wire


def _text_and_images(content: Any) -> tuple[str, tuple[str, ...] | None]:
    """Message content (string, null or content parts) → (text, images)."""
    if content is None:
        return "", None
    if isinstance(content, str):
        return content, None
    if not isinstance(content, list):
        raise WireError("an OpenAI message content is neither a string nor a list of parts")
    texts: list[str] = []
    images: list[str] = []
    for part in content:
        if not isinstance(part, dict):
            raise WireError("an OpenAI content part is not an object")
        if part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif part.get("type") == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if isinstance(url, str):
                images.append(_image_from_url(url))
    return "".join(texts), tuple(images) or None


def _calls_from_openai(calls: Sequence[OpenAIToolCall], id_prefix: str) -> tuple[ToolCall, ...]:
    raw = [
        (c.id, (c.function.name if c.function else None) or "", c.function.arguments if c.function else None)
        for c in calls
    ]
    return build_tool_calls(raw, id_prefix)


def message_from_openai(raw: Any, *, id_prefix: str = "call_", tool_names: Mapping[str, str] | None = None) -> Message:
    """One chat-completions message → an agentd message. ``tool_names`` (call id → tool name)
    names tool results, which carry only the id on this wire."""
    wire = convert(raw, OpenAIMessage, "an OpenAI message")
    text, images = _text_and_images(wire.content)
    if wire.role == "user":
        return UserMessage(content=text, images=images, name=wire.name)
    if wire.role in ("system", "developer"):
        return SystemMessage(content=text)
    if wire.role == "tool":
        call_id = wire.tool_call_id or ""
        return ToolResult(name=(tool_names or {}).get(call_id) or wire.name or "", content=text, call_id=call_id)
    if wire.role == "assistant":
        calls = _calls_from_openai(wire.tool_calls or [], id_prefix)
        return assistant_from_parts(text or wire.refusal or "", _reasoning(wire), calls, name=wire.name)
    raise WireError(f"an OpenAI message has unknown role {wire.role!r}")


def _reasoning(wire: OpenAIMessage) -> str | None:
    return wire.reasoning_content or wire.reasoning or None


def messages_from_openai(raw: Sequence[Any]) -> list[Message]:
    """A chat-completions history → agentd messages, tool results named after their calls."""
    messages: list[Message] = []
    for n, item in enumerate(raw):
        messages.append(message_from_openai(item, id_prefix=f"call_{n}_", tool_names=tool_names_by_id(messages)))
    return messages


# --------------------------------------------------------------------------- responses


class _PartialCall:
    """A tool call being stitched from stream fragments."""

    def __init__(self) -> None:
        self.id: str | None = None
        self.name = ""
        self.arguments: list[str] = []
        self.object: Any = None  # a server that sends arguments as an object sends it whole


class OpenAIStream:
    """Accumulates chat-completion chunks (choice 0) into one answer.

    Handles both chunk layouts seen in the wild: ``role`` on every delta or on the first only, and
    the finish on the last content chunk or on a separate chunk with an empty delta. Tool-call
    fragments are stitched by ``index`` (id and name from the first, ``arguments`` concatenated).
    The usage chunk (``choices: []``) may come before or after the finish. A stream is complete
    once it has a finish_reason or ``[DONE]``; ``result()`` before that raises IncompleteStream.
    """

    def __init__(self, *, id_prefix: str = "call_", sink: StreamSink | None = None) -> None:
        self._id_prefix = id_prefix
        self._sink = sink  # handed each piece of content and reasoning as it arrives
        self._content: list[str] = []
        self._thinking: list[str] = []
        self._calls: dict[int, _PartialCall] = {}
        self._last_index: int | None = None
        self._usage: OpenAIUsage | None = None
        self._model: str | None = None
        self.finish_reason: str | None = None
        self.saw_done = False

    @property
    def complete(self) -> bool:
        """Whether the stream has reached an end that makes its answer whole."""
        return self.saw_done or self.finish_reason is not None

    def feed_data(self, data: str) -> None:
        """Take one SSE ``data`` payload (a JSON chunk or ``[DONE]``)."""
        if data.strip() == "[DONE]":
            self.saw_done = True
            return
        try:
            chunk = _CHUNK_DECODER.decode(data)  # straight into the wire Struct: this runs per token
        except msgspec.ValidationError:
            chunk = None  # JSON of the wrong shape (or an odd error payload): the slow path says which
        except msgspec.DecodeError as exc:
            raise WireError(f"an OpenAI stream chunk is not JSON: {exc}") from None
        if chunk is None:
            self.feed(msgspec.json.decode(data))
        else:
            self._take(chunk)

    def feed(self, raw: Any) -> None:
        """Take one decoded chunk."""
        if isinstance(raw, dict) and raw.get("error") is not None:
            raise openai_remote_error(raw["error"])
        self._take(convert(raw, OpenAIChunk, "an OpenAI stream chunk"))

    def _take(self, chunk: OpenAIChunk) -> None:
        if chunk.error is not None:
            raise openai_remote_error(chunk.error)
        self._model = chunk.model or self._model
        if chunk.usage is not None:
            self._usage = chunk.usage
        for choice in chunk.choices or []:
            if choice.index != 0:
                continue  # we ask for one choice; ignore any others a server invents
            self._take_delta(choice.delta or choice.message)
            if choice.finish_reason:
                self.finish_reason = choice.finish_reason

    def _take_delta(self, delta: OpenAIMessage | None) -> None:
        if delta is None:
            return
        text, _ = _text_and_images(delta.content)
        text = text or delta.refusal or ""
        if text:
            self._content.append(text)
            if self._sink is not None:
                self._sink.content(text)
        if reasoning := delta.reasoning_content or delta.reasoning:
            self._thinking.append(reasoning)
            if self._sink is not None:
                self._sink.thinking(reasoning)
        for fragment in delta.tool_calls or []:
            self._take_fragment(fragment)

    def _take_fragment(self, fragment: OpenAIToolCall) -> None:
        index = fragment.index
        if index is None:
            # No index (a few servers): a new id starts a new call, otherwise continue the last.
            if fragment.id and (
                self._last_index is None or self._calls[self._last_index].id not in (None, fragment.id)
            ):
                index = len(self._calls)
            else:
                index = self._last_index if self._last_index is not None else 0
        elif fragment.id and index in self._calls and self._calls[index].id not in (None, fragment.id):
            # Ollama's compat layer sends every (whole) parallel call with index 0 and its own id:
            # a new id at a taken index is a new call, never more arguments for the old one.
            index = max(self._calls) + 1
        call = self._calls.setdefault(index, _PartialCall())
        self._last_index = index
        if fragment.id and not call.id:
            call.id = fragment.id
        function = fragment.function
        if function is None:
            return
        if function.name and not call.name:
            call.name = function.name
        if isinstance(function.arguments, str):
            call.arguments.append(function.arguments)
        elif function.arguments is not None:
            call.object = function.arguments

    def result(self) -> ChatResult:
        """The whole answer. Raises IncompleteStream when neither a finish nor ``[DONE]`` came."""
        if not self.complete:
            raise IncompleteStream("the OpenAI stream ended without a finish_reason or [DONE]")
        raw = [
            (call.id, call.name, call.object if call.object is not None else "".join(call.arguments))
            for _, call in sorted(self._calls.items())
        ]
        message = assistant_from_parts(
            "".join(self._content), "".join(self._thinking), build_tool_calls(raw, self._id_prefix)
        )
        usage = self._usage or OpenAIUsage()
        return ChatResult(
            message=message,
            usage=usage_of(usage.prompt_tokens, usage.completion_tokens),
            model=self._model,
            finish_reason=self.finish_reason,
        )


def openai_response(raw: Any, *, id_prefix: str = "call_") -> ChatResult:
    """A non-stream chat-completions body (decoded JSON) → the answer."""
    if not isinstance(raw, dict):
        raise WireError("an OpenAI response is not a JSON object")
    if not raw.get("choices") and raw.get("error") is None:
        raise WireError("an OpenAI response has no choices")
    stream = OpenAIStream(id_prefix=id_prefix)
    stream.feed(raw)
    stream.saw_done = True  # a whole body is complete even if a server left finish_reason null
    return stream.result()


def openai_error_message(error: Any) -> str:
    """The text of an OpenAI ``error`` value: ``{message, type, code}`` (tolerate a bare string)."""
    if isinstance(error, str):
        return error
    if isinstance(error, dict):
        message = error.get("message")
        if isinstance(message, str):
            return message
    return msgspec.json.encode(error).decode()


def openai_remote_error(error: Any) -> RemoteError:
    """A mid-stream error payload as a RemoteError; an ``invalid_request_error`` or a 4xx code is the
    request's fault (not retried), anything else the server's."""
    request_error = False
    if isinstance(error, dict):
        kind = error.get("type")
        code = error.get("code")
        status = code if isinstance(code, int) else (int(code) if isinstance(code, str) and code.isdigit() else None)
        request_error = kind == "invalid_request_error" or (
            status is not None and 400 <= status < 500 and status != 429
        )
    return RemoteError(openai_error_message(error), request_error=request_error)


def openai_model_names(raw: Any) -> list[str]:
    """``GET /v1/models`` → the model ids it lists."""
    if not isinstance(raw, dict) or not isinstance(raw.get("data"), list):
        raise WireError("a /v1/models response has no data list")
    return [entry["id"] for entry in raw["data"] if isinstance(entry, dict) and isinstance(entry.get("id"), str)]
