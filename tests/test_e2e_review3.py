"""Hostile review (wave-review3) of the wave's console, door, usage and approvals: each test here is
a break found, through the real daemon; each was a strict xfail until it was fixed, and stays as a
regression test."""

from __future__ import annotations

import contextlib
import json
import re
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.daemon_harness import TIMEOUT, Daemon, free_port, running_daemon, wait_until
from tests.fakes import FakeCall, FakeOpenAI, Reply

pytestmark = pytest.mark.e2e

TOKEN = "review3-console-token-8c1f2a"
CONFIG = """
[[assistants]]
name = "main"
first_message_mode = "assistant-waits-for-user"
"""


def running(tmp: Path, config: str = CONFIG) -> contextlib.AbstractContextManager[Daemon]:
    """A daemon on the unix socket (the harness's client)."""
    return running_daemon(tmp, config)


#: The proxy in front of agentd connects from loopback here (a k8s ingress: from its pod's address).
PROXIED_CONFIG = (
    """
[server]
trusted_proxies = ["127.0.0.1"]
"""
    + CONFIG
)


def proxied_login(tmp_path: Path, config: str) -> tuple[httpx.Response, list[str]]:
    """Log in to the console as a browser on https://<host> does through a TLS-terminating proxy
    (which forwards ``X-Forwarded-Proto: https``, the original ``Host``, and the browser's cookies,
    Secure ones included: the browser's side is https). The login's answer and the login form's
    Set-Cookie headers."""
    port = free_port()
    daemon = Daemon(tmp_path, config, args=["--listen", f"127.0.0.1:{port}"], env={"AGENTD_API_TOKEN": TOKEN})
    daemon.start()
    try:
        host = f"127.0.0.1:{port}"
        proxied = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "10.0.0.1", "Host": host}
        with httpx.Client(base_url=f"http://{host}", timeout=TIMEOUT, headers=proxied) as browser:
            wait_until(lambda: browser.get("/console/login").status_code == 200, "the console to answer")
            form = browser.get("/console/login")
            csrf = re.search(r'name="csrf" value="([^"]+)"', form.text)
            assert csrf is not None, form.text
            answer = browser.post(
                "/console/login",
                data={"token": TOKEN, "csrf": csrf.group(1), "next": "/console/"},
                headers={
                    "Origin": f"https://{host}",
                    "Sec-Fetch-Site": "same-origin",
                    # The browser is on https: it sends its Secure cookies too, which the proxy
                    # forwards (httpx's jar keeps them off this plain-http hop).
                    "Cookie": "; ".join(f"{c.name}={c.value}" for c in browser.cookies.jar),
                },
            )
            return answer, form.headers.get_list("set-cookie")
    finally:
        daemon.stop()


def test_the_console_logs_in_behind_a_tls_terminating_proxy(tmp_path: Path) -> None:
    """agentd serves plain HTTP; in production an ingress terminates TLS and forwards with
    ``X-Forwarded-Proto: https`` and the original ``Host``. The browser's form post then carries
    ``Origin: https://<host>``, which ``same_origin`` (agentd/console/auth.py) compared with
    ``request.url.scheme`` — ``http`` — so the login (and every other form) was 403 and the console
    could not be used at all; nor was its cookie marked Secure. With the proxy's address in
    ``[server] trusted_proxies`` the request's scheme is the one the browser used."""
    answer, cookies = proxied_login(tmp_path, PROXIED_CONFIG)
    assert answer.status_code == 303, f"{answer.status_code}: {re.findall('refused[^<]*', answer.text)}"
    assert all("Secure" in cookie for cookie in cookies) and cookies, cookies
    logged_in = answer.headers.get_list("set-cookie")
    assert any(c.startswith("agentd_console=") and "Secure" in c for c in logged_in), logged_in


