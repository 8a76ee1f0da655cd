"""Human approval of tool calls (RFC 0012): the pure pieces — which calls need one, the record of an
approval, what a decision may change, and what a parked run carries back to its child.

No I/O here. The child asks ``ApprovalRules.needs`` at a step boundary; the supervisor's owner of
approvals (``agentd.supervisor.approvals``) stores, decides and expires them through the store;
the status transitions are ``decided_status`` and ``rejection_text``.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from agentd.budget import Usage
from agentd.config import Intelligence
from agentd.messages import AssistantMessage, Message
from agentd.records import ModelSpend, TurnRecord

__all__ = [
    "ALL_TOOLS",
    "Approval",
    "ApprovalRequest",
    "ApprovalRules",
    "ApprovalStatus",
    "Decision",
    "ParkedRun",
    "check_arguments",
    "decided_status",
    "rejection_text",
    "with_parked_spend",
]

#: ``require_approval = ["*"]``: every tool that is not declared free of side effects.
ALL_TOOLS = "*"


class ApprovalStatus(enum.StrEnum):
    """Where an approval is: ``pending`` until decided once, then one of the others, for good."""

    PENDING = "pending"
    APPROVED = "approved"
    REJECTED = "rejected"
    EXPIRED = "expired"
    CANCELLED = "cancelled"


class Approval(msgspec.Struct, frozen=True, kw_only=True):
    """One tool call a human must decide on, as stored. ``arguments`` are those that run (edited ones
    once approved with an edit); ``parameters`` is the tool's JSON schema, to check an edit against."""

    id: str
    session: str
    turn: str
    call_id: str
    tool: str
    arguments: dict[str, Any]
    status: ApprovalStatus = ApprovalStatus.PENDING
    reason: str | None = None
    requested_at: float
    decided_at: float | None = None
    expires_at: float | None = None
    parameters: dict[str, Any] = {}


class ApprovalRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A call of a parked step that needs an approval (from the child, in ``TurnParked``)."""

    call_id: str
    tool: str
    arguments: dict[str, Any]
    parameters: dict[str, Any] = {}


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """What was decided for one call of a parked step (to the child, in ``Input``)."""

    call_id: str
    status: ApprovalStatus
    reason: str | None = None
    arguments: dict[str, Any] | None = None  # approved with an edit: these run


class ParkedRun(msgspec.Struct, frozen=True, kw_only=True):
    """A run of a turn that stopped at a step boundary to wait for approvals.

    ``messages``: what the turn added so far, ending with the assistant message whose calls wait.
    ``elapsed``: seconds of the turn's deadline it had used (the wait does not count).
    ``intelligence``: what it ran on, so that finish-on-old finishes it there (RFC 0002 §4).
    ``spend``: what its model calls spent per (assistant, model), so that the ended turn's
    ``by_model`` and cost count the calls made before it waited (RFC 0011 §1).
    """

    messages: list[Message]
    steps: int = 0
    usage: Usage = Usage()
    elapsed: float = 0.0
    intelligence: Intelligence | None = None
    calls: tuple[str, ...] = ()  # the call ids that wait for a decision
    spend: tuple[ModelSpend, ...] = ()


def with_parked_spend(record: TurnRecord, parked: ParkedRun) -> TurnRecord:
    """The record of a turn that ends while it waits for approvals (cancelled, closed), with what
    its parked run spent: no results, but the model calls made before it waited were paid for
    (RFC 0011 §1, RFC 0012 §5). Unpriced: the supervisor prices it like any ended turn."""
    models = tuple(dict.fromkeys(m.model for m in parked.messages if isinstance(m, AssistantMessage) and m.model))
    return msgspec.structs.replace(record, models=models, steps=parked.steps, usage=parked.usage, by_model=parked.spend)


@dataclass(frozen=True)
class ApprovalRules:
    """An assistant's ``require_approval``: which of its tools wait for a human."""

    refs: frozenset[str]

    @classmethod
    def of(cls, require_approval: Iterable[str]) -> ApprovalRules:
        return cls(frozenset(require_approval))

    def needs(self, ref: str | None, server: str | None, side_effect_free: bool) -> bool:
        """Whether a call of a tool needs approval: ``ref`` is its entry in ``tools`` (a built-in or
        ``module:function``, or ``server:tool``), ``server`` its MCP server if it has one."""
        if not self.refs:
            return False
        if ALL_TOOLS in self.refs and not side_effect_free:
            return True
        if ref is not None and ref in self.refs:
            return True
        return server is not None and f"{server}:*" in self.refs


def decided_status(decision: str) -> ApprovalStatus:
    """The status a ``decision`` (``approve``/``reject``) leads to; ValueError for anything else."""
    if decision == "approve":
        return ApprovalStatus.APPROVED
    if decision == "reject":
        return ApprovalStatus.REJECTED
    raise ValueError(f"decision must be 'approve' or 'reject', not {decision!r}")


def rejection_text(tool: str, status: ApprovalStatus, reason: str | None) -> str:
    """The error tool result the model gets for a call that was not approved."""
    why = f": {reason}" if reason else ""
    return f"tool {tool!r} was not run: its approval was {status.value}{why}"


def check_arguments(arguments: Any, parameters: dict[str, Any]) -> str | None:
    """Why edited ``arguments`` do not fit a tool's JSON schema ``parameters``, or None when they do.

    Nothing is fetched, ever: a ``$ref`` the schema does not hold itself is a reason, like one that
    points nowhere inside it. A tool schema comes from a tool (an MCP server's ``inputSchema``), and
    jsonschema's default would fetch a remote ``$ref`` synchronously, on the supervisor's loop.
    """
    import jsonschema
    import referencing.exceptions

    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, not {type(arguments).__name__}"
    if not parameters:
        return None
    validator = _validator(msgspec.json.encode(parameters, order="sorted"))
    if isinstance(validator, str):
        return validator
    try:
        validator.validate(arguments)
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        return f"{where + ': ' if where else ''}{exc.message}"
    except referencing.exceptions.Unresolvable as exc:
        return f"the tool's schema cannot be checked: $ref {exc.ref!r} does not resolve ({_NO_FETCH})"
    except (referencing.exceptions.Unretrievable, referencing.exceptions.CannotDetermineSpecification) as exc:
        return f"the tool's schema cannot be checked: {_clip(str(exc))} ({_NO_FETCH})"
    except RecursionError:  # e.g. {"$ref": "#"}: a reference to itself that never reaches a check
        return "the tool's schema cannot be checked: its references refer back to themselves without end"
    return None


_NO_FETCH = "agentd resolves only references within the schema and fetches none"


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _refuse(uri: str) -> Any:
    """The registry's retrieve: every document not in the schema itself is refused, never fetched."""
    raise LookupError(f"{uri!r} is not fetched")


@functools.lru_cache(maxsize=256)
def _validator(schema_json: bytes) -> Any:
    """A validator for one schema (by its canonical JSON, so repeated decisions build it once),
    or why the schema is no schema. Its registry retrieves nothing (see ``check_arguments``)."""
    import jsonschema
    import referencing

    schema = msgspec.json.decode(schema_json)
    try:
        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        return f"the tool's schema cannot be checked: {exc.message}"
    return cls(schema, registry=referencing.Registry(retrieve=_refuse))  # type: ignore[call-arg]
