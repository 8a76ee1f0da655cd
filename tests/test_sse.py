"""The one SSE parser (agentd.sse): the WHATWG event-stream rules one by one, and chunking invariance.

The property tests compare the incremental parser, fed any split of the bytes, with a literal
transcription of the spec's algorithm run on the whole stream at once (``_reference`` below).
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentd.sse import SSEEvent, SSEParser, iter_sse


def _parse(*chunks: bytes | str) -> tuple[list[SSEEvent], SSEParser]:
    parser = SSEParser()
    events = [event for chunk in chunks for event in parser.feed(chunk)]
    parser.finish()
    return events, parser


def _events(*chunks: bytes | str) -> list[SSEEvent]:
    return _parse(*chunks)[0]


def _message(data: str, event: str = "message", id: str | None = None, retry: int | None = None) -> SSEEvent:
    return SSEEvent(event=event, data=data, id=id, retry=retry)


# --------------------------------------------------------------------------- byte-order mark and decoding


def test_a_leading_bom_is_stripped() -> None:
    assert _events(b"\xef\xbb\xbfdata: a\n\n") == [_message("a")]
    assert _events("\ufeffdata: a\n\n") == [_message("a")]


def test_a_bom_split_across_chunks_is_still_stripped() -> None:
    assert _events(b"\xef", b"", b"\xbb", b"\xbfdata: a\n\n") == [_message("a")]
    assert _events("", "\ufeffdata: a\n\n") == [_message("a")]  # an empty first chunk is not the stream's start


def test_only_one_bom_is_stripped_and_only_at_the_start() -> None:
    # A second BOM belongs to the first line: the field is named "\ufeffdata", which is unknown.
    assert _events(b"\xef\xbb\xbf\xef\xbb\xbfdata: a\n\n") == []
    assert _events("data: \ufeffa\n\n") == [_message("\ufeffa")]
    assert _events("data: a\n\n", "\ufeffdata: b\n\n") == [_message("a")]


def test_bytes_are_utf8_even_split_inside_a_character_and_invalid_bytes_are_replaced() -> None:
    data = "data: héllo ✓\n\n".encode()
    cut = data.index("✓".encode()) + 1
    assert _events(data[:cut], data[cut:]) == [_message("héllo ✓")]
    assert _events(b"data: a\xffb\n\n") == [_message("a\ufffdb")]


# --------------------------------------------------------------------------- line ends


@pytest.mark.parametrize("eol", ["\n", "\r", "\r\n"], ids=["LF", "CR", "CRLF"])
def test_each_line_end(eol: str) -> None:
    text = f"event: e{eol}data: a{eol}data: b{eol}{eol}"
    assert _events(text) == [_message("a\nb", "e")]
    assert _events(text.encode()) == [_message("a\nb", "e")]


def test_mixed_line_ends_in_one_stream() -> None:
    assert _events("data: a\r\ndata: b\rdata: c\n\r\n") == [_message("a\nb\nc")]


def test_cr_ending_one_chunk_and_lf_starting_the_next_is_one_line_end() -> None:
    # Read as two line ends, the LF would be a blank line dispatching "a" before its second data line.
    assert _events("data: a\r", "\ndata: b\r", "\n\r", "\n") == [_message("a\nb")]
    assert _events(b"data: a\r", b"\ndata: b\r\n\r\n") == [_message("a\nb")]


def test_the_lf_of_a_split_crlf_may_arrive_after_empty_chunks() -> None:
    assert _events("data: a\r", "", "", "\ndata: b\n\n") == [_message("a\nb")]
    assert _events(b"data: a\r", b"", b"\ndata: b\n\n") == [_message("a\nb")]


def test_two_crs_are_two_line_ends_and_dispatch_without_waiting_for_more() -> None:
    parser = SSEParser()
    assert parser.feed("data: a\r\r") == [_message("a")]  # a CR ends its line at once; only a LF would be swallowed
    assert parser.feed("\ndata: b\n\n") == [_message("b")]


# --------------------------------------------------------------------------- comments and fields


def test_comment_lines_are_ignored_and_dispatch_nothing() -> None:
    events, parser = _parse(": keep-alive\n\n:\n\ndata: a\n: inside an event\ndata: b\n\n")
    assert events == [_message("a\nb")]
    assert parser.saw_line


def test_a_field_without_a_colon_is_a_name_with_an_empty_value() -> None:
    assert _events("data\n\n") == [_message("")]
    assert _events("event\ndata: x\n\n") == [_message("x")]  # empty event name: "message"
    assert _events("data: a\ndata\n\n") == [_message("a\n")]


def test_exactly_one_space_after_the_colon_is_stripped() -> None:
    assert _events("data:  two\n\n") == [_message(" two")]
    assert _events("data:none\n\n") == [_message("none")]
    assert _events("data: \n\n") == [_message("")]
    assert _events("data:\ttab\n\n") == [_message("\ttab")]
    assert _events("data: a: b\n\n") == [_message("a: b")]  # only the first colon separates


def test_unknown_fields_are_ignored_and_field_names_are_case_sensitive() -> None:
    assert _events("Data: x\nunknown: y\ndata: z\n\n") == [_message("z")]


def test_data_lines_are_joined_with_lf() -> None:
    assert _events("data: a\ndata: b\ndata: c\n\n") == [_message("a\nb\nc")]
    assert _events("data:\ndata:\n\n") == [_message("\n")]


# --------------------------------------------------------------------------- dispatch


def test_a_blank_line_dispatches_and_the_event_name_does_not_carry_over() -> None:
    assert _events("event: first\ndata: 1\n\ndata: 2\n\n") == [_message("1", "first"), _message("2")]


def test_an_event_without_data_is_not_dispatched_but_its_name_is_reset() -> None:
    events, parser = _parse("event: named\n\ndata: y\n\n")
    assert events == [_message("y")]
    assert not parser.truncated
    assert _events("event: a\nevent: b\ndata: x\n\n") == [_message("x", "b")]  # the last name wins


def test_an_unterminated_last_event_is_discarded_and_marks_the_stream_truncated() -> None:
    events, parser = _parse("data: a\n\ndata: b\n")  # no blank line after "b"
    assert (events, parser.truncated) == ([_message("a")], True)
    events, parser = _parse("data: a\n\ndata: b")  # cut inside the line
    assert (events, parser.truncated) == ([_message("a")], True)
    events, parser = _parse("event: x\n")
    assert (events, parser.truncated) == ([], True)
    events, parser = _parse(b"data: \xe2\x9c")  # cut inside a character
    assert (events, parser.truncated) == ([], True)


def test_a_stream_ending_between_events_is_not_truncated() -> None:
    for text in ("", "data: a\n\n", "data: a\n\n: ping\n", "data: a\r\n\r\n", "id: 3\n", "event: x\n\n"):
        _, parser = _parse(text)
        assert not parser.truncated, text


def test_iter_sse_parses_a_whole_stream_and_drops_its_unterminated_tail() -> None:
    assert list(iter_sse([b"data: a\n", b"\ndata: ", b"never\n"])) == [_message("a")]
    assert list(iter_sse(["data: a\n\n"])) == [_message("a")]


# --------------------------------------------------------------------------- id and retry


def test_the_last_event_id_persists_across_events() -> None:
    events, parser = _parse("data: a\n\nid: 7\ndata: b\n\ndata: c\n\nid\ndata: d\n\n")
    assert [e.id for e in events] == [None, "7", "7", ""]  # an empty id resets it to ""
    assert parser.last_event_id == ""


def test_an_id_containing_nul_is_ignored() -> None:
    events, parser = _parse("id: 1\ndata: a\n\nid: 2\x003\ndata: b\n\n")
    assert [e.id for e in events] == ["1", "1"]
    assert parser.last_event_id == "1"


def test_an_id_set_without_data_still_applies_to_later_events() -> None:
    assert _events("id: 9\n\ndata: a\n\n") == [_message("a", id="9")]


@pytest.mark.parametrize("value", ["", "15x", "-1", "1.5", " 10", "+3", "\u0661\u0662", "\uff11"])
def test_retry_that_is_not_all_ascii_digits_is_ignored(value: str) -> None:
    events, parser = _parse(f"retry: 1500\ndata: a\n\nretry: {value}\ndata: b\n\n")  # one space is the separator
    assert [e.retry for e in events] == [1500, 1500]
    assert parser.retry_ms == 1500


def test_retry_of_ascii_digits_sets_the_reconnection_time() -> None:
    events, parser = _parse("data: a\n\nretry: 0250\ndata: b\n\n")
    assert [e.retry for e in events] == [None, 250]
    assert parser.retry_ms == 250


# --------------------------------------------------------------------------- misuse


def test_bytes_and_str_cannot_be_mixed() -> None:
    parser = SSEParser()
    parser.feed(b"data: a")
    with pytest.raises(TypeError):
        parser.feed("\n\n")


def test_feed_after_finish_is_an_error() -> None:
    parser = SSEParser()
    parser.finish()
    with pytest.raises(ValueError, match="after finish"):
        parser.feed(b"data: a\n\n")


# --------------------------------------------------------------------------- any split, against the spec's algorithm


def _reference(stream: bytes) -> tuple[list[SSEEvent], str | None, int | None]:
    """The spec's algorithm as written, on the whole stream: a string data buffer, one line at a time."""
    text = stream.decode("utf-8", "replace")
    if text.startswith("\ufeff"):
        text = text[1:]
    *lines, _unterminated = re.split(r"\r\n|\r|\n", text)
    events: list[SSEEvent] = []
    data, event_type, last_id, retry = "", "", None, None
    for line in lines:
        if line == "":
            if data == "":
                event_type = ""
                continue
            if data.endswith("\n"):
                data = data[:-1]
            events.append(SSEEvent(event_type or "message", data, last_id, retry))
            data, event_type = "", ""
            continue
        if line.startswith(":"):
            continue
        if ":" in line:
            field, value = line.split(":", 1)
            value = value[1:] if value.startswith(" ") else value
        else:
            field, value = line, ""
        if field == "event":
            event_type = value
        elif field == "data":
            data += value + "\n"
        elif field == "id" and "\0" not in value:
            last_id = value
        elif field == "retry" and value and all(c in "0123456789" for c in value):
            retry = int(value)
    return events, last_id, retry


