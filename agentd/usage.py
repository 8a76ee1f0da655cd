"""What turns spent and what it cost (RFC 0011 §1–§3): pure functions over records and prices.

A model call's usage is what its server reported (``agentd.budget.Usage``); the child sums it per
assistant and model (``ModelSpend``). When the turn ends, the supervisor prices it once
(``price_record``) with the ``[[prices]]`` it runs then: a later reload prices later turns only.

Money is ``Decimal`` arithmetic in a context wide enough that nothing is ever rounded (a price has
at most 18 decimal places, a token count at most 19 digits), rendered as a plain decimal string.
A cost is ``None`` — never 0 — when a part of the spend has no price, or when parts are priced in
different currencies: a total that leaves something out would be wrong, not approximate.
"""

from __future__ import annotations

import decimal
import gc
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from decimal import Decimal
from typing import Final

import msgspec

from agentd.budget import Usage
from agentd.config import Price
from agentd.records import Cost, Discarded, ModelSpend, StartedTurn, TurnRecord
from agentd.store.base import SpendRow
from agentd.views import ModelUsageView, SessionUsageView, UsageGroup, UsageReport, iso, usage_view

__all__ = [
    "ModelTotal",
    "add_costs",
    "cost_of",
    "decimal_text",
    "model_totals",
    "price_record",
    "report",
    "session_usage",
    "spend_cost",
]

_MILLION: Final = Decimal(1_000_000)
#: Exact: every operand has at most ~40 significant digits, far inside this precision, and the
#: Inexact trap turns a rounding — which must never happen — into an error instead of a wrong sum.
_EXACT: Final = decimal.Context(prec=200, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN, traps=[decimal.Inexact])


