"""Usage and cost end to end (RFC 0011 §1–§3), against one real ``agentd run`` subprocess.

The scripted model reports deterministic counts, so every figure is checked exactly: the turn's
usage and its cost (priced when it ended, discarded attempts included), the session's totals,
``GET /v1/usage`` summed by the store, the metrics, and a price reload pricing later turns only.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_harness import Daemon, running_daemon

pytestmark = pytest.mark.e2e

PRICES = {"echo-small": (Decimal("0.15"), Decimal("0.60")), "echo-large": (Decimal("2.5"), Decimal("10"))}


def config(hold: Path, small_input: str = "0.15") -> str:
    return f"""
model_swap = "restart-turn"

[intelligence]
provider = "scripted"
model = "echo-small"

[[assistants]]
name = "main"
system = "You help."
first_message_mode = "assistant-waits-for-user"

[[assistants]]
name = "held"
first_message_mode = "assistant-waits-for-user"
intelligence = {{ options = {{ hold_file = "{hold}" }} }}

[[assistants]]
name = "free"
first_message_mode = "assistant-waits-for-user"
intelligence = {{ model = "unpriced-model" }}

[[prices]]
model = "echo-small"
currency = "USD"
input_per_mtok = {small_input}
output_per_mtok = 0.60

[[prices]]
model = "echo-large"
currency = "USD"
input_per_mtok = "2.5"
output_per_mtok = 10
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("usage")
    with running_daemon(tmp, config(tmp / "hold")) as d:
        d.hold = tmp / "hold"  # type: ignore[attr-defined]
        yield d


def expected_amount(usage: dict[str, Any], price_in: Decimal, price_out: Decimal) -> Decimal:
    return (usage["input_tokens"] * price_in + usage["output_tokens"] * price_out) / Decimal(1_000_000)


def test_a_turn_reports_the_servers_counts_and_their_exact_cost(daemon: Daemon) -> None:
    session = daemon.new_session("main")
    turn = daemon.send(session, "hello there friend")["turn"]
    usage = turn["usage"]
    # The scripted model counts words: "You help." + "hello there friend" in, its reply out.
    assert usage["input_tokens"] == 5 and usage["output_tokens"] > 0
    assert (usage["requests"], usage["unreported"], usage["cached_input_tokens"]) == (1, 0, 0)
    cost = usage["cost"]
    assert cost["currency"] == "USD" and isinstance(cost["amount"], str)
    assert Decimal(cost["amount"]) == expected_amount(usage, *PRICES["echo-small"])
    assert "e" not in cost["amount"].lower()
    assert daemon.turn(session, turn["id"])["usage"] == usage  # as stored


def test_an_unpriced_model_costs_null_never_zero(daemon: Daemon) -> None:
    session = daemon.new_session("free")
    turn = daemon.send(session, "hi")["turn"]
    assert turn["usage"]["requests"] == 1 and turn["usage"]["input_tokens"] > 0
    assert turn["usage"]["cost"] is None
    assert daemon.session(session)["usage"]["cost"] is None


def test_the_session_sums_its_turns_per_model(daemon: Daemon) -> None:
    session = daemon.new_session("main")
    turns = [daemon.send(session, text)["turn"] for text in ("one", "two words", "three small words")]
    usage = daemon.session(session)["usage"]
    for key in ("input_tokens", "output_tokens", "requests"):
        assert usage[key] == sum(t["usage"][key] for t in turns)
    assert Decimal(usage["cost"]["amount"]) == sum(Decimal(t["usage"]["cost"]["amount"]) for t in turns)
    (small,) = usage["by_model"]
    assert small["model"] == "echo-small" and small["input_tokens"] == usage["input_tokens"]


def test_a_discarded_attempts_spend_is_counted_and_priced(daemon: Daemon, tmp_path: Path) -> None:
    """restart-turn: the held step on echo-small is thrown away, the turn re-runs on echo-large;
    both were paid for, each at its own model's price."""
    hold: Path = daemon.hold  # type: ignore[attr-defined]
    session = daemon.new_session("held")
    events = daemon.events(session)
    turn_id = daemon.send(session, "please answer", wait=False)["turn_id"]
    events.wait("step.started", lambda d: d["turn"] == turn_id)
    original = daemon.config_path.read_text()
    try:
        daemon.write_config(original.replace('model = "echo-small"', 'model = "echo-large"', 1))
        assert daemon.json("POST", "/v1/reload", status=200)["applied"]
        events.wait("swap.parked", lambda d: d.get("model_to") == "echo-large")
        hold.touch()
        events.wait("turn.done", lambda d: d["turn"] == turn_id)
    finally:
        hold.touch()
        daemon.write_config(original)
        daemon.json("POST", "/v1/reload", status=200)
        hold.unlink(missing_ok=True)
    turn = daemon.turn(session, turn_id)
    assert turn["status"] == "completed" and turn["restarts"] == 1
    (discarded,) = turn["discarded"]
    assert discarded["model"] == "echo-small" and discarded["usage"]["requests"] == 1
    thrown = Decimal(discarded["usage"]["cost"]["amount"])
    assert thrown == expected_amount(discarded["usage"], *PRICES["echo-small"]) and thrown > 0
    usage = turn["usage"]
    assert usage["requests"] == 2  # the discarded call and the re-run's
    kept = {k: usage[k] - discarded["usage"][k] for k in ("input_tokens", "output_tokens")}
    assert Decimal(usage["cost"]["amount"]) == thrown + expected_amount(kept, *PRICES["echo-large"])
    models = {m["model"]: m for m in daemon.session(session)["usage"]["by_model"]}
    assert set(models) == {"echo-small", "echo-large"}


