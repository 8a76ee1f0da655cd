"""Transfers and openers as pure logic (agentd/transfer.py; RFC 0004)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentd.config import Assistant, FirstMessageMode, Transfer, TransferMode
from agentd.messages import (
    AssistantMessage,
    Message,
    SystemMessage,
    ToolCall,
    ToolResult,
    UserMessage,
    is_empty_assistant,
)
from agentd.tools import ToolSpec
from agentd.transfer import (
    OpenerKind,
    OpenerPlan,
    assistant_prompt,
    destination_message,
    destination_of,
    find_transfer,
    generated_opener,
    is_assistant_prompt,
    opener_message,
    opener_plan,
    select_transfer,
    session_start_history,
    transfer_history,
    transfer_result,
    transfer_tool_name,
    transfer_tool_specs,
)

ROLLING = TransferMode.ROLLING_HISTORY
SWAP = TransferMode.SWAP_SYSTEM_MESSAGE
REMOVE = TransferMode.SWAP_SYSTEM_MESSAGE_AND_REMOVE_TRANSFER
DELETE = TransferMode.DELETE_HISTORY
ALL_MODES = list(TransferMode)

# --------------------------------------------------------------------------- the conversation of RFC 0004 §4

A1 = Assistant(
    name="assistant1",
    system="assistant1 system message",
    first_message="assistant1 first message",
    transfers=(Transfer(to="assistant2", description="Account questions", message="(destination.message)"),),
)
A2 = Assistant(
    name="assistant2",
    system="assistant2 system message",
    first_message="assistant2 first message",
    transfers=(Transfer(to="assistant3", message="Over to assistant3."),),
)
A3 = Assistant(name="assistant3", system="assistant3 system message", first_message="assistant3 first message")

S1 = SystemMessage(content="assistant1 system message", name="assistant1")
F1 = AssistantMessage(content="assistant1 first message", turn="t0", model="model-a", assistant="assistant1")
U1 = UserMessage(content="hey, good morning", turn="t1")
R1 = AssistantMessage(content="how can i help?", turn="t1", model="model-a", assistant="assistant1")
U2 = UserMessage(content="i need help with my account", turn="t2")
TT = AssistantMessage(
    tool_calls=(ToolCall(id="call-1", name="transfer_to_assistant2"),),
    turn="t2",
    model="model-a",
    assistant="assistant1",
)
TR = ToolResult(name="transfer_to_assistant2", content=transfer_result("assistant2"), call_id="call-1", turn="t2")
M = AssistantMessage(content="(destination.message)", turn="t2", model="model-a", assistant="assistant1")
S2 = SystemMessage(content="assistant2 system message", name="assistant2", turn="t2")
F2 = AssistantMessage(content="assistant2 first message", turn="t3", model="model-b", assistant="assistant2")

PRE = [S1, F1, U1, R1, U2, TT, TR]


def take_over(
    history: Sequence[Message],
    mode: TransferMode,
    *,
    source: Assistant = A1,
    destination: Assistant = A2,
    call_id: str = "call-1",
    transfer_turn: str = "t2",
    opener_turn: str = "t3",
) -> list[Message]:
    """What the child loop will do with these functions: transform, then add the opener."""
    transfer = find_transfer(source, transfer_tool_name(destination.name))
    assert transfer is not None
    spoken = destination_message(transfer, turn=transfer_turn, model="model-a", assistant=source.name)
    out = transfer_history(
        history,
        mode=mode,
        destination_system=assistant_prompt(destination, turn=transfer_turn),
        transfer_call_id=call_id,
        message=spoken,
    )
    plan = opener_plan(destination, out)
    if plan.kind is OpenerKind.FIRST_MESSAGE:
        out.append(opener_message(plan, turn=opener_turn, model="model-b"))
    return out


def roles(messages: Sequence[Message]) -> list[tuple[str, str]]:
    """(role, content) per message, with tool calls and results spelled like RFC 0004 §4."""
    out = []
    for m in messages:
        if isinstance(m, ToolResult):
            out.append(("tool", "transfer-tool-result" if m.name.startswith("transfer_to_") else m.content))
        elif isinstance(m, AssistantMessage) and any(c.name.startswith("transfer_to_") for c in m.tool_calls):
            out.append(("assistant", "transfer-tool"))
        else:
            out.append((type(m).__name__.removesuffix("Message").lower(), m.content))
    return out


# --------------------------------------------------------------------------- RFC 0004 §3–§4, exactly


def test_seed_rolling_history() -> None:
    out = take_over(PRE, ROLLING)
    assert out == [S1, F1, U1, R1, U2, TT, TR, M, S2, F2]  # RFC 0004 §3: [S1, …history, TT, TR, M, S2, F2]
    assert roles(out) == [
        ("system", "assistant1 system message"),
        ("assistant", "assistant1 first message"),
        ("user", "hey, good morning"),
        ("assistant", "how can i help?"),
        ("user", "i need help with my account"),
        ("assistant", "transfer-tool"),
        ("tool", "transfer-tool-result"),
        ("assistant", "(destination.message)"),
        ("system", "assistant2 system message"),
        ("assistant", "assistant2 first message"),
    ]


def test_seed_swap_system_message_in_history() -> None:
    out = take_over(PRE, SWAP)
    assert out == [S2, F1, U1, R1, U2, TT, TR, M, F2]  # RFC 0004 §3: [S2, …history, TT, TR, M, F2]
    assert roles(out) == [
        ("system", "assistant2 system message"),
        ("assistant", "assistant1 first message"),
        ("user", "hey, good morning"),
        ("assistant", "how can i help?"),
        ("user", "i need help with my account"),
        ("assistant", "transfer-tool"),
        ("tool", "transfer-tool-result"),
        ("assistant", "(destination.message)"),
        ("assistant", "assistant2 first message"),
    ]


def test_seed_swap_and_remove_transfer_tool_messages() -> None:
    out = take_over(PRE, REMOVE)
    assert out == [S2, F1, U1, R1, U2, M, F2]  # RFC 0004 §3: [S2, …history, M, F2]
    assert roles(out) == [
        ("system", "assistant2 system message"),
        ("assistant", "assistant1 first message"),
        ("user", "hey, good morning"),
        ("assistant", "how can i help?"),
        ("user", "i need help with my account"),
        ("assistant", "(destination.message)"),
        ("assistant", "assistant2 first message"),
    ]


def test_seed_delete_history() -> None:
    # RFC 0004 §4: the transfer itself leaves [S2, F2]; the conversation goes on from there.
    out = take_over(PRE, DELETE)
    assert out == [S2, F2]
    assert roles(out) == [("system", "assistant2 system message"), ("assistant", "assistant2 first message")]


def test_mode_may_be_given_as_its_config_string() -> None:
    out = transfer_history(PRE, mode="delete-history", destination_system=S2, transfer_call_id="call-1", message=M)
    assert out == [S2]
    with pytest.raises(ValueError):
        transfer_history(PRE, mode="keep-everything", destination_system=S2, transfer_call_id="call-1", message=M)


def test_kept_messages_keep_their_bookkeeping_and_identity() -> None:
    out = take_over(PRE, SWAP)
    for original in (F1, U1, R1, U2, TT, TR):
        assert any(m is original for m in out)
    assert out[-2] == M and out[-2].model == "model-a" and out[-2].assistant == "assistant1"
    assert out[1].model == "model-a" and out[1].assistant == "assistant1" and out[1].turn == "t0"
    assert out[-1].model == "model-b" and out[-1].assistant == "assistant2" and out[-1].turn == "t3"


# --------------------------------------------------------------------------- a second transfer


def second_transfer_pre() -> list[Message]:
    """After a rolling transfer to assistant2, a user message, then assistant2 transfers to assistant3."""
    first = take_over(PRE, ROLLING)
    u3 = UserMessage(content="actually, something else", turn="t4")
    tt2 = AssistantMessage(
        tool_calls=(ToolCall(id="call-2", name="transfer_to_assistant3"),),
        turn="t4",
        model="model-b",
        assistant="assistant2",
    )
    tr2 = ToolResult(name="transfer_to_assistant3", content=transfer_result("assistant3"), call_id="call-2", turn="t4")
    return [*first, u3, tt2, tr2]


def test_second_transfer_after_a_rolling_one() -> None:
    pre = second_transfer_pre()
    assert [m for m in pre if isinstance(m, SystemMessage)] == [S1, S2]
    u3, tt2, tr2 = pre[-3:]
    m2 = AssistantMessage(content="Over to assistant3.", turn="t4", model="model-a", assistant="assistant2")
    s3 = SystemMessage(content="assistant3 system message", name="assistant3", turn="t4")
    f3 = AssistantMessage(content="assistant3 first message", turn="t5", model="model-b", assistant="assistant3")

    def run(mode: TransferMode) -> list[Message]:
        return take_over(pre, mode, source=A2, destination=A3, call_id="call-2", transfer_turn="t4", opener_turn="t5")

    # rolling keeps both earlier prompts and adds the third
    assert run(ROLLING) == [S1, F1, U1, R1, U2, TT, TR, M, S2, F2, u3, tt2, tr2, m2, s3, f3]
    # swap replaces every assistant prompt (S1 and S2) with one S3 at the head
    assert run(SWAP) == [s3, F1, U1, R1, U2, TT, TR, M, F2, u3, tt2, tr2, m2, f3]
    # remove: only this transfer's call and result go; the first transfer's (kept by rolling) stay
    assert run(REMOVE) == [s3, F1, U1, R1, U2, TT, TR, M, F2, u3, m2, f3]
    assert run(DELETE) == [s3, f3]


def test_second_transfer_after_a_remove_mode_one() -> None:
    first = take_over(PRE, REMOVE)  # [S2, F1, U1, R1, U2, M, F2]
    tt2 = AssistantMessage(
        content="Let me get assistant3.",
        tool_calls=(ToolCall(id="call-2", name="transfer_to_assistant3"),),
        turn="t4",
        model="model-b",
        assistant="assistant2",
    )
    tr2 = ToolResult(name="transfer_to_assistant3", content=transfer_result("assistant3"), call_id="call-2", turn="t4")
    out = take_over([*first, tt2, tr2], REMOVE, source=A2, destination=A3, call_id="call-2", transfer_turn="t4")
    kept_tt2 = AssistantMessage(content="Let me get assistant3.", turn="t4", model="model-b", assistant="assistant2")
    assert [m for m in out if isinstance(m, SystemMessage)] == [out[0]]
    assert out[0].name == "assistant3"
    assert out[1:7] == [F1, U1, R1, U2, M, F2]
    assert out[7] == kept_tt2  # content survives without the call
    assert [m.content for m in out[8:]] == ["Over to assistant3.", "assistant3 first message"]


# --------------------------------------------------------------------------- parallel tool calls

LOOKUP = ToolCall(id="call-0", name="lookup_account", arguments={"user": "ada"})
PAR_TT = AssistantMessage(
    content="Checking your account and connecting you.",
    tool_calls=(LOOKUP, ToolCall(id="call-1", name="transfer_to_assistant2")),
    turn="t2",
    model="model-a",
    assistant="assistant1",
)
LOOKUP_RESULT = ToolResult(name="lookup_account", content='{"plan": "pro"}', call_id="call-0", turn="t2")


@pytest.mark.parametrize("results", [[LOOKUP_RESULT, TR], [TR, LOOKUP_RESULT]], ids=["call-order", "reversed"])
def test_transfer_beside_another_tool_call(results: list[ToolResult]) -> None:
    pre = [S1, F1, U1, R1, U2, PAR_TT, *results]
    assert take_over(pre, ROLLING) == [*pre, M, S2, F2]
    assert take_over(pre, SWAP) == [S2, F1, U1, R1, U2, PAR_TT, *results, M, F2]
    out = take_over(pre, REMOVE)
    kept = AssistantMessage(
        content="Checking your account and connecting you.",
        tool_calls=(LOOKUP,),
        turn="t2",
        model="model-a",
        assistant="assistant1",
    )
    # the other call stays, paired with its result right after it; M follows every tool result
    assert out == [S2, F1, U1, R1, U2, kept, LOOKUP_RESULT, M, F2]
    assert take_over(pre, DELETE) == [S2, F2]


def test_parallel_call_survives_when_the_message_had_no_content() -> None:
    tt = AssistantMessage(
        tool_calls=(ToolCall(id="call-1", name="transfer_to_assistant2"), LOOKUP), turn="t2", model="model-a"
    )
    out = transfer_history(
        [U2, tt, TR, LOOKUP_RESULT], mode=REMOVE, destination_system=S2, transfer_call_id="call-1", message=M
    )
    assert out == [S2, U2, AssistantMessage(tool_calls=(LOOKUP,), turn="t2", model="model-a"), LOOKUP_RESULT, M]


def test_results_without_ids_are_paired_by_name_and_order() -> None:
    # A provider pairing by name and order (Ollama) may leave call_id empty.
    tt = AssistantMessage(
        tool_calls=(
            ToolCall(id="a", name="lookup_account"),
            ToolCall(id="b", name="transfer_to_assistant2"),
            ToolCall(id="c", name="transfer_to_assistant2"),
        ),
    )
    r_a = ToolResult(name="lookup_account", content="ok")
    r_b = ToolResult(name="transfer_to_assistant2", content="first transfer result")
    r_c = ToolResult(name="transfer_to_assistant2", content="superseded", is_error=True)
    out = transfer_history(
        [U2, tt, r_a, r_b, r_c], mode=REMOVE, destination_system=S2, transfer_call_id="b", message=None
    )
    assert out == [S2, U2, AssistantMessage(tool_calls=(tt.tool_calls[0], tt.tool_calls[2])), r_a, r_c]
    out = transfer_history(
        [U2, tt, r_a, r_b, r_c], mode=REMOVE, destination_system=S2, transfer_call_id="c", message=None
    )
    assert out == [S2, U2, AssistantMessage(tool_calls=tt.tool_calls[:2]), r_a, r_b]


# --------------------------------------------------------------------------- M and the emptied message


@pytest.mark.parametrize("text", ["", "   \n"], ids=["empty", "blank"])
def test_blank_destination_message_is_no_m(text: str) -> None:
    transfer = Transfer(to="assistant2", message=text)
    assert destination_message(transfer, turn="t2", model="model-a", assistant="assistant1") is None
    assert destination_message(Transfer(to="assistant2"), turn="t2", model="m", assistant="a") is None  # unset


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("message", [None, AssistantMessage(content="", turn="t2")], ids=["unset", "empty"])
def test_no_m_in_any_mode(mode: TransferMode, message: AssistantMessage | None) -> None:
    out = transfer_history(PRE, mode=mode, destination_system=S2, transfer_call_id="call-1", message=message)
    assert M not in out
    assert not any(is_empty_assistant(m) for m in out)
    expected = {
        ROLLING: [*PRE, S2],
        SWAP: [S2, F1, U1, R1, U2, TT, TR],
        REMOVE: [S2, F1, U1, R1, U2],
        DELETE: [S2],
    }[mode]
    assert out == expected


def test_destination_message_is_spoken_by_the_old_assistant() -> None:
    spoken = destination_message(A1.transfers[0], turn="t2", model="model-a", assistant="assistant1")
    assert spoken == M


def test_message_holding_only_the_transfer_call_is_dropped() -> None:
    out = transfer_history(PRE, mode=REMOVE, destination_system=S2, transfer_call_id="call-1", message=M)
    assert not any(isinstance(m, AssistantMessage) and m.turn == "t2" and not m.content for m in out)
    assert not any(isinstance(m, ToolResult) for m in out)
    assert out == [S2, F1, U1, R1, U2, M]


@pytest.mark.parametrize(
    "tt",
    [
        AssistantMessage(content="One moment.", tool_calls=TT.tool_calls, turn="t2", model="model-a"),
        AssistantMessage(
            thinking="billing question → assistant2", tool_calls=TT.tool_calls, turn="t2", model="model-a"
        ),
    ],
    ids=["content", "thinking"],
)
def test_message_with_content_or_thinking_is_kept_without_the_call(tt: AssistantMessage) -> None:
    out = transfer_history([U2, tt, TR], mode=REMOVE, destination_system=S2, transfer_call_id="call-1", message=M)
    assert out == [S2, U2, AssistantMessage(content=tt.content, thinking=tt.thinking, turn="t2", model="model-a"), M]


# --------------------------------------------------------------------------- what is not touched


def test_thinking_and_images_pass_untouched() -> None:
    u = UserMessage(content="what is on this invoice?", images=("aW52b2ljZQ==",), name="ada", turn="t1")
    a = AssistantMessage(
        content="It is a pro plan invoice.",
        thinking="the image shows…",
        images=("Y2hhcnQ=",),
        turn="t1",
        model="model-a",
    )
    s_img = SystemMessage(content="assistant1 system message", images=("bG9nbw==",), name="assistant1")
    tt = AssistantMessage(thinking="hand over", tool_calls=TT.tool_calls, turn="t2", model="model-a")
    pre = [s_img, u, a, U2, tt, TR]
    for mode in (ROLLING, SWAP, REMOVE):
        out = transfer_history(pre, mode=mode, destination_system=S2, transfer_call_id="call-1", message=M)
        assert out[out.index(u)] is u and out[out.index(a)] is a
        assert u.images == ("aW52b2ljZQ==",) and a.thinking == "the image shows…" and a.images == ("Y2hhcnQ=",)
    assert transfer_history(pre, mode=REMOVE, destination_system=S2, transfer_call_id="call-1", message=M)[-2] == (
        AssistantMessage(thinking="hand over", turn="t2", model="model-a")
    )


def test_system_messages_without_a_name_are_kept_in_place() -> None:
    note = SystemMessage(content="The customer is a verified account holder.")
    pre = [S1, note, U2, TT, TR]
    assert not is_assistant_prompt(note) and is_assistant_prompt(S1)
    assert transfer_history(pre, mode=SWAP, destination_system=S2, transfer_call_id="call-1", message=M) == [
        S2,
        note,
        U2,
        TT,
        TR,
        M,
    ]
    assert transfer_history(pre, mode=REMOVE, destination_system=S2, transfer_call_id="call-1", message=M) == [
        S2,
        note,
        U2,
        M,
    ]
    assert transfer_history(pre, mode=DELETE, destination_system=S2, transfer_call_id="call-1", message=M) == [S2]


def test_destination_without_a_prompt() -> None:
    silent = Assistant(name="assistant2", system="  ", first_message="hello")
    assert assistant_prompt(silent) is None
    for mode, expected in [
        (ROLLING, [*PRE, M]),
        (SWAP, [F1, U1, R1, U2, TT, TR, M]),
        (REMOVE, [F1, U1, R1, U2, M]),
        (DELETE, []),
    ]:
        assert (
            transfer_history(PRE, mode=mode, destination_system=None, transfer_call_id="call-1", message=M) == expected
        )


def test_misuse_is_rejected() -> None:
    unnamed = SystemMessage(content="assistant2 system message")
    with pytest.raises(ValueError, match="name"):
        transfer_history(PRE, mode=SWAP, destination_system=unnamed, transfer_call_id="call-1", message=M)
    for mode in ALL_MODES:
        with pytest.raises(ValueError, match="call-9"):
            transfer_history(PRE, mode=mode, destination_system=S2, transfer_call_id="call-9", message=M)


# --------------------------------------------------------------------------- the transfer tool


def test_tool_names() -> None:
    assert transfer_tool_name("billing") == "transfer_to_billing"
    assert destination_of("transfer_to_billing") == "billing"
    assert destination_of(transfer_tool_name("eu.billing-2")) == "eu.billing-2"
    assert destination_of("clock") is None
    assert destination_of("transfer_to_") is None
    assert destination_of("transfer_billing") is None


def test_tool_specs() -> None:
    assistant = Assistant(
        name="triage",
        transfers=(Transfer(to="billing", description="Questions about invoices"), Transfer(to="support")),
    )
    specs = transfer_tool_specs(assistant)
    assert specs == [
        ToolSpec(
            name="transfer_to_billing",
            description="Questions about invoices",
            parameters={"type": "object", "properties": {}},
            side_effect_free=False,
        ),
        ToolSpec(
            name="transfer_to_support",
            description="Transfer the conversation to the support assistant.",
            parameters={"type": "object", "properties": {}},
            side_effect_free=False,
        ),
    ]
    assert transfer_tool_specs(A3) == []


def test_find_and_select_transfer() -> None:
    assert find_transfer(A1, "transfer_to_assistant2") is A1.transfers[0]
    assert find_transfer(A1, "transfer_to_assistant3") is None  # not a destination of assistant1
    assert find_transfer(A1, "clock") is None
    clock = ToolCall(id="c0", name="clock")
    first = ToolCall(id="c1", name="transfer_to_assistant2")
    stranger = ToolCall(id="c2", name="transfer_to_assistant3")
    again = ToolCall(id="c3", name="transfer_to_assistant2", arguments_error="not JSON")
    assert select_transfer(A1, AssistantMessage(content="hi")) is None
    assert select_transfer(A1, AssistantMessage(tool_calls=(clock, stranger))) is None
    choice = select_transfer(A1, AssistantMessage(tool_calls=(clock, stranger, first, again)))
    assert choice is not None
    assert choice.call is first and choice.transfer is A1.transfers[0] and choice.superseded == (again,)
    bad_args = select_transfer(A1, AssistantMessage(tool_calls=(again,)))
    assert bad_args is not None and bad_args.call is again


def test_transfer_result_text() -> None:
    assert transfer_result("billing") == "Transferred the conversation to billing."
    superseded = transfer_result("support", superseded_by="billing")
    assert "Not transferred to support" in superseded and "billing" in superseded


# --------------------------------------------------------------------------- openers and session start


def test_session_start_history() -> None:
    assert session_start_history(A1) == [SystemMessage(content="assistant1 system message", name="assistant1")]
    assert session_start_history(Assistant(name="quiet")) == []
    assert session_start_history(Assistant(name="quiet", system=" \t")) == []


@pytest.mark.parametrize("history", [None, [S1], [S2, F1, M]], ids=["unknown", "session-start", "after-transfer"])
def test_opener_plans(history: list[Message] | None) -> None:
    speaks = Assistant(name="b", first_message="Billing here.")
    assert opener_plan(speaks, history) == OpenerPlan(
        assistant="b", kind=OpenerKind.FIRST_MESSAGE, content="Billing here."
    )
    assert opener_plan(speaks, history).speaks
    blank = opener_plan(Assistant(name="b", first_message="  "), history)
    assert blank.kind is OpenerKind.NONE and not blank.speaks
    generated = Assistant(
        name="b", first_message="ignored", first_message_mode=FirstMessageMode.SPEAKS_FIRST_MODEL_GENERATED
    )
    assert opener_plan(generated, history) == OpenerPlan(assistant="b", kind=OpenerKind.GENERATED)
    waits = Assistant(name="b", first_message="never said", first_message_mode=FirstMessageMode.WAITS_FOR_USER)
    assert opener_plan(waits, history).kind is OpenerKind.NONE


def test_generated_opener_needs_a_history() -> None:
    generated = Assistant(name="b", first_message_mode=FirstMessageMode.SPEAKS_FIRST_MODEL_GENERATED)
    plan = opener_plan(generated, session_start_history(generated))
    assert plan.kind is OpenerKind.NONE and "empty history" in plan.reason


def test_opener_message() -> None:
    plan = opener_plan(A2)
    assert opener_message(plan, turn="t3", model="model-b") == F2
    with pytest.raises(ValueError):
        opener_message(OpenerPlan(assistant="b", kind=OpenerKind.GENERATED), turn="t3", model="model-b")


def test_generated_opener() -> None:
    raw = AssistantMessage(
        content="Hello from billing!", thinking="greet", tool_calls=(ToolCall(id="x", name="clock"),), model="ignored"
    )
    assert generated_opener(raw, turn="t3", model="model-b", assistant="assistant2") == AssistantMessage(
        content="Hello from billing!", thinking="greet", turn="t3", model="model-b", assistant="assistant2"
    )
    only_tools = AssistantMessage(tool_calls=(ToolCall(id="x", name="clock"),))
    assert generated_opener(only_tools, turn="t3", model="model-b", assistant="assistant2") is None
    assert generated_opener(AssistantMessage(), turn="t3", model="model-b", assistant="assistant2") is None
    thinking_only = generated_opener(AssistantMessage(thinking="hmm"), turn="t3", model="model-b", assistant="b")
    assert thinking_only == AssistantMessage(thinking="hmm", turn="t3", model="model-b", assistant="b")


def test_waits_for_user_after_transfer_leaves_no_f2() -> None:
    waiting = Assistant(
        name="assistant2", system="assistant2 system message", first_message_mode=FirstMessageMode.WAITS_FOR_USER
    )
    assert take_over(PRE, ROLLING, destination=waiting) == [*PRE, M, S2]
    assert take_over(PRE, DELETE, destination=waiting) == [S2]


# --------------------------------------------------------------------------- properties over random histories

_S2 = SystemMessage(content="new prompt", name="dest")
_M = AssistantMessage(content="handing over", model="old-model", assistant="src")


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[Message], str]:
    """A random transcript ending with a step that holds the transfer call (maybe beside others)."""
    counter = iter(range(10_000))
    text = st.text(alphabet="abc ", max_size=6)

    def step(names: list[str], with_transfer: bool) -> list[Message]:
        calls = [ToolCall(id=f"c{next(counter)}", name=name) for name in names]
        transfer = ToolCall(id=f"c{next(counter)}", name="transfer_to_dest")
        if with_transfer:
            calls.insert(draw(st.integers(0, len(calls))), transfer)
        message = AssistantMessage(
            content=draw(st.sampled_from(["", "ok"])),
            thinking=draw(st.sampled_from([None, "hmm"])),
            tool_calls=tuple(calls),
            turn=f"t{next(counter)}",
            model="old-model",
        )
        results: list[Message] = [ToolResult(name=c.name, content="r", call_id=c.id) for c in calls]
        return [message, *draw(st.permutations(results))]

    history: list[Message] = []
    for kind in draw(st.lists(st.sampled_from(["user", "assistant", "tools", "prompt", "note"]), max_size=12)):
        if kind == "user":
            history.append(UserMessage(content=draw(text) or "u", turn=f"t{next(counter)}"))
        elif kind == "assistant":
            history.append(AssistantMessage(content="a", thinking=draw(st.sampled_from([None, "x"]))))
        elif kind == "tools":
            history.extend(step(draw(st.lists(st.sampled_from(["clock", "lookup"]), min_size=1, max_size=3)), False))
        elif kind == "prompt":
            history.append(SystemMessage(content="p", name=draw(st.sampled_from(["src", "other"]))))
        else:
            history.append(SystemMessage(content="note"))
    last = step(draw(st.lists(st.sampled_from(["clock", "lookup"]), max_size=3)), True)
    history.extend(last)
    assert isinstance(last[0], AssistantMessage)
    call_id = next(c.id for c in last[0].tool_calls if c.name == "transfer_to_dest")
    return history, call_id


def _is_subsequence(small: Sequence[Message], big: Sequence[Message]) -> bool:
    it = iter(big)
    return all(any(x is y for y in it) for x in small)


@settings(max_examples=200, deadline=None)
@given(histories(), st.booleans())
def test_property_delete_history_is_only_s2(case: tuple[list[Message], str], with_m: bool) -> None:
    history, call_id = case
    out = transfer_history(
        history, mode=DELETE, destination_system=_S2, transfer_call_id=call_id, message=_M if with_m else None
    )
    assert out == [_S2]


@settings(max_examples=200, deadline=None)
@given(histories(), st.booleans())
def test_property_rolling_is_an_ordered_superset(case: tuple[list[Message], str], with_m: bool) -> None:
    history, call_id = case
    m = _M if with_m else None
    out = transfer_history(history, mode=ROLLING, destination_system=_S2, transfer_call_id=call_id, message=m)
    assert all(a is b for a, b in zip(out, history, strict=False)) and len(out) >= len(history)
    assert out[len(history) :] == ([_M] if with_m else []) + [_S2]


@settings(max_examples=200, deadline=None)
@given(histories(), st.booleans())
def test_property_swap_has_one_prompt_at_the_head(case: tuple[list[Message], str], with_m: bool) -> None:
    history, call_id = case
    out = transfer_history(
        history, mode=SWAP, destination_system=_S2, transfer_call_id=call_id, message=_M if with_m else None
    )
    assert out[0] is _S2
    assert [m for m in out if is_assistant_prompt(m)] == [_S2]
    body = out[1:-1] if with_m else out[1:]
    assert body == [m for m in history if not is_assistant_prompt(m)]


@settings(max_examples=300, deadline=None)
@given(histories(), st.booleans())
def test_property_remove_mode_keeps_calls_and_results_paired(case: tuple[list[Message], str], with_m: bool) -> None:
    history, call_id = case
    out = transfer_history(
        history, mode=REMOVE, destination_system=_S2, transfer_call_id=call_id, message=_M if with_m else None
    )
    assert out[0] is _S2 and [m for m in out if is_assistant_prompt(m)] == [_S2]
    assert not any(is_empty_assistant(m) for m in out)
    calls = [c.id for m in out if isinstance(m, AssistantMessage) for c in m.tool_calls]
    results = [m.call_id for m in out if isinstance(m, ToolResult)]
    assert call_id not in calls and call_id not in results
    assert sorted(calls) == sorted(results)  # every call has exactly one result, every result its call
    # each result directly follows (within its block) the message that asked for it
    open_calls: set[str] = set()
    for m in out:
        if isinstance(m, AssistantMessage) and m.tool_calls:
            assert not open_calls
            open_calls = {c.id for c in m.tool_calls}
        elif isinstance(m, ToolResult):
            open_calls.remove(m.call_id)
        else:
            assert not open_calls
    # nothing but the transfer call, its result, prompts and an emptied message went; order kept
    unchanged = [m for m in out[1:] if m is not _M and any(m is h for h in history)]
    assert _is_subsequence(unchanged, history)
    dropped = [h for h in history if not any(h is m for m in out)]
    for h in dropped:
        assert (
            is_assistant_prompt(h)
            or (isinstance(h, ToolResult) and h.call_id == call_id)
            or (isinstance(h, AssistantMessage) and any(c.id == call_id for c in h.tool_calls))
        )
