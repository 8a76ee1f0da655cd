"""The pure pieces of approvals (RFC 0012): which calls need one, the decisions a parked run gets,
and what edited arguments must fit. No processes."""

from __future__ import annotations

import pytest

from agentd.approvals import (
    Approval,
    ApprovalRules,
    ApprovalStatus,
    ParkedRun,
    check_arguments,
    decided_status,
    rejection_text,
)
from agentd.config import ConfigError, parse_config
from agentd.supervisor.approvals import decisions_of


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