_PIECES = st.sampled_from(
    [
        b"data",
        b"data:",
        b"data: ",
        b"event:",
        b"event: e",
        b"id: ",
        b"id",
        b"retry: ",
        b"retry:",
        b":",
        b" ",
        b"\r",
        b"\n",
        b"\r\n",
        b"\xef\xbb\xbf",
        b"x",
        b"12",
        b"\x00",
        b"\xc3\xa9",
        b"\xe2\x9c\x93",
        b"\xe2\x9c",
        b"\xff",
    ]
)
_streams = st.lists(st.one_of(_PIECES, st.binary(max_size=6)), max_size=40).map(b"".join)


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@settings(max_examples=400, deadline=None)
@given(_streams, st.lists(st.integers(min_value=0), max_size=12))
def test_any_split_of_the_bytes_yields_the_same_events_as_the_spec(stream: bytes, cuts: list[int]) -> None:
    expected, last_id, retry = _reference(stream)
    whole, whole_parser = _parse(stream)
    split, split_parser = _parse(*_split(stream, cuts))
    assert whole == expected
    assert split == expected
    assert split_parser.truncated == whole_parser.truncated
    assert (split_parser.last_event_id, split_parser.retry_ms) == (whole_parser.last_event_id, whole_parser.retry_ms)
    assert (whole_parser.last_event_id, whole_parser.retry_ms) == (last_id, retry)


@settings(max_examples=200, deadline=None)
@given(_streams)
def test_one_byte_at_a_time_yields_the_same_events(stream: bytes) -> None:
    one_by_one = _parse(*(stream[i : i + 1] for i in range(len(stream))))[0]
    assert one_by_one == _reference(stream)[0]


@settings(max_examples=200, deadline=None)
@given(_streams, st.lists(st.integers(min_value=0), max_size=12))
def test_text_chunks_yield_the_same_events_as_bytes(stream: bytes, cuts: list[int]) -> None:
    text = stream.decode("utf-8", "replace")
    points = sorted({c % (len(text) + 1) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    assert _events(*chunks) == _reference(stream)[0]
