"""The tool journal as one turn sees it: the side-effecting calls its runs made (RFC 0008 §5).

A turn may run more than once: a restart-turn swap re-runs it in the same child, a child crash or
a supervisor restart re-runs it in another. Whatever ran a side-effecting call before is in the
``ToolLedger``: what this child's earlier attempts did (in memory) and what earlier runs
journaled (``Input.journal``). A call of the same tool with the same arguments reuses that
result (``replayed``); a call that started and has no result is not run again — its outcome is
unknown, and the model is told so (``outcome_unknown``). Anything else runs, journaled first: the
tool runs only once the supervisor has acknowledged the journal entry as durable.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agentd import events
from agentd.budget import call_key
from agentd.messages import ToolCall
from agentd.obs import get_logger
from agentd.protocol import JournalFinish, JournalStart
from agentd.records import JournalEntry
from agentd.redact import SECRETS
from agentd.tools import AnyTool, ToolOutcome

__all__ = ["OUTCOME_UNKNOWN", "REPLAYED", "JournalWrite", "ToolLedger"]

#: How a result came about, when it was not by running the tool now.
REPLAYED = "replayed"
OUTCOME_UNKNOWN = "outcome_unknown"

#: Sends a journal frame and waits for its ack: None once durable, else why it could not be written.
JournalWrite = Callable[[JournalStart | JournalFinish], Awaitable[str | None]]

log = get_logger("child")


@dataclass
class _Call:
    seq: int
    key: str
    outcome: ToolOutcome | None  # None: started, no result recorded


def unknown_outcome(tool: str) -> ToolOutcome:
    """The error result for a call an earlier run started and never recorded a result for."""
    return ToolOutcome(
        f"tool {tool!r} was not run again: an earlier run of this turn started this same call and was "
        "interrupted before its result was recorded, so its outcome is unknown (it may or may not have "
        "taken effect)",
        is_error=True,
    )


class ToolLedger:
    """The side-effecting calls of one turn, across its attempts and runs."""

    def __init__(
        self, session: str, turn: str, journaled: Sequence[JournalEntry] = (), write: JournalWrite | None = None
    ):
        self.session, self.turn = session, turn
        self._write = write
        self._calls = [
            _Call(e.seq, call_key(e.tool, e.arguments), ToolOutcome(e.content, e.is_error) if e.finished else None)
            for e in journaled
        ]
        self._next_seq = max((e.seq for e in journaled), default=0) + 1
        self._taken: set[int] = set()  # calls the current attempt has answered

    def new_attempt(self) -> None:
        """A new attempt of the turn may reuse every call made so far."""
        self._taken = set()

    async def run(self, call: ToolCall, tool: AnyTool) -> tuple[ToolOutcome, str | None]:
        """The outcome of ``call``, and how it came about (``REPLAYED``, ``OUTCOME_UNKNOWN``, None = ran now)."""
        if tool.spec.side_effect_free:
            return await _invoke(tool, call.arguments), None
        key = call_key(call.name, call.arguments)
        earlier = next((c for c in self._calls if c.key == key and c.seq not in self._taken), None)
        if earlier is not None:
            self._taken.add(earlier.seq)
            if earlier.outcome is None:
                return unknown_outcome(call.name), OUTCOME_UNKNOWN
            return earlier.outcome, REPLAYED
        return await self._run_new(call, tool, key), None

    async def _run_new(self, call: ToolCall, tool: AnyTool, key: str) -> ToolOutcome:
        entry = JournalEntry(seq=self._next_seq, call=call.id, tool=call.name, arguments=call.arguments)
        self._next_seq += 1
        if self._write is not None:
            error = await self._write(JournalStart(session=self.session, turn=self.turn, entry=entry))
            if error is not None:  # not durable: running it could make a second run of it
                return ToolOutcome(f"tool {call.name!r} was not run: its call could not be journaled ({error})", True)
        record = _Call(entry.seq, key, None)
        self._calls.append(record)
        self._taken.add(record.seq)
        outcome = await _invoke(tool, call.arguments)
        record.outcome = outcome
        if self._write is not None:
            finished = JournalEntry(
                seq=entry.seq,
                call=entry.call,
                tool=entry.tool,
                finished=True,
                content=outcome.content,
                is_error=outcome.is_error,
            )
            error = await self._write(JournalFinish(session=self.session, turn=self.turn, entry=finished))
            if error is not None:  # it ran; a later run will find its outcome unknown
                log.error(
                    events.LOG_TOOL_JOURNAL_FAILED, session=self.session, turn=self.turn, tool=call.name, error=error
                )
        return outcome


async def _invoke(tool: AnyTool, arguments: dict[str, Any]) -> ToolOutcome:
    """Run the tool; its result without the secrets this child holds. Every result a tool gives
    passes here, before it is journaled, committed or streamed, so neither the store nor the API
    ever holds one (an MCP server may quote its credential in an error, RFC 0008 §3)."""
    outcome = await tool.invoke(arguments)
    scrubbed = SECRETS.scrub(outcome.content)
    return outcome if scrubbed == outcome.content else ToolOutcome(scrubbed, outcome.is_error)
