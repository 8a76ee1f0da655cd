"""The step-budgeted agent loop: one turn, possibly several attempts under restart-turn.

A turn is one or more *attempts*. An attempt runs steps (a model call, then the tool calls it asked
for) within a fresh budget until it ends with a status — or until a restart-turn model swap is
parked, in which case it stops at the next checkpoint: work already running (a model call, a tool
call) always completes; nothing new of the attempt starts. The attempt's messages are discarded,
the swap is applied, and the turn re-runs from the pre-turn transcript. Side-effecting tools that
ran in a discarded attempt — or in an earlier run of the turn, as the tool journal says — are not
run again for the same arguments: their results are replayed (``agentd.child.journal``, RFC 0008).
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec

from agentd import events
from agentd.approvals import ApprovalRequest, ApprovalRules, ApprovalStatus, Decision, ParkedRun, rejection_text
from agentd.budget import TurnBudget, TurnStatus, Usage
from agentd.child.deltas import DeltaStream
from agentd.child.journal import OUTCOME_UNKNOWN, REPLAYED, JournalWrite, ToolLedger
from agentd.child.session import ChildSession
from agentd.child.spans import chat_done, input_messages, tool_done
from agentd.child.toolbox import approval_ref
from agentd.config import SwapPolicy
from agentd.intel import CompletionRequest, IntelError
from agentd.intel.base import Completion, IntelErrorKind
from agentd.messages import AssistantMessage, Message, ToolCall, ToolResult, UserMessage, is_empty_assistant
from agentd.obs import get_logger
from agentd.otel import tracing
from agentd.protocol import TurnDiscarded, TurnDone, TurnParked
from agentd.records import Discarded, JournalEntry, ModelSpend, TurnRecord
from agentd.tools import AnyTool, ToolOutcome, ToolSpec
from agentd.transfer import (
    OpenerKind,
    TransferChoice,
    assistant_prompt,
    destination_message,
    destination_of,
    generated_opener,
    opener_message,
    opener_plan,
    select_transfer,
    transfer_history,
    transfer_result,
    transfer_tool_specs,
)

__all__ = ["ToolsFor", "run_turn"]

log = get_logger("child")

_RESULT_EVENT_CHARS = 2000
_INTEL_BACKOFF_START = 0.5
_INTEL_BACKOFF_MAX = 10.0

#: The tools of a turn, resolved when it starts (MCP tools need their servers' listings).
ToolsFor = Callable[[], Awaitable[Mapping[str, AnyTool]]]


class _Restart(Exception):
    """Raised at a checkpoint when a restart-turn model swap is parked."""


class _Park(Exception):
    """Raised at a step boundary when calls of the step wait for a human's approval (RFC 0012 §3)."""

    def __init__(self, requests: list[ApprovalRequest]) -> None:
        super().__init__(f"{len(requests)} calls await approval")
        self.requests = requests


