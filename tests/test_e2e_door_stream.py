"""The door's streamed answers (RFC 0010 §7) with the official ``openai`` SDK as the client.

The scripted model streams its reply in word-sized pieces (``chunk_ms``); it quotes the user and
calls the ``clock`` tool when the user's text names it, so a turn has a tool step and an answer.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.daemon_harness import TIMEOUT, Daemon, running_daemon, wait_until
from tests.fakes import FakeCall, FakeOpenAI, Fault, Reply
from tests.pg_harness import PgServer
from tests.test_e2e_door import TOKEN, Door, _answers
from tests.test_e2e_door import door_config as base_config
from tests.test_e2e_replicas import replicas

pytestmark = pytest.mark.e2e


def stream_config(hold: Path) -> str:
    return base_config(hold).replace('model = "echo-small"', 'model = "echo-small"\noptions = { chunk_ms = 5 }')


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Door]:
    from tests.daemon_harness import free_port

    tmp = tmp_path_factory.mktemp("doorstream")
    port = free_port()
    with running_daemon(
        tmp, stream_config(tmp / "never"), args=["--listen", f"127.0.0.1:{port}"], env={"AGENTD_API_TOKEN": TOKEN}
    ) as daemon:
        door = Door(daemon, port)
        wait_until(lambda: _answers(door), "the TCP listener to answer")
        try:
            yield door
        finally:
            door.tcp.close()
            door.unix.close()


def clients(door: Door) -> list[openai.OpenAI]:
    return [door.tcp, door.unix]


ASKED = "what does the clock say, twice over?"


# --------------------------------------------------------------------------- chat completions


def test_a_streamed_chat_completion_adds_up_to_the_non_streamed_answer(door: Door) -> None:
    for client in clients(door):
        whole = client.chat.completions.create(model="main", messages=[{"role": "user", "content": ASKED}])
        raw = client.chat.completions.with_raw_response.create(
            model="main", messages=[{"role": "user", "content": ASKED}], stream=True
        )
        session = raw.headers["x-agentd-session"]
        assert raw.headers["content-type"].startswith("text/event-stream")
        chunks = list(raw.parse())
        assert chunks[0].choices[0].delta.role == "assistant"
        texts = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert "".join(texts) == whole.choices[0].message.content
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
        turn = chunks[0].id.removeprefix("chatcmpl-")
        assert {c.id for c in chunks} == {f"chatcmpl-{turn}"} and chunks[-1].model == "main"
        assert [t["id"] for t in door.daemon.session(session)["turns"]] == [turn]


def test_include_usage_ends_with_a_usage_chunk_then_done(door: Door) -> None:
    body = {
        "model": "main",
        "messages": [{"role": "user", "content": "count me"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    lines: list[str] = []
    with (
        httpx.Client(transport=httpx.HTTPTransport(uds=str(door.daemon.socket)), timeout=TIMEOUT) as http,
        http.stream("POST", "http://agentd/v1/chat/completions", json=body) as answer,
    ):
        assert answer.status_code == 200
        lines = [line for line in answer.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    usage = openai.types.chat.ChatCompletionChunk.model_validate_json(lines[-2].removeprefix("data: "))
    assert usage.choices == [] and usage.usage is not None
    turn = usage.id.removeprefix("chatcmpl-")
    session = door.daemon.json("GET", "/v1/responses/resp_" + turn, status=200)["conversation"]["id"]
    stored = next(t for t in door.daemon.session(session)["turns"] if t["id"] == turn)["usage"]
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (
        stored["input_tokens"],
        stored["output_tokens"],
    )
    chunks = list(
        door.tcp.chat.completions.create(
            model="main",
            messages=[{"role": "user", "content": "count me"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.total_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])
    with pytest.raises(openai.BadRequestError) as caught:
        door.tcp.chat.completions.create(
            model="main", messages=[{"role": "user", "content": "x"}], stream=True, stream_options={"nope": True}
        )
    assert caught.value.param == "stream_options.nope"


def test_a_keyed_stream_replayed_answers_the_same_turn_as_a_short_stream(door: Door) -> None:
    asked: dict[str, Any] = {"model": "main", "messages": [{"role": "user", "content": "keyed"}], "stream": True}
    key = {"Idempotency-Key": "stream-1"}
    before = len(door.daemon.json("GET", "/v1/sessions?limit=10000", status=200))
    first = list(door.tcp.chat.completions.create(**asked, extra_headers=key))
    again = list(door.tcp.chat.completions.create(**asked, extra_headers=key))
    assert again[0].id == first[0].id
    text = "".join(c.choices[0].delta.content or "" for c in first if c.choices)
    assert "".join(c.choices[0].delta.content or "" for c in again if c.choices) == text
    assert len(door.daemon.json("GET", "/v1/sessions?limit=10000", status=200)) == before + 1


# --------------------------------------------------------------------------- responses

ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",  # the clock's mcp_call
    "response.output_item.done",
    "response.output_item.added",  # the answer
    "response.content_part.added",
]
CLOSING = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


def test_a_streamed_response_in_order_and_its_final_response(door: Door) -> None:
    for client in clients(door):
        with client.responses.stream(model="main", input=ASKED) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
        deltas = [k for k in kinds if k == "response.output_text.delta"]
        assert deltas  # how many: as the deltas were coalesced (RFC 0000 §7)
        assert [k for k in kinds if k != "response.output_text.delta"] == ORDER + CLOSING, kinds
        assert kinds[len(ORDER) : len(ORDER) + len(deltas)] == deltas
        assert final.status == "completed" and "clock" in final.output_text
        stored = client.responses.retrieve(final.id)
        assert stored.output_text == final.output_text
        assert [i.id for i in stored.output] == [i.id for i in final.output]


def test_create_stream_true_numbers_its_events_and_names_the_final_items(door: Door) -> None:
    events = list(door.unix.responses.create(model="main", input=ASKED, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    completed = events[-1]
    assert completed.type == "response.completed"
    assert [i.id for i in done] == [i.id for i in completed.response.output]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == completed.response.output_text


@pytest.mark.anyio
async def test_the_async_client_streams_over_tcp_and_the_socket(door: Door) -> None:
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
            whole = await client.chat.completions.create(model="main", messages=[{"role": "user", "content": ASKED}])
            streamed = await client.chat.completions.create(
                model="main", messages=[{"role": "user", "content": ASKED}], stream=True
            )
            text = "".join([c.choices[0].delta.content or "" async for c in streamed if c.choices])
            assert text == whole.choices[0].message.content
            async with client.responses.stream(model="main", input="async stream") as stream:
                async for _ in stream:
                    pass
                final = await stream.get_final_response()
            assert final.status == "completed" and "async stream" in final.output_text


def test_a_cancelled_turn_ends_its_streams_as_the_non_streamed_answer_would(door: Door) -> None:
    conversation = door.tcp.conversations.create(metadata={"assistant": "held"})
    events = iter(door.tcp.responses.create(model="held", input="wait", conversation=conversation.id, stream=True))
    created = next(events)
    assert created.type == "response.created" and created.response.status == "in_progress"
    door.tcp.responses.cancel(created.response.id)
    rest = list(events)
    assert rest[-1].type == "response.failed" and rest[-1].response.status == "cancelled"

    session = door.daemon.new_session("held")
    chunks = iter(
        door.unix.chat.completions.create(
            model="held",
            messages=[{"role": "user", "content": "wait"}],
            stream=True,
            extra_headers={"X-Agentd-Session": session, "Idempotency-Key": "held-stream"},
        )
    )
    first = next(chunks)
    with pytest.raises(openai.ConflictError) as busy:  # the key is held while its stream runs
        door.unix.chat.completions.create(
            model="held",
            messages=[{"role": "user", "content": "wait"}],
            stream=True,
            extra_headers={"X-Agentd-Session": session, "Idempotency-Key": "held-stream"},
        )
    assert busy.value.code == "idempotency_in_progress"
    door.daemon.json("POST", f"/v1/sessions/{session}/cancel", status=202)
    with pytest.raises(openai.APIError) as ended:
        list(chunks)
    assert ended.value.code == "turn_cancelled"
    assert first.id == "chatcmpl-" + door.daemon.session(session)["turns"][0]["id"]


def test_a_client_gone_mid_stream_leaves_the_turn_running_and_the_key_free(door: Door) -> None:
    session = door.daemon.new_session("held")
    asked: dict[str, Any] = {
        "model": "held",
        "messages": [{"role": "user", "content": "wait"}],
        "stream": True,
        "extra_headers": {"X-Agentd-Session": session, "Idempotency-Key": "gone-stream"},
    }
    stream = door.tcp.chat.completions.create(**asked)
    first = next(iter(stream))
    stream.close()  # the client goes away; the turn waits on its hold file
    turn = first.id.removeprefix("chatcmpl-")

    def retried() -> Any:
        try:
            return iter(door.tcp.chat.completions.create(**asked))
        except openai.ConflictError:  # until the server noticed the client went away
            return None

    again = wait_until(retried, "the key to be released once its stream ended")
    assert door.daemon.turn(session, turn, finished=False)["status"] == "pending"
    door.daemon.json("POST", f"/v1/sessions/{session}/cancel", status=202)
    with pytest.raises(openai.APIError) as ended:
        list(again)  # a short stream of the same turn: not begun again
    assert ended.value.code == "turn_cancelled"
    assert [t["id"] for t in door.daemon.session(session)["turns"]] == [turn]


# --------------------------------------------------------------------------- stream_reset


def swap_config(model: str, hold: Path) -> str:
    return f"""
