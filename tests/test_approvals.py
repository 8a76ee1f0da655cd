"""The pure pieces of approvals (RFC 0012): which calls need one, the decisions a parked run gets,
and what edited arguments must fit. No processes."""

from __future__ import annotations

from decimal import Decimal

import pytest

from agentd.approvals import (
    Approval,
    ApprovalRules,
    ApprovalStatus,
    ParkedRun,
    check_arguments,
    decided_status,
    rejection_text,
    with_parked_spend,
)
from agentd.budget import TurnStatus, Usage
from agentd.config import ConfigError, Price, parse_config
from agentd.messages import AssistantMessage, ToolCall
from agentd.records import ModelSpend, TurnRecord
from agentd.supervisor.approvals import decisions_of
from agentd.usage import price_record


def test_rules_match_refs_servers_and_star() -> None:
    rules = ApprovalRules.of(["tests.tooling:record", "time:*"])
    assert rules.needs("tests.tooling:record", None, side_effect_free=False)
    assert rules.needs("time:get_current_time", "time", side_effect_free=True)  # named: asked even if free
    assert not rules.needs("clock", None, side_effect_free=True)
    assert not rules.needs("tests.tooling:held", None, side_effect_free=False)
    star = ApprovalRules.of(["*"])
    assert star.needs("tests.tooling:held", None, side_effect_free=False)
    assert not star.needs("clock", None, side_effect_free=True)  # "*" = every tool not free of side effects
    assert not ApprovalRules.of([]).needs("anything", None, side_effect_free=False)


def test_decisions_and_rejections() -> None:
    assert decided_status("approve") is ApprovalStatus.APPROVED
    assert decided_status("reject") is ApprovalStatus.REJECTED
    with pytest.raises(ValueError, match="approve"):
        decided_status("maybe")
    text = rejection_text("refund", ApprovalStatus.EXPIRED, "no decision within [limits] approval_timeout")
    assert "refund" in text and "expired" in text and "approval_timeout" in text


def test_edited_arguments_must_fit_the_schema() -> None:
    schema = {"type": "object", "properties": {"label": {"type": "string"}}, "additionalProperties": False}
    assert check_arguments({"label": "x"}, schema) is None
    assert "label" in str(check_arguments({"label": 5}, schema))
    assert check_arguments({"other": 1}, schema) is not None
    assert "JSON object" in str(check_arguments([1], schema))
    assert check_arguments({"anything": 1}, {}) is None  # no schema: any object


def approval(call: str, status: ApprovalStatus, **kw: object) -> Approval:
    fields: dict[str, object] = {"arguments": {"a": 1}, "requested_at": 1.0, **kw}
    return Approval(id=f"ap_{call}", session="s", turn="t", call_id=call, tool="record", status=status, **fields)  # type: ignore[arg-type]


def test_decisions_of_a_parked_run() -> None:
    run = ParkedRun(messages=[], calls=("c1", "c2"))
    assert decisions_of(run, [approval("c1", ApprovalStatus.APPROVED), approval("c2", ApprovalStatus.PENDING)]) is None
    decided = decisions_of(
        run,
        [
            approval("c1", ApprovalStatus.APPROVED, arguments={"a": 2}),
            approval("c2", ApprovalStatus.REJECTED, reason="no"),
        ],
    )
    assert decided is not None
    assert [(d.call_id, d.status, d.arguments, d.reason) for d in decided] == [
        ("c1", ApprovalStatus.APPROVED, {"a": 2}, None),
        ("c2", ApprovalStatus.REJECTED, None, "no"),
    ]


def test_require_approval_is_validated_like_tools() -> None:
    text = """
[[assistants]]
name = "main"
tools = ["clock", "tests.tooling:record"]
require_approval = ["tests.tooling:record", "*", "tests.tooling:held"]
"""
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    [issue] = caught.value.issues
    assert issue.path == "assistants[0].require_approval[2]" and "not among the assistant's tools" in issue.message
    ok = parse_config(text.replace(', "tests.tooling:held"', "") + '\n[limits]\napproval_timeout = "0s"\n')
    assert ok.limits.approval_timeout == 0.0
    assert ok.assistants[0].require_approval == ("tests.tooling:record", "*")
    assert parse_config('[[assistants]]\nname = "a"\n').limits.approval_timeout == 24 * 3600


def test_a_turn_abandoned_while_it_waits_carries_what_its_parked_run_spent() -> None:
    """A cancel or close of a waiting turn ends it with no results, but its model calls were paid:
    the record has the parked run's steps, models, usage and spend, and prices like any turn."""
    spent = Usage(input_tokens=100, output_tokens=20, requests=1)
    parked = ParkedRun(
        messages=[AssistantMessage(content="", model="m1", tool_calls=(ToolCall(id="c1", name="t", arguments={}),))],
        steps=1,
        usage=spent,
        spend=(ModelSpend(assistant="a", model="m1", usage=spent),),
    )
    bare = TurnRecord(id="t1", status=TurnStatus.CANCELLED, started_at=1.0, ended_at=2.0, error="cancelled")
    record = with_parked_spend(bare, parked)
    assert (record.status, record.steps, record.models, record.usage, record.error, record.ended_at) == (
        TurnStatus.CANCELLED,
        1,
        ("m1",),
        spent,
        "cancelled",
        2.0,
    )
    priced = price_record(record, [Price(model="m1", input_per_mtok=Decimal(1000), output_per_mtok=Decimal(2000))])
    assert priced.cost is not None and Decimal(priced.cost.amount) == Decimal("0.14")
    assert priced.by_model[0].cost == priced.cost
