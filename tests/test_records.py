"""A turn's one record (agentd.records) and its one rendering (agentd.views): the API's Turn and the turn.done event.

The expected JSON is spelled out byte for byte: it is the API's contract (the ``Turn`` object and
the ``turn.done`` event data), which must not move when the types behind it do.
"""

from __future__ import annotations

import msgspec
import pytest

from agentd.budget import TurnStatus, Usage
from agentd.messages import AssistantMessage
from agentd.records import Discarded, StartedTurn, TurnRecord
from agentd.views import MessageResult, TurnView, entry_from_message, turn_done_event, turn_view

RECORD = TurnRecord(
    id="t1",
    status=TurnStatus.LOOP_DETECTED,
    models=("m0", "m1"),
    steps=3,
    restarts=2,
    # A discarded attempt that spent nothing still shows its (zero) usage in the API view.
    discarded=(
        Discarded(model="m0", steps=2, reason="r", usage=Usage(1, 2)),
        Discarded(model="m1", steps=0, reason="x"),
    ),
    usage=Usage(10, 20),
    started_at=1714561200.25,
    ended_at=1714561203.5,
    error="boom",
)

# Every usage shows every count and its cost (null: unpriced), a discarded attempt's too (RFC 0011 §2).
USAGE_1_2 = '{"input_tokens":1,"output_tokens":2,"cached_input_tokens":0,"reasoning_tokens":0,"requests":0,"unreported":0,"cost":null}'
USAGE_10_20 = '{"input_tokens":10,"output_tokens":20,"cached_input_tokens":0,"reasoning_tokens":0,"requests":0,"unreported":0,"cost":null}'
USAGE_0_0 = '{"input_tokens":0,"output_tokens":0,"cached_input_tokens":0,"reasoning_tokens":0,"requests":0,"unreported":0,"cost":null}'
DISCARDED_JSON = (
    f'[{{"model":"m0","steps":2,"reason":"r","usage":{USAGE_1_2}}},'
    f'{{"model":"m1","steps":0,"reason":"x","usage":{USAGE_0_0}}}]'
)
RECORD_JSON = (
    '{"id":"t1","status":"loop_detected","models":["m0","m1"],"steps":3,"restarts":2,'
    f'"discarded":{DISCARDED_JSON},"usage":{USAGE_10_20},'
    '"started_at":"2024-05-01T11:00:00.250Z","ended_at":"2024-05-01T11:00:03.500Z","error":"boom"}'
)


def test_a_finished_turn_renders_as_the_api_turn() -> None:
    assert msgspec.json.encode(turn_view(RECORD)).decode() == RECORD_JSON


def test_a_turn_without_error_or_spend_still_has_every_key() -> None:
    quiet = TurnRecord(id="t1", status=TurnStatus.COMPLETED, started_at=1714561200.25, ended_at=1714561203.5)
    assert msgspec.json.encode(turn_view(quiet)).decode() == (
        '{"id":"t1","status":"completed","models":[],"steps":0,"restarts":0,"discarded":[],'
        f'"usage":{USAGE_0_0},'
        '"started_at":"2024-05-01T11:00:00.250Z","ended_at":"2024-05-01T11:00:03.500Z","error":null}'
    )


def test_a_started_turn_renders_as_pending() -> None:
    started = StartedTurn(id="t2", message=None, started_at=1714561200.25)
    assert msgspec.json.encode(turn_view(started)).decode() == (
        '{"id":"t2","status":"pending","models":[],"steps":0,"restarts":0,"discarded":[],'
        f'"usage":{USAGE_0_0},'
        '"started_at":"2024-05-01T11:00:00.250Z","ended_at":null,"error":null}'
    )


@pytest.mark.parametrize("error", ["boom", None])
def test_the_turn_done_event_is_the_rendered_turn_less_its_id_and_times(error: str | None) -> None:
    record = msgspec.structs.replace(RECORD, error=error)
    entries = [entry_from_message(7, AssistantMessage(content="hi", model="m1", assistant="a", turn="t1"))]
    event = turn_done_event(record, entries)
    assert list(event) == ["status", "models", "steps", "restarts", "discarded", "usage", "error", "messages"]
    assert msgspec.json.encode(event).decode() == (
        '{"status":"loop_detected","models":["m0","m1"],"steps":3,"restarts":2,'
        f'"discarded":{DISCARDED_JSON},"usage":{USAGE_10_20},'
        f'"error":{msgspec.json.encode(error).decode()},'
        '"messages":[{"seq":7,"turn":"t1","role":"assistant","content":"hi","model":"m1","assistant":"a"}]}'
    )


def test_the_client_decodes_the_rendered_turn_back() -> None:
    """The CLI client decodes the same bytes into the shared view types."""
    body = msgspec.json.encode(MessageResult(turn=turn_view(RECORD)))
    decoded = msgspec.json.decode(body, type=MessageResult)
    assert decoded.turn == turn_view(RECORD)
    assert isinstance(decoded.turn, TurnView)
    assert [(d.model, d.steps, d.reason, d.usage.input_tokens) for d in decoded.turn.discarded] == [
        (d.model, d.steps, d.reason, d.usage.input_tokens) for d in RECORD.discarded
    ]


def test_records_are_frozen() -> None:
    with pytest.raises(AttributeError):
        RECORD.status = TurnStatus.COMPLETED  # type: ignore[misc]
