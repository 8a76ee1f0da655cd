"""Usage and cost (RFC 0011 §1–§3): what servers report, exact decimal prices, the turn's pricing,
the session's totals, and ``GET /v1/usage``'s sums in the store (SQLite and PostgreSQL).

Providers are driven over real HTTP against the fake servers of ``tests/fakes``; the arithmetic
is checked with hypothesis against exact fractions.
"""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentd.apicommon import instant_param
from agentd.budget import TurnStatus, Usage
from agentd.config import ConfigError, Intelligence, Price, parse_config
from agentd.errors import BadInput
from agentd.intel.base import CompletionRequest
from agentd.intel.ollama import OllamaProvider
from agentd.intel.openai import OpenAIProvider
from agentd.intel.scripted import ScriptedOptions, scripted_reply
from agentd.messages import SystemMessage, UserMessage
from agentd.records import Cost, Discarded, ModelSpend, StartedTurn, TurnRecord
from agentd.store.base import SpendRow
from agentd.usage import add_costs, cost_of, decimal_text, price_record, report, session_usage
from agentd.views import iso
from tests.fakes import FakeOllama, FakeOpenAI, Reply
from tests.store_harness import Backend

pytestmark = pytest.mark.anyio

MINI = Price(
    model="gpt-4o-mini",
    currency="USD",
    input_per_mtok=Decimal("0.15"),
    output_per_mtok=Decimal("0.60"),
    cached_input_per_mtok=Decimal("0.075"),
)
BASE_CONFIG = '[[assistants]]\nname = "a"\n'

# --------------------------------------------------------------------------- prices in the config