[intelligence]
provider = "scripted"
model = "{model}"
options = {{ chunk_ms = 1, hold_file = "{hold}" }}

[[assistants]]
name = "main"
first_message_mode = "assistant-waits-for-user"
"""


def _swapped_mid_stream(daemon: Daemon, hold: Path, session: str, start: Callable[[], Iterator[Any]]) -> list[Any]:
    """What a door stream ``start`` gives when a restart-turn swap discards text it already sent."""
    native = daemon.events(session)
    stream = start()
    seen = [next(stream)]  # the turn was accepted: its step waits on the hold file
    native.wait("step.started", lambda d: True)
    daemon.write_config(swap_config("new-model", hold))
    daemon.signal(signal.SIGHUP)
    native.wait("swap.parked", lambda d: True)
    hold.touch()
    try:
        for event in stream:
            seen.append(event)
    except openai.APIError as exc:  # a chat stream's error: the SDK raises it
        seen.append(exc)
    return seen


def test_a_restart_after_text_went_out_ends_a_response_stream_with_stream_reset(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    with running_daemon(tmp_path, swap_config("old-model", hold), args=["--model-swap", "restart-turn"]) as daemon:
        client = unix_client(daemon)
        conversation = client.conversations.create()
        seen = _swapped_mid_stream(
            daemon,
            hold,
            conversation.id,
            lambda: iter(
                client.responses.create(model="main", input="say this twice", conversation=conversation.id, stream=True)
            ),
        )
        kinds = [e.type for e in seen]
        assert "response.output_text.delta" in kinds and kinds[-1] == "error", kinds
        assert seen[-1].code == "stream_reset"
        assert [e.sequence_number for e in seen] == list(range(len(seen)))
        sent = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
        assert sent and "[old-model] You said: say this twice".startswith(sent)
        response_id = seen[0].response.id
        final = wait_until(
            lambda: (r := client.responses.retrieve(response_id)).status == "completed" and r,
            "the turn to end after the reset",
        )
        assert final.output_text == "[new-model] You said: say this twice"
        client.close()


def test_a_restart_after_text_went_out_ends_a_chat_stream_with_stream_reset(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    with running_daemon(tmp_path, swap_config("old-model", hold), args=["--model-swap", "restart-turn"]) as daemon:
        client = unix_client(daemon)
        session = daemon.new_session()
        seen = _swapped_mid_stream(
            daemon,
            hold,
            session,
            lambda: iter(
                client.chat.completions.create(
                    model="main",
                    messages=[{"role": "user", "content": "say this twice"}],
                    stream=True,
                    extra_headers={"X-Agentd-Session": session},
                )
            ),
        )
        error = seen[-1]
        assert isinstance(error, openai.APIError) and error.code == "stream_reset", seen
        sent = "".join(c.choices[0].delta.content or "" for c in seen[:-1] if c.choices)
        assert sent and "[old-model] You said: say this twice".startswith(sent)
        turn = seen[0].id.removeprefix("chatcmpl-")
        assert daemon.turn(session, turn)["status"] == "completed"
        said = [e["content"] for e in daemon.session(session)["transcript"] if e["role"] == "assistant"]
        assert said[-1] == "[new-model] You said: say this twice"
        client.close()


def unix_client(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://agentd/v1",
        api_key="unused",
        max_retries=0,
        timeout=TIMEOUT,
        http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.socket))),
    )


TRANSFER_CONFIG = """
[intelligence]
provider = "scripted"
model = "echo-small"
options = { chunk_ms = 2 }

