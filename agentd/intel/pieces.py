"""An answer's pieces as they stream, split the way the whole answer will be (RFC 0005 §7).

A model that writes its reasoning as ``<think>…</think>`` at the start of its content gets that
block moved to thinking when the answer is whole (``agentd.intel.wire.split_think``). Streamed
pieces must add up to the same content, so ``ThinkTagSplitter`` makes the same decision
incrementally: it holds content back only while it cannot yet tell (leading whitespace, a partial
``<think>``, a partial ``</think>``), then routes it. Pure; ``TaggedSink`` puts it in front of a
``StreamSink``.
"""

from __future__ import annotations

import enum

from agentd.intel.base import StreamSink

__all__ = ["Piece", "TaggedSink", "ThinkTagSplitter"]

_OPEN = "<think>"
_CLOSE = "</think>"

#: (``"content"`` or ``"thinking"``, text)
Piece = tuple[str, str]


class _State(enum.Enum):
    UNDECIDED = "undecided"  # only whitespace and a prefix of <think> so far
    THINKING = "thinking"  # inside the opening block
    AFTER = "after"  # just past </think>: leading whitespace is dropped (split_think lstrips)
    CONTENT = "content"  # everything from here on is content


class ThinkTagSplitter:
    """Routes streamed content pieces to content or thinking as ``split_think`` will (see module)."""

    def __init__(self) -> None:
        self._state = _State.UNDECIDED
        self._held = ""

    def feed(self, text: str) -> list[Piece]:
        """Take one content piece; return what can be routed now (possibly nothing)."""
        if self._state is _State.CONTENT:
            return [("content", text)] if text else []
        self._held += text
        return self._advance()

    def finish(self) -> list[Piece]:
        """The answer is whole: route what was held back."""
        held, self._held = self._held, ""
        if self._state is _State.UNDECIDED:
            # Never opened a block (or opened it only partly): split_think leaves it all as content.
            self._state = _State.CONTENT
            return [("content", held)] if held else []
        if self._state is _State.THINKING:
            return [("thinking", held)] if held else []  # an unclosed block is all thinking
        return []  # AFTER: only whitespace, which split_think strips

    def _advance(self) -> list[Piece]:
        out: list[Piece] = []
        if self._state is _State.UNDECIDED:
            stripped = self._held.lstrip()
            if stripped.lower().startswith(_OPEN):
                self._state, self._held = _State.THINKING, stripped[len(_OPEN) :]
            elif _OPEN.startswith(stripped.lower()):
                return out  # whitespace, or a prefix of the tag: cannot tell yet
            else:
                self._state, held, self._held = _State.CONTENT, self._held, ""
                return [("content", held)]
        if self._state is _State.THINKING:
            at = self._held.lower().find(_CLOSE)
            if at < 0:
                keep = _partial_suffix(self._held.lower(), _CLOSE)
                ready, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
                return [("thinking", ready)] if ready else out
            if at:
                out.append(("thinking", self._held[:at]))
            self._state, self._held = _State.AFTER, self._held[at + len(_CLOSE) :]
        if self._state is _State.AFTER:
            rest = self._held.lstrip()
            self._held = ""
            if rest:
                self._state = _State.CONTENT
                out.append(("content", rest))
        return out


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that starts ``tag`` (0 when none)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class TaggedSink:
    """A ``StreamSink`` in front of another: content goes through a ``ThinkTagSplitter``."""

    def __init__(self, sink: StreamSink) -> None:
        self._sink = sink
        self._splitter = ThinkTagSplitter()

    def content(self, text: str) -> None:
        self._route(self._splitter.feed(text))

    def thinking(self, text: str) -> None:
        self._sink.thinking(text)

    def reset(self, reason: str) -> None:
        self._splitter = ThinkTagSplitter()
        self._sink.reset(reason)

    def finish(self) -> None:
        """The answer is whole: hand on what the splitter held back."""
        self._route(self._splitter.finish())

    def _route(self, pieces: list[Piece]) -> None:
        for kind, text in pieces:
            if kind == "content":
                self._sink.content(text)
            else:
                self._sink.thinking(text)
