"""A turn that waits for approvals, as the door shows it (``agentd.door.parked``, RFC 0010 §8),
and a stream followed from the middle of a turn (``agentd.door.follow``): pure, no processes."""

from __future__ import annotations

import json

from agentd import events
from agentd.budget import Usage
from agentd.door.follow import Rerun, Sent, StepEnded, TakenBack, Text, ToolEnded, ToolStarted, follow
from agentd.door.outcome import response_object
from agentd.door.parked import ApprovalRequired, approval_required, parked_response, since, waiting
from agentd.door.shapes import McpApprovalRequest, McpCall, OutputMessage
from agentd.errors import Conflict
from agentd.views import ApprovalView, Entry, ParkedTurn, ToolCallView, TurnView

PENDING_TURN = TurnView(id="t_1", status="pending", started_at="2026-01-01T00:00:00.000Z")


def approval(approval_id: str, call: str, status: str = "pending") -> ApprovalView:
    return ApprovalView(
        id=approval_id, session="s_1", turn="t_1", call_id=call, tool="refund", arguments={"n": 1}, status=status
    )


def assistant(seq: int, content: str, *calls: tuple[str, str]) -> Entry:
    views = [ToolCallView(id=call, name=name, arguments={"n": 1}) for call, name in calls] or None
    return Entry(seq=seq, turn="t_1", role="assistant", content=content, tool_calls=views, model="m", assistant="main")


def tool(seq: int, call: str, content: str, is_error: bool = False) -> Entry:
    return Entry(seq=seq, turn="t_1", role="tool", content=content, tool_call_id=call, is_error=is_error or None)


# The turn's user message is seq 2. Step 1 ran the clock; step 2 asks for a refund (needs approval)
# and the clock again (needs none): the run parked after step 2.
PARKED_ENTRIES = [
    assistant(3, "Let me look.", ("c1", "clock")),
    tool(4, "c1", "noon"),
    assistant(5, "Refunding now.", ("c2", "refund"), ("c3", "clock")),
]
PARKED = ParkedTurn(
    turn="t_1",
    entries=PARKED_ENTRIES,
    calls=["c2"],
    approvals=[approval("ap_old", "c0", "approved"), approval("ap_2", "c2")],
)


def test_a_parked_turn_is_a_completed_response_ending_with_its_approval_requests() -> None:
    shown = parked_response(PENDING_TURN, PARKED, session="s_1", model="main", base=-1)
    assert shown.id == "resp_t_1" and shown.status == "completed" and shown.usage is None
    kinds = [(type(item).__name__, item.id) for item in shown.output]
    # The clock of the parked step needs no approval: it runs (and shows) once the step is decided.
    assert kinds == [
        ("OutputMessage", "msg_t_1_a_main_0"),
        ("McpCall", "mcp_t_1_c1"),
        ("OutputMessage", "msg_t_1_a_main_1"),
        ("McpApprovalRequest", "ap_2"),
    ]
    request = shown.output[-1]
    assert isinstance(request, McpApprovalRequest)
    assert (request.name, request.server_label, json.loads(request.arguments)) == ("refund", "agentd", {"n": 1})
    assert [a.id for a in waiting(PARKED)] == ["ap_2"]


def test_the_answer_after_the_approvals_starts_with_the_parked_steps_calls() -> None:
    ended = TurnView(id="t_1", status="completed", usage=Usage(3, 4), started_at="2026-01-01T00:00:00.000Z")
    entries = [
        *PARKED_ENTRIES,
        tool(6, "c2", "tool 'refund' was not run: its approval was rejected: no", is_error=True),
        tool(7, "c3", "noon"),
        assistant(8, "No refund then."),
    ]
    rest = since(entries, base=5)
    assert [e.seq for e in rest] == [5, 6, 7, 8] and rest[0].content == ""  # its text went out before
    # The whole turn, shown from base: its item ids count over the whole (RFC 0010 §7).
    shown = response_object(ended, entries, session="s_1", model="main", base=5)
    assert [item.id for item in shown.output] == ["mcp_t_1_c2", "mcp_t_1_c3", "msg_t_1_a_main_2"]
    refused, clock = shown.output[0], shown.output[1]
    assert isinstance(refused, McpCall) and refused.error and refused.output is None
    assert isinstance(clock, McpCall) and clock.output == "noon"
    whole = response_object(ended, since(entries, base=-1), session="s_1", model="main")
    assert [type(i).__name__ for i in whole.output][:2] == ["OutputMessage", "McpCall"]
    assert isinstance(whole.output[-1], OutputMessage)


def test_parked_again_shows_only_what_came_after_the_last_park() -> None:
    again = ParkedTurn(
        turn="t_1",
        entries=[*PARKED_ENTRIES, tool(6, "c2", "refunded"), tool(7, "c3", "noon"), assistant(8, "", ("c4", "refund"))],
        calls=["c4"],
        approvals=[approval("ap_2", "c2", "approved"), approval("ap_4", "c4")],
    )
    shown = parked_response(PENDING_TURN, again, session="s_1", model="main", base=5)
    assert [item.id for item in shown.output] == ["mcp_t_1_c2", "mcp_t_1_c3", "ap_4"]


def test_a_chat_completion_of_a_waiting_turn_is_a_conflict_naming_the_approvals() -> None:
    error = approval_required("t_1", [approval("ap_2", "c2"), approval("ap_3", "c3")])
    assert isinstance(error, ApprovalRequired) and isinstance(error, Conflict)
    assert error.code == "approval_required" and error.turn == "t_1"
    assert "ap_2 (refund)" in error.message and "ap_3 (refund)" in error.message


def test_a_stream_followed_after_approvals_takes_the_run_that_goes_on() -> None:
    """Followed from the middle of a turn (``run`` None), the run that goes on is whichever it is:
    its tool events (which carry no run) and its later steps are not a re-run."""
    sent = Sent(run=None, shows_tools=True)
    said = []
    for name, data in [
        (events.TOOL_CALL, {"id": "c2", "name": "refund", "arguments": {"n": 1}}),
        (events.TOOL_RESULT, {"id": "c2", "content": "refunded", "is_error": False}),
        (events.DELTA, {"run": 1, "step": 3, "content": "Done."}),
        (events.STEP_DONE, {"run": 1, "step": 3, "content": "Done."}),
        (events.DELTA, {"run": 0, "step": 3, "content": "stale"}),
    ]:
        sent, happened = follow(sent, name, data)
        said += happened
    assert said == [
        ToolStarted(id="c2", name="refund", arguments='{"n":1}'),
        ToolEnded(id="c2", content="refunded", is_error=False),
        Text(step=3, text="Done."),
        StepEnded(step=3, content="Done."),
    ]
    assert sent.run == 1
    # A later run still takes back what went out.
    _, happened = follow(sent, events.DELTA, {"run": 2, "step": 3, "content": "x"})
    assert isinstance(happened[0], TakenBack)
    # Nothing went out yet: a re-run is only that.
    _, happened = follow(Sent(run=None), events.TURN_RESTARTED, {"run": 2})
    assert happened == [Rerun(run=2)]