def test_a_toml_price_is_read_as_the_decimal_written() -> None:
    config = parse_config(
        BASE_CONFIG
        + """
[[prices]]
model = "gpt-4o-mini"
currency = "USD"
input_per_mtok = 0.15
output_per_mtok = 0.60
cached_input_per_mtok = 0.075

[[prices]]
model = "precise"
input_per_mtok = "0.123456789012345678"
output_per_mtok = 3
"""
    )
    assert config.price("gpt-4o-mini") == MINI
    assert config.price("gpt-4o-mini").input_per_mtok == Decimal("0.15")  # type: ignore[union-attr]
    precise = config.price("precise")
    assert precise is not None and precise.input_per_mtok == Decimal("0.123456789012345678")
    assert precise.output_per_mtok == 3 and precise.currency == "USD" and precise.cached_input_per_mtok is None
    assert config.price("unpriced") is None


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("input_per_mtok = 0.12345678901234567", "write it as a string"),
        ("input_per_mtok = -1", "from 0 to"),
        ("input_per_mtok = true", "got a boolean"),
        ('input_per_mtok = "cheap"', "invalid price"),
        ('input_per_mtok = "nan"', "finite"),
        ('input_per_mtok = "0.1234567890123456789"', "decimal places"),
    ],
)
def test_a_bad_price_is_refused_at_its_path(line: str, needle: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(BASE_CONFIG + f'[[prices]]\nmodel = "m"\n{line}\noutput_per_mtok = 1\n')
    assert "prices[0].input_per_mtok" in str(caught.value) and needle in str(caught.value)


def test_two_prices_for_one_model_are_refused() -> None:
    text = BASE_CONFIG + '[[prices]]\nmodel = "m"\ninput_per_mtok = 1\noutput_per_mtok = 1\n' * 2
    with pytest.raises(ConfigError, match=r"prices\[1\]\.model: duplicate price"):
        parse_config(text)


# --------------------------------------------------------------------------- the arithmetic

counts = st.integers(min_value=0, max_value=10**12)
prices = st.decimals(min_value=0, max_value=10**6, places=9, allow_nan=False, allow_infinity=False)


def _exact(usage: Usage, price: Price) -> Fraction:
    cached = min(usage.cached_input_tokens, usage.input_tokens)
    cached_price = price.cached_input_per_mtok if price.cached_input_per_mtok is not None else price.input_per_mtok
    return (
        Fraction(usage.input_tokens - cached) * Fraction(price.input_per_mtok)
        + Fraction(cached) * Fraction(cached_price)
        + Fraction(usage.output_tokens) * Fraction(price.output_per_mtok)
    ) / 1_000_000


@given(counts, counts, counts, prices, prices, st.none() | prices)
def test_a_cost_is_the_exact_decimal_of_tokens_times_price(
    inp: int, out: int, cached: int, pin: Decimal, pout: Decimal, pcached: Decimal | None
) -> None:
    usage = Usage(input_tokens=inp, output_tokens=out, cached_input_tokens=cached)
    price = Price(model="m", input_per_mtok=pin, output_per_mtok=pout, cached_input_per_mtok=pcached)
    cost = cost_of(usage, price)
    assert Fraction(Decimal(cost.amount)) == _exact(usage, price)
    assert "E" not in cost.amount and "e" not in cost.amount and cost.currency == "USD"


@given(st.lists(st.tuples(counts, counts), min_size=1, max_size=8), prices, prices)
def test_costs_add_up_exactly_whatever_the_split(parts: list[tuple[int, int]], pin: Decimal, pout: Decimal) -> None:
    price = Price(model="m", input_per_mtok=pin, output_per_mtok=pout)
    usages = [Usage(i, o) for i, o in parts]
    whole = cost_of(sum(usages, Usage()), price)
    summed = add_costs(cost_of(u, price) for u in usages)
    assert summed is not None and Decimal(summed.amount) == Decimal(whole.amount)


@given(st.decimals(allow_nan=False, allow_infinity=False, places=12, min_value=-(10**9), max_value=10**9))
def test_decimal_text_is_plain_and_exact(value: Decimal) -> None:
    text = decimal_text(value)
    assert Decimal(text) == value and "E" not in text
    assert not ("." in text and text.endswith("0"))


def test_known_figures() -> None:
    usage = Usage(input_tokens=1000, output_tokens=500, cached_input_tokens=400)
    # 600 × 0.15 + 400 × 0.075 + 500 × 0.60 = 90 + 30 + 300 = 420 per million.
    assert cost_of(usage, MINI) == Cost(amount="0.00042", currency="USD")
    assert cost_of(Usage(), MINI) == Cost(amount="0", currency="USD")
    assert cost_of(Usage(input_tokens=1), MINI).amount == "0.00000015"


def test_an_unpriced_part_or_a_mix_of_currencies_makes_a_total_null_never_zero() -> None:
    usd, eur = Cost("0.1", "USD"), Cost("0.2", "EUR")
    assert add_costs([usd, Cost("0.2", "USD")]) == Cost("0.3", "USD")
    assert add_costs([usd, None]) is None
    assert add_costs([usd, eur]) is None
    assert add_costs([]) is None


# --------------------------------------------------------------------------- pricing a turn


def _turn(**fields: Any) -> TurnRecord:
    return TurnRecord(id="t1", status=TurnStatus.COMPLETED, started_at=1.0, ended_at=2.0, **fields)


def test_a_turn_is_priced_per_model_discarded_attempts_included() -> None:
    record = _turn(
        usage=Usage(1500, 700, requests=3),
        discarded=(Discarded(model="gpt-4o-mini", steps=1, reason="swap", usage=Usage(500, 200, requests=1)),),
        by_model=(ModelSpend(assistant="a", model="gpt-4o-mini", usage=Usage(1500, 700, requests=3)),),
    )
    priced = price_record(record, [MINI])
    part = priced.by_model[0]
    assert part.price == MINI and part.cost == Cost("0.000645", "USD")  # 1500 × 0.15 + 700 × 0.60 = 645
    assert priced.cost == part.cost
    assert priced.discarded[0].cost == Cost("0.000195", "USD")  # the discarded part, counted in the total too


def test_a_turn_on_an_unpriced_model_costs_null() -> None:
    record = _turn(
        usage=Usage(10, 10, requests=2),
        by_model=(
            ModelSpend(assistant="a", model="gpt-4o-mini", usage=Usage(5, 5, requests=1)),
            ModelSpend(assistant="b", model="local-llama", usage=Usage(5, 5, requests=1)),
        ),
    )
    priced = price_record(record, [MINI])
    assert priced.by_model[0].cost is not None and priced.by_model[1].cost is None
    assert priced.cost is None
    assert price_record(_turn(), [MINI]).cost is None  # no model call: nothing was priced


def test_a_price_change_prices_later_turns_only() -> None:
    record = _turn(by_model=(ModelSpend(assistant="a", model="gpt-4o-mini", usage=Usage(1_000_000, 0)),))
    before = price_record(record, [MINI])
    dearer = msgspec.structs.replace(MINI, input_per_mtok=Decimal("0.30"))
    after = price_record(record, [dearer])
    assert before.cost == Cost("0.15", "USD") and after.cost == Cost("0.3", "USD")
    # The first record keeps what it was priced at: the price travels with it.
    assert before.by_model[0].price == MINI


def test_session_usage_sums_turns_and_models() -> None:
    one = price_record(
        _turn(
            usage=Usage(100, 10, requests=1),
            by_model=(ModelSpend(assistant="a", model="gpt-4o-mini", usage=Usage(100, 10, requests=1)),),
        ),
        [MINI],
    )
    two = price_record(
        _turn(
            usage=Usage(50, 5, 20, 3, requests=2, unreported=1),
            by_model=(
                ModelSpend(assistant="a", model="gpt-4o-mini", usage=Usage(50, 5, 20, 3, requests=2, unreported=1)),
            ),
        ),
        [MINI],
    )
    pending = StartedTurn(id="t9", message=None, started_at=3.0)
    usage = session_usage([one, two, pending])
    assert (usage.input_tokens, usage.output_tokens, usage.cached_input_tokens, usage.reasoning_tokens) == (
        150,
        15,
        20,
        3,
    )
    assert (usage.requests, usage.unreported) == (3, 1)
    # 100×0.15 + 10×0.6 = 21; 30×0.15 + 20×0.075 + 5×0.6 = 9 → 30 per million.
    assert usage.cost == Cost("0.00003", "USD")
    assert [m.model for m in usage.by_model] == ["gpt-4o-mini"] and usage.by_model[0].cost == usage.cost


def test_a_session_with_a_turn_from_before_per_model_usage_costs_null() -> None:
    old = _turn(usage=Usage(10, 10))  # committed before schema 8: no per-model spend kept
    assert session_usage([old]).cost is None and session_usage([old]).input_tokens == 10


# --------------------------------------------------------------------------- what servers report


def _ask() -> CompletionRequest:
    return CompletionRequest(messages=[UserMessage(content="hi")])


async def test_openai_usage_chunk_with_cached_and_reasoning_tokens_is_read() -> None:
    reply = Reply(content="ok", input_tokens=30, output_tokens=12, cached_tokens=10, reasoning_tokens=4)
    with FakeOpenAI(default=reply) as server:
        provider = OpenAIProvider(Intelligence(provider="openai", endpoints=(server.url + "/v1",), model="gpt-test"))
        try:
            completion = await provider.complete(_ask())
        finally:
            await provider.aclose()
    assert completion.usage == Usage(30, 12, 10, 4) and completion.usage_reported
    assert server.chat_requests[0].body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("stream", [True, False])
async def test_an_openai_server_that_reports_no_usage_is_unreported_never_guessed(stream: bool) -> None:
    with FakeOpenAI(default=Reply(content="ok", report_usage=False)) as server:
        intelligence = Intelligence(
            provider="openai", endpoints=(server.url + "/v1",), model="gpt-test", options={"stream": stream}
        )
        provider = OpenAIProvider(intelligence)
        try:
            completion = await provider.complete(_ask())
        finally:
            await provider.aclose()
    assert completion.usage == Usage() and not completion.usage_reported


async def test_ollama_done_line_counts_and_their_absence() -> None:
    for reply, expected, reported in (
        (Reply(content="ok", input_tokens=13, output_tokens=7), Usage(13, 7), True),
        (Reply(content="ok", input_tokens=None, output_tokens=None), Usage(), False),
    ):
        with FakeOllama(default=reply) as server:
            provider = OllamaProvider(Intelligence(provider="ollama", endpoints=(server.url,), model="llama3"))
            try:
                completion = await provider.complete(_ask())
            finally:
                await provider.aclose()
        assert (completion.usage, completion.usage_reported) == (expected, reported)


def test_the_scripted_model_reports_deterministic_counts() -> None:
    history = [SystemMessage(content="be brief"), UserMessage(content="hello there you")]
    options = ScriptedOptions(think=True)
    first = scripted_reply("echo-small", history, (), options)
    again = scripted_reply("echo-small", history, (), options)
    assert first.usage == again.usage and first.usage_reported
    assert first.usage.input_tokens == 5  # "be brief" + "hello there you"
    assert 0 < first.usage.reasoning_tokens < first.usage.output_tokens


# --------------------------------------------------------------------------- sums in the store


async def _spend(
    backend: Backend, store: Any, session: str, turn: str, ended_at: float, parts: list[ModelSpend]
) -> None:
    await store.begin_turn(session, turn, None, ended_at - 1)
    usage = sum((p.usage for p in parts), Usage())
    record = price_record(
        TurnRecord(
            id=turn,
            status=TurnStatus.COMPLETED,
            started_at=ended_at - 1,
            ended_at=ended_at,
            usage=usage,
            by_model=tuple(parts),
        ),
        [MINI],
    )
    await store.commit_turn(session, record, assistant=parts[0].assistant)


async def test_usage_is_summed_by_the_store_per_group_over_a_time_range(backend: Backend) -> None:
    store = await backend.open()
    try:
        for session, assistant in (("s1", "triage"), ("s2", "billing")):
            await store.create_session(
                session, assistant=assistant, generation=1, model="gpt-4o-mini", created_at=1.0, transcript=[]
            )
        await _spend(
            backend,
            store,
            "s1",
            "t1",
            100.0,
            [ModelSpend(assistant="triage", model="gpt-4o-mini", usage=Usage(1000, 100, requests=1))],
        )
        await _spend(
            backend,
            store,
            "s1",
            "t2",
            200.0,
            [
                ModelSpend(assistant="triage", model="gpt-4o-mini", usage=Usage(2000, 200, 1000, requests=2)),
                ModelSpend(assistant="triage", model="local", usage=Usage(5, 5, requests=1, unreported=1)),
            ],
        )
        await _spend(
            backend,
            store,
            "s2",
            "t1",
            300.0,
            [ModelSpend(assistant="billing", model="gpt-4o-mini", usage=Usage(10, 10, requests=1))],
        )

        by_model = report("model", await store.usage_report("model"), None, None)
        groups = {g.key: g for g in by_model.groups}
        mini = groups["gpt-4o-mini"]
        assert (mini.input_tokens, mini.output_tokens, mini.cached_input_tokens, mini.requests) == (3010, 310, 1000, 4)
        # 1000×0.15+100×0.6 = 210; 1000×0.15+1000×0.075+200×0.6 = 345; 10×0.15+10×0.6 = 7.5 → 562.5
        assert mini.cost == Cost("0.0005625", "USD")
        assert groups["local"].cost is None and groups["local"].unreported == 1

        by_assistant = report("assistant", await store.usage_report("assistant"), None, None)
        triage = next(g for g in by_assistant.groups if g.key == "triage")
        assert triage.cost is None  # a part of it ran on an unpriced model
        assert [m.model for m in triage.by_model] == ["gpt-4o-mini", "local"]
        assert triage.by_model[0].cost == Cost("0.000555", "USD")

        ranged = report("session", await store.usage_report("session", since=150.0, until=300.0), 150.0, 300.0)
        assert [g.key for g in ranged.groups] == ["s1"] and ranged.groups[0].requests == 3
        assert ranged.since is not None and ranged.since.startswith("1970-01-01T00:02:30")

        # Paged: one group a page, in key order; every model row of a group stays on its page.
        first = await store.usage_report("session", limit=1)
        assert {row.key for row in first} == {"s1"} and {row.model for row in first} == {"gpt-4o-mini", "local"}
        second = await store.usage_report("session", limit=1, after="s1")
        assert {row.key for row in second} == {"s2"}
        assert await store.usage_report("session", limit=1, after="s2") == []
        assert {row.key for row in await store.usage_report("model", limit=5, after="gpt-4o-mini")} == {"local"}
    finally:
        await store.close()


async def test_a_committed_turn_reads_back_with_its_usage_cost_and_models(backend: Backend) -> None:
    store = await backend.open()
    try:
        await store.create_session(
            "s1", assistant="a", generation=1, model="gpt-4o-mini", created_at=1.0, transcript=[]
        )
        part = ModelSpend(assistant="a", model="gpt-4o-mini", usage=Usage(1000, 500, 400, 7, requests=2, unreported=1))
        await _spend(backend, store, "s1", "t1", 10.0, [part])
        stored = await store.load_session("s1")
        assert stored is not None
        (turn,) = stored.turns
        assert isinstance(turn, TurnRecord)
        assert turn.usage == part.usage and turn.cost == Cost("0.00042", "USD")
        assert turn.by_model[0].price == MINI
    finally:
        await store.close()


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.sampled_from(["m1", "m2"]),
            counts,
            counts,
            st.sampled_from([None, "USD", "EUR"]),
            prices,
        ),
        max_size=12,
    )
)
def test_a_report_prices_each_line_and_adds_up_exactly(
    lines: list[tuple[str, str, int, int, str | None, Decimal]],
) -> None:
    rows = [
        SpendRow(
            key=key,
            model=model,
            usage=Usage(inp, out, requests=1),
            price=None
            if currency is None
            else Price(model=model, currency=currency, input_per_mtok=p, output_per_mtok=p),
        )
        for key, model, inp, out, currency, p in lines
    ]
    made = report("assistant", rows, None, None)
    assert [g.key for g in made.groups] == sorted({row.key for row in rows})
    for group in made.groups:
        mine = [r for r in rows if r.key == group.key]
        expected = add_costs(cost_of(r.usage, r.price) if r.price else None for r in mine)
        assert group.cost == (
            None if expected is None else Cost(decimal_text(Decimal(expected.amount)), expected.currency)
        )
        assert group.input_tokens == sum(r.usage.input_tokens for r in mine)
        for model in group.by_model:
            parts = [r for r in mine if r.model == model.model]
            assert model.requests == len(parts)
            assert model.cost == add_costs(cost_of(r.usage, r.price) if r.price else None for r in parts)


