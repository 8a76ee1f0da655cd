"""NDJSON and SSE framing of model streams: any split of the bytes gives the same records.

SSE is parsed by agentd.sse (its WHATWG rules are tested one by one in test_sse.py); here it is
exercised the way the OpenAI-compatible provider reads a body, bytes in, with what that reader
makes of a stream that ends mid-event.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentd.intel.openai import SSEReader
from agentd.intel.streams import NDJSONSplitter
from agentd.intel.wire import IncompleteStream
from agentd.sse import SSEEvent, SSEParser


def _cuts(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, start = [], 0
    for point in points:
        pieces.append(data[start:point])
        start = point
    pieces.append(data[start:])
    return pieces


def _ndjson(pieces: list[bytes]) -> tuple[list[bytes], bytes]:
    splitter = NDJSONSplitter()
    lines = [line for piece in pieces for line in splitter.feed(piece)]
    return lines, splitter.finish()


def _sse(pieces: list[bytes]) -> tuple[list[SSEEvent], bool]:
    parser = SSEParser()
    events = [event for piece in pieces for event in parser.feed(piece)]
    parser.finish()
    return events, parser.truncated


_payload = st.text(alphabet=st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)), max_size=20)

# --------------------------------------------------------------------------- NDJSON


def test_ndjson_lines_blank_lines_and_split_reads() -> None:
    lines, rest = _ndjson([b'{"a":1}\n\n{"b"', b":2}\r\n", b'\n{"c":3}\n'])
    assert lines == [b'{"a":1}', b'{"b":2}', b'{"c":3}']
    assert rest == b""


def test_ndjson_unterminated_last_line_is_returned_by_finish() -> None:
    lines, rest = _ndjson([b'{"a":1}\n{"b":'])
    assert lines == [b'{"a":1}']
    assert rest == b'{"b":'


def test_ndjson_multibyte_character_split_across_reads() -> None:
    data = '{"content":"héllo ✓"}\n'.encode()
    lines, _ = _ndjson([data[:12], data[12:14], data[14:]])
    assert lines == [data.strip()]


@given(
    st.lists(_payload.filter(lambda t: t.encode().strip()), max_size=8), st.lists(st.integers(min_value=0), max_size=12)
)
def test_ndjson_any_split_gives_the_same_lines(texts: list[str], cuts: list[int]) -> None:
    data = b"".join(text.encode() + b"\n" for text in texts)
    lines, rest = _ndjson(_cuts(data, cuts))
    assert lines == [text.encode().strip() for text in texts]
    assert rest == b""


# --------------------------------------------------------------------------- SSE


def test_sse_comments_crlf_multiline_data_and_event_names() -> None:
    data = b': keep-alive\r\n\r\ndata: {"a":1}\r\n\r\nevent: error\ndata: line1\ndata: line2\n\ndata:[DONE]\n\n'
    events, truncated = _sse([data])
    assert events == [SSEEvent("message", '{"a":1}'), SSEEvent("error", "line1\nline2"), SSEEvent("message", "[DONE]")]
    assert not truncated


def test_sse_cr_at_a_read_boundary_is_one_line_end() -> None:
    events, _ = _sse([b"data: x\r", b"\n\r", b"\ndata: y\r\r"])
    assert events == [SSEEvent("message", "x"), SSEEvent("message", "y")]


def test_sse_last_event_without_blank_line_is_discarded_as_truncated() -> None:
    # WHATWG: an event not followed by its blank line is never dispatched, even if its lines ended.
    events, truncated = _sse([b"data: [DONE]\n"])
    assert (events, truncated) == ([], True)
    events, truncated = _sse([b'data: {"a":1}\n\ndata: {"cut'])
    assert (events, truncated) == ([SSEEvent("message", '{"a":1}')], True)


_CONTENT = b'data: {"choices":[{"index":0,"delta":{"content":"partial"}}]}\n\n'
_FINISH = b'data: {"choices":[{"index":0,"delta":{"content":"end"},"finish_reason":"stop"}]}\n'


@pytest.mark.parametrize("tail", [b"data: [DONE]\n", _FINISH, b"data: [DO"], ids=["done", "finish", "cut-line"])
def test_openai_stream_whose_terminator_is_cut_off_fails_instead_of_answering_short(tail: bytes) -> None:
    """The event carrying [DONE] or the finish_reason lacks its blank line: it is discarded, so the
    stream never reached its end, and the provider must fail the call (retry) rather than answer."""
    reader = SSEReader("c_")
    assert not reader.feed(_CONTENT + tail)
    with pytest.raises(IncompleteStream):
        reader.finish()


def test_openai_stream_with_its_terminator_complete_answers() -> None:
    reader = SSEReader("c_")
    reader.feed(_CONTENT + _FINISH + b"\n")  # the finish event is whole: the answer is complete
    assert reader.finish().message.content == "partialend"
    done = SSEReader("c_")
    assert done.feed(_CONTENT + b"data: [DONE]\n\n")  # [DONE] is whole: nothing more is read
    assert done.finish().message.content == "partial"


@given(
    st.lists(st.tuples(st.sampled_from(["", "error"]), st.lists(_payload, min_size=1, max_size=3)), max_size=6),
    st.sampled_from(["\n", "\r\n", "\r"]),
    st.booleans(),
    st.lists(st.integers(min_value=0), max_size=12),
)
def test_sse_any_split_and_line_end_gives_the_same_events(
    spec: list[tuple[str, list[str]]], newline: str, comments: bool, cuts: list[int]
) -> None:
    text = ""
    for name, datas in spec:
        if comments:
            text += f": ping{newline}"
        if name:
            text += f"event: {name}{newline}"
        text += "".join(f"data: {d}{newline}" for d in datas) + newline
    events, truncated = _sse(_cuts(text.encode(), cuts))
    assert events == [SSEEvent(name or "message", "\n".join(datas)) for name, datas in spec]
    assert not truncated