[[assistants]]
name = "front"
system = "You are the front desk."
first_message_mode = "assistant-waits-for-user"

[[assistants.transfers]]
to = "back"
message = "Over to back."

[[assistants]]
name = "back"
system = "You are the back office."
first_message = "Back office here."
"""


def test_text_a_transfer_adds_without_streaming_it_ends_the_streams(tmp_path: Path) -> None:
    asked = "please transfer me to back"
    with running_daemon(tmp_path, TRANSFER_CONFIG) as daemon:
        client = unix_client(daemon)
        whole = client.chat.completions.create(model="front", messages=[{"role": "user", "content": asked}])
        chunks = list(
            client.chat.completions.create(model="front", messages=[{"role": "user", "content": asked}], stream=True)
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content and "\n\n" in text, text
        assert chunks[-1].model == whole.model
        with client.responses.stream(model="front", input=asked) as stream:
            events = list(stream)
            final = stream.get_final_response()
        assert [e.sequence_number for e in events] == list(range(len(events)))
        done = [e.item.id for e in events if e.type == "response.output_item.done"]
        assert done == [item.id for item in final.output]
        stored = client.responses.retrieve(final.id)
        assert [i.id for i in stored.output] == done and stored.output_text == final.output_text
        client.close()


# --------------------------------------------------------------------------- a real wire: text before a tool call, a failover


def fake_config(endpoints: list[str]) -> str:
    return f"""
