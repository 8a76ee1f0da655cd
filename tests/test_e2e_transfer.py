"""Transfers end to end (RFC 0004): the real daemon, the scripted model, each history mode once,
then a reload that swaps the destination's model mid-turn under restart-turn."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.daemon_harness import running_daemon

pytestmark = pytest.mark.e2e


def squad(mode: str, billing_model: str = "billing-small", billing_options: str = "") -> str:
    return f"""
[intelligence]
provider = "scripted"
model = "triage-small"

[[assistants]]
name = "triage"
system = "You route."
first_message = "Triage here."

[[assistants.transfers]]
to = "billing"
description = "Invoices"
message = "Connecting you to billing."
mode = "{mode}"

[[assistants]]
name = "billing"
system = "You bill."
first_message = "Billing here."
intelligence = {{ model = "{billing_model}", options = {{ {billing_options} }} }}
"""


def picture(transcript: list[dict]) -> list[str]:
    out = []
    for e in transcript:
        if e["role"] == "system":
            out.append(f"S:{e['name']}")
        elif e["role"] == "user":
            out.append("U")
        elif e["role"] == "tool":
            out.append("TR")
        elif e.get("tool_calls"):
            out.append("TT")
        else:
            out.append(f"A:{e['assistant']}")
    return out


EXPECTED = {
    "rolling-history": ["S:triage", "A:triage", "U", "TT", "TR", "A:triage", "S:billing", "A:billing"],
    "swap-system-message-in-history": ["S:billing", "A:triage", "U", "TT", "TR", "A:triage", "A:billing"],
    "swap-system-message-in-history-and-remove-transfer-tool-messages": [
        "S:billing",
        "A:triage",
        "U",
        "A:triage",
        "A:billing",
    ],
    "delete-history": ["S:billing", "A:billing"],
}


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_transfer_then_swap_the_destination_mid_turn(tmp_path: Path, mode: str) -> None:
    gate = tmp_path / "billing.gate"
    held = f'hold_file = "{gate}"'
    with running_daemon(tmp_path, squad(mode, billing_options=held), args=["--model-swap", "restart-turn"]) as daemon:
        session = daemon.new_session("triage")
        events = daemon.events(session)
        result = daemon.send(session, "please transfer me to billing", wait=True)
        assert result["turn"]["status"] == "transferred"
        handoff = events.wait("transfer")
        assert (handoff["from"], handoff["to"], handoff["mode"]) == ("triage", "billing", mode)
        stored = daemon.session(session)
        assert stored["assistant"] == "billing" and stored["model"] == "billing-small"
        assert picture(stored["transcript"]) == EXPECTED[mode]
        assert stored["transcript"][-1]["content"] == "Billing here."
        assert stored["transcript"][-1]["model"] == "billing-small"
        # A reload changes billing's model while billing's turn is held mid-call → the turn re-runs on it.
        turn_id = daemon.send(session, "what do I owe?", wait=False)["turn_id"]
        events.wait("step.started", lambda d: d["turn"] == turn_id)
        daemon.write_config(squad(mode, billing_model="billing-large"))
        daemon.signal(signal.SIGHUP)
        events.wait("swap.parked", lambda d: d["model_to"] == "billing-large")
        gate.touch()
        done = events.wait("turn.done", lambda d: d["turn"] == turn_id)
        assert done["restarts"] == 1
        assert [d["model"] for d in done["discarded"]] == ["billing-small"]
        assert done["messages"][-1]["model"] == "billing-large"
        assert done["messages"][-1]["content"] == "[billing-large] You said: what do I owe?"
        assert daemon.session(session)["model"] == "billing-large"


def test_chat_shows_the_handoff(tmp_path: Path) -> None:
    with running_daemon(tmp_path, squad("rolling-history")) as daemon:
        chat = daemon.run_cli("chat", "--assistant", "triage", input="please transfer me to billing\nhello\n")
        assert chat.returncode == 0, chat.stderr
        assert "Triage here." in chat.stdout
        assert "billing" in chat.stdout and "triage" in chat.stdout
        assert "transfer" in chat.stdout.lower()
        assert "[billing-small] You said: hello" in chat.stdout


@pytest.mark.parametrize(
    ("mode", "first", "expected"),
    [
        ("assistant-speaks-first", 'first_message = "Hi there."', ["S:solo", "A:solo"]),
        ("assistant-speaks-first-with-model-generated-message", "", ["S:solo", "A:solo"]),
        ("assistant-waits-for-user", 'first_message = "never said"', ["S:solo"]),
    ],
)
def test_first_message_modes_at_session_start(tmp_path: Path, mode: str, first: str, expected: list[str]) -> None:
    text = f"""
[intelligence]
provider = "scripted"
model = "solo-model"

[[assistants]]
name = "solo"
system = "You work alone."
first_message_mode = "{mode}"
{first}
"""
    with running_daemon(tmp_path, text) as daemon:
        created = daemon.json("POST", "/v1/sessions", {}, status=201)
        assert picture(created["transcript"]) == expected
        if mode == "assistant-speaks-first":
            assert created["transcript"][-1]["content"] == "Hi there."
            assert created["turns"] == []
        elif mode.endswith("model-generated-message"):
            opener = created["transcript"][-1]
            assert opener["content"] == "[solo-model] Hello, solo here. How can I help?"
            assert opener["model"] == "solo-model"
            assert [t["status"] for t in created["turns"]] == ["completed"]
        reply = daemon.send(created["id"], "hello")
        assert reply["messages"][-1]["content"] == "[solo-model] You said: hello"


def test_a_reload_keeps_an_assistant_that_a_turn_in_flight_may_transfer_to(tmp_path: Path) -> None:
    """The supervisor learns of a transfer when the turn commits, so while a turn runs, every
    destination of its assistant must stay (RFC 0003 §4); once it ended, the removal applies."""
    gate = tmp_path / "triage.gate"
    held = squad("rolling-history").replace(
        'model = "triage-small"', f'model = "triage-small"\noptions = {{ hold_file = "{gate}" }}'
    )
    alone = held.split("[[assistants.transfers]]")[0]
    with running_daemon(tmp_path, held) as daemon:
        session = daemon.new_session("triage")
        events = daemon.events(session)
        turn_id = daemon.send(session, "hello", wait=False)["turn_id"]
        events.wait("step.started", lambda d: d["turn"] == turn_id)
        daemon.write_config(alone)
        refused = daemon.json("POST", "/v1/reload", status=422)
        assert refused["generation"] == 1
        assert any("may transfer to it" in e["message"] and "'billing'" in e["message"] for e in refused["errors"])
        gate.touch()
        events.wait("turn.done", lambda d: d["turn"] == turn_id)
        assert daemon.json("POST", "/v1/reload", status=200)["generation"] == 2
