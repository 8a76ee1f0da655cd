"""How a store writes what it keeps: messages as msgspec JSON, and the checks every backend makes first.

Both backends encode and decode through this module (looked up at call time, so one definition
decides the stored form of a message), and refuse the same bad arguments with the same words
before they touch their database.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final, NamedTuple, get_args

import msgspec

from agentd.budget import TurnStatus, Usage
from agentd.messages import AssistantMessage, Message, SystemMessage, ToolResult, UserMessage
from agentd.records import Cost, Discarded, ModelSpend, SessionState, TurnRecord
from agentd.store.base import StoreError

__all__ = [
    "SESSION_STATES",
    "TURN_STATUSES",
    "EntryRow",
    "check_message",
    "check_replica",
    "check_state",
    "check_ttl",
    "decode_discarded",
    "decode_message",
    "decode_models",
    "decode_spend",
    "decode_trace",
    "encode_json",
    "encode_message",
    "encode_trace",
    "ended_turn_columns",
    "landed_commit_seqs",
    "not_pending",
    "spend_rows",
]

# The states a session row holds: ``awaiting_approval`` is derived from its turn (RFC 0012 §4).
SESSION_STATES: Final[frozenset[str]] = frozenset(get_args(SessionState)) - {"awaiting_approval"}
TURN_STATUSES: Final[frozenset[str]] = frozenset(status.value for status in TurnStatus)
_MESSAGE_TYPES = (UserMessage, AssistantMessage, SystemMessage, ToolResult)
#: The longest lease a replica may take (a week, like every duration in the config).
MAX_TTL: Final = 7 * 24 * 3600.0

_json_encoder = msgspec.json.Encoder()
_message_decoder = msgspec.json.Decoder(Message)
_discarded_decoder = msgspec.json.Decoder(tuple[Discarded, ...])
_models_decoder = msgspec.json.Decoder(tuple[str, ...])
_arguments_decoder = msgspec.json.Decoder(dict[str, Any])
_reload_errors_decoder = msgspec.json.Decoder(tuple[tuple[str, str], ...])


class StoredSpend(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """``turns.spend``: a committed turn's whole usage, its cost and its per-model spend (RFC 0011 §2).

    ``usage`` None: a turn committed before schema 8 (``{}``), whose two token columns are all there is.
    """

    usage: Usage | None = None
    cost: Cost | None = None
    by_model: tuple[ModelSpend, ...] = ()


_spend_decoder = msgspec.json.Decoder(StoredSpend)


_trace_decoder = msgspec.json.Decoder(dict[str, str])


def encode_trace(carrier: Mapping[str, str] | None) -> str | None:
    """``turns.trace``: a turn's W3C trace context as stored (NULL without one)."""
    return encode_json(dict(carrier)) if carrier else None


def decode_trace(text: str | None) -> dict[str, str]:
    """A turn row's ``trace`` column (``{}`` for NULL)."""
    return _trace_decoder.decode(text) if text else {}


def decode_spend(text: str) -> StoredSpend:
    """A turn row's ``spend`` column."""
    return _spend_decoder.decode(text)


def spend_rows(session_id: str, record: TurnRecord) -> list[dict[str, Any]]:
    """The ``turn_spend`` rows a committed turn adds: one per assistant and model it spent on."""
    rows: list[dict[str, Any]] = []
    for part in record.by_model:
        usage, price = part.usage, part.price
        rows.append(
            {
                "session": session_id,
                "turn": record.id,
                "assistant": part.assistant,
                "model": part.model,
                "ended_at": record.ended_at,
                "input_tokens": usage.input_tokens,
                "output_tokens": usage.output_tokens,
                "cached_input_tokens": usage.cached_input_tokens,
                "reasoning_tokens": usage.reasoning_tokens,
                "requests": usage.requests,
                "unreported": usage.unreported,
                "currency": price.currency if price else None,
                "input_price": str(price.input_per_mtok) if price else None,
                "output_price": str(price.output_per_mtok) if price else None,
                "cached_input_price": (
                    str(price.cached_input_per_mtok) if price and price.cached_input_per_mtok is not None else None
                ),
            }
        )
    return rows


def encode_message(message: Message) -> str:
    """The stored form of one message: msgspec JSON of the ``Message`` union (tag ``role``)."""
    return _json_encoder.encode(message).decode()


def decode_message(text: str) -> Message:
    """The message stored as ``text`` (msgspec.DecodeError if it is not one)."""
    return _message_decoder.decode(text)


def encode_json(value: object) -> str:
    """A turn record's list field (models, discarded) as stored."""
    return _json_encoder.encode(value).decode()


def decode_models(text: str) -> tuple[str, ...]:
    return _models_decoder.decode(text)


def decode_strings(text: str) -> tuple[str, ...]:
    """A JSON list of strings (a reload's changed paths)."""
    return _models_decoder.decode(text)


def decode_reload_errors(text: str) -> tuple[tuple[str, str], ...]:
    """A reload's errors: (path, message) pairs."""
    return _reload_errors_decoder.decode(text)


def decode_arguments(text: str) -> dict[str, Any]:
    """A journaled tool call's arguments (a JSON object)."""
    return _arguments_decoder.decode(text)


def decode_discarded(text: str) -> tuple[Discarded, ...]:
    return _discarded_decoder.decode(text)


def check_message(message: object, where: str) -> None:
    """StoreError unless ``message`` is one of the four transcript message kinds."""
    if not isinstance(message, _MESSAGE_TYPES):
        raise StoreError(f"{where}: not a transcript message: {type(message).__name__}")