@given(st.decimals(min_value=0, max_value=10**6, places=6, allow_nan=False, allow_infinity=False))
def test_a_price_written_as_a_toml_number_is_that_exact_decimal(price: Decimal) -> None:
    literal = format(price, "f")
    if "." not in literal:
        literal += ".0"  # a TOML float, not an integer
    config = parse_config(BASE_CONFIG + f'[[prices]]\nmodel = "m"\ninput_per_mtok = {literal}\noutput_per_mtok = 1\n')
    parsed = config.price("m")
    assert parsed is not None and parsed.input_per_mtok == price


@pytest.mark.parametrize(
    "text",
    ["999999999999", "-999999999999", "253402300800", "0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59.9995Z"],
)
def test_an_instant_an_iso_time_cannot_render_is_a_bad_usage_query_naming_the_range(text: str) -> None:
    with pytest.raises(BadInput) as raised:
        instant_param("until", text)
    assert raised.value.code == "bad_usage_query"
    assert "until must be between 0001-01-01T00:00:00Z and 9999-12-31T23:59:59.999Z" in raised.value.message


@pytest.mark.parametrize("text", ["-62135596800", "253402300799.999", "0001-01-01T00:00:00Z", "9999-12-31T23:59:59Z"])
def test_the_ends_of_the_instant_range_are_accepted_and_render(text: str) -> None:
    instant = instant_param("since", text)
    assert instant is not None and iso(instant) is not None


