"""A turn's native session events as what a door stream says (RFC 0010 §7): pure, over a snapshot.

A door stream shows a turn's output as it is made: the content of every step as it streams
(``delta`` events), and every tool agentd runs (``tool.call``, ``tool.result``). ``follow`` reads
one native event with what was sent so far (``Sent``) and says what to send (``Happening``s).
Text once sent cannot be taken back over OpenAI's wire: a ``step.reset`` of a step whose text
went out, or a re-run (``turn.restarted``, or the first event of a later run) after any output
went out, is ``TakenBack`` — the stream ends with a ``stream_reset`` error. A reset before
anything went out takes nothing back: the stream goes on with the new run.
"""

from __future__ import annotations

from typing import Any

import msgspec

from agentd import events

__all__ = ["Happening", "Rerun", "Sent", "StepEnded", "TakenBack", "Text", "ToolEnded", "ToolStarted", "follow"]


class Text(msgspec.Struct, frozen=True, kw_only=True):
    """Content the model streamed for step ``step`` of the current run."""

    step: int
    text: str


class StepEnded(msgspec.Struct, frozen=True, kw_only=True):
    """Step ``step`` ended: its stored entry has ``content``."""

    step: int
    content: str


class ToolStarted(msgspec.Struct, frozen=True, kw_only=True):
    """agentd began running a tool call."""

    id: str
    name: str
    arguments: str  # JSON text


class ToolEnded(msgspec.Struct, frozen=True, kw_only=True):
    """A tool call's result (``content``: its first 2000 characters, as ``tool.result`` has it)."""

    id: str
    content: str
    is_error: bool


class Rerun(msgspec.Struct, frozen=True, kw_only=True):
    """The turn runs again from its start (nothing of the run before had been sent)."""

    run: int


class TakenBack(msgspec.Struct, frozen=True, kw_only=True):
    """Output already sent is discarded by the turn: the stream cannot go on truthfully."""

    reason: str


Happening = Text | StepEnded | ToolStarted | ToolEnded | Rerun | TakenBack


class Sent(msgspec.Struct, frozen=True, kw_only=True):
    """What a stream has sent of its turn so far."""

    run: int | None = 0  # None: followed from the middle of a turn (after approvals): the first run heard is it
    texted: frozenset[int] = frozenset()  # steps of ``run`` whose text went out
    output: bool = False  # anything of ``run`` went out (text, or a tool where tools are shown)
    shows_tools: bool = False  # the stream shows tool calls (a Response's does, a chat completion's not)


def _rerun(sent: Sent, run: int, why: str) -> tuple[Sent, list[Happening]]:
    if sent.output:
        return sent, [TakenBack(reason=why)]
    return Sent(run=run, shows_tools=sent.shows_tools), [Rerun(run=run)]


def follow(sent: Sent, name: str, data: dict[str, Any]) -> tuple[Sent, list[Happening]]:
    """What to send for the native event ``name`` (``data``) of the followed turn, and what is then sent."""
    run = data.get("run")
    if sent.run is None and isinstance(run, int) and name != events.TURN_RESTARTED:
        sent = msgspec.structs.replace(sent, run=run)  # the run that goes on after the approvals
    if name == events.TURN_RESTARTED:
        return _rerun(sent, int(run or (sent.run or 0) + 1), f"the turn restarts (model {data.get('model_to')})")
    if isinstance(run, int) and sent.run is not None and run < sent.run:
        return sent, []  # a straggler of a discarded run (a tool's events carry no run)
    if isinstance(run, int) and sent.run is not None and run > sent.run:
        sent, happened = _rerun(sent, run, "the turn runs again (its child was replaced)")
        if any(isinstance(h, TakenBack) for h in happened):
            return sent, happened
        more_sent, more = follow(sent, name, data)
        return more_sent, happened + more
    step = int(data.get("step", 0))
    if name == events.DELTA:
        text = data.get("content")
        if not text:
            return sent, []
        texted = sent.texted | {step}
        return msgspec.structs.replace(sent, texted=texted, output=True), [Text(step=step, text=text)]
    if name == events.STEP_RESET:
        if step in sent.texted:
            return sent, [TakenBack(reason=f"step {step} is retried ({data.get('reason')})")]
        return sent, []
    if name == events.STEP_DONE:
        return sent, [StepEnded(step=step, content=data.get("content") or "")]
    if name == events.TOOL_CALL:
        arguments = msgspec.json.encode(data.get("arguments") or {}).decode()
        started = ToolStarted(id=data["id"], name=data["name"], arguments=arguments)
        return msgspec.structs.replace(sent, output=sent.output or sent.shows_tools), [started]
    if name == events.TOOL_RESULT:
        return sent, [ToolEnded(id=data["id"], content=data.get("content") or "", is_error=bool(data.get("is_error")))]
    return sent, []