def test_forwarded_headers_are_believed_from_no_one_by_default(tmp_path: Path) -> None:
    """Without ``[server] trusted_proxies`` nobody's ``X-Forwarded-Proto`` counts, loopback's
    included (uvicorn's own default trusts it): the request stays http, so an https Origin is
    another origin and the cookie is not Secure."""
    answer, cookies = proxied_login(tmp_path, CONFIG)
    assert answer.status_code == 403, f"{answer.status_code}: {answer.text[:300]}"
    assert "another origin" in answer.text
    assert cookies and not any("Secure" in cookie for cookie in cookies), cookies


def test_a_retried_response_continuing_a_conversation_is_replayed_not_refused(tmp_path: Path) -> None:
    """The SDKs retry a request whose answer was lost (a timeout, a reset connection) with the same
    ``Idempotency-Key``. ``responses.create`` (agentd/door/responses.py) checks ``previous_response_id``
    against the session's latest turn *before* it looks at the key (``idempotent``): the first attempt
    made its own turn the latest, so the retry is refused — the client is told its request failed,
    and never learns the id of the response it did create."""
    with running(tmp_path) as daemon:
        first = daemon.json("POST", "/v1/responses", {"model": "main", "input": "hello"}, status=200)
        ask = {"model": "main", "input": "and again", "previous_response_id": first["id"]}
        key = {"Idempotency-Key": "review3-continue-1"}
        assert daemon.client is not None
        created = daemon.client.post("/v1/responses", json=ask, headers=key)
        assert created.status_code == 200, created.text
        retried = daemon.client.post("/v1/responses", json=ask, headers=key)
        assert retried.status_code == 200, retried.text
        assert retried.headers.get("idempotent-replayed") == "true"
        assert retried.json()["id"] == created.json()["id"]


APPROVAL_CONFIG = """
[intelligence]
provider = "scripted"
model = "echo-small"

[[prices]]
model = "echo-small"
input_per_mtok = "1000"
output_per_mtok = "2000"

[[assistants]]
name = "main"
tools = ["tests.tooling:record", "clock"]
require_approval = ["tests.tooling:record"]
"""


def test_a_turn_that_waited_for_approval_is_priced_for_every_model_call_it_made(tmp_path: Path) -> None:
    """The step that asked for the call was a paid model call. On resume the child restores the
    parked run's usage total (``attempt.budget.usage``) but not its per-(assistant, model) spend
    (``_Attempt.spend``, agentd/child/turn.py), and only that spend is priced (``price_record``) and
    written to ``turn_spend``: the turn's and session's ``cost`` and ``GET /v1/usage`` leave out every
    call before the park, while the token totals count them."""
    with running(tmp_path, APPROVAL_CONFIG) as daemon:
        session = daemon.new_session()
        answer = daemon.send(session, "record please")
        turn = answer["turn"]["id"]
        [waiting] = answer["approvals"]
        daemon.json("POST", f"/v1/approvals/{waiting['id']}", {"decision": "approve"}, status=200)
        ended = daemon.turn(session, turn)
        assert ended["status"] == "completed"
        usage = ended["usage"]
        spent = daemon.session(session)["usage"]["by_model"]
        by_usage_report = daemon.json("GET", "/v1/usage?group_by=model", status=200)["groups"]
        assert usage["requests"] == 2, usage  # the call that asked, and the one after the tool ran
        assert sum(m["requests"] for m in spent) == usage["requests"], (usage, spent)
        assert sum(g["requests"] for g in by_usage_report) == usage["requests"], by_usage_report
        price_in, price_out = Decimal(1000), Decimal(2000)
        expected = (usage["input_tokens"] * price_in + usage["output_tokens"] * price_out) / Decimal(1_000_000)
        assert Decimal(usage["cost"]["amount"]) == expected, usage


def test_a_turn_cancelled_while_awaiting_approval_keeps_the_spend_of_its_parked_run(tmp_path: Path) -> None:
    """``end_awaiting`` (agentd/supervisor/turns/owner.py) ends the waiting turn through
    ``end_without_result`` with an empty record, dropping the parked run whose ``usage`` the store
    holds: the model call that asked for the tool is not counted anywhere — the turn, the session,
    ``GET /v1/usage`` and the metrics all say nothing was spent (RFC 0011 §6 lists only calls that
    failed and turns whose child crashed as not counted)."""
    with running(tmp_path, APPROVAL_CONFIG) as daemon:
        session = daemon.new_session()
        turn = daemon.send(session, "record please")["turn"]["id"]
        daemon.json("POST", f"/v1/sessions/{session}/cancel", status=202)
        ended = daemon.turn(session, turn)
        assert ended["status"] == "cancelled"
        assert ended["usage"]["requests"] == 1, ended["usage"]
        assert ended["usage"]["output_tokens"] > 0, ended["usage"]


