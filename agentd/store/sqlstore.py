"""``SqlStore``: the ``Store`` both backends are, written once over ``agentd.store.operations``.

Each call checks its arguments (``agentd.store.codec``: the same refusals, in the same words,
before the database is touched), makes its free text storable (the backend's ``Dialect``),
and hands the operation to the backend: ``_write`` (one write transaction; ``durable`` False:
its commit need not be synced by itself) or ``_read`` (one consistent snapshot). What stays with
a backend is how it runs them: connections, transactions, group commit or the pool, errors,
notifications (``SqliteStore``, ``PostgresStore``).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import msgspec

from agentd import events
from agentd.approvals import Approval, ApprovalRequest, ParkedRun
from agentd.budget import TurnStatus
from agentd.messages import Message, UserMessage
from agentd.obs import get_logger
from agentd.records import JournalEntry, SessionState, StartedTurn, TurnRecord
from agentd.store import approval_ops, codec, history, keys
from agentd.store import operations as ops
from agentd.store.base import (
    CommittedTurn,
    IdempotencyRecord,
    Lease,
    ParkResult,
    ReloadRow,
    ReplicaRow,
    SpendRow,
    Store,
    StoredEntry,
    StoredSession,
    StoreError,
)
from agentd.store.dialect import Dialect
from agentd.store.sansio import Op

__all__ = ["SqlStore"]

T = TypeVar("T")

log = get_logger("store")


class SqlStore(Store):
    """Every ``Store`` call, once; a backend supplies ``dialect``, ``_write`` and ``_read``."""

    #: How this backend spells the operations' SQL.
    dialect: Dialect

    @abc.abstractmethod
    async def _write(self, what: str, op: Op[T], *, durable: bool = True) -> T:
        """Run ``op`` in one write transaction: committed if it returns, rolled back if it raises.

        Its errors are StoreErrors named by ``what``; ``durable`` False: the commit may return
        before it is synced (the next durable commit syncs it).
        """

    @abc.abstractmethod
    async def _read(self, what: str, op: Op[T]) -> T:
        """Run ``op`` in one read-only transaction (a consistent snapshot)."""

    # ------------------------------------------------------------------ sessions

    async def create_session(
        self,
        session_id: str,
        *,
        assistant: str,
        generation: int,
        model: str,
        created_at: float,
        transcript: Sequence[Message] = (),
    ) -> StoredSession:
        where = f"session {session_id}"
        for message in transcript:
            codec.check_message(message, where)
        op = ops.create_session(
            session_id,
            assistant=assistant,
            generation=generation,
            model=model,
            created_at=created_at,
            transcript=transcript,
        )
        return await self._write(f"create {where}", op)

    async def update_session(
        self,
        session_id: str,
        *,
        state: SessionState | None = None,
        generation: int | None = None,
        model: str | None = None,
        assistant: str | None = None,
        lease: Lease | None = None,
    ) -> None:
        where = f"session {session_id}"
        fields = codec.session_fields(where, state=state, generation=generation, model=model, assistant=assistant)
        await self._write(f"update {where}", ops.update_session(session_id, fields, time.time(), lease))

    async def load_session(self, session_id: str) -> StoredSession | None:
        return await self._read(f"load session {session_id}", ops.load_session(session_id))

    async def ended_turn(self, session_id: str, turn_id: str) -> tuple[TurnRecord, list[StoredEntry]] | None:
        return await self._read(f"read turn {turn_id} of session {session_id}", ops.ended_turn(session_id, turn_id))

    async def session_summary(self, session_id: str) -> StoredSession | None:
        return await self._read(f"read session {session_id}", ops.session_summary(session_id))

    async def transcript(self, session_id: str, *, exclude_turn: str | None = None) -> list[Message]:
        op = ops.transcript(session_id, exclude_turn)
        return await self._read(f"read transcript of session {session_id}", op)

    async def list_sessions(
        self, *, limit: int = 100, after: str | None = None, state: str | None = None, assistant: str | None = None
    ) -> list[StoredSession]:
        codec.check_state(state, "cannot list sessions")
        assistant = self.dialect.text(assistant) if assistant is not None else None
        return await self._read("list sessions", ops.list_sessions(limit, after, state, assistant))

    async def interrupted_turns(self) -> list[tuple[StoredSession, StartedTurn]]:
        return await self._read("list interrupted turns", ops.interrupted_turns())

    async def sessions_of_turn(self, turn_id: str) -> list[str]:
        return await self._read(f"find turn {turn_id}", ops.sessions_of_turn(turn_id))

    async def session_counts(self) -> dict[str, int]:
        return await self._read("count sessions", ops.session_counts())

    async def open_sessions_by_assistant(self) -> dict[str, int]:
        return await self._read("count sessions by assistant", ops.open_sessions_by_assistant())

    async def usage_report(
        self,
        group_by: str,
        *,
        since: float | None = None,
        until: float | None = None,
        limit: int | None = None,
        after: str | None = None,
    ) -> list[SpendRow]:
        if group_by not in ops.USAGE_GROUPS:
            raise StoreError(f"usage: cannot group by {group_by!r} (expected one of {', '.join(ops.USAGE_GROUPS)})")
        return await self._read(f"sum usage by {group_by}", ops.usage_report(group_by, since, until, limit, after))

    # ------------------------------------------------------------------ turns

    async def begin_turn(
        self,
        session_id: str,
        turn_id: str,
        message: UserMessage | None,
        started_at: float,
        *,
        durable: bool = True,
        trace: Mapping[str, str] | None = None,
    ) -> int | None:
        where = f"session {session_id} turn {turn_id}"
        if message is not None:
            if not isinstance(message, UserMessage):
                raise StoreError(f"{where}: a turn's input must be a user message, not {type(message).__name__}")
            message = msgspec.structs.replace(message, turn=turn_id)
        relaxed = None if durable else self.dialect.relaxed_commit
        op = ops.begin_turn(
            session_id,
            turn_id,
            message,
            started_at,
            relaxed=relaxed,
            trace=self.dialect.text(codec.encode_trace(trace)),
        )
        return await self._write(f"begin {where}", op, durable=durable)

    async def commit_turn(
        self,
        session_id: str,
        record: TurnRecord,
        *,
        assistant: str,
        messages: Sequence[Message] = (),
        transcript: Sequence[Message] | None = None,
        model: str | None = None,
        lease: Lease | None = None,
    ) -> CommittedTurn:
        where = f"session {session_id} turn {record.id}"
        try:
            status = TurnStatus(record.status)
        except ValueError:
            raise StoreError(f"cannot commit {where}: unknown status {record.status!r}") from None
        new_messages = messages if transcript is None else transcript
        for message in new_messages:
            codec.check_message(message, where)
        columns = codec.ended_turn_columns(record, status)
        columns["error"] = self.dialect.text(record.error)
        op = ops.commit_turn(
            session_id,
            record,
            status,
            columns,
            assistant=assistant,
            messages=new_messages,
            rewrite=transcript is not None,
            model=model,
            lease=lease,
        )
        committed, recovered = await self._write(f"commit {where}", op)
        if recovered:
            log.warning(events.LOG_TURN_COMMIT_RECOVERED, session=session_id, turn=record.id, seqs=list(committed.seqs))
        return committed

    async def abandon_turn(
        self,
        session_id: str,
        turn_id: str,
        *,
        status: str,
        error: str | None,
        ended_at: float,
        lease: Lease | None = None,
        spent: TurnRecord | None = None,
    ) -> None:
        where = f"session {session_id} turn {turn_id}"
        if status not in codec.TURN_STATUSES:
            raise StoreError(
                f"cannot abandon {where}: unknown status {status!r} (expected one of {sorted(codec.TURN_STATUSES)})"
            )
        error = self.dialect.text(error)
        op = ops.abandon_turn(
            session_id, turn_id, status=status, error=error, ended_at=ended_at, lease=lease, spent=spent
        )
        await self._write(f"abandon {where}", op)

    async def pending_turn(self, session_id: str) -> StartedTurn | None:
        return await self._read(f"pending turn of session {session_id}", ops.pending_turn(session_id))

    async def request_cancel(self, session_id: str, turn_id: str) -> bool:
        op = ops.request_cancel(session_id, turn_id)
        return await self._write(f"request the cancel of session {session_id} turn {turn_id}", op)

    # ------------------------------------------------------------------ the tool journal

    async def journal_start(
        self, session_id: str, turn_id: str, entry: JournalEntry, *, lease: Lease | None = None
    ) -> None:
        text = self.dialect.text
        op = ops.journal_start(
            session_id,
            turn_id,
            entry.seq,
            call=text(entry.call),
            tool=text(entry.tool),
            arguments=text(codec.encode_json(entry.arguments)),
            now=time.time(),
            lease=lease,
        )
        await self._write(f"journal session {session_id} turn {turn_id} call {entry.seq}", op)

    async def journal_finish(
        self, session_id: str, turn_id: str, seq: int, *, content: str, is_error: bool, lease: Lease | None = None
    ) -> None:
        op = ops.journal_finish(
            session_id,
            turn_id,
            seq,
            content=self.dialect.text(content),
            is_error=is_error,
            now=time.time(),
            lease=lease,
        )
        await self._write(f"journal the result of session {session_id} turn {turn_id} call {seq}", op)

    async def journal_entries(self, session_id: str, turn_id: str) -> list[JournalEntry]:
        op = ops.journal_entries(session_id, turn_id)
        return await self._read(f"read the journal of session {session_id} turn {turn_id}", op)

    # ------------------------------------------------------------------ approvals (RFC 0012 §4)

    async def park_turn(
        self,
        session_id: str,
        turn_id: str,
        run: ParkedRun,
        requests: Sequence[tuple[str, ApprovalRequest]],
        *,
        expires_at: float | None,
        lease: Lease | None = None,
    ) -> ParkResult:
        model = run.intelligence.model if run.intelligence is not None else ""
        op = approval_ops.park_turn(
            session_id,
            turn_id,
            run=self.dialect.text(approval_ops.encode_run(run)),
            model=self.dialect.text(model),
            requests=requests,
            now=time.time(),
            expires_at=expires_at,
            lease=lease,
        )
        return await self._write(f"store the approvals of session {session_id} turn {turn_id}", op)

    async def decide_approval(
        self, approval_id: str, status: str, *, reason: str | None, arguments: dict[str, Any] | None
    ) -> tuple[Approval, bool]:
        op = approval_ops.decide_approval(
            approval_id,
            status=status,
            reason=self.dialect.text(reason),
            arguments=None if arguments is None else self.dialect.text(codec.encode_json(arguments)),
            now=time.time(),
        )
        return await self._write(f"decide approval {approval_id}", op)

    async def expire_approvals(self, now: float, *, limit: int = 1000) -> tuple[list[Approval], list[tuple[str, str]]]:
        op = approval_ops.expire_approvals(now, limit, "no decision within [limits] approval_timeout")
        return await self._write("expire approvals", op)

    async def next_expiry(self) -> float | None:
        return await self._read("read the next approval expiry", approval_ops.next_expiry())

    async def parked_run(self, session_id: str, turn_id: str) -> tuple[ParkedRun, list[Approval]] | None:
        op = approval_ops.parked_run(session_id, turn_id)
        return await self._read(f"read the parked run of session {session_id} turn {turn_id}", op)

    async def awaiting_turn(self, session_id: str) -> str | None:
        return await self._read(
            f"read whether session {session_id} awaits approval", approval_ops.awaiting_turn(session_id)
        )

    async def awaiting_sessions(self, session_ids: Sequence[str]) -> set[str]:
        return await self._read("read which sessions await approval", approval_ops.awaiting_sessions(session_ids))

    async def get_approval(self, approval_id: str) -> Approval | None:
        return await self._read(f"read approval {approval_id}", approval_ops.get_approval(approval_id))

    async def list_approvals(
        self, *, status: str | None = None, session: str | None = None, limit: int = 100, after: str | None = None
    ) -> list[Approval]:
        return await self._read("list approvals", approval_ops.list_approvals(status, session, limit, after))

    async def pending_approvals(self) -> int:
        return await self._read("count pending approvals", approval_ops.pending_approvals())

    async def unpark_for_swap(self, assistant: str, model: str) -> list[tuple[str, str]]:
        op = approval_ops.unpark_for_swap(assistant, model, time.time())
        return await self._write(f"discard the parked runs of assistant {assistant}", op)

    # ------------------------------------------------------------------ leases

    async def claim(self, session_id: str, replica: str, ttl: float, *, turn: str | None = None) -> Lease | None:
        what = f"cannot claim session {session_id}"
        codec.check_replica(replica, what)
        codec.check_ttl(ttl, what)
        return await self._write(f"claim session {session_id}", ops.claim(session_id, replica, ttl, turn))

    async def renew(self, replica: str, ttl: float) -> dict[str, Lease]:
        what = f"cannot renew the leases of replica {replica}"
        codec.check_replica(replica, what)
        codec.check_ttl(ttl, what)
        return await self._write(f"renew the leases of replica {replica}", ops.renew(replica, ttl))

    async def release(self, lease: Lease) -> bool:
        op = ops.release(lease, self.dialect.orphan_notice)
        return await self._write(f"release session {lease.session}", op)

    async def claim_orphaned(self, replica: str, ttl: float, *, limit: int = 100) -> list[Lease]:
        what = f"cannot claim orphaned sessions for replica {replica}"
        codec.check_replica(replica, what)
        codec.check_ttl(ttl, what)
        op = ops.claim_orphaned(replica, ttl, limit)
        return await self._write(f"claim orphaned sessions for replica {replica}", op)

    async def lease_of(self, session_id: str) -> Lease | None:
        return await self._read(f"read the lease of session {session_id}", ops.lease_of(session_id))

    # ------------------------------------------------------------------ the replica registry
    # Heartbeat rows are hints rewritten every beat: not synced by themselves (``durable=False``).

    async def beat(self, replica: str, *, generation: int, sessions: int) -> ReplicaRow:
        codec.check_replica(replica, f"cannot record replica {replica}")
        op = ops.beat(replica, generation, sessions)
        return await self._write(f"record replica {replica}", op, durable=False)

    async def record_reload(self, reload: ReloadRow, *, keep: int) -> None:
        if keep < 1:
            raise StoreError(f"cannot record a reload: keep must be at least 1, not {keep}")
        text = self.dialect.text
        stored = msgspec.structs.replace(
            reload,
            errors=tuple((text(path), text(message)) for path, message in reload.errors),
            changed=tuple(text(path) for path in reload.changed),
        )
        await self._write(f"record the reload to generation {reload.generation}", history.record_reload(stored, keep))

    async def reloads(self, limit: int) -> list[ReloadRow]:
        return await self._read("read the reload history", history.reloads(limit))

    async def live_replicas(self, max_age: float) -> list[ReplicaRow]:
        return await self._read("read the live replicas", ops.live_replicas(max_age))

    async def watch(self, replica: str, sessions: Sequence[str], ttl: float) -> None:
        what = f"cannot record the watches of replica {replica}"
        codec.check_replica(replica, what)
        codec.check_ttl(ttl, what)
        await self._write(what.replace("cannot ", ""), ops.watch(replica, sessions, ttl), durable=False)

    async def unwatch(self, replica: str, sessions: Sequence[str]) -> None:
        op = ops.unwatch(replica, sessions)
        await self._write(f"forget the watches of replica {replica}", op, durable=False)

    # ------------------------------------------------------------------ idempotency keys

    async def idempotency_claim(
        self,
        scope: str,
        key: str,
        *,
        fingerprint: str,
        owner: str,
        session: str | None,
        turn: str | None,
        ttl: float,
    ) -> IdempotencyRecord | None:
        if not 0 < ttl <= codec.MAX_TTL:
            raise StoreError(
                f"cannot claim idempotency key {key!r}: its ttl must be more than 0 and at most {codec.MAX_TTL:g} s"
            )
        op = keys.idempotency_claim(scope, key, fingerprint, owner, session, turn, ttl)
        return await self._write(f"claim idempotency key {key!r}", op)

    async def idempotency_take_over(self, scope: str, key: str, *, owner: str, previous: str | None) -> bool:
        op = keys.idempotency_take_over(scope, key, owner, previous)
        return await self._write(f"take over idempotency key {key!r}", op)

    async def idempotency_release(self, scope: str, key: str, *, owner: str) -> None:
        await self._write(f"release idempotency key {key!r}", keys.idempotency_release(scope, key, owner))

    async def idempotency_answer(
        self, scope: str, key: str, *, status: int, answer: str, headers: dict[str, str]
    ) -> None:
        op = keys.idempotency_answer(scope, key, status, self.dialect.text(answer), codec.encode_json(headers))
        await self._write(f"keep the answer of idempotency key {key!r}", op)
