"""Transfers between assistants and openers, as pure functions over the transcript (RFC 0004).

Nothing here does I/O or calls a model. The child loop asks this module:

- which transfer tools to offer (``transfer_tool_specs``) and whether a model's answer asked for a
  transfer (``select_transfer``), and what the transfer call's tool result says (``transfer_result``);
- what the destination assistant's transcript is before its opener (``transfer_history``), with
  the destination message M (``destination_message``) and the new system prompt S2
  (``assistant_prompt``) built here too;
- what the opener F2 is (``opener_plan``, then ``opener_message`` or ``generated_opener``), at
  session start (``session_start_history``) and after a transfer alike.

Vocabulary of RFC 0004 §3: S1/S2 = old/new assistant's system prompt, TT/TR = the transfer tool
call and its result, M = destination message spoken by the old assistant, F2 = the new
assistant's opener. Every message keeps its bookkeeping (``turn``, ``model``, ``assistant``): a
transfer reshapes which messages the destination sees, never what a kept message says or who
produced it. The choices made where the modes alone are ambiguous are listed in
RFC 0004 §5 and in the docstrings below.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import msgspec

from agentd.config import TRANSFER_TOOL_PREFIX, Assistant, FirstMessageMode, Transfer, TransferMode
from agentd.messages import (
    AssistantMessage,
    Message,
    SystemMessage,
    ToolCall,
    ToolResult,
    is_empty_assistant,
)
from agentd.tools import ToolSpec

__all__ = [
    "TRANSFER_TOOL_PREFIX",
    "OpenerKind",
    "OpenerPlan",
    "TransferChoice",
    "assistant_prompt",
    "destination_message",
    "destination_of",
    "find_transfer",
    "generated_opener",
    "is_assistant_prompt",
    "opener_message",
    "opener_plan",
    "select_transfer",
    "session_start_history",
    "transfer_history",
    "transfer_result",
    "transfer_tool_name",
    "transfer_tool_specs",
]


def _blank(text: str | None) -> bool:
    """Unset, empty or whitespace only: configured text that says nothing."""
    return not text or not text.strip()


# --------------------------------------------------------------------------- the transfer tool


def transfer_tool_name(destination: str) -> str:
    """The name of the tool that transfers to ``destination``: ``transfer_to_<destination>``."""
    return TRANSFER_TOOL_PREFIX + destination


def destination_of(tool_name: str) -> str | None:
    """The destination a transfer tool name points at, or None when the name is not a transfer tool.

    This is the bare inverse of ``transfer_tool_name``; whether the current assistant may
    actually transfer there is ``find_transfer``'s question.
    """
    if not tool_name.startswith(TRANSFER_TOOL_PREFIX):
        return None
    destination = tool_name[len(TRANSFER_TOOL_PREFIX) :]
    return destination or None


def _tool_description(transfer: Transfer) -> str:
    if not _blank(transfer.description):
        return transfer.description
    # A tool without a description gives the model nothing to decide on; say at least where it goes.
    return f"Transfer the conversation to the {transfer.to} assistant."


def transfer_tool_specs(assistant: Assistant) -> list[ToolSpec]:
    """One tool per transfer destination of ``assistant``, in config order.

    Name from ``transfer_tool_name``, description from the destination's ``description`` (a
    generic "Transfer the conversation to the <to> assistant." when that is blank), parameters an
    empty object schema (a transfer takes no arguments), and not side-effect free: a transfer
    changes the session, so restart-turn must never re-run one on its own.
    """
    return [
        ToolSpec(
            name=transfer_tool_name(transfer.to),
            description=_tool_description(transfer),
            parameters={"type": "object", "properties": {}},
            side_effect_free=False,
        )
        for transfer in assistant.transfers
    ]


def find_transfer(assistant: Assistant, tool_name: str) -> Transfer | None:
    """The transfer of ``assistant`` that ``tool_name`` invokes, or None (not a transfer tool of it)."""
    destination = destination_of(tool_name)
    if destination is None:
        return None
    for transfer in assistant.transfers:
        if transfer.to == destination:
            return transfer
    return None


class TransferChoice(msgspec.Struct, frozen=True, kw_only=True):
    """The transfer a model answer asked for: the call that wins, its config, and the calls it beat."""

    call: ToolCall
    transfer: Transfer
    superseded: tuple[ToolCall, ...] = ()


def select_transfer(assistant: Assistant, message: AssistantMessage) -> TransferChoice | None:
    """Did this model answer ask ``assistant`` to transfer? None when it did not.

    The first transfer call (in ``tool_calls`` order) to one of the assistant's destinations wins.
    Later transfer calls in the same message are ``superseded``: the loop answers each with
    ``transfer_result(their destination, superseded_by=winner)`` as an error result. A call named
    like a transfer tool the assistant does not have is not a transfer (the loop treats it as an
    unknown tool). Arguments are ignored — a transfer takes none — so a call whose argument text
    was invalid still names its destination unambiguously and still transfers.
    """
    chosen: tuple[ToolCall, Transfer] | None = None
    superseded: list[ToolCall] = []
    for call in message.tool_calls:
        transfer = find_transfer(assistant, call.name)
        if transfer is None:
            continue
        if chosen is None:
            chosen = (call, transfer)
        else:
            superseded.append(call)
    if chosen is None:
        return None
    return TransferChoice(call=chosen[0], transfer=chosen[1], superseded=tuple(superseded))


def transfer_result(destination: str, *, superseded_by: str | None = None) -> str:
    """The tool-result text answering a transfer call.

    With ``superseded_by`` (another transfer in the same step won), the text says this transfer
    did not happen; the loop records that result with ``is_error=True``.
    """
    if superseded_by is not None:
        return (
            f"Not transferred to {destination}: the conversation was transferred to "
            f"{superseded_by} by another call in the same step."
        )
    return f"Transferred the conversation to {destination}."


# --------------------------------------------------------------------------- transcript pieces


def is_assistant_prompt(message: Message) -> bool:
    """A system message that is an assistant's prompt: it carries the assistant's ``name``.

    Only these are replaced by the swap modes. A system message without a name is something else
    (a note an operator or integration put in the conversation) and is kept where it is.
    """
    return isinstance(message, SystemMessage) and bool(message.name)


def assistant_prompt(assistant: Assistant, *, turn: str | None = None) -> SystemMessage | None:
    """The assistant's system prompt as a transcript message, named after the assistant.

    None when ``assistant.system`` is blank (empty or whitespace): an empty system message tells
    a model nothing, so none is written. The transcript still shows who speaks through every
    assistant message's ``assistant`` field.
    """
    if _blank(assistant.system):
        return None
    return SystemMessage(content=assistant.system, name=assistant.name, turn=turn)


def session_start_history(assistant: Assistant) -> list[Message]:
    """The transcript of a new session before its opener: ``[S1]``, or ``[]`` with a blank prompt.

    The opener (if any) follows from ``opener_plan(assistant, history)``.
    """
    prompt = assistant_prompt(assistant)
    return [prompt] if prompt is not None else []


def destination_message(
    transfer: Transfer, *, turn: str | None, model: str | None, assistant: str
) -> AssistantMessage | None:
    """M: the destination's ``message`` as spoken by the old assistant, or None when it is blank.

    ``assistant`` and ``model`` are the *old* assistant and the model it is running on: M is the
    old assistant's last words, recorded in the transfer turn like the rest of that turn.
    """
    if _blank(transfer.message):
        return None
    return AssistantMessage(content=transfer.message, turn=turn, model=model, assistant=assistant)


# --------------------------------------------------------------------------- the four modes


def _transfer_call_index(history: Sequence[Message], call_id: str) -> int:
    """Index of the (latest) assistant message holding the tool call ``call_id``."""
    for index in range(len(history) - 1, -1, -1):
        message = history[index]
        if isinstance(message, AssistantMessage) and any(c.id == call_id for c in message.tool_calls):
            return index
    raise ValueError(f"no assistant message in the history holds the transfer call {call_id!r}")


def _result_index(history: Sequence[Message], tt_index: int, call: ToolCall) -> int | None:
    """Index of the result answering ``call`` among the tool results right after its message.

    Paired by call id; a result without an id (a provider that pairs by name and order) is paired
    by being the k-th id-less result named like the k-th call of that name.
    """
    tt = history[tt_index]
    assert isinstance(tt, AssistantMessage)
    block: list[int] = []
    for index in range(tt_index + 1, len(history)):
        if not isinstance(history[index], ToolResult):
            break
        block.append(index)
    for index in block:
        result = history[index]
        assert isinstance(result, ToolResult)
        if result.call_id and result.call_id == call.id:
            return index
    rank = [c.id for c in tt.tool_calls if c.name == call.name].index(call.id)
    anonymous: list[int] = []
    for index in block:
        result = history[index]
        assert isinstance(result, ToolResult)
        if not result.call_id and result.name == call.name:
            anonymous.append(index)
    return anonymous[rank] if rank < len(anonymous) else None


def _without_transfer_call(history: Sequence[Message], call_id: str) -> list[Message]:
    """The history without the transfer call and its result; an assistant message left empty goes."""
    tt_index = _transfer_call_index(history, call_id)
    tt = history[tt_index]
    assert isinstance(tt, AssistantMessage)
    call = next(c for c in tt.tool_calls if c.id == call_id)
    result_index = _result_index(history, tt_index, call)
    out: list[Message] = []
    for index, message in enumerate(history):
        if index == result_index:
            continue
        if index == tt_index:
            kept = msgspec.structs.replace(tt, tool_calls=tuple(c for c in tt.tool_calls if c.id != call_id))
            if is_empty_assistant(kept):
                continue
            message = kept
        out.append(message)
    return out


def transfer_history(
    history: Sequence[Message],
    *,
    mode: TransferMode | str,
    destination_system: SystemMessage | None,
    transfer_call_id: str,
    message: AssistantMessage | None,
) -> list[Message]:
    """The destination assistant's transcript before its opener F2 (RFC 0004 §3).

    ``history`` is the transcript up to and including the old assistant's message holding the
    transfer call TT (id ``transfer_call_id``, possibly beside other tool calls) and the tool
    results of that message (TR and the results of the other calls). ``destination_system`` is S2
    (``assistant_prompt(destination)``; None when the destination's prompt is blank). ``message``
    is M (``destination_message(...)``; None, or an empty assistant message, means no M).

    - ``rolling-history``: ``[S1, …history, TT, TR, M, S2]`` — the history untouched, M, then S2.
      Earlier prompts stay too: after a second rolling transfer the transcript holds S1, S2, S3.
    - ``swap-system-message-in-history``: ``[S2, …history, TT, TR, M]`` — every assistant prompt
      (``is_assistant_prompt``: a system message with a ``name``) is removed, wherever it stands,
      and one S2 goes at the head. System messages without a name are not assistant prompts and
      stay where they are (after S2).
    - ``swap-system-message-in-history-and-remove-transfer-tool-messages``: ``[S2, …history, M]``
      — as above, and the transfer call is removed from its message's ``tool_calls`` and its
      result from the history. Nothing else goes: other calls of that message keep their results,
      earlier transfers' calls (kept by their own mode) are part of "…history". The message is
      dropped when it is left with no content, no thinking and no tool calls.
    - ``delete-history``: ``[S2]`` (or ``[]`` without S2); M is not kept.

    M always goes after every tool result of TT's message: results must directly follow the
    message that asked for them on the wire. Kept messages are the same objects, bookkeeping
    (``turn``, ``model``, ``assistant``), thinking and images included; only TT is rebuilt in the
    remove mode, with its other fields unchanged.

    Raises ValueError when no assistant message in ``history`` holds ``transfer_call_id``, or when
    S2 has no ``name`` (a later swap could not recognise it as an assistant prompt).
    """
    mode = TransferMode(mode)
    if destination_system is not None and not destination_system.name:
        raise ValueError("the destination system message must carry the destination assistant's name")
    _transfer_call_index(history, transfer_call_id)
    spoken: list[Message] = [] if message is None or is_empty_assistant(message) else [message]
    head: list[Message] = [destination_system] if destination_system is not None else []
    if mode is TransferMode.ROLLING_HISTORY:
        return [*history, *spoken, *head]
    if mode is TransferMode.DELETE_HISTORY:
        return head
    if mode is TransferMode.SWAP_SYSTEM_MESSAGE_AND_REMOVE_TRANSFER:
        body = _without_transfer_call(history, transfer_call_id)
    else:
        body = list(history)
    return [*head, *(m for m in body if not is_assistant_prompt(m)), *spoken]


# --------------------------------------------------------------------------- openers


class OpenerKind(enum.StrEnum):
    """What F2 is when an assistant takes the conversation."""

    FIRST_MESSAGE = "first-message"  # the configured first_message, verbatim
    GENERATED = "generated"  # one model call by the assistant over the history so far
    NONE = "none"  # no opener: the assistant waits for the user


class OpenerPlan(msgspec.Struct, frozen=True, kw_only=True):
    """The opener decision for one assistant taking a conversation; ``reason`` is for logs."""

    assistant: str
    kind: OpenerKind
    content: str = ""
    reason: str = ""

    @property
    def speaks(self) -> bool:
        """True when an opener message will follow."""
        return self.kind is not OpenerKind.NONE


def opener_plan(assistant: Assistant, history: Sequence[Message] | None = None) -> OpenerPlan:
    """Decide F2 from ``assistant.first_message_mode``; the same at session start and after a transfer.

    - ``assistant-speaks-first``: the configured ``first_message`` — or nothing when it is blank.
    - ``assistant-speaks-first-with-model-generated-message``: one model call (see
      ``generated_opener``) — or nothing when ``history`` is given and empty (delete-history to
      an assistant without a prompt, or a session start without one): a model cannot be called
      with an empty history.
    - ``assistant-waits-for-user``: nothing, even when ``first_message`` is set.
    """
    mode = FirstMessageMode(assistant.first_message_mode)
    if mode is FirstMessageMode.WAITS_FOR_USER:
        return OpenerPlan(assistant=assistant.name, kind=OpenerKind.NONE, reason="assistant waits for the user")
    if mode is FirstMessageMode.SPEAKS_FIRST:
        if _blank(assistant.first_message):
            return OpenerPlan(assistant=assistant.name, kind=OpenerKind.NONE, reason="no first_message configured")
        return OpenerPlan(assistant=assistant.name, kind=OpenerKind.FIRST_MESSAGE, content=assistant.first_message)
    if history is not None and not history:
        return OpenerPlan(
            assistant=assistant.name, kind=OpenerKind.NONE, reason="empty history: nothing to generate an opener from"
        )
    return OpenerPlan(assistant=assistant.name, kind=OpenerKind.GENERATED)


def opener_message(plan: OpenerPlan, *, turn: str | None, model: str | None) -> AssistantMessage:
    """F2 for a ``first-message`` plan: the configured text, spoken by the plan's assistant.

    No model produced it, but every assistant entry records a model (RFC 0002 §8): pass the model
    the assistant is running on when it takes the conversation. Raises ValueError for other plans.
    """
    if plan.kind is not OpenerKind.FIRST_MESSAGE:
        raise ValueError(f"an opener plan of kind {plan.kind.value!r} has no configured message")
    return AssistantMessage(content=plan.content, turn=turn, model=model, assistant=plan.assistant)


def generated_opener(
    message: AssistantMessage, *, turn: str | None, model: str, assistant: str
) -> AssistantMessage | None:
    """F2 from the one model call of a ``generated`` plan, or None when the model said nothing.

    The opener call is made with no tools offered: one call cannot run a tool and answer after it.
    Should a model ask for tools anyway, the calls are dropped (never a call without its result
    in history). An answer left empty never enters history (RFC 0007 §2); a thinking-only answer is
    kept. The message is recorded with the model that produced it.
    """
    opener = msgspec.structs.replace(message, tool_calls=(), turn=turn, model=model, assistant=assistant)
    return None if is_empty_assistant(opener) else opener