def test_usage_is_grouped_by_assistant_model_and_session_over_a_time_range(daemon: Daemon) -> None:
    before = time.time() - 1
    daemon.send(daemon.new_session("free"), "on the house")  # a turn on the unpriced model
    session = daemon.new_session("main")
    turn = daemon.send(session, "count me in")["turn"]
    by_session = daemon.json("GET", f"/v1/usage?group_by=session&since={before}", status=200)
    assert by_session["group_by"] == "session" and by_session["since"]
    mine = [g for g in by_session["groups"] if g["key"] == session]
    assert len(mine) == 1 and mine[0]["input_tokens"] == turn["usage"]["input_tokens"]
    assert mine[0]["cost"] == turn["usage"]["cost"]

    by_model = daemon.json("GET", "/v1/usage?group_by=model", status=200)["groups"]
    small = next(g for g in by_model if g["key"] == "echo-small")
    assert small["requests"] >= 1 and Decimal(small["cost"]["amount"]) > 0
    assert next(g for g in by_model if g["key"] == "unpriced-model")["cost"] is None

    by_assistant = daemon.json("GET", "/v1/usage?group_by=assistant", status=200)["groups"]
    assert {"main"} <= {g["key"] for g in by_assistant}

    future = daemon.json("GET", "/v1/usage?group_by=model&since=2999-01-01T00:00:00Z", status=200)
    assert future["groups"] == []
    bad = daemon.api("GET", "/v1/usage?group_by=colour")
    assert bad.status_code == 400 and "group_by" in bad.json()["error"]["message"]
    bad = daemon.api("GET", "/v1/usage?since=yesterday")
    assert bad.status_code == 400 and "since" in bad.json()["error"]["message"]


def test_usage_by_session_comes_in_pages(daemon: Daemon) -> None:
    sessions = sorted(daemon.new_session("main") for _ in range(3))
    for session in sessions:
        daemon.send(session, "paged")
    seen: list[str] = []
    after = ""
    while True:
        page = daemon.json("GET", f"/v1/usage?group_by=session&limit=2&after={after}", status=200)
        assert len(page["groups"]) <= 2
        seen += [g["key"] for g in page["groups"]]
        if page["next"] is None:
            break
        assert page["next"] == page["groups"][-1]["key"]
        after = page["next"]
    assert seen == sorted(seen) and len(seen) == len(set(seen)) and set(sessions) <= set(seen)
    bad = daemon.api("GET", "/v1/usage?limit=0")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "bad_limit"


def test_metrics_count_tokens_and_cost(daemon: Daemon) -> None:
    session = daemon.new_session("main")
    daemon.send(session, "metered words")
    text = daemon.api("GET", "/metrics").text
    tokens = re.search(r'agentd_tokens_total\{model="echo-small",type="input"\} ([0-9.e+]+)', text)
    cost = re.search(r'agentd_cost_total\{currency="USD",model="echo-small"\} ([0-9.e+-]+)', text)
    assert tokens is not None and float(tokens.group(1)) > 0, text
    assert cost is not None and float(cost.group(1)) > 0, text


def test_a_price_reload_prices_later_turns_only(daemon: Daemon) -> None:
    session = daemon.new_session("main")
    first = daemon.send(session, "same words")["turn"]
    original = daemon.config_path.read_text()
    try:
        daemon.write_config(original.replace("input_per_mtok = 0.15", "input_per_mtok = 1.15", 1))
        result = daemon.json("POST", "/v1/reload", status=200)
        assert "prices[0].input_per_mtok" in result["changed"] and not result["restart_required"]
        second = daemon.send(session, "same words")["turn"]
    finally:
        daemon.write_config(original)
        daemon.json("POST", "/v1/reload", status=200)
    assert Decimal(first["usage"]["cost"]["amount"]) == expected_amount(first["usage"], *PRICES["echo-small"])
    assert Decimal(second["usage"]["cost"]["amount"]) == expected_amount(
        second["usage"], Decimal("1.15"), Decimal("0.60")
    )
    stored = {t["id"]: t for t in daemon.session(session)["turns"]}
    assert stored[first["id"]]["usage"]["cost"] == first["usage"]["cost"]  # fixed when it ended
