"""The door's pure parts (RFC 0010): the turn-status table, items, and the error shape and headers."""

from __future__ import annotations

import json

import pytest
from starlette.requests import Request

from agentd.budget import TurnStatus, Usage
from agentd.door.errors import Unsupported, error_of
from agentd.door.outcome import OUTCOMES, TurnFailed, chat_completion, items_of, response_object
from agentd.errors import BadInput, Conflict, Draining, KeyInUse, NotEnded, StoreDown, Unavailable
from agentd.records import PENDING
from agentd.views import Entry, ToolCallView, TurnView


def request(headers: dict[str, str] | None = None) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return Request({"type": "http", "method": "POST", "path": "/v1/responses", "headers": raw})


def turn(status: str, error: str | None = None) -> TurnView:
    return TurnView(id="t_1", status=status, usage=Usage(3, 4), started_at="2026-01-01T00:00:00.000Z", error=error)


ENTRIES = [
    Entry(seq=2, turn="t_1", role="user", content="hi"),
    Entry(
        seq=3,
        turn="t_1",
        role="assistant",
        content="",
        tool_calls=[ToolCallView(id="c1", name="time:now", arguments={"tz": "UTC"})],
        model="m",
        assistant="main",
    ),
    Entry(seq=4, turn="t_1", role="tool", content="noon", name="time:now", tool_call_id="c1"),
    Entry(seq=5, turn="t_1", role="assistant", content="It is noon.", model="m", assistant="main"),
]


def test_every_turn_status_has_an_openai_shape_and_none_is_a_silent_partial() -> None:
    assert set(OUTCOMES) == {s.value for s in TurnStatus} | {PENDING}
    for status, outcome in OUTCOMES.items():
        whole = status in (TurnStatus.COMPLETED, TurnStatus.TRANSFERRED)
        assert (outcome.status == "completed") == whole, status
        assert (outcome.finish_reason == "stop") == whole, status
        if outcome.status == "incomplete":
            assert outcome.reason and outcome.finish_reason == "length"
        if outcome.status in ("failed", "cancelled"):
            assert outcome.finish_reason is None and outcome.chat_error is not None


def test_a_response_shows_tool_calls_as_mcp_calls_and_text_as_messages() -> None:
    shown = response_object(turn("completed"), ENTRIES, session="s_1", model="main")
    assert shown.id == "resp_t_1" and shown.status == "completed" and shown.created_at == 1767225600
    assert [type(item).__name__ for item in shown.output] == ["McpCall", "OutputMessage"]
    call = shown.output[0]
    assert (call.server_label, call.name, json.loads(call.arguments), call.output) == (  # type: ignore[union-attr]
        "time",
        "time:now",
        {"tz": "UTC"},
        "noon",
    )
    assert shown.usage is not None and shown.usage.total_tokens == 7
    listed = items_of(ENTRIES, session="s_1", inputs=True)
    assert [(type(i).__name__, getattr(i, "role", None)) for i in listed] == [
        ("OutputMessage", "user"),
        ("McpCall", None),
        ("OutputMessage", "assistant"),
    ]


def test_a_turn_that_ended_short_is_marked_so() -> None:
    shown = response_object(turn("deadline"), ENTRIES, session="s_1", model="main")
    assert shown.status == "incomplete" and shown.incomplete_details and shown.incomplete_details.reason == "deadline"
    failed = response_object(turn("failed", "boom"), ENTRIES[:1], session="s_1", model="main")
    assert failed.status == "failed" and failed.error and failed.error.message == "boom"
    assert chat_completion(turn("exhausted_tokens"), ENTRIES, model="main").choices[0].finish_reason == "length"
    for status, kind in (("cancelled", Conflict), ("intel_unavailable", Unavailable), ("failed", TurnFailed)):
        with pytest.raises(kind) as caught:
            chat_completion(turn(status), ENTRIES[:1], model="main")
        assert caught.value.turn == "t_1" and caught.value.code == f"turn_{status}"


@pytest.mark.parametrize(
    ("error", "keyed", "status", "headers"),
    [
        (BadInput("bad"), False, 400, {"x-should-retry": "false"}),
        (Conflict("busy", code="turn_running"), False, 409, {"x-should-retry": "false"}),
        (KeyInUse("later"), True, 409, {"x-should-retry": "true", "retry-after": "1"}),
        (Draining("stopping"), False, 503, {"x-should-retry": "true", "retry-after": "5"}),
        (NotEnded("cut", turn="t_1"), False, 503, {"x-should-retry": "false"}),
        (NotEnded("cut", turn="t_1"), True, 503, {}),
        (StoreDown("down"), False, 503, {}),
    ],
)
def test_door_errors_say_whether_a_retry_helps(
    error: Exception, keyed: bool, status: int, headers: dict[str, str]
) -> None:
    assert isinstance(error, BadInput | Conflict | Unavailable)
    answer = error_of(error, request({"Idempotency-Key": "k"} if keyed else {}))
    assert answer.status_code == status
    shown = {k: v for k, v in answer.headers.items() if k in ("x-should-retry", "retry-after")}
    assert shown == headers
    body = json.loads(answer.body)
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == ("server_error" if status >= 500 else "invalid_request_error")


def test_the_parameter_a_door_error_is_about_is_named() -> None:
    body = json.loads(error_of(Unsupported("tools", "no tools"), request()).body)
    assert (body["error"]["param"], body["error"]["code"]) == ("tools", "unsupported_parameter")
    unknown = BadInput("invalid request body: Object contains unknown field `seed`")
    body = json.loads(error_of(unknown, request()).body)
    assert (body["error"]["param"], body["error"]["code"]) == ("seed", "unknown_parameter")
    wrong = BadInput("invalid request body: Expected `str`, got `int` - at `$.model`")
    assert json.loads(error_of(wrong, request()).body)["error"]["param"] == "model"
