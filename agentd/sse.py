"""Server-Sent Events: the one parser of the ``text/event-stream`` format, for every reader in agentd.

The CLI client reads the daemon's event streams with it and the OpenAI-compatible provider reads
model streams with it. It is pure (no I/O) and incremental: feed it the body as it arrives, in
chunks of any size (bytes, or text already decoded), and it returns the events completed so far.
Any split of the same stream gives the same events.

It follows the WHATWG HTML "event stream interpretation" rules (§9.2.6) exactly:

- the stream is UTF-8 (invalid bytes become U+FFFD); one leading byte-order mark is dropped;
- a line ends at CRLF, LF or CR, also when a CRLF is split across two chunks;
- a line starting with ``:`` is a comment (servers send them as keep-alives);
- ``field: value`` sets a field, one space after the colon is dropped; a line without a colon is
  a field name with an empty value;
- ``data`` lines accumulate and are joined with ``\\n``; ``event`` names the event (``message``
  when unnamed); ``id`` sets the last event id unless its value contains NUL; ``retry`` sets the
  reconnection time only when it is all ASCII digits; other fields are ignored;
- a blank line dispatches the event; one without any ``data`` line is not dispatched (its name is
  forgotten all the same);
- at the end of the stream an event not yet followed by its blank line is discarded, never
  dispatched. ``finish()`` records whether that happened (``truncated``): a stream that stops
  mid-event was cut off, and readers that need a terminator treat it as a failed stream.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable, Iterator
from typing import NamedTuple

__all__ = ["SSEEvent", "SSEParser", "iter_sse"]

_LINE_END = re.compile(r"\r\n|\r|\n")
_BOM = "\ufeff"


class SSEEvent(NamedTuple):
    """One dispatched event.

    ``event`` is its type (``message`` when the stream named none), ``data`` its data lines joined
    with ``\\n``. ``id`` is the stream's last event id when the event was dispatched (None until an
    ``id`` field set one; ids persist across events, as the spec says) and ``retry`` likewise the
    last reconnection time in milliseconds that a ``retry`` field set.
    """

    event: str
    data: str
    id: str | None = None
    retry: int | None = None


class SSEParser:
    """An incremental ``text/event-stream`` parser (see the module docstring for the rules).

    Feed either bytes or str, not both: bytes are decoded as UTF-8 here, across chunk boundaries.
    ``last_event_id`` and ``retry_ms`` hold the stream's current id and reconnection time.
    ``saw_line`` turns true at the first non-blank line (a field or a comment): the body has the
    shape of an event stream. ``truncated`` is set by ``finish()``.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._kind: type[bytes] | type[str] | None = None
        self._pending: list[str] = []  # the start of a line whose end has not arrived yet
        self._started = False  # the stream's first character has been seen (it may be the BOM)
        self._skip_lf = False  # the text so far ended in CR: a LF arriving next completes that CRLF
        self._event = ""
        self._data: list[str] = []
        self._finished = False
        self.last_event_id: str | None = None
        self.retry_ms: int | None = None
        self.saw_line = False
        self.truncated = False

    def feed(self, chunk: bytes | str) -> list[SSEEvent]:
        """Consume the next piece of the stream; return the events it completed, in order."""
        if self._finished:
            raise ValueError("SSEParser.feed() after finish()")
        kind = str if isinstance(chunk, str) else bytes
        if self._kind is None:
            self._kind = kind
        elif kind is not self._kind:
            raise TypeError("feed an SSEParser either bytes or str, not both")
        text = chunk if isinstance(chunk, str) else self._decoder.decode(chunk)
        return self._feed_text(text)

    def finish(self) -> None:
        """The stream ended. A pending event (or a line cut before its end) is discarded, and
        ``truncated`` says whether there was one."""
        if self._finished:
            return
        self._finished = True
        tail = self._decoder.decode(b"", final=True) if self._kind is bytes else ""
        self.truncated = bool(self._pending or tail or self._data or self._event)
        self._pending, self._data, self._event = [], [], ""

    def _feed_text(self, text: str) -> list[SSEEvent]:
        if not text:
            return []  # keep _started and _skip_lf as they are: the next character decides them
        if not self._started:
            self._started = True
            if text[0] == _BOM:
                text = text[1:]
        if self._skip_lf and text:
            self._skip_lf = False
            if text[0] == "\n":
                text = text[1:]
        if "\n" not in text and "\r" not in text:
            if text:
                self._pending.append(text)  # no line end yet: defer the joining, a long line may come in many chunks
            return []
        if self._pending:
            self._pending.append(text)
            text = "".join(self._pending)
            self._pending = []
        events: list[SSEEvent] = []
        start = 0
        for match in _LINE_END.finditer(text):
            event = self._line(text[start : match.start()])
            if event is not None:
                events.append(event)
            start = match.end()
        if start < len(text):
            self._pending.append(text[start:])
        elif text[-1] == "\r":
            self._skip_lf = True  # the line already ended; a LF at the start of the next chunk is part of its CRLF
        return events

    def _line(self, line: str) -> SSEEvent | None:
        if not line:
            return self._dispatch()
        self.saw_line = True
        if line[0] == ":":
            return None
        field, colon, value = line.partition(":")
        if colon and value[:1] == " ":
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id" and "\0" not in value:
            self.last_event_id = value
        elif field == "retry" and value.isascii() and value.isdigit():
            self.retry_ms = int(value)
        return None  # other fields, and ids and retries with values the spec rejects, are ignored

    def _dispatch(self) -> SSEEvent | None:
        data, event = self._data, self._event
        self._data, self._event = [], ""
        if not data:
            return None
        return SSEEvent(event or "message", "\n".join(data), self.last_event_id, self.retry_ms)


def iter_sse(chunks: Iterable[bytes | str]) -> Iterator[SSEEvent]:
    """The events of a whole stream given as chunks; an unterminated last event is discarded."""
    parser = SSEParser()
    for chunk in chunks:
        yield from parser.feed(chunk)
    parser.finish()
