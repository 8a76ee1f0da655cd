"""The scripted provider: agentd's embedded default model.

Deterministic, offline and honest about being a test model, yet it exercises the whole loop:
tool calls, parallel calls, transfers, thinking, per-step delay and multi-step turns. Every reply
starts with ``[<model>]`` so a swap is visible in the transcript.

How it decides, reading the history since the last user message (step k = assistant messages since):
- step 0 calls, in parallel: every offered tool the user's text names; NAME for "call tool NAME"
  even when it is not offered (to show what an unknown tool does), with the arguments of a flat
  JSON object right after it ("call tool time__get_current_time {"timezone": "UTC"}"); and, when the user asks to be
  transferred ("transfer" and the name of an offered ``transfer_to_<name>`` tool's destination),
  that transfer tool, last;
- while k < ``steps`` → call the first offered (non-transfer) tool; its first integer parameter
  gets k and its first string parameter ``"step k+1"`` so steps differ (``loop = true`` makes
  every call identical, to exercise loop detection);
- otherwise → the final answer, quoting the user — or, when no user message follows the last
  system prompt (an opener: session start or a transfer), a greeting naming that prompt's assistant.

Options (config ``options``): ``delay_ms`` per step, ``steps``, ``think`` (emit thinking),
``loop``, ``hold_file``: each step waits until that path exists (lets tests and demos hold a
model call in flight for as long as they need, without timing guesses), and ``chunk_ms``: the
reply streams (thinking, then content) in word-sized pieces, this long apart (RFC 0000 §10).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

import anyio
import msgspec

from agentd.budget import Usage
from agentd.config import TRANSFER_TOOL_PREFIX, Intelligence
from agentd.intel.base import Completion, CompletionRequest, IntelError, IntelErrorKind, StreamSink
from agentd.messages import AssistantMessage, Message, SystemMessage, ToolCall, ToolResult, UserMessage
from agentd.tools import ToolSpec

__all__ = ["ScriptedOptions", "ScriptedProvider", "scripted_reply"]

_HOLD_POLL_SECONDS = 0.02
_PIECE_RE = re.compile(r"\s*\S+\s*|\s+")
_CALL_TOOL_RE = re.compile(r"\bcall tool ([A-Za-z_][\w.-]*)(?:\s+(\{[^{}]*\}))?", re.IGNORECASE)


class ScriptedOptions(msgspec.Struct, frozen=True, kw_only=True):
    """The scripted model's knobs; other option keys (meant for real providers) are ignored."""

    delay_ms: int = 0
    steps: int = 0
    think: bool = False
    loop: bool = False
    hold_file: str | None = None
    chunk_ms: int = 0


def word_pieces(text: str) -> list[str]:
    """``text`` in word-sized pieces (a word and the whitespace after it) that join back to it exactly."""
    return _PIECE_RE.findall(text)


def _words(text: str) -> int:
    return len(text.split())


def _mentions(text: str, word: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text, re.IGNORECASE) is not None


def _filler_arguments(spec: ToolSpec, step: int, loop: bool) -> dict[str, Any]:
    properties: dict[str, Any] = spec.parameters.get("properties", {})
    arguments: dict[str, Any] = {}
    for kind, value in (("integer", 0 if loop else step), ("string", "step 1" if loop else f"step {step + 1}")):
        name = next((n for n, p in properties.items() if p.get("type") == kind), None)
        if name is not None:
            arguments[name] = value
    return arguments