async def test_an_abandoned_turn_stores_what_it_spent_like_a_commit(backend: Backend) -> None:
    """``Store.abandon_turn(spent=…)`` (a turn cancelled while it awaited approvals, RFC 0012 §5):
    the turn's row has the usage, cost and spend per model, and ``turn_spend`` has its rows."""
    store = await backend.open()
    try:
        await store.create_session(
            "s1", assistant="triage", generation=1, model="gpt-4o-mini", created_at=1.0, transcript=[]
        )
        await store.begin_turn("s1", "t1", None, 99.0)
        part = ModelSpend(assistant="triage", model="gpt-4o-mini", usage=Usage(1000, 100, requests=1))
        bare = TurnRecord(id="t1", status=TurnStatus.CANCELLED, started_at=99.0, ended_at=100.0, error="cancelled")
        spent = price_record(msgspec.structs.replace(bare, steps=1, usage=part.usage, by_model=(part,)), [MINI])
        await store.abandon_turn("s1", "t1", status="cancelled", error="cancelled", ended_at=100.0, spent=spent)
        ended = await store.ended_turn("s1", "t1")
        assert ended is not None
        record = ended[0]
        assert (record.status, record.steps, record.usage, record.cost, record.error) == (
            TurnStatus.CANCELLED,
            1,
            part.usage,
            Cost("0.00021", "USD"),
            "cancelled",
        )
        assert [p.model for p in record.by_model] == ["gpt-4o-mini"]
        rows = report("model", await store.usage_report("model"), None, None)
        assert [(g.key, g.requests, g.cost) for g in rows.groups] == [("gpt-4o-mini", 1, Cost("0.00021", "USD"))]
    finally:
        await store.close()
