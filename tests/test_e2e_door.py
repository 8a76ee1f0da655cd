"""The OpenAI-compatible door (RFC 0010) with the official ``openai`` SDK as the client.

One daemon serves the module on its unix socket and on TCP (``--listen`` with
``AGENTD_API_TOKEN``: the SDK's ``api_key`` is the bearer token); the sync and async clients
talk to both. The scripted model answers: it quotes the user, and calls the ``clock`` tool when
the user's text names it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.daemon_harness import TIMEOUT, Daemon, free_port, running_daemon, wait_until

pytestmark = pytest.mark.e2e

TOKEN = "door-t0ken"


def door_config(hold: Path) -> str:
    return f"""
[intelligence]
provider = "scripted"
model = "echo-small"

[limits]
max_steps = 3

[[assistants]]
name = "main"
system = "You help."
first_message = "Hello from main."
tools = ["clock"]

[[assistants]]
name = "held"
tools = ["clock"]
intelligence = {{ options = {{ hold_file = "{hold}" }} }}

[[assistants]]
name = "looper"
tools = ["clock"]
intelligence = {{ options = {{ steps = 10 }} }}
"""


class Door:
    """The daemon, its TCP address, and SDK clients over both listeners."""

    def __init__(self, daemon: Daemon, port: int) -> None:
        self.daemon = daemon
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.tcp = openai.OpenAI(base_url=self.base_url, api_key=TOKEN, max_retries=0, timeout=TIMEOUT)
        self.unix = openai.OpenAI(
            base_url="http://agentd/v1",
            api_key="unused-on-the-socket",
            max_retries=0,
            timeout=TIMEOUT,
            http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.socket))),
        )


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Door]:
    tmp = tmp_path_factory.mktemp("door")
    port = free_port()
    with running_daemon(
        tmp, door_config(tmp / "never"), args=["--listen", f"127.0.0.1:{port}"], env={"AGENTD_API_TOKEN": TOKEN}
    ) as daemon:
        door = Door(daemon, port)
        wait_until(lambda: _answers(door), "the TCP listener to answer")
        try:
            yield door
        finally:
            door.tcp.close()
            door.unix.close()


def _answers(door: Door) -> bool:
    try:
        door.tcp.models.list()
    except openai.APIConnectionError:
        return False
    return True


def clients(door: Door) -> list[openai.OpenAI]:
    return [door.tcp, door.unix]


# --------------------------------------------------------------------------- models


def test_the_models_are_the_assistants(door: Door) -> None:
    for client in clients(door):
        models = client.models.list()
        assert [m.id for m in models.data] == ["main", "held", "looper"]
        assert all(m.object == "model" and m.owned_by == "agentd" and m.created > 0 for m in models.data)
        assert client.models.retrieve("held").id == "held"
        with pytest.raises(openai.NotFoundError) as caught:
            client.models.retrieve("gpt-nope")
        assert caught.value.code == "model_not_found"
        assert "main, held, looper" in caught.value.message


# --------------------------------------------------------------------------- chat completions


def test_a_chat_completion_is_a_turn_of_a_new_session_seeded_with_the_earlier_messages(door: Door) -> None:
    raw = door.tcp.chat.completions.with_raw_response.create(
        model="main",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": "Hello Ada."},
            {"role": "user", "content": "What is my name?"},
        ],
    )
    session = raw.headers["x-agentd-session"]
    completion = raw.parse()
    assert completion.object == "chat.completion"
    assert completion.model == "main"
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert "What is my name?" in (choice.message.content or "")
    turn = completion.id.removeprefix("chatcmpl-")
    assert completion.usage is not None and completion.usage.total_tokens > 0
    transcript = door.daemon.session(session)["transcript"]
    said = [(e["role"], e["content"]) for e in transcript if e["role"] != "system" or e["content"] == "Be brief."]
    assert said[:4] == [
        ("system", "Be brief."),
        ("user", "My name is Ada."),
        ("assistant", "Hello Ada."),
        ("user", "What is my name?"),
    ]
    assert "Hello from main." not in [e["content"] for e in transcript]  # no opener: the client spoke first
    assert [t["id"] for t in door.daemon.session(session)["turns"]] == [turn]


def test_x_agentd_session_continues_a_session_with_the_last_message(door: Door) -> None:
    first = door.unix.chat.completions.with_raw_response.create(
        model="main", messages=[{"role": "user", "content": "one"}]
    )
    session = first.headers["x-agentd-session"]
    second = door.unix.chat.completions.with_raw_response.create(
        model="main",
        messages=[{"role": "user", "content": "ignored, the session has it"}, {"role": "user", "content": "two"}],
        extra_headers={"X-Agentd-Session": session},
    )
    assert second.headers["x-agentd-session"] == session
    users = [e["content"] for e in door.daemon.session(session)["transcript"] if e["role"] == "user"]
    assert users == ["one", "two"]
    with pytest.raises(openai.NotFoundError):
        door.unix.chat.completions.create(
            model="main", messages=[{"role": "user", "content": "x"}], extra_headers={"X-Agentd-Session": "s_nope"}
        )


def test_a_chat_turn_cut_short_says_so_with_finish_reason_length(door: Door) -> None:
    completion = door.tcp.chat.completions.create(model="looper", messages=[{"role": "user", "content": "go"}])
    assert completion.choices[0].finish_reason == "length"


def test_a_running_session_answers_409_as_conflict_error(door: Door) -> None:
    session = door.daemon.new_session("held")
    door.daemon.send(session, "block", wait=False)
    try:
        with pytest.raises(openai.ConflictError) as caught:
            door.tcp.chat.completions.create(
                model="held", messages=[{"role": "user", "content": "x"}], extra_headers={"X-Agentd-Session": session}
            )
        assert caught.value.code == "turn_running"
        assert caught.value.response.headers["x-should-retry"] == "false"
    finally:
        door.daemon.json("POST", f"/v1/sessions/{session}/cancel", status=202)


def test_what_agentd_does_not_serve_is_a_400_naming_the_parameter(door: Door) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"tools": [tool]}, "tools", "unsupported_parameter"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
        ({"temperature": 0.5}, "temperature", "unknown_parameter"),
    ]
    for extra, param, code in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            door.tcp.chat.completions.create(model="main", messages=[{"role": "user", "content": "x"}], **extra)
        assert (caught.value.param, caught.value.code) == (param, code), caught.value.body
        assert caught.value.response.headers["x-should-retry"] == "false"
        assert caught.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as caught:
        door.tcp.chat.completions.create(model="main", messages=[{"role": "assistant", "content": "x"}])
    assert caught.value.param == "messages"


def test_a_wrong_api_key_on_tcp_is_an_authentication_error(door: Door) -> None:
    with (
        openai.OpenAI(base_url=door.base_url, api_key="wrong", max_retries=0) as wrong,
        pytest.raises(openai.AuthenticationError) as caught,
    ):
        wrong.models.list()
    assert caught.value.type == "authentication_error"


def test_an_idempotency_key_makes_one_chat_turn(door: Door) -> None:
    before = len(door.daemon.json("GET", "/v1/sessions?limit=10000", status=200))
    asked = {"model": "main", "messages": [{"role": "user", "content": "once"}]}
    first = door.tcp.chat.completions.with_raw_response.create(**asked, extra_headers={"Idempotency-Key": "chat-1"})
    again = door.tcp.chat.completions.with_raw_response.create(**asked, extra_headers={"Idempotency-Key": "chat-1"})
    assert again.parse().id == first.parse().id
    assert again.headers["x-agentd-session"] == first.headers["x-agentd-session"]
    assert again.headers["idempotent-replayed"] == "true"
    assert len(door.daemon.json("GET", "/v1/sessions?limit=10000", status=200)) == before + 1
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        door.tcp.chat.completions.create(
            model="main", messages=[{"role": "user", "content": "other"}], extra_headers={"Idempotency-Key": "chat-1"}
        )
    assert caught.value.code == "idempotency_key_reused"


# --------------------------------------------------------------------------- responses


def test_a_response_lists_the_answer_and_the_tools_agentd_ran(door: Door) -> None:
    for client in clients(door):
        response = client.responses.create(model="main", input="what does the clock say?")
        assert response.status == "completed"
        assert response.id.startswith("resp_t_")
        assert "clock" in response.output_text
        kinds = [item.type for item in response.output]
        assert kinds == ["mcp_call", "message"], kinds
        call = response.output[0]
        assert call.type == "mcp_call" and call.name == "clock" and call.server_label == "agentd"
        assert call.output and call.error is None
        assert response.usage is not None and response.usage.total_tokens > 0
        again = client.responses.retrieve(response.id)
        assert (again.id, again.status, again.output_text) == (response.id, "completed", response.output_text)


def test_previous_response_id_continues_only_from_the_latest_response(door: Door) -> None:
    first = door.tcp.responses.create(model="main", input="first", instructions="Answer in English.")
    second = door.tcp.responses.create(model="main", input="second", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    session = first.conversation.id if first.conversation else None
    assert session and second.conversation and second.conversation.id == session
    transcript = door.daemon.session(session)["transcript"]
    assert any(e["role"] == "system" and e["content"] == "Answer in English." for e in transcript)
    assert [e["content"] for e in transcript if e["role"] == "user"] == ["first", "second"]
    with pytest.raises(openai.BadRequestError) as caught:
        door.tcp.responses.create(model="main", input="third", previous_response_id=first.id)
    assert (caught.value.code, caught.value.param) == ("previous_response_not_latest", "previous_response_id")
    with pytest.raises(openai.BadRequestError) as caught:
        door.tcp.responses.create(model="main", input="x", previous_response_id=second.id, conversation=session)
    assert caught.value.code == "conflicting_parameters"
    with pytest.raises(openai.NotFoundError):
        door.tcp.responses.retrieve("resp_t_000000000000")


def test_a_response_cut_short_is_incomplete_with_its_reason(door: Door) -> None:
    response = door.unix.responses.create(model="looper", input="go")
    assert response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_steps"


def test_a_response_in_progress_is_cancelled(door: Door) -> None:
    conversation = door.tcp.conversations.create(metadata={"assistant": "held"})
    answers: list[Any] = []
    waiting = threading.Thread(
        target=lambda: answers.append(
            door.tcp.responses.create(model="held", input="wait", conversation=conversation.id)
        )
    )
    waiting.start()
    turn = wait_until(
        lambda: (t := door.daemon.session(conversation.id)["turns"]) and t[0]["id"], "the response's turn to start"
    )
    running = door.tcp.responses.retrieve(f"resp_{turn}")
    assert running.status == "in_progress" and running.usage is None
    cancelled = door.tcp.responses.cancel(f"resp_{turn}")
    assert cancelled.status == "cancelled"
    waiting.join(TIMEOUT)
    assert answers[0].status == "cancelled" and answers[0].id == f"resp_{turn}"
    with pytest.raises(openai.ConflictError):
        door.tcp.responses.cancel(f"resp_{turn}")


# --------------------------------------------------------------------------- conversations


def test_a_conversation_is_a_session_from_creation_to_deletion(door: Door) -> None:
    for client in clients(door):
        conversation = client.conversations.create(
            metadata={"assistant": "main"}, items=[{"type": "message", "role": "user", "content": "earlier"}]
        )
        assert conversation.metadata == {"assistant": "main"}
        assert client.conversations.retrieve(conversation.id).id == conversation.id
        response = client.responses.create(model="main", input="the clock, please", conversation=conversation.id)
        assert response.conversation and response.conversation.id == conversation.id
        items = client.conversations.items.list(conversation.id, order="asc")
        kinds = [(item.type, getattr(item, "role", None)) for item in items.data]
        assert kinds == [
            ("message", "system"),
            ("message", "user"),
            ("message", "user"),
            ("mcp_call", None),
            ("message", "assistant"),
        ], kinds
        newest = client.conversations.items.list(conversation.id, limit=1)
        assert [i.id for i in newest.data] == [items.data[-1].id] and newest.has_more
        deleted = client.conversations.delete(conversation.id)
        assert deleted.deleted and deleted.id == conversation.id
        assert door.daemon.session(conversation.id)["state"] == "closed"
        with pytest.raises(openai.NotFoundError):
            client.conversations.retrieve(conversation.id)


def test_a_conversation_refuses_metadata_it_would_not_keep(door: Door) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        door.tcp.conversations.create(metadata={"topic": "x"})
    assert caught.value.param == "metadata"
    with pytest.raises(openai.NotFoundError):
        door.tcp.conversations.create(metadata={"assistant": "nobody"})


# --------------------------------------------------------------------------- the async client


@pytest.mark.anyio
async def test_the_async_client_over_tcp_and_the_socket(door: Door) -> None:
    tcp = openai.AsyncOpenAI(base_url=door.base_url, api_key=TOKEN, max_retries=0, timeout=TIMEOUT)
    unix = openai.AsyncOpenAI(
        base_url="http://agentd/v1",
        api_key="unused",
        max_retries=0,
        timeout=TIMEOUT,
        http_client=httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(door.daemon.socket))),
    )
    for client in (tcp, unix):
        async with client:
            assert [m.id async for m in client.models.list()] == ["main", "held", "looper"]
            completion = await client.chat.completions.create(
                model="main", messages=[{"role": "user", "content": "async hello"}]
            )
            assert "async hello" in (completion.choices[0].message.content or "")
            response = await client.responses.create(model="main", input="async too")
            assert response.status == "completed" and "async too" in response.output_text
            conversation = await client.conversations.create()
            assert (await client.conversations.delete(conversation.id)).deleted
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve("resp_nope")


PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


def test_images_travel_as_data_urls_and_urls_are_refused_naming_the_part(door: Door) -> None:
    def ask(url: str) -> Any:
        return door.unix.chat.completions.with_raw_response.create(
            model="main",
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}],
                }
            ],
        )

    answered = ask(f"data:image/png;base64,{PNG}")
    session = answered.headers["x-agentd-session"]
    users = [e for e in door.daemon.session(session)["transcript"] if e["role"] == "user"]
    assert users[0]["images"] == [PNG] and users[0]["content"] == "look"
    with pytest.raises(openai.BadRequestError) as caught:
        ask("https://example.com/cat.png")
    assert caught.value.param == "messages[0].content[1].image_url"
