"""Render a Reply as the real servers would send it: Ollama NDJSON/JSON and OpenAI SSE/JSON.

Pure functions (no I/O), so property tests can render, cut at random points and parse back
without a server. Records are returned without framing newlines for NDJSON (the server joins them
with ``\\n``) and as full SSE event bytes for OpenAI.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tests.fakes.script import FakeCall, Reply

__all__ = [
    "OpenAILayout",
    "ollama_body",
    "ollama_error_record",
    "ollama_records",
    "openai_body",
    "openai_error_event",
    "openai_events",
    "split_text",
]

CREATED_AT = "2026-11-30T12:00:00.000000Z"


def split_text(text: str, pieces: int) -> list[str]:
    """``text`` in about ``pieces`` consecutive parts (none empty; ``[]`` for empty text)."""
    if not text:
        return []
    size = max(1, -(-len(text) // max(1, pieces)))
    return [text[i : i + size] for i in range(0, len(text), size)]


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _content_and_thinking(reply: Reply) -> tuple[str, str | None]:
    if reply.think_tags and reply.thinking:
        return f"<think>\n{reply.thinking}\n</think>\n\n{reply.content}", None
    return reply.content, reply.thinking


def _arguments_object(call: FakeCall) -> Any:
    if isinstance(call.arguments, str):
        try:
            return json.loads(call.arguments)
        except ValueError:
            return call.arguments  # Ollama would never; a broken server might
    return call.arguments


def _arguments_text(call: FakeCall) -> str:
    return call.arguments if isinstance(call.arguments, str) else _dumps(call.arguments)


def _finish(reply: Reply) -> str:
    return reply.finish_reason or ("tool_calls" if reply.tool_calls else "stop")


# --------------------------------------------------------------------------- Ollama


def _ollama_call(call: FakeCall, index: int, with_ids: bool, seq: int) -> dict[str, Any]:
    out: dict[str, Any] = {"function": {"index": index, "name": call.name, "arguments": _arguments_object(call)}}
    if with_ids:
        out["id"] = call.id or f"call_fake{seq}_{index}"
    return out


def ollama_records(reply: Reply, model: str, *, with_ids: bool = True, seq: int = 0) -> list[bytes]:
    """The NDJSON lines of a streamed ``/api/chat`` answer (thinking, content, calls, done)."""
    content, thinking = _content_and_thinking(reply)
    lines: list[dict[str, Any]] = []

    def line(**message: Any) -> dict[str, Any]:
        return {
            "model": model,
            "created_at": CREATED_AT,
            "message": {"role": "assistant", "content": "", **message},
            "done": False,
        }

    for part in split_text(thinking or "", reply.pieces):
        lines.append(line(thinking=part))
    for part in split_text(content, reply.pieces):
        lines.append(line(content=part))
    for index, call in enumerate(reply.tool_calls):
        lines.append(line(tool_calls=[_ollama_call(call, index, with_ids, seq)]))
    done: dict[str, Any] = {
        "model": model,
        "created_at": CREATED_AT,
        "message": {"role": "assistant", "content": ""},
        "done": True,
        "done_reason": "stop" if _finish(reply) in ("stop", "tool_calls") else _finish(reply),
        "total_duration": 1234567,
        "load_duration": 1000,
    }
    if reply.input_tokens is not None:
        done["prompt_eval_count"] = reply.input_tokens
    if reply.output_tokens is not None:
        done["eval_count"] = reply.output_tokens
    lines.append(done)
    return [_dumps(item).encode() for item in lines]


def ollama_body(reply: Reply, model: str, *, with_ids: bool = True, seq: int = 0) -> dict[str, Any]:
    """A non-stream ``/api/chat`` response."""
    content, thinking = _content_and_thinking(reply)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        message["thinking"] = thinking
    if reply.tool_calls:
        message["tool_calls"] = [_ollama_call(c, i, with_ids, seq) for i, c in enumerate(reply.tool_calls)]
    body: dict[str, Any] = {
        "model": model,
        "created_at": CREATED_AT,
        "message": message,
        "done": True,
        "done_reason": "stop",
        "total_duration": 1234567,
    }
    if reply.input_tokens is not None:
        body["prompt_eval_count"] = reply.input_tokens
    if reply.output_tokens is not None:
        body["eval_count"] = reply.output_tokens
    return body


def ollama_error_record(message: str) -> bytes:
    """The mid-stream error line."""
    return _dumps({"error": message}).encode()


# --------------------------------------------------------------------------- OpenAI


@dataclass(frozen=True)
class OpenAILayout:
    """How an OpenAI-compatible server lays out its stream.

    ``split_finish``: Ollama's compat layer since Aug 2026 — ``role`` on the first chunk only and
    the finish in a separate chunk with an empty delta. Otherwise the classic layout: ``role`` on
    every delta and the finish on the last content chunk. ``whole_calls`` sends each tool call in
    one fragment (Ollama compat) instead of id/name first and arguments in pieces.
    """

    split_finish: bool = False
    reasoning_field: str = "reasoning_content"
    whole_calls: bool = False
    with_ids: bool = True
    crlf: bool = False
    comments: bool = True
    omit_index: bool = False


def _sse(data: str, layout: OpenAILayout) -> bytes:
    newline = "\r\n" if layout.crlf else "\n"
    return f"data: {data}{newline}{newline}".encode()


def openai_events(
    reply: Reply, model: str, *, layout: OpenAILayout = OpenAILayout(), include_usage: bool = True, seq: int = 0
) -> list[bytes]:
    """The SSE events of a streamed chat completion, ending with ``data: [DONE]``."""
    content, thinking = _content_and_thinking(reply)
    base = {"id": f"chatcmpl-{seq}", "object": "chat.completion.chunk", "created": 1764500000, "model": model}
    deltas: list[dict[str, Any]] = []
    for part in split_text(thinking or "", reply.pieces):
        deltas.append({layout.reasoning_field: part})
    for part in split_text(content, reply.pieces):
        deltas.append({"content": part})
    for index, call in enumerate(reply.tool_calls):
        deltas.extend(_call_fragments(call, index, layout, seq))
    if not deltas:
        deltas.append({"content": ""})
    chunks: list[dict[str, Any]] = []
    for n, delta in enumerate(deltas):
        if not layout.split_finish or n == 0:
            delta = {"role": "assistant", **delta}
        chunks.append({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    if layout.split_finish:
        chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": _finish(reply)}]})
    else:
        chunks[-1]["choices"][0]["finish_reason"] = _finish(reply)
    if include_usage and reply.report_usage:
        chunks.append({**base, "choices": [], "usage": _usage(reply)})
    events = [_sse(_dumps(chunk), layout) for chunk in chunks]
    if layout.comments:
        events.insert(1, (": keep-alive\r\n\r\n" if layout.crlf else ": keep-alive\n\n").encode())
    events.append(_sse("[DONE]", layout))
    return events


def _call_fragments(call: FakeCall, index: int, layout: OpenAILayout, seq: int) -> list[dict[str, Any]]:
    call_id = (call.id or f"call_fake{seq}_{index}") if layout.with_ids else None
    head: dict[str, Any] = {"type": "function", "function": {"name": call.name, "arguments": ""}}
    if not layout.omit_index:
        head["index"] = index
    if call_id:
        head["id"] = call_id
    text = _arguments_text(call)
    if layout.whole_calls:
        head["function"]["arguments"] = text
        return [{"tool_calls": [head]}]
    fragments = [{"tool_calls": [head]}]
    for part in split_text(text, 3):
        fragment: dict[str, Any] = {"function": {"arguments": part}}
        if not layout.omit_index:
            fragment["index"] = index
        fragments.append({"tool_calls": [fragment]})
    return fragments


def _usage(reply: Reply) -> dict[str, Any]:
    prompt = reply.input_tokens or 0
    completion = reply.output_tokens or 0
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if reply.cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": reply.cached_tokens}
    if reply.reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reply.reasoning_tokens}
    return usage


def openai_body(reply: Reply, model: str, *, layout: OpenAILayout = OpenAILayout(), seq: int = 0) -> dict[str, Any]:
    """A non-stream chat completion."""
    content, thinking = _content_and_thinking(reply)
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if thinking:
        message[layout.reasoning_field] = thinking
    if reply.tool_calls:
        message["tool_calls"] = [
            {
                "id": (c.id or f"call_fake{seq}_{i}"),
                "type": "function",
                "function": {"name": c.name, "arguments": _arguments_text(c)},
            }
            for i, c in enumerate(reply.tool_calls)
        ]
    return {
        "id": f"chatcmpl-{seq}",
        "object": "chat.completion",
        "created": 1764500000,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": _finish(reply)}],
        **({"usage": _usage(reply)} if reply.report_usage else {}),
    }


def openai_error_event(message: str, layout: OpenAILayout = OpenAILayout()) -> bytes:
    """A mid-stream error payload."""
    return _sse(_dumps({"error": {"message": message, "type": "server_error", "param": None, "code": None}}), layout)
