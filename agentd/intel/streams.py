"""Incremental stream framing: NDJSON lines (Ollama) and Server-Sent Events (OpenAI-compatible).

Both parsers are pure and incremental: feed them the bytes as they arrive, in any split, and they
hand back the complete records seen so far. Bytes are buffered until a line ends, so a multi-byte
UTF-8 character or a JSON object split across reads is never decoded half-way. ``finish()`` says
whether the stream stopped in the middle of a record (a truncated stream), which callers treat as
a failed call rather than a short answer.
"""

from __future__ import annotations

import re

import msgspec

__all__ = ["NDJSONSplitter", "SSEEvent", "SSEParser"]

_LINE_END = re.compile(rb"\r\n|\r|\n")


class NDJSONSplitter:
    """Splits a byte stream into its non-blank lines (one JSON document each, undecoded)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """Add ``data``; return every complete, non-blank line it finished (without the newline)."""
        self._buffer += data
        if b"\n" not in data:
            return []
        *complete, rest = bytes(self._buffer).split(b"\n")
        self._buffer = bytearray(rest)
        return [line.strip() for line in complete if line.strip()]

    def finish(self) -> bytes:
        """The stream ended: return the unterminated last line (``b""`` when the stream ended cleanly).

        Ollama ends every line with a newline, so leftover bytes mean the stream was cut mid-line;
        the caller decides whether that line is usable (it usually is not).
        """
        rest = bytes(self._buffer).strip()
        self._buffer.clear()
        return rest


class SSEEvent(msgspec.Struct, frozen=True):
    """One dispatched server-sent event: its ``event`` name (default ``message``) and ``data``."""

    data: str
    event: str = "message"
    id: str | None = None


class SSEParser:
    """The SSE line protocol (WHATWG HTML §9.2.6): ``data:``/``event:``/``id:`` fields, ``:`` comments
    (keep-alives), events ended by a blank line, and any of CRLF, LF or CR as line ends."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None
        self.truncated = False
        self.saw_line = False

    def feed(self, data: bytes) -> list[SSEEvent]:
        """Add ``data``; return the events it completed."""
        self._buffer += data
        events: list[SSEEvent] = []
        for line in self._take_lines(final=False):
            event = self._line(line)
            if event is not None:
                events.append(event)
        return events

    def finish(self) -> list[SSEEvent]:
        """The stream ended: dispatch a pending event whose lines were complete.

        The SSE spec drops an event not followed by a blank line; we keep one whose ``data`` lines
        all ended, because some servers end on ``data: [DONE]\\n`` with no blank line. A last line
        cut before its line end is never used, and sets ``truncated``.
        """
        events: list[SSEEvent] = []
        for line in self._take_lines(final=True):
            event = self._line(line)
            if event is not None:
                events.append(event)
        if self._buffer:
            self.truncated = True
            self._buffer.clear()
        if self._data:
            events.append(self._dispatch())
        return events

    def _take_lines(self, *, final: bool) -> list[str]:
        """Cut complete lines off the buffer. A trailing CR waits for the next read: it may be a CRLF."""
        buffer = bytes(self._buffer)
        if not final and buffer.endswith(b"\r"):
            held, buffer = b"\r", buffer[:-1]
        else:
            held = b""
        parts = _LINE_END.split(buffer)
        rest = parts.pop()
        self._buffer = bytearray(rest + held)
        return [part.decode("utf-8", "replace") for part in parts]

    def _line(self, line: str) -> SSEEvent | None:
        if not line:
            if self._data:
                return self._dispatch()
            self._event = ""  # a blank line with no data dispatches nothing
            return None
        self.saw_line = True  # any SSE-shaped line (comment or field): this is an SSE stream
        if line.startswith(":"):
            return None  # a comment: keep-alive
        field, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id":
            self._id = value
        return None  # "retry" and unknown fields are ignored, as the spec says

    def _dispatch(self) -> SSEEvent:
        event = SSEEvent(data="\n".join(self._data), event=self._event or "message", id=self._id)
        self._data = []
        self._event = ""
        return event