def check_state(state: str | None, where: str) -> None:
    """StoreError unless ``state`` is None or a session state."""
    if state is not None and state not in SESSION_STATES:
        raise StoreError(f"{where}: unknown state {state!r} (expected one of {sorted(SESSION_STATES)})")


def session_fields(
    where: str,
    *,
    state: str | None,
    generation: int | None,
    model: str | None,
    assistant: str | None,
) -> dict[str, Any]:
    """The columns an ``update_session`` sets (the ones given), after checking the state."""
    check_state(state, where)
    given = {"state": state, "generation": generation, "model": model, "assistant": assistant}
    return {name: value for name, value in given.items() if value is not None}


#: What a replica id may be: it travels in space-separated notification payloads (RFC 0009 §7),
#: so no whitespace; ASCII, like a Kubernetes pod name or a hostname, and short.
REPLICA_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,252}")
REPLICA_ID_RULE = "1 to 253 ASCII letters, digits and . _ : @ -, starting with a letter or digit"


#: What the store records as a replica (a lease's owner, a registry row, a watcher): a replica id,
#: optionally with ``/`` and the incarnation of the process that bears it (RFC 0009 §7), so that a
#: process restarted under the same id is a new holder and never renews a dead one's leases.
LEASE_HOLDER = re.compile(REPLICA_ID.pattern + r"(?:/[0-9a-f]{8})?")


def valid_replica_id(replica: object) -> bool:
    """Whether ``replica`` is a usable replica id (``REPLICA_ID``)."""
    return isinstance(replica, str) and REPLICA_ID.fullmatch(replica) is not None


def check_replica(replica: str, where: str) -> None:
    """StoreError unless ``replica`` is a usable replica id, with or without its incarnation (``LEASE_HOLDER``)."""
    if not (isinstance(replica, str) and LEASE_HOLDER.fullmatch(replica) is not None):
        raise StoreError(f"{where}: a replica id must be {REPLICA_ID_RULE}, not {replica!r}")


def check_ttl(ttl: float, where: str) -> None:
    """StoreError unless ``ttl`` is a lease time a replica can hold: more than 0, at most a week."""
    if not isinstance(ttl, int | float) or not math.isfinite(ttl) or not 0 < ttl <= MAX_TTL:
        raise StoreError(f"{where}: a lease time must be more than 0 and at most {MAX_TTL:g} seconds, not {ttl!r}")


# --------------------------------------------------------------------------- ending a turn


def ended_turn_columns(record: TurnRecord, status: TurnStatus) -> dict[str, Any]:
    """The columns of the turn's row that its commit sets, as stored, in the order the UPDATE names them.

    One definition for both backends' commit and for recognising, on a retry, a commit that landed
    (``landed_commit_seqs`` compares the stored row with these).
    """
    return {
        "status": status.value,
        "models": encode_json(record.models),
        "steps": record.steps,
        "restarts": record.restarts,
        "discarded": encode_json(record.discarded),
        "input_tokens": record.usage.input_tokens,
        "output_tokens": record.usage.output_tokens,
        "ended_at": record.ended_at,
        "error": record.error,
        "spend": encode_json(StoredSpend(usage=record.usage, cost=record.cost, by_model=record.by_model)),
    }


class EntryRow(NamedTuple):
    """One stored transcript entry as ``landed_commit_seqs`` reads it: its seq, whether it is
    active, the message in its stored form, and whether it is a turn's input (``begin_turn`` wrote it)."""

    seq: int
    active: bool
    message: str
    input: bool


def landed_commit_seqs(
    stored: Mapping[str, Any], columns: Mapping[str, Any], entries: Sequence[EntryRow], messages: Sequence[str]
) -> tuple[int, ...] | None:
    """The seqs an earlier commit of exactly these results wrote, or None if the turn ended otherwise.

    A commit whose connection was lost while ``COMMIT`` was in flight may have landed; its retry
    finds the turn no longer pending. It was this commit that ended the turn when the turn's row
    (``stored``) holds what this commit writes (``columns``, from ``ended_turn_columns``) and the
    session's entries from the first one this commit would have written (``entries``, in seq
    order, at least one more than ``messages`` when there are more) are ``messages`` (their
    stored form), consecutive and still active, followed by nothing or by the input of a later
    turn: after a commit, the next entry any call writes is a later turn's input (``begin_turn``).
    Anything else — another outcome (an abandon, a commit of other results), entries that differ
    or were rewritten since — is None: the caller refuses as for any turn that is not pending.

    The caller checks the fence first: a lease that is still the session's current one means no
    other replica can have ended the turn meanwhile (a claim changes the token).
    """
    if any(stored[name] != value for name, value in columns.items()):
        return None
    count = len(messages)
    written, after = entries[:count], entries[count : count + 1]
    if len(written) != count:
        return None
    if not all(e.active and not e.input and e.message == text for e, text in zip(written, messages, strict=True)):
        return None
    if after and not after[0].input:  # the commit wrote more entries than these: other results
        return None
    seqs = tuple(entry.seq for entry in written)
    if seqs and seqs != tuple(range(seqs[0], seqs[0] + count)):
        return None
    return seqs


def not_pending(refusal: str, status: str) -> StoreError:
    """The refusal of a write for a turn that has ended already."""
    return StoreError(f"{refusal}: the turn is not pending (status {status})")