def transfer_config(url: str, mode: str = "rolling-history") -> str:
    return f"""
[intelligence]
provider = "openai"
endpoints = ["{url}"]
model = "fake-model"
api_key_env = "REVIEW3_KEY"

[[assistants]]
name = "front"
system = "You are the front desk."
first_message_mode = "assistant-waits-for-user"

[[assistants.transfers]]
to = "back"
message = "Over to back."
mode = "{mode}"

[[assistants]]
name = "back"
system = "You are the back office."
first_message = "Back office here."
"""


#: The front desk says something, then transfers (a model's usual way of handing over).
HANDS_OVER = Reply(content="Let me hand you over.", tool_calls=(FakeCall("transfer_to_back"),), pieces=3)


def sse_events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[len("data:") :]) for line in text.splitlines() if line.startswith("data:")]


def test_a_streamed_response_of_a_transfer_after_text_completes(tmp_path: Path) -> None:
    """The stream names a message item ``msg_<turn>_<seq>`` from the seq it predicts (the user
    message's + 1, agentd/door/responsestream.py); a transfer rewrites the session's transcript with
    new seqs (RFC 0004 §9), so the final Response's items have other ids, ``stream_end`` finds a shown
    item missing and sends ``error`` ``stream_reset`` ("the turn goes on" — it has ended, completed):
    the SDK raises for a turn that succeeded, in the default transfer mode."""
    with (
        FakeOpenAI(default=Reply(content="fine")) as server,
        running_daemon(tmp_path, transfer_config(server.url), env={"REVIEW3_KEY": "k"}) as daemon,
    ):
        assert daemon.client is not None
        server.script(HANDS_OVER)
        answer = daemon.client.post("/v1/responses", json={"model": "front", "input": "help", "stream": True})
        assert answer.status_code == 200, answer.text
        events = sse_events(answer.text)
        final = next((e["response"] for e in events if e["type"] == "response.completed"), None)
        assert final is not None, [(e["type"], e.get("code")) for e in events][-2:]
        stored = daemon.json("GET", f"/v1/responses/{final['id']}", status=200)
        done = [e["item"]["id"] for e in events if e["type"] == "response.output_item.done"]
        assert done == [item["id"] for item in stored["output"]]


def test_a_streamed_chat_completion_of_a_delete_history_transfer_adds_up_to_its_answer(tmp_path: Path) -> None:
    """RFC 0010 §7: the chunks join to exactly the non-streamed ``content``. With ``mode =
    "delete-history"`` the transfer deletes the step's text the stream already sent (the turn's
    entries are only S2 and F2 afterwards), so ``_ending`` (agentd/door/chatstream.py) found the answer
    did not start with what was sent and ended the completed turn's stream with ``stream_reset``.
    Fixed by RFC 0010 §7's rule for text a transfer removes: it was said and stays as sent, and the
    stored answer follows it after a blank line (a stream cannot unsay it, and the transcript,
    the destination's view, RFC 0004 §9, does not keep it)."""
    with (
        FakeOpenAI(default=Reply(content="fine")) as server,
        running_daemon(tmp_path, transfer_config(server.url, "delete-history"), env={"REVIEW3_KEY": "k"}) as daemon,
    ):
        assert daemon.client is not None
        server.script(HANDS_OVER)
        ask = {"model": "front", "messages": [{"role": "user", "content": "help"}], "stream": True}
        answer = daemon.client.post("/v1/chat/completions", json=ask)
        assert answer.status_code == 200, answer.text
        events = sse_events(answer.text.replace("data: [DONE]", ""))
        errors = [e["error"] for e in events if "error" in e]
        assert errors == [], errors
        session = answer.headers["x-agentd-session"]
        streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in events if c.get("choices"))
        turn = events[0]["id"].removeprefix("chatcmpl-")
        assert daemon.turn(session, turn)["status"] == "transferred"
        stored = "\n\n".join(e["content"] for e in daemon.entries(session, turn) if e["role"] == "assistant")
        assert stored == "Back office here."  # the transfer deleted the text it streamed
        assert streamed == HANDS_OVER.content + "\n\n" + stored


