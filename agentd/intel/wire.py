"""What the Ollama and OpenAI wire conversions share: results, errors, options, ids, think tags.

Everything here is pure. ``wire_ollama`` and ``wire_openai`` build requests and read responses with
these helpers; the providers add the I/O. See RFC 0005 §3 for the choices made here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from agentd.budget import Usage
from agentd.config import parse_duration
from agentd.messages import AssistantMessage, Message, ToolCall, ToolResult
from agentd.tools import ToolSpec

__all__ = [
    "AGENTD_OPTIONS",
    "CallOptions",
    "ChatResult",
    "IncompleteStream",
    "OptionError",
    "RemoteError",
    "WireError",
    "call_options",
    "ensure_call_ids",
    "pair_tool_results",
    "parse_arguments",
    "split_think",
    "tool_to_wire",
    "wire_options",
]

# Option keys agentd itself interprets; they are never sent to a server.
AGENTD_OPTIONS = frozenset({"stream", "read_timeout", "connect_timeout"})

DEFAULT_READ_TIMEOUT = 300.0  # a cold model load can keep the first byte away for minutes
DEFAULT_CONNECT_TIMEOUT = 5.0


class WireError(ValueError):
    """A body that is not the wire format (→ IntelError MALFORMED)."""


class RemoteError(Exception):
    """The server reported an error inside a 200 response (a mid-stream ``{"error": …}``).

    ``request_error`` is True when the server says the request itself was bad, so retrying the
    same request cannot help; otherwise the failure is the server's and may be retried.
    """

    def __init__(self, message: str, *, request_error: bool = False) -> None:
        super().__init__(message)
        self.request_error = request_error


class IncompleteStream(Exception):
    """A stream that ended without its terminator: a failed call, never a short answer."""


class OptionError(ValueError):
    """An agentd option (``stream``, ``read_timeout``, ``connect_timeout``) with an unusable value."""


class ChatResult(msgspec.Struct, frozen=True, kw_only=True):
    """One model answer read off the wire."""

    message: AssistantMessage
    usage: Usage = Usage()
    usage_reported: bool = False  # whether the server reported any usage (RFC 0011 §1)
    model: str | None = None  # the model the server says answered, when it says
    finish_reason: str | None = None


class CallOptions(msgspec.Struct, frozen=True, kw_only=True):
    """The options agentd interprets itself (never sent on the wire)."""

    stream: bool = True
    read_timeout: float = DEFAULT_READ_TIMEOUT
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT


# --------------------------------------------------------------------------- options


def _seconds(key: str, value: Any) -> float:
    """A timeout option: a positive number of seconds or a duration string like ``"30s"``."""
    if isinstance(value, bool):
        raise OptionError(f"options.{key}: expected seconds or a duration like '30s', got a boolean")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        try:
            seconds = parse_duration(value)
        except ValueError as exc:
            raise OptionError(f"options.{key}: {exc}") from None
    else:
        raise OptionError(f"options.{key}: expected seconds or a duration like '30s'")
    if seconds <= 0:
        raise OptionError(f"options.{key}: must be greater than zero")
    return seconds


def call_options(options: Mapping[str, Any]) -> CallOptions:
    """Read agentd's own options out of an intelligence's ``options``. Raises OptionError."""
    stream = options.get("stream", True)
    if not isinstance(stream, bool):
        raise OptionError("options.stream: expected true or false")
    return CallOptions(
        stream=stream,
        read_timeout=_seconds("read_timeout", options.get("read_timeout", DEFAULT_READ_TIMEOUT)),
        connect_timeout=_seconds("connect_timeout", options.get("connect_timeout", DEFAULT_CONNECT_TIMEOUT)),
    )


def wire_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options meant for the server: everything except agentd's own keys."""
    return {key: value for key, value in options.items() if key not in AGENTD_OPTIONS}


# --------------------------------------------------------------------------- tools and tool calls


def tool_to_wire(spec: ToolSpec) -> dict[str, Any]:
    """A tool spec in the ``{type: function, function: {…}}`` shape both wire formats use."""
    return {
        "type": "function",
        "function": {"name": spec.name, "description": spec.description, "parameters": spec.parameters},
    }