[intelligence]
provider = "openai"
endpoints = {json.dumps(endpoints)}
model = "fake-model"
api_key_env = "DOOR_STREAM_KEY"

[[assistants]]
name = "main"
system = "You help."
first_message_mode = "assistant-waits-for-user"
tools = ["clock"]
"""


def test_text_before_a_tool_call_is_part_of_the_streamed_answer(tmp_path: Path) -> None:
    with (
        FakeOpenAI(default=Reply(content="It is noon, I see.", pieces=4)) as server,
        running_daemon(tmp_path, fake_config([server.url]), env={"DOOR_STREAM_KEY": "k"}) as daemon,
    ):
        client = unix_client(daemon)
        looks = Reply(content="Let me look at the clock.", tool_calls=(FakeCall("clock"),), pieces=3)
        server.script(looks)  # each turn's first step; its second is the default answer
        whole = client.chat.completions.create(model="main", messages=[{"role": "user", "content": "time?"}])
        server.script(looks)
        chunks = list(
            client.chat.completions.create(model="main", messages=[{"role": "user", "content": "time?"}], stream=True)
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content == "Let me look at the clock.\n\nIt is noon, I see."
        server.script(looks)
        with client.responses.stream(model="main", input="time?") as stream:
            events = list(stream)
            final = stream.get_final_response()
        added = [e.item.type for e in events if e.type == "response.output_item.added"]
        assert added == ["message", "mcp_call", "message"] == [i.type for i in final.output]
        done = [e.item.id for e in events if e.type == "response.output_item.done"]
        assert done == [i.id for i in final.output] == [i.id for i in client.responses.retrieve(final.id).output]
        assert final.output_text == "Let me look at the clock.It is noon, I see."
        client.close()


def test_a_failover_after_text_went_out_ends_the_stream_with_stream_reset(tmp_path: Path) -> None:
    midway = threading.Event()
    partial = Reply(content="doomed words that the failover takes back", pieces=8, midway=midway)
    answer = "the answer that stands"
    with (
        FakeOpenAI(default=Reply(content=answer)) as dying,
        FakeOpenAI(default=Reply(content=answer, pieces=4)) as healthy,
        running_daemon(tmp_path, fake_config([dying.url, healthy.url]), env={"DOOR_STREAM_KEY": "k"}) as daemon,
    ):
        dying.script(Fault("drop", after=4, reply=partial))
        client = unix_client(daemon)
        chunks: list[Any] = []
        stream = client.chat.completions.create(
            model="main", messages=[{"role": "user", "content": "fail over please"}], stream=True
        )

        def read() -> None:
            for chunk in stream:
                chunks.append(chunk)
                if "doomed" in (chunk.choices[0].delta.content or ""):
                    midway.set()  # text went out: let the fault cut the answer

        try:
            with pytest.raises(openai.APIError) as reset:
                read()
        finally:
            midway.set()
        assert reset.value.code == "stream_reset"
        assert "doomed" in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        turn = chunks[0].id.removeprefix("chatcmpl-")
        final = wait_until(
            lambda: (r := client.responses.retrieve(f"resp_{turn}")).status == "completed" and r, "the turn's end"
        )
        assert final.output_text == answer
        client.close()


# --------------------------------------------------------------------------- replicas


def test_a_stream_for_a_session_last_run_on_another_replica_adds_up_to_its_answer(tmp_path: Path, pg: PgServer) -> None:
    with replicas(tmp_path, pg, 2) as (started, _hold):
        a, b = started
        session = a.new_session("main")
        a.send(session, "warm on a")  # its last turn ran on a; b, receiving the next, runs it (RFC 0009 §7)
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(b.socket)), timeout=TIMEOUT) as http:
            client = openai.OpenAI(base_url="http://agentd/v1", api_key="unused", max_retries=0, http_client=http)
            chunks = list(
                client.chat.completions.create(
                    model="main",
                    messages=[{"role": "user", "content": "streamed through b"}],
                    stream=True,
                    extra_headers={"X-Agentd-Session": session},
                )
            )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        turn = chunks[0].id.removeprefix("chatcmpl-")
        stored = [e["content"] for e in a.entries(session, turn) if e["role"] == "assistant"]
        assert text == "\n\n".join(stored) and "streamed through b" in text
        assert chunks[-1].choices[0].finish_reason == "stop"
