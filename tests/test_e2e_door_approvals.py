"""Approvals through the door (RFC 0010 §8, RFC 0012 §9) with the official ``openai`` SDK.

A Response whose turn waits for approval lists ``mcp_approval_request`` items; a request with
``previous_response_id`` and ``mcp_approval_response`` items decides them and answers the rest
of the turn (streamed too). A chat completion's turn that waits is 409 ``approval_required``.
The scripted model calls every tool the user's text names; ``record`` (``tests.tooling``) is
side-effecting and appends a line to ``tools.log`` each time it runs, so its runs are counted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response
from openai.types.responses.response_output_item import McpApprovalRequest, McpCall

from tests.daemon_harness import TIMEOUT, Daemon, running_daemon

pytestmark = pytest.mark.e2e

CONFIG = """
[intelligence]
provider = "scripted"
model = "echo-small"
options = { chunk_ms = 5 }

[[assistants]]
name = "main"
tools = ["tests.tooling:record", "clock"]
require_approval = ["tests.tooling:record"]
"""


class Door:
    """The daemon, its working directory, and an SDK client over the unix socket."""

    def __init__(self, daemon: Daemon, tmp: Path) -> None:
        self.daemon = daemon
        self.tmp = tmp
        self.client = openai.OpenAI(
            base_url="http://agentd/v1",
            api_key="unused-on-the-socket",
            max_retries=0,
            timeout=TIMEOUT,
            http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.socket))),
        )

    def runs(self, label: str) -> int:
        """How many times ``record`` ran with ``label``."""
        path = self.tmp / "tools.log"
        lines = path.read_text().splitlines() if path.exists() else []
        return sum(1 for line in lines if line == f"record {label}")


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Door]:
    tmp = tmp_path_factory.mktemp("doorapprovals")
    with running_daemon(tmp, CONFIG) as daemon:
        door = Door(daemon, tmp)
        try:
            yield door
        finally:
            door.client.close()


def ask(label: str) -> str:
    return f'call tool record {{"label": "{label}"}}'


def requests_of(response: Response) -> list[McpApprovalRequest]:
    return [item for item in response.output if isinstance(item, McpApprovalRequest)]


def answer(request: McpApprovalRequest, approve: bool, reason: str | None = None) -> dict[str, Any]:
    item: dict[str, Any] = {"type": "mcp_approval_response", "approval_request_id": request.id, "approve": approve}
    if reason is not None:
        item["reason"] = reason
    return item


def session_of(door: Door, response: Response) -> Any:
    assert response.conversation is not None
    return door.daemon.session(response.conversation.id)


def turn_of(door: Door, response: Response) -> dict[str, Any]:
    turn = response.id.removeprefix("resp_")
    return next(t for t in session_of(door, response)["turns"] if t["id"] == turn)


# --------------------------------------------------------------------------- responses


def test_a_response_asks_for_approval_then_goes_on_once_approved(door: Door) -> None:
    asked = door.client.responses.create(model="main", input=ask("approve-me"))
    assert asked.status == "completed" and asked.usage is None
    [request] = requests_of(asked)
    assert (request.type, request.name, request.server_label) == ("mcp_approval_request", "record", "agentd")
    assert json.loads(request.arguments) == {"label": "approve-me"}
    native = door.daemon.json("GET", f"/v1/approvals/{request.id}", status=200)
    assert native["status"] == "pending" and native["turn"] == asked.id.removeprefix("resp_")
    assert door.runs("approve-me") == 0
    assert [r.id for r in requests_of(door.client.responses.retrieve(asked.id))] == [request.id]
    assert session_of(door, asked)["state"] == "awaiting_approval"

    went_on = door.client.responses.create(
        model="main", previous_response_id=asked.id, input=[answer(request, True, "fine")]
    )
    assert went_on.status == "completed" and went_on.id == asked.id
    assert went_on.previous_response_id == asked.id
    kinds = [item.type for item in went_on.output]
    assert kinds == ["mcp_call", "message"], kinds
    call = went_on.output[0]
    assert isinstance(call, McpCall) and call.name == "record" and call.output == "recorded approve-me"
    assert went_on.output_text and went_on.usage is not None and went_on.usage.total_tokens > 0
    assert door.runs("approve-me") == 1
    assert turn_of(door, went_on)["status"] == "completed"
    assert door.daemon.json("GET", f"/v1/approvals/{request.id}", status=200)["reason"] == "fine"
    # The whole turn, as it is now.
    assert door.client.responses.retrieve(asked.id).output_text.endswith(went_on.output_text)

    with pytest.raises(openai.ConflictError) as caught:
        door.client.responses.create(model="main", previous_response_id=asked.id, input=[answer(request, False)])
    assert caught.value.code == "already_decided"
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert door.runs("approve-me") == 1


def test_a_rejected_call_is_not_run_and_the_model_is_told(door: Door) -> None:
    asked = door.client.responses.create(model="main", input=ask("reject-me"))
    [request] = requests_of(asked)
    went_on = door.client.responses.create(
        model="main", previous_response_id=asked.id, input=[answer(request, False, "not today")]
    )
    assert went_on.status == "completed"
    call = went_on.output[0]
    assert isinstance(call, McpCall) and call.output is None
    assert call.error and "rejected" in call.error and "not today" in call.error
    assert door.runs("reject-me") == 0
    assert turn_of(door, went_on)["status"] == "completed"


def test_one_decision_of_two_answers_the_call_that_still_waits(door: Door) -> None:
    asked = door.client.responses.create(model="main", input=f"{ask('one')} and {ask('two')}")
    first, second = requests_of(asked)
    still = door.client.responses.create(model="main", previous_response_id=asked.id, input=[answer(first, True)])
    assert [r.id for r in requests_of(still)] == [second.id]
    assert door.runs("one") == 0  # no call of the step runs before all are decided
    done = door.client.responses.create(model="main", previous_response_id=asked.id, input=[answer(second, True)])
    assert [item.type for item in done.output] == ["mcp_call", "mcp_call", "message"]
    assert (door.runs("one"), door.runs("two")) == (1, 1)


def test_what_a_decision_request_must_name(door: Door) -> None:
    asked = door.client.responses.create(model="main", input=ask("named"))
    [request] = requests_of(asked)
    with pytest.raises(openai.BadRequestError) as caught:
        door.client.responses.create(model="main", input=[answer(request, True)])
    assert caught.value.param == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as caught:
        door.client.responses.create(
            model="main",
            previous_response_id=asked.id,
            input=[answer(request, True), {"role": "user", "content": "and more"}],
        )
    assert caught.value.param == "input[1]"
    with pytest.raises(openai.NotFoundError):
        door.client.responses.create(
            model="main",
            previous_response_id=asked.id,
            input=[{"type": "mcp_approval_response", "approval_request_id": "ap_nope", "approve": True}],
        )
    other = door.client.responses.create(model="main", input="hello")
    with pytest.raises(openai.BadRequestError) as caught:
        door.client.responses.create(model="main", previous_response_id=other.id, input=[answer(request, True)])
    assert caught.value.param == "input[0].approval_request_id"
    # A new message while the turn waits is refused: it is decided first.
    with pytest.raises(openai.ConflictError):
        door.client.responses.create(model="main", previous_response_id=asked.id, input="something else")
    door.client.responses.create(model="main", previous_response_id=asked.id, input=[answer(request, False)])


# --------------------------------------------------------------------------- streamed


def test_a_streamed_response_ends_with_the_approval_request_and_the_rest_streams(door: Door) -> None:
    events = list(door.client.responses.create(model="main", input=ask("streamed"), stream=True))
    assert all(e.type != "error" for e in events), events
    assert events[-1].type == "response.completed"
    final = events[-1].response
    [request] = requests_of(final)
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.id for i in added if i.type == "mcp_approval_request"] == [request.id]
    assert door.runs("streamed") == 0

    with door.client.responses.stream(
        model="main", previous_response_id=final.id, input=[answer(request, True)]
    ) as stream:
        kinds = [event.type for event in stream]
        went_on = stream.get_final_response()
    assert "error" not in kinds and kinds[-1] == "response.completed", kinds
    assert "response.output_text.delta" in kinds
    assert [item.type for item in went_on.output] == ["mcp_call", "message"]
    assert went_on.output_text and door.runs("streamed") == 1
    stored = door.client.responses.retrieve(final.id)
    assert stored.output_text.endswith(went_on.output_text)
    assert [i.id for i in stored.output if i.type == "mcp_call"] == [went_on.output[0].id]


# --------------------------------------------------------------------------- chat completions


def test_a_chat_turn_that_waits_is_409_approval_required(door: Door) -> None:
    with pytest.raises(openai.ConflictError) as caught:
        door.client.chat.completions.create(model="main", messages=[{"role": "user", "content": ask("chat")}])
    assert caught.value.code == "approval_required"
    assert caught.value.response.headers["x-should-retry"] == "false"
    pending = [a for a in door.daemon.json("GET", "/v1/approvals?status=pending", status=200) if a["tool"] == "record"]
    named = [a for a in pending if a["id"] in caught.value.message]
    assert len(named) == 1 and "(record)" in caught.value.message
    door.daemon.json("POST", f"/v1/approvals/{named[0]['id']}", {"decision": "reject"}, status=200)

    with pytest.raises(openai.APIError) as streamed:
        list(
            door.client.chat.completions.create(
                model="main", messages=[{"role": "user", "content": ask("chat-stream")}], stream=True
            )
        )
    assert streamed.value.code == "approval_required"
    assert door.runs("chat") == 0 and door.runs("chat-stream") == 0


# --------------------------------------------------------------------------- idempotency keys


def test_a_keyed_request_retried_after_its_turn_parked_finds_it_waiting(door: Door) -> None:
    """A chat error releases its key (RFC 0010 §2): retried, the key's turn is found waiting — the
    same approvals, no second turn; a keyed stream retried is a short stream of the same wait."""
    key = {"Idempotency-Key": "door-approval-chat"}
    asked = [{"role": "user", "content": ask("keyed-chat")}]
    with pytest.raises(openai.ConflictError) as first:
        door.client.chat.completions.create(model="main", messages=asked, extra_headers=key)  # type: ignore[arg-type]
    with pytest.raises(openai.ConflictError) as again:
        door.client.chat.completions.create(model="main", messages=asked, extra_headers=key)  # type: ignore[arg-type]
    assert again.value.code == "approval_required" and again.value.message == first.value.message
    waiting = [
        a for a in door.daemon.json("GET", "/v1/approvals?status=pending", status=200) if a["id"] in first.value.message
    ]
    assert len(waiting) == 1
    door.daemon.json("POST", f"/v1/approvals/{waiting[0]['id']}", {"decision": "reject"}, status=200)

    streamed = {"Idempotency-Key": "door-approval-stream"}
    events = list(door.client.responses.create(model="main", input=ask("keyed"), stream=True, extra_headers=streamed))
    replayed = list(door.client.responses.create(model="main", input=ask("keyed"), stream=True, extra_headers=streamed))
    assert events[-1].type == replayed[-1].type == "response.completed"
    [request] = requests_of(events[-1].response)
    assert [r.id for r in requests_of(replayed[-1].response)] == [request.id]
    assert replayed[-1].response.id == events[-1].response.id
    door.client.responses.create(
        model="main", previous_response_id=events[-1].response.id, input=[answer(request, True)]
    )
    assert door.runs("keyed") == 1
