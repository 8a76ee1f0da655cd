"""Incremental stream framing for NDJSON lines (Ollama). Server-Sent Events (OpenAI-compatible
servers) are parsed by ``agentd.sse``, the one SSE parser, shared with the CLI client.

The splitter is pure and incremental: feed it the bytes as they arrive, in any split, and it hands
back the complete lines seen so far. Bytes are buffered until a line ends, so a multi-byte UTF-8
character or a JSON object split across reads is never decoded half-way. ``finish()`` returns what
was left when the stream stopped in the middle of a line (a truncated stream), which callers treat
as a failed call rather than a short answer.
"""

from __future__ import annotations

__all__ = ["NDJSONSplitter"]


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