def test_a_streamed_response_of_a_delete_history_transfer_completes_with_the_stored_response(tmp_path: Path) -> None:
    """RFC 0010 §9: the message the stream showed was said (it stays as sent, done); the transfer
    deleted it, so the final Response, as ``GET /v1/responses/{id}`` shows it, lists only the opener."""
    with (
        FakeOpenAI(default=Reply(content="fine")) as server,
        running_daemon(tmp_path, transfer_config(server.url, "delete-history"), env={"REVIEW3_KEY": "k"}) as daemon,
    ):
        assert daemon.client is not None
        server.script(HANDS_OVER)
        answer = daemon.client.post("/v1/responses", json={"model": "front", "input": "help", "stream": True})
        assert answer.status_code == 200, answer.text
        events = sse_events(answer.text)
        assert [e for e in events if e["type"] == "error"] == []
        final = events[-1]["response"]
        assert events[-1]["type"] == "response.completed"
        streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert streamed == HANDS_OVER.content + "Back office here."  # the opener follows once the turn ended
        stored = daemon.json("GET", f"/v1/responses/{final['id']}", status=200)
        assert stored["output"] == final["output"]
        assert [item["content"][0]["text"] for item in final["output"]] == ["Back office here."]


SCRIPTED_TRANSFER = """
[intelligence]
provider = "scripted"
model = "echo-small"

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


def test_item_ids_a_conversation_gave_out_survive_a_transfer(tmp_path: Path) -> None:
    """Item ids are built from entry seqs (agentd/door/outcome.py); a transfer stores the
    destination's view of the transcript with new seqs (RFC 0004 §9). A client that kept an item id
    — to page ``GET /v1/conversations/{id}/items?after=``, or to match a Response's output it
    stored — finds it gone: ``after`` is 400 ``invalid_value`` and ``GET /v1/responses/{id}`` of an
    earlier turn names its items differently than when it was created."""
    with running(tmp_path, SCRIPTED_TRANSFER) as daemon:
        first = daemon.json("POST", "/v1/responses", {"model": "front", "input": "hello"}, status=200)
        conversation = first["conversation"]["id"]
        first_ids = [item["id"] for item in first["output"]]
        kept = daemon.json("GET", f"/v1/conversations/{conversation}/items?order=asc", status=200)["data"]
        ask = {"model": "front", "input": "please transfer me to back", "conversation": conversation}
        daemon.json("POST", "/v1/responses", ask, status=200)
        again = daemon.json("GET", f"/v1/responses/{first['id']}", status=200)
        assert [item["id"] for item in again["output"]] == first_ids
        paged = daemon.api("GET", f"/v1/conversations/{conversation}/items?after={kept[0]['id']}")
        assert paged.status_code == 200, paged.text


@pytest.mark.parametrize("query", ["until=999999999999", "since=-999999999999", "since=0001-01-01T00:00:00%2B01:00"])
def test_usage_with_an_instant_out_of_range_is_a_clear_400(tmp_path: Path, query: str) -> None:
    """``instant_param`` (agentd/apicommon.py) accepts up to 12 digits of epoch seconds and any ISO
    time, and the report renders them back with ``iso`` (agentd/usage.py ``report``), which raises
    ``ValueError`` (year out of range) for anything past 9999 or before year 1: an internal error
    for "far future" bounds a dashboard may well send."""
    with running(tmp_path) as daemon:
        answer = daemon.api("GET", f"/v1/usage?{query}")
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["code"] == "bad_usage_query"