def parse_arguments(raw: Any) -> tuple[dict[str, Any], str | None]:
    """Tool-call arguments as sent by a server → (a JSON object, an error or None).

    Objects pass through; strings are decoded (an empty string means no arguments, as some servers
    send for argument-less calls). Anything else is an error *for the model*: the arguments become
    ``{}`` and the error text says what was wrong without repeating the invalid text.
    """
    if raw is None:
        return {}, None
    if isinstance(raw, dict):
        return raw, None
    if isinstance(raw, str):
        if not raw.strip():
            return {}, None
        try:
            value = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            return {}, f"the tool-call arguments were not valid JSON ({exc}); send a JSON object"
        if isinstance(value, dict):
            return value, None
        return {}, f"the tool-call arguments must be a JSON object, not {_json_kind(value)}"
    return {}, f"the tool-call arguments must be a JSON object, not {_json_kind(raw)}"


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    return {list: "an array", str: "a string", int: "a number", float: "a number", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def ensure_call_ids(ids: Sequence[str | None], prefix: str) -> list[str]:
    """Keep the server's tool-call ids; generate ``<prefix><k>`` for missing, empty or repeated ones.

    Ids must be unique within a message for OpenAI-style pairing, so a repeated server id (some
    servers send the same id for every call) is replaced too. Generated ids depend only on the
    position, so the same answer always gets the same ids.
    """
    seen: set[str] = set()
    out: list[str] = []
    taken = {i for i in ids if i}
    for k, call_id in enumerate(ids):
        if not call_id or call_id in seen:
            call_id = f"{prefix}{k}"
            while call_id in taken or call_id in seen:
                call_id += "_"
        seen.add(call_id)
        out.append(call_id)
    return out


def pair_tool_results(messages: Iterable[Message]) -> list[Message]:
    """Give every tool result a ``call_id``: missing ones are matched by name and order.

    Ollama pairs results with calls by name and order; OpenAI by id. A history that came without
    ids (old Ollama, or results recorded without one) is paired here the way Ollama would: the k-th
    result named ``x`` after an assistant message answers that message's k-th call to ``x``.
    """
    out: list[Message] = []
    pending: dict[str, list[str]] = {}
    for message in messages:
        if isinstance(message, AssistantMessage):
            pending = {}
            for call in message.tool_calls:
                pending.setdefault(call.name, []).append(call.id)
        elif isinstance(message, ToolResult):
            queue = pending.get(message.name, [])
            if message.call_id:
                if message.call_id in queue:
                    queue.remove(message.call_id)
            elif queue:
                message = msgspec.structs.replace(message, call_id=queue.pop(0))
        out.append(message)
    return out


def tool_names_by_id(messages: Iterable[Message]) -> dict[str, str]:
    """Call id → tool name over a history (OpenAI tool results carry only the id)."""
    return {
        call.id: call.name
        for message in messages
        if isinstance(message, AssistantMessage)
        for call in message.tool_calls
    }


def build_tool_calls(raw: Sequence[tuple[str | None, str, Any]], prefix: str) -> tuple[ToolCall, ...]:
    """``(id, name, raw arguments)`` triples in order → ToolCalls with ids ensured, arguments parsed."""
    ids = ensure_call_ids([call_id for call_id, _, _ in raw], prefix)
    calls: list[ToolCall] = []
    for call_id, (_, name, arguments) in zip(ids, raw, strict=True):
        parsed, error = parse_arguments(arguments)
        calls.append(ToolCall(id=call_id, name=name, arguments=parsed, arguments_error=error))
    return tuple(calls)


# --------------------------------------------------------------------------- thinking

_THINK_OPEN = re.compile(r"^\s*<think>", re.IGNORECASE)
_THINK_CLOSE = re.compile(r"</think>", re.IGNORECASE)


def split_think(content: str) -> tuple[str | None, str]:
    """``<think>T</think>C`` at the start of ``content`` → (``T``, ``C``), whitespace-trimmed.

    Only a block that *opens* the content is reasoning: a ``</think>`` elsewhere is ordinary text
    (an answer may well talk about the tag) and is never cut. An opened block that never closes
    (the answer was cut off) is all thinking.
    """
    opened = _THINK_OPEN.match(content)
    if opened is None:
        return None, content
    body = content[opened.end() :]
    closed = _THINK_CLOSE.search(body)
    if closed is None:
        return body.strip() or None, ""
    thinking = body[: closed.start()].strip()
    return thinking or None, body[closed.end() :].lstrip()


def merge_thinking(field: str | None, from_content: str | None) -> str | None:
    """A thinking field and thinking found in content tags, joined; None when both are empty."""
    parts = [part for part in (field, from_content) if part]
    return "\n".join(parts) if parts else None


def assistant_from_parts(
    content: str,
    thinking: str | None,
    tool_calls: tuple[ToolCall, ...],
    *,
    name: str | None = None,
    images: tuple[str, ...] | None = None,
) -> AssistantMessage:
    """An AssistantMessage from wire parts, with ``<think>`` tags in content moved to thinking."""
    tagged, content = split_think(content)
    return AssistantMessage(
        content=content,
        thinking=merge_thinking(thinking or None, tagged),
        tool_calls=tool_calls,
        name=name,
        images=images or None,
    )


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def usage_of(
    input_tokens: Any, output_tokens: Any, cached_input_tokens: Any = None, reasoning_tokens: Any = None
) -> Usage:
    """Token counts as servers send them (possibly absent or null) → Usage (tokens only: the loop
    counts the request, and whether it was reported, itself)."""
    return Usage(
        input_tokens=_count(input_tokens),
        output_tokens=_count(output_tokens),
        cached_input_tokens=_count(cached_input_tokens),
        reasoning_tokens=_count(reasoning_tokens),
    )


def decode_json(data: bytes | str, what: str) -> Any:
    """JSON text → value; WireError (MALFORMED) naming ``what`` when it is not JSON."""
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise WireError(f"{what} is not JSON: {exc}") from None


def convert(value: Any, type_: type[Any], what: str) -> Any:
    """Validate decoded JSON against a wire Struct; WireError naming ``what`` when it does not fit."""
    try:
        return msgspec.convert(value, type_)
    except msgspec.ValidationError as exc:
        raise WireError(f"{what} does not have the expected shape: {exc}") from None