def _json_object(text: str) -> dict[str, Any]:
    """The arguments written after "call tool NAME" ({} when none, or when they are not a JSON object)."""
    try:
        value = msgspec.json.decode(text) if text else {}
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def scripted_reply(
    model: str, messages: Sequence[Message], tools: Sequence[ToolSpec], options: ScriptedOptions
) -> Completion:
    """The deterministic reply for one step (pure: the provider adds only the delays)."""
    last_user = max((i for i, m in enumerate(messages) if isinstance(m, UserMessage)), default=-1)
    last_prompt = max((i for i, m in enumerate(messages) if isinstance(m, SystemMessage)), default=-1)
    # A prompt after the last user message: an assistant just took over and speaks first.
    text = messages[last_user].content if last_user > last_prompt else ""
    since = messages[last_user + 1 :]
    step = sum(1 for m in since if isinstance(m, AssistantMessage))
    called = {c.name for m in since if isinstance(m, AssistantMessage) for c in m.tool_calls}
    transfer_tools = [t for t in tools if t.name.startswith(TRANSFER_TOOL_PREFIX)]
    work_tools = [t for t in tools if not t.name.startswith(TRANSFER_TOOL_PREFIX)]

    calls: list[tuple[str, dict[str, Any]]] = []
    if step == 0:
        calls = [(name, _json_object(arguments)) for name, arguments in _CALL_TOOL_RE.findall(text)]
        calls += [
            (t.name, _filler_arguments(t, step, options.loop))
            for t in work_tools
            if _mentions(text, t.name) and t.name not in called and all(t.name != name for name, _ in calls)
        ]
        if _mentions(text, "transfer") or _mentions(text, "transferred"):
            # Named tools run beside the transfer, in the same step (parallel calls).
            calls += [(t.name, {}) for t in transfer_tools if _mentions(text, t.name[len(TRANSFER_TOOL_PREFIX) :])][:1]
    if not calls and step < options.steps and work_tools:
        calls = [(work_tools[0].name, _filler_arguments(work_tools[0], step, options.loop))]

    thinking = f"[{model}] step {step + 1}: deciding how to answer" if options.think else None
    if calls:
        tool_calls = tuple(
            ToolCall(id=f"call_{len(messages)}_{i}", name=name, arguments=arguments)
            for i, (name, arguments) in enumerate(calls)
        )
        content = ""
    else:
        tool_calls = ()
        content = _final_answer(model, text, since, messages)
    usage = Usage(
        input_tokens=sum(_words(getattr(m, "content", "")) for m in messages),
        output_tokens=_words(content) + len(tool_calls) + (_words(thinking) if thinking else 0),
    )
    return Completion(
        message=AssistantMessage(content=content, thinking=thinking, tool_calls=tool_calls), usage=usage, model=model
    )


def _final_answer(model: str, text: str, since: Sequence[Message], messages: Sequence[Message]) -> str:
    if not text:
        speaker = next((m.name for m in reversed(messages) if isinstance(m, SystemMessage) and m.name), None)
        return f"[{model}] Hello, {speaker} here. How can I help?" if speaker else f"[{model}] Hello! How can I help?"
    results = [m for m in since if isinstance(m, ToolResult)]
    suffix = f" (after {len(results)} tool result{'s' if len(results) != 1 else ''})" if results else ""
    return f"[{model}] You said: {text}{suffix}"


class ScriptedProvider:
    """The Provider for ``provider = "scripted"``."""

    def __init__(self, intelligence: Intelligence) -> None:
        self.intelligence = intelligence
        self.failing = False  # the scripted model is always reachable
        try:
            self.options = msgspec.convert(intelligence.options, ScriptedOptions)
        except msgspec.ValidationError as exc:
            raise IntelError(IntelErrorKind.REQUEST, f"invalid scripted options: {exc}") from None

    async def complete(self, request: CompletionRequest) -> Completion:
        if self.options.hold_file:
            hold = self.options.hold_file
            # The stat runs in a worker thread, so a slow filesystem never stalls the loop (os.path.exists, not
            # anyio.Path.exists: any OSError still means "not there yet"). ASYNC110 (use an Event, not a sleep
            # loop) does not apply: another process (a test, a user) makes the file, which no anyio.Event can
            # observe, and polling is this option's documented behaviour.
            while not await anyio.to_thread.run_sync(os.path.exists, hold):  # noqa: ASYNC110
                await anyio.sleep(_HOLD_POLL_SECONDS)
        if self.options.delay_ms:
            await anyio.sleep(self.options.delay_ms / 1000)
        completion = scripted_reply(self.intelligence.model, request.messages, request.tools, self.options)
        await self._stream(completion.message, request.sink)
        return completion

    async def _stream(self, message: AssistantMessage, sink: StreamSink | None) -> None:
        """Hand the reply out in word-sized pieces, ``chunk_ms`` apart (the pace does not depend on
        whether anyone listens, so a watched session runs as fast as an unwatched one)."""
        pieces = [("thinking", p) for p in word_pieces(message.thinking or "")]
        pieces += [("content", p) for p in word_pieces(message.content)]
        for n, (kind, piece) in enumerate(pieces):
            if n and self.options.chunk_ms:
                await anyio.sleep(self.options.chunk_ms / 1000)
            if sink is not None:
                (sink.thinking if kind == "thinking" else sink.content)(piece)

    async def aclose(self) -> None:
        return None