def decimal_text(amount: Decimal) -> str:
    """``amount`` as a plain decimal string: no exponent, no trailing zeros (``0.0000225``, ``12``)."""
    text = format(amount, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("", "-0") else text


def _amount(usage: Usage, price: Price) -> Decimal:
    """``cost_of``'s amount, as a Decimal; call it inside ``decimal.localcontext(_EXACT)``."""
    cached = min(usage.cached_input_tokens, usage.input_tokens)
    cached_price = price.cached_input_per_mtok if price.cached_input_per_mtok is not None else price.input_per_mtok
    per_million = (
        Decimal(usage.input_tokens - cached) * price.input_per_mtok
        + Decimal(cached) * cached_price
        + Decimal(usage.output_tokens) * price.output_per_mtok
    )
    return per_million / _MILLION


def cost_of(usage: Usage, price: Price) -> Cost:
    """The exact cost of ``usage`` at ``price``: input (less its cached part) at the input price,
    the cached part at the cached price (the input price when none is set), output at the output
    price — per million tokens. Reasoning tokens are part of the output and priced as output."""
    with decimal.localcontext(_EXACT):
        amount = _amount(usage, price)
    return Cost(amount=decimal_text(amount), currency=price.currency)


def add_costs(costs: Iterable[Cost | None]) -> Cost | None:
    """The exact sum of ``costs``; None when any is None, when they are in different currencies,
    or when there are none (nothing was priced)."""
    given = list(costs)
    priced = [cost for cost in given if cost is not None]
    # Most turns run on a model without a price: answered before any decimal arithmetic.
    if not priced or len(priced) != len(given):
        return None
    currency = priced[0].currency
    if any(cost.currency != currency for cost in priced):
        return None
    with decimal.localcontext(_EXACT):
        total = sum((Decimal(cost.amount) for cost in priced), Decimal(0))
    return Cost(amount=decimal_text(total), currency=currency)


def spend_cost(spend: Sequence[ModelSpend]) -> Cost | None:
    """What a list of per-model spends cost together (``add_costs`` of theirs)."""
    return add_costs(part.cost for part in spend)


def price_record(record: TurnRecord, prices: Sequence[Price]) -> TurnRecord:
    """``record`` with every per-model spend, every discarded attempt and the turn itself priced at
    ``prices`` (the ones running when the turn ends). Pure; a model without a price costs None."""
    table = {price.model: price for price in prices}

    def priced(part: ModelSpend) -> ModelSpend:
        price = table.get(part.model)
        cost = cost_of(part.usage, price) if price is not None else None
        return msgspec.structs.replace(part, price=price, cost=cost)

    def discarded(attempt: Discarded) -> Discarded:
        price = table.get(attempt.model)
        return msgspec.structs.replace(attempt, cost=cost_of(attempt.usage, price) if price is not None else None)

    by_model = tuple(priced(part) for part in record.by_model)
    return msgspec.structs.replace(
        record,
        by_model=by_model,
        discarded=tuple(discarded(attempt) for attempt in record.discarded),
        cost=spend_cost(by_model),
    )


class ModelTotal(msgspec.Struct, frozen=True, kw_only=True):
    """A model's spend summed over turns: its usage and what it cost (None: partly unpriced)."""

    model: str
    usage: Usage
    cost: Cost | None


def model_totals(parts: Iterable[ModelSpend]) -> list[ModelTotal]:
    """Per-model sums of ``parts`` (assistants merged), in model-name order."""
    usage: dict[str, Usage] = {}
    costs: dict[str, list[Cost | None]] = {}
    for part in parts:
        usage[part.model] = usage.get(part.model, Usage()) + part.usage
        costs.setdefault(part.model, []).append(part.cost)
    return [ModelTotal(model=model, usage=usage[model], cost=add_costs(costs[model])) for model in sorted(usage)]


def _model_views(totals: Iterable[ModelTotal]) -> list[ModelUsageView]:
    return [_model_view(t.model, t.usage, t.cost) for t in totals]


def session_usage(turns: Iterable[TurnRecord | StartedTurn]) -> SessionUsageView:
    """``Session.usage``: its ended turns' usage summed (discarded attempts included) and per model.

    Turns committed before usage was kept per model (schema 8) count in the totals, and make the
    cost null: what they cost is unknown.
    """
    ended = [turn for turn in turns if isinstance(turn, TurnRecord)]
    total = sum((turn.usage for turn in ended), Usage())
    parts = [part for turn in ended for part in turn.by_model]
    unitemized = any(turn.usage.total and not turn.by_model for turn in ended)
    cost = None if unitemized else spend_cost(parts)
    return SessionUsageView(
        **msgspec.structs.asdict(usage_view(total, cost)), by_model=_model_views(model_totals(parts))
    )


def _model_view(model: str, u: Usage, cost: Cost | None) -> ModelUsageView:
    # Fields spelled out: this runs once per group and model, 100,000 times for a big report.
    return ModelUsageView(
        input_tokens=u.input_tokens,
        output_tokens=u.output_tokens,
        cached_input_tokens=u.cached_input_tokens,
        reasoning_tokens=u.reasoning_tokens,
        requests=u.requests,
        unreported=u.unreported,
        cost=cost,
        model=model,
    )


_Part = tuple[Usage, Decimal | None, str | None]  # a line's usage, its exact amount (None: unpriced), currency


def _fold(parts: Sequence[_Part]) -> tuple[Usage, Cost | None]:
    """Parts summed: their usage, and their cost by ``add_costs``'s rule (call inside the exact context)."""
    if len(parts) == 1:  # the usual case (one model, one price): nothing to add
        usage, amount, currency = parts[0]
        return usage, None if amount is None or currency is None else Cost(decimal_text(amount), currency)
    usage = sum((part[0] for part in parts), Usage())
    currencies = {part[2] for part in parts}
    if None in currencies or len(currencies) != 1 or any(part[1] is None for part in parts):
        return usage, None
    total = sum((part[1] for part in parts if part[1] is not None), Decimal(0))
    return usage, Cost(decimal_text(total), parts[0][2] or "")


@contextmanager
def _collector_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def report(group_by: str, rows: Sequence[SpendRow], since: float | None, until: float | None) -> UsageReport:
    """``GET /v1/usage`` from the database's sums (``Store.usage_report``): each line priced exactly
    at the price it was spent at, then added up per group and per model within it, in key order."""
    groups: dict[str, dict[str, list[_Part]]] = {}
    out = []
    # A report by session over a long range builds a few objects per session, 100,000s of them,
    # none garbage: the cyclic collector would walk the growing heap again and again (it tripled
    # the time, bench/usage.py). Paused for this loop only, which never awaits.
    with _collector_paused(), decimal.localcontext(_EXACT):
        for row in rows:
            price = row.price
            part = (
                (row.usage, _amount(row.usage, price), price.currency) if price is not None else (row.usage, None, None)
            )
            models = groups.get(row.key)
            if models is None:
                models = groups[row.key] = {}
            models.setdefault(row.model, []).append(part)
        for key in sorted(groups):
            models = groups[key]
            by_model = [_model_view(name, *_fold(models[name])) for name in sorted(models)]
            if len(by_model) == 1:  # one model: the group's figures are its figures
                only = by_model[0]
                u = Usage(
                    only.input_tokens,
                    only.output_tokens,
                    only.cached_input_tokens,
                    only.reasoning_tokens,
                    only.requests,
                    only.unreported,
                )
                cost = only.cost
            else:
                u, cost = _fold([part for parts in models.values() for part in parts])
            out.append(
                UsageGroup(
                    input_tokens=u.input_tokens,
                    output_tokens=u.output_tokens,
                    cached_input_tokens=u.cached_input_tokens,
                    reasoning_tokens=u.reasoning_tokens,
                    requests=u.requests,
                    unreported=u.unreported,
                    cost=cost,
                    key=key,
                    by_model=by_model,
                )
            )
    return UsageReport(
        group_by=group_by,  # type: ignore[arg-type]  # checked by the caller against USAGE_GROUPS
        since=iso(since),
        until=iso(until),
        groups=out,
    )