@dataclass
class _Attempt:
    """One run of the turn's steps on one model, within one budget."""

    session: ChildSession
    turn: str
    base: list[Message]
    tools: Mapping[str, AnyTool]
    ledger: ToolLedger
    restarts: int
    run_index: int = 0  # 0 for the turn's first run, +1 for every re-run (restart-turn, or after a crash)
    deltas: DeltaStream | None = None  # where the model's pieces go (None: not streamed)
    messages: list[Message] = field(default_factory=list)
    budget: TurnBudget | None = None
    waiting_for_intel: bool = False
    error: str | None = None
    model: str = ""
    transcript: list[Message] | None = None  # set by a transfer: the session's rewritten transcript
    # Epoch seconds the turn was accepted, for its first attempt: the deadline counts from there
    # across re-runs on other children. A restart-turn attempt gets a fresh budget (None).
    accepted_at: float | None = None
    # What the whole turn spent per (assistant, model), shared by its attempts: a discarded
    # attempt's calls were paid for too (RFC 0011 §1).
    spend: dict[tuple[str, str], Usage] = field(default_factory=dict)
    # A run that waited for approvals goes on with this step's calls (their decisions below).
    resumed: AssistantMessage | None = None
    decisions: dict[str, Decision] = field(default_factory=dict)
    restored: ParkedRun | None = None
    started_wall: float = 0.0

    def deadline_seconds(self, deadline: float) -> float:
        """How long this attempt may run: the whole deadline, less what earlier runs of the turn used."""
        if self.accepted_at is None:
            return deadline
        return max(0.0, min(deadline, self.accepted_at + deadline - time.time()))

    async def run(self) -> TurnStatus:
        """Run steps until a status ends the attempt; raises _Restart at a checkpoint if due."""
        limits = self.session.limits
        self.ledger.new_attempt()
        self.budget = TurnBudget(limits, anyio.current_time())
        self.started_wall = time.time()
        if self.restored is not None:  # the budget goes on where the parked run left it
            self.budget.steps, self.budget.usage = self.restored.steps, self.restored.usage
        self.model = self.session.current_intelligence.model
        with anyio.move_on_after(self.deadline_seconds(limits.deadline)) as deadline_scope:
            status = await self._steps()
        if deadline_scope.cancelled_caught:
            unreachable = self.waiting_for_intel or self.session.provider.failing
            status = TurnStatus.INTEL_UNAVAILABLE if unreachable else TurnStatus.DEADLINE
        self.close_unpaired(status)
        return status

    async def checkpoint(self) -> None:
        """Between pieces of work: restart if a restart-turn model swap is parked.

        Before the attempt has done anything there is nothing to discard: the swap is simply
        applied (a boundary, like the top of the turn) and no restart is spent.
        """
        if not self.session.restart_due(self.restarts):
            return
        if not self.messages and (self.budget is None or self.budget.steps == 0):
            await self.session.apply_parked(self.turn)
            self.model = self.session.current_intelligence.model
            return
        raise _Restart

    async def _steps(self) -> TurnStatus:
        assert self.budget is not None
        while True:
            if self.resumed is not None:  # the step whose calls waited for approvals: run them now
                message, self.resumed = self.resumed, None
                status = await self._calls(message)
                self.decisions = {}  # they answer that step only (call ids may repeat later)
                if status is not None:
                    return status
                continue
            await self.checkpoint()
            if (status := self.budget.before_step()) is not None:
                return status
            step = self.budget.steps + 1
            await self.session.emit(events.STEP_STARTED, self.turn, step=step, model=self.model, run=self.run_index)
            if self.deltas is not None:
                self.deltas.begin(self.run_index, step, self.model)
            completion = await self._call_model()
            if isinstance(completion, TurnStatus):
                return completion
            message = msgspec.structs.replace(
                completion.message, model=completion.model, turn=self.turn, assistant=self.session.assistant
            )
            if self.deltas is not None:  # the step's last deltas go before its step.done
                await self.deltas.end_step(message.content, message.thinking)
            if not is_empty_assistant(message):
                self.messages.append(message)
            over_budget = self.budget.after_step(completion.usage)
            await self.session.emit(
                events.STEP_DONE,
                self.turn,
                step=step,
                run=self.run_index,
                model=completion.model,
                usage=msgspec.to_builtins(completion.usage),
                tool_calls=[c.name for c in message.tool_calls],
                content=message.content,
                thinking=message.thinking,
            )
            # A restart-turn swap that landed during this call discards even a final answer.
            await self.checkpoint()
            if over_budget is not None:
                return over_budget
            if not message.tool_calls:
                return TurnStatus.COMPLETED
            if requests := self._approvals_needed(message):
                raise _Park(requests)  # nothing of this step ran: it runs once all are decided
            if (status := await self._calls(message)) is not None:
                return status

    def _approvals_needed(self, message: AssistantMessage) -> list[ApprovalRequest]:
        """The calls of ``message`` that wait for a human (``require_approval``, RFC 0012 §2)."""
        rules = ApprovalRules.of(self.session.assistant_config.require_approval)
        requests = []
        for call in message.tool_calls:
            tool = self.tools.get(call.name)
            if tool is None or call.arguments_error is not None:
                continue  # answered with an error at once: nothing to approve
            ref, server = approval_ref(tool)
            if rules.needs(ref, server, tool.spec.side_effect_free):
                requests.append(
                    ApprovalRequest(
                        call_id=call.id, tool=call.name, arguments=call.arguments, parameters=tool.spec.parameters
                    )
                )
        return requests

    def parked(self, requests: list[ApprovalRequest], usage: Usage) -> ParkedRun:
        """This run, stopped after its last step for ``requests``."""
        started = self.accepted_at if self.accepted_at is not None else self.started_wall
        return ParkedRun(
            messages=list(self.messages),
            steps=self.steps,
            usage=usage,
            elapsed=max(0.0, time.time() - started),
            intelligence=self.session.current_intelligence,
            calls=tuple(r.call_id for r in requests),
            spend=tuple(ModelSpend(assistant=a, model=m, usage=spent) for (a, m), spent in self.spend.items()),
        )

    def resume(self, run: ParkedRun, decisions: Sequence[Decision]) -> None:
        """Go on from a parked run: its messages, its budget, its last step's calls as decided."""
        messages = list(run.messages)
        last = messages[-1] if messages else None
        if not isinstance(last, AssistantMessage):
            return  # nothing to go on from: the turn runs from its start
        edited = {
            d.call_id: d.arguments for d in decisions if d.status is ApprovalStatus.APPROVED and d.arguments is not None
        }
        if edited:  # the transcript shows the arguments that ran
            calls = tuple(msgspec.structs.replace(c, arguments=edited.get(c.id, c.arguments)) for c in last.tool_calls)
            last = msgspec.structs.replace(last, tool_calls=calls)
            messages[-1] = last
        self.messages, self.resumed, self.restored = messages, last, run
        self.decisions = {d.call_id: d for d in decisions}
        for part in run.spend:  # the calls before the wait were paid for: they count in by_model and the cost
            key = (part.assistant, part.model)
            self.spend[key] = self.spend.get(key, Usage()) + part.usage

    async def _calls(self, message: AssistantMessage) -> TurnStatus | None:
        """Run the step's calls; the status that ends the turn, if one does."""
        assert self.budget is not None
        transfer = select_transfer(self.session.assistant_config, message)
        # Work calls first, transfer calls last: a transfer is only answered "transferred"
        # once nothing else in the step can still end the turn first (a loop, a restart).
        calls = sorted(message.tool_calls, key=lambda c: transfer is not None and _is_transfer_call(transfer, c))
        for call in calls:
            await self.checkpoint()
            if transfer is not None and _is_transfer_call(transfer, call):
                await self._answer_transfer_call(call, transfer)
                continue
            if (status := self.budget.before_tool(call.name, call.arguments)) is not None:
                return status
            await self._run_tool(call)
        if transfer is not None:
            await self._transfer(transfer)
            return TurnStatus.TRANSFERRED
        return None

    async def _call_model(self) -> Completion | TurnStatus:
        """One model call. While every endpoint is down, wait (jittered backoff) until the deadline."""
        backoff = _INTEL_BACKOFF_START
        tools = [tool.spec for tool in self.tools.values()] + transfer_tool_specs(self.session.assistant_config)
        while True:
            try:
                completion = await self._complete(self.base + self.messages, tools, during="step", sink=self.deltas)
            except IntelError as exc:
                if exc.kind is not IntelErrorKind.UNAVAILABLE:
                    self.error = str(exc)
                    return TurnStatus.FAILED
                if self.deltas is not None:  # the call is made again: what it streamed is void
                    self.deltas.reset("the model call is retried: no endpoint could serve it")
                if not self.waiting_for_intel:
                    self.waiting_for_intel = True
                    await self.session.emit(events.INTEL_WAITING, self.turn, model=self.model, error=str(exc))
                await self._wait_for_intel(backoff)
                backoff = min(backoff * 2, _INTEL_BACKOFF_MAX)
                continue
            if self.waiting_for_intel:
                self.waiting_for_intel = False
                await self.session.emit(events.INTEL_RECOVERED, self.turn, model=completion.model)
            return completion

    async def _complete(
        self, messages: list[Message], tools: Sequence[ToolSpec], *, during: str, sink: DeltaStream | None = None
    ) -> Completion:
        """One ``complete`` on the session's provider within the budget's deadline; an IntelError is logged."""
        request = CompletionRequest(
            messages=messages,
            tools=tools,
            options=self.session.current_intelligence.options,
            deadline=self.budget.deadline_at if self.budget else None,
            sink=sink,
        )
        tracer, intelligence = tracing(), self.session.current_intelligence
        with tracer.chat(
            provider=intelligence.provider,
            model=intelligence.model,
            turn=self.turn,
            generation=self.session.generation,
            run=self.session.turn_run,
        ) as span:
            if tracer.capture:
                span.set(input_messages(messages))
            try:
                completion = await self._provider_complete(request, during)
            except IntelError as exc:
                span.fail(exc.kind.value)
                raise
            chat_done(span, completion, capture=tracer.capture)
        return self._spent(completion)

    async def _provider_complete(self, request: CompletionRequest, during: str) -> Completion:
        """The provider's ``complete``; an IntelError is logged."""
        try:
            return await self.session.provider.complete(request)
        except IntelError as exc:
            self.session.log.warning(
                events.LOG_INTEL_ERROR,
                turn=self.turn,
                kind=exc.kind.value,
                error=str(exc),
                during=during,
            )
            raise

    def _spent(self, completion: Completion) -> Completion:
        """Count a model call that answered in the turn's spend; the completion with its request counted."""
        # One more request; unreported when its server said nothing of usage (never guessed).
        usage = completion.usage + Usage(requests=1, unreported=0 if completion.usage_reported else 1)
        key = (self.session.assistant, completion.model)
        self.spend[key] = self.spend.get(key, Usage()) + usage
        return msgspec.structs.replace(completion, usage=usage)

    async def _wait_for_intel(self, backoff: float) -> None:
        """Sleep before retrying; a parked swap ends the wait early.

        Nothing of the step is in flight while we wait, so a parked repoint (same model, new
        endpoints — the usual fix for a dead endpoint) is applied now; a restart-turn model swap
        restarts the turn; a finish-on-old model swap keeps waiting on the old model.
        """
        session = self.session
        with anyio.move_on_after(backoff * random.uniform(0.5, 1.0)):
            # Only a swap this wait can act on ends it early; others stay parked for the boundary.
            while not (session.repoint_parked() or session.restart_due(self.restarts)):
                await session.swap_parked_event.wait()
        await self.checkpoint()
        if self.session.repoint_parked():
            await self.session.apply_parked(self.turn)

    async def _answer_transfer_call(self, call: ToolCall, transfer: TransferChoice) -> None:
        """The winning transfer call is answered "transferred"; superseded ones with an error."""
        await self.session.emit(events.TOOL_CALL, self.turn, id=call.id, name=call.name, arguments=call.arguments)
        if call.id == transfer.call.id:
            outcome = ToolOutcome(transfer_result(transfer.transfer.to))
        else:
            destination = destination_of(call.name) or call.name
            outcome = ToolOutcome(transfer_result(destination, superseded_by=transfer.transfer.to), is_error=True)
        await self._record(call, outcome, None)

    async def _transfer(self, choice: TransferChoice) -> None:
        """Hand the conversation over: rewrite the history per the mode, switch assistant, add the opener."""
        session = self.session
        source, target = session.assistant, choice.transfer.to
        destination = session.config.assistant(target)
        spoken = destination_message(choice.transfer, turn=self.turn, model=self.model, assistant=source)
        history = transfer_history(
            self.base + self.messages,
            mode=choice.transfer.mode,
            destination_system=assistant_prompt(destination, turn=self.turn),
            transfer_call_id=choice.call.id,
            message=spoken,
        )
        previous = session.current_intelligence
        # Assistant and transcript change together, with no await between: a cancel or deadline
        # from here on commits a whole handoff, never B over A's history.
        session.switch_assistant(target)
        self._set_transcript(history)
        if session.current_intelligence != previous:
            await session.replace_provider()
        session.log.info(
            events.LOG_TRANSFER,
            turn=self.turn,
            **{"from": source},
            to=target,
            mode=choice.transfer.mode.value,
        )
        await session.emit(events.TRANSFER, self.turn, **{"from": source}, to=target, mode=choice.transfer.mode.value)
        opener = await self._opener(destination, history)
        if opener is not None:
            self._set_transcript([*history, opener])

    def _set_transcript(self, transcript: list[Message]) -> None:
        self.transcript = transcript
        self.messages = [m for m in transcript if m.turn == self.turn and not isinstance(m, UserMessage)]

    async def _opener(self, destination: Any, history: list[Message]) -> AssistantMessage | None:
        """F2: the destination's configured first message, or one model call over the new history."""
        plan = opener_plan(destination, history)
        model = self.session.current_intelligence.model
        if plan.kind is OpenerKind.FIRST_MESSAGE:
            return opener_message(plan, turn=self.turn, model=model)
        if plan.kind is not OpenerKind.GENERATED:
            return None
        try:
            completion = await self._complete(history, (), during="opener")
        except IntelError:
            return None
        if self.budget is not None:
            self.budget.after_step(completion.usage)
        return generated_opener(completion.message, turn=self.turn, model=completion.model, assistant=destination.name)

    async def _run_tool(self, call: ToolCall) -> None:
        await self.session.emit(events.TOOL_CALL, self.turn, id=call.id, name=call.name, arguments=call.arguments)
        tracer = tracing()
        scope = tracer.execute_tool(
            tool=call.name,
            call_id=call.id,
            turn=self.turn,
            generation=self.session.generation,
            run=self.session.turn_run,
        )
        with scope as span:
            outcome, how = await self._tool_outcome(call)
            tool_done(span, call.arguments, outcome, how, capture=tracer.capture)
        await self._record(call, outcome, how)

    async def _tool_outcome(self, call: ToolCall) -> tuple[ToolOutcome, str | None]:
        how: str | None = None
        tool = self.tools.get(call.name)
        decision = self.decisions.get(call.id)
        if decision is not None and decision.status is not ApprovalStatus.APPROVED:
            outcome = ToolOutcome(rejection_text(call.name, decision.status, decision.reason), is_error=True)
        elif call.arguments_error is not None:
            outcome = ToolOutcome(f"invalid arguments for tool {call.name!r}: {call.arguments_error}", is_error=True)
        elif tool is None:
            available = ", ".join(self.tools) or "none"
            outcome = ToolOutcome(f"unknown tool {call.name!r}; available tools: {available}", is_error=True)
        else:
            outcome, how = await self.ledger.run(call, tool)
            if how is not None:
                self.session.log.info(events.LOG_TOOL_REPLAYED, turn=self.turn, tool=call.name, how=how)
        return outcome, how

    async def _record(self, call: ToolCall, outcome: ToolOutcome, how: str | None) -> None:
        replayed, unknown = how == REPLAYED, how == OUTCOME_UNKNOWN
        self.messages.append(
            ToolResult(
                turn=self.turn,
                name=call.name,
                content=outcome.content,
                call_id=call.id,
                is_error=outcome.is_error,
                replayed=replayed,
                outcome_unknown=unknown,
            )
        )
        await self.session.emit(
            events.TOOL_RESULT,
            self.turn,
            id=call.id,
            name=call.name,
            is_error=outcome.is_error,
            replayed=replayed,
            outcome_unknown=unknown,
            content=outcome.content[:_RESULT_EVENT_CHARS],
        )

    def close_unpaired(self, status: TurnStatus) -> None:
        """Answer calls the turn will not run, so the history stays valid for every provider."""
        where = next(
            (i for i in range(len(self.messages) - 1, -1, -1) if isinstance(self.messages[i], AssistantMessage)), None
        )
        if where is None:
            return
        last = self.messages[where]
        assert isinstance(last, AssistantMessage)
        # Only results after that message count: some servers reuse call ids from step to step.
        answered = {m.call_id for m in self.messages[where + 1 :] if isinstance(m, ToolResult)}
        for call in last.tool_calls:
            if call.id not in answered:
                self.messages.append(
                    ToolResult(
                        turn=self.turn,
                        name=call.name,
                        call_id=call.id,
                        is_error=True,
                        content=f"not run: the turn ended ({status.value})",
                    )
                )

    @property
    def steps(self) -> int:
        return self.budget.steps if self.budget else 0

    @property
    def usage(self) -> Usage:
        return self.budget.usage if self.budget else Usage()


def _is_transfer_call(choice: TransferChoice, call: ToolCall) -> bool:
    return call.id == choice.call.id or any(call.id == other.id for other in choice.superseded)


async def run_turn(
    session: ChildSession,
    turn: str,
    message: UserMessage | None,
    tools: Mapping[str, AnyTool] | ToolsFor,
    accepted_at: float | None = None,
    *,
    journal: Sequence[JournalEntry] = (),
    write: JournalWrite | None = None,
    run: int = 0,
    deltas: DeltaStream | None = None,
    resume: ParkedRun | None = None,
    decisions: Sequence[Decision] = (),
) -> TurnDone | TurnParked:
    """Run one turn to its end and return the TurnDone to send (TurnDiscarded frames are sent on the way),
    or the TurnParked that stops it at a step whose calls wait for approvals (RFC 0012 §3).

    ``accepted_at`` (epoch seconds) is when the supervisor accepted the turn: its deadline counts
    from then, so a turn re-run after a crash does not get a fresh deadline. ``journal`` is what
    earlier runs of the turn journaled; ``write`` journals durably (None: in memory only).
    ``tools`` may be resolved when the turn starts (inside its cancel scope: a Cancel ends the wait).
    ``run`` numbers this run of the turn (the supervisor counts earlier runs); each restart-turn
    re-run here is the next. ``deltas`` streams the model's text (None: not streamed).
    ``resume`` is a run that parked, to go on from with ``decisions`` for its last step's calls.
    """
    started_at = time.time()
    session.turn_id = turn
    try:
        await session.apply_parked(turn)  # the top of the turn is a boundary
        if resume is not None and resume.intelligence is not None and session.policy is SwapPolicy.FINISH_ON_OLD:
            await session.pin(resume.intelligence)  # it finishes on the model it started on
        await session.ready_provider()  # a swap adopted while idle rebuilt nothing yet
        base = list(session.transcript) + ([message] if message else [])
        await session.emit(
            events.TURN_STARTED, turn, assistant=session.assistant, model=session.current_intelligence.model
        )
        restarts, discarded, usage = 0, [], Usage()
        ledger = ToolLedger(session.id, turn, journal, write)
        scope = session.turn_scope or anyio.CancelScope()
        session.turn_scope = scope
        status: TurnStatus = TurnStatus.CANCELLED
        attempt = _Attempt(session, turn, base, {}, ledger, restarts, run, deltas, accepted_at=accepted_at)
        if resume is not None:
            attempt.resume(resume, decisions)
        parked: TurnParked | None = None
        with scope:  # Cancel frames cancel this scope, whichever attempt is running
            attempt.tools = tools if isinstance(tools, Mapping) else await tools()
            while True:
                try:
                    status = await attempt.run()
                    break
                except _Park as park:
                    stopped = attempt.parked(park.requests, usage + attempt.usage)
                    parked = TurnParked(session=session.id, turn=turn, run=stopped, requests=park.requests)
                    break
                except _Restart:
                    # Switch to the fresh attempt before any await: a cancel from here on ends
                    # the turn with the discarded attempt already accounted for, never committed.
                    thrown_away, restarts = attempt, restarts + 1
                    usage = usage + thrown_away.usage
                    attempt = _Attempt(
                        session,
                        turn,
                        base,
                        thrown_away.tools,
                        ledger,
                        restarts,
                        thrown_away.run_index + 1,
                        deltas,
                        spend=attempt.spend,
                    )
                    with anyio.CancelScope(shield=True):
                        discarded.append(await _discard(session, thrown_away))
        if parked is not None and not scope.cancelled_caught:
            # The turn has not ended: the session's transcript stays as it was before it.
            session.log.debug(events.LOG_TURN_PARKED, turn=turn, calls=len(parked.requests))
            return parked
        if scope.cancelled_caught:
            status = TurnStatus.CANCELLED
            attempt.close_unpaired(status)
        usage = usage + attempt.usage
        session.transcript = attempt.transcript if attempt.transcript is not None else base + attempt.messages
        models = tuple(dict.fromkeys(m.model for m in attempt.messages if isinstance(m, AssistantMessage) and m.model))
        record = TurnRecord(
            id=turn,
            status=status,
            models=models,
            steps=attempt.steps,
            restarts=restarts,
            discarded=tuple(discarded),
            usage=usage,
            started_at=started_at,
            ended_at=time.time(),
            error=attempt.error,
            by_model=tuple(
                ModelSpend(assistant=assistant, model=model, usage=spent)
                for (assistant, model), spent in attempt.spend.items()
            ),
        )
        # Debug only: the supervisor logs turn.done once the turn is committed, one line per turn.
        session.log.debug(
            events.LOG_TURN_DONE,
            turn=turn,
            status=status.value,
            steps=attempt.steps,
            restarts=restarts,
            models=list(models),
        )
        return TurnDone(
            session=session.id,
            assistant=session.assistant,
            record=record,
            messages=attempt.messages,
            transcript=attempt.transcript,
        )
    finally:
        session.turn_id = None
        session.turn_scope = None
        session.unpin()


async def _discard(session: ChildSession, attempt: _Attempt) -> Discarded:
    """Report the attempt as discarded, apply the parked swap, announce the restart."""
    model_from = attempt.model
    discarded = Discarded(
        model=model_from, steps=attempt.steps, reason="restart-turn: model swapped", usage=attempt.usage
    )
    await session.send(TurnDiscarded(session=session.id, turn=attempt.turn, attempt=discarded))
    session.log.info(events.LOG_TURN_DISCARDED, turn=attempt.turn, model=model_from, steps=attempt.steps)
    await session.apply_parked(attempt.turn)
    model_to = session.current_intelligence.model
    session.log.info(
        events.LOG_TURN_RESTARTED,
        turn=attempt.turn,
        model_from=model_from,
        model_to=model_to,
        restarts=attempt.restarts + 1,
    )
    await session.emit(
        events.TURN_RESTARTED,
        attempt.turn,
        model_from=model_from,
        model_to=model_to,
        restarts=attempt.restarts + 1,
        discarded_steps=attempt.steps,
        run=attempt.run_index + 1,  # every delta of run ``attempt.run_index`` is void; the re-run streams as this
    )
    return discarded
