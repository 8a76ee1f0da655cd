"""The API's operations (RFC 0000 §6): status, sessions, messages, events, cancels, closes.

Each turns a request into store calls and turns (``agentd.supervisor.turns``), and answers with a
body of ``agentd.views`` or refuses with a domain error of ``agentd.errors`` — never an HTTP
status: ``agentd.api`` alone says how each error is answered. Which replica runs a session's turn
is membership's business (``agentd.supervisor.membership``); nothing here asks which store it is.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Mapping, Sequence
from typing import TypeVar, get_args

import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream

from agentd import __version__, events
from agentd.config import ConfigIssue, effective_intelligence
from agentd.errors import BadInput, Conflict, Draining, NotFound, ServiceError, StoreDown, store_failure
from agentd.messages import Message, UserMessage
from agentd.obs import get_logger
from agentd.protocol import Watch
from agentd.records import SessionState, StartedTurn
from agentd.store import Store, StoredSession, StoreError, StoreUnavailable, UnknownSession
from agentd.supervisor.approvals import Approvals
from agentd.supervisor.membership import Membership
from agentd.supervisor.pool import Pool
from agentd.supervisor.replica import registry_max_age, replica_views
from agentd.supervisor.running import Running
from agentd.supervisor.session import EventItem, SessionRuntime, SessionTable
from agentd.supervisor.turns import Turns, new_id
from agentd.transfer import OpenerKind, opener_message, opener_plan, session_start_history
from agentd.usage import report, session_usage
from agentd.views import (
    Accepted,
    ApprovalCounts,
    ApprovalView,
    ChildView,
    MessageResult,
    ParkedTurn,
    PolicyView,
    PostMessage,
    ReloadView,
    ReplicaView,
    SessionCounts,
    SessionSummary,
    SessionView,
    StatusView,
    UsageReport,
    approval_view,
    entry_from_message,
    iso,
    turn_view,
)

__all__ = ["Operations"]

log = get_logger("supervisor")
T = TypeVar("T")

#: The states a session can be listed by (``GET /v1/sessions?state=``).
SESSION_STATES: tuple[str, ...] = get_args(SessionState)


class Operations:
    """What the API asks of the daemon, answered from the store and the hot sessions."""

    def __init__(
        self,
        *,
        store: Store,
        running: Running,
        sessions: SessionTable,
        pool: Pool,
        membership: Membership,
        turns: Turns,
        approvals: Approvals,
    ) -> None:
        self.store = store
        self.approvals = approvals
        self.running = running
        self.sessions = sessions
        self.pool = pool
        self.membership = membership
        self.turns = turns

    # ------------------------------------------------------------------ the daemon

    async def status(self) -> StatusView:
        """What ``agentd status`` shows: generation, policy, children and session counts."""
        children = [
            ChildView(
                pid=c.pid,
                sessions=len(c.loaded),
                in_flight=len(c.in_flight),
                state=c.role.value,
                generation=c.generation,
                restarts=c.restarts,
            )
            for c in self.pool.children.values()
        ]
        counts = await self._store(self.store.session_counts())
        sessions = SessionCounts(
            open=sum(n for state, n in counts.items() if state != "closed"),
            loaded=sum(len(c.loaded) for c in self.pool.children.values()),
            running=self.sessions.running(),
            failed=counts.get("failed", 0),
        )
        running = self.running
        return StatusView(
            pid=os.getpid(),
            version=__version__,
            generation=running.generation,
            model_swap=PolicyView(policy=running.policy.policy.value, source=running.policy.source),
            config_path=str(running.options.config_path) if running.options.config_path else None,
            children=children,
            sessions=sessions,
            draining=running.draining,
            replica=self.membership.name,
            replicas=await self._live_replicas(),
            approvals=ApprovalCounts(pending=await self.approvals.pending()),
        )

    async def _live_replicas(self) -> list[ReplicaView]:
        max_age = registry_max_age(self.running.config.store.lease)
        rows = replica_views(await self._store(self.store.live_replicas(max_age)))
        return [ReplicaView(id=r.id, generation=r.generation, sessions=r.sessions, seen_at=r.seen_at) for r in rows]

    async def metrics_text(self) -> bytes:
        """Prometheus exposition, with the gauges read fresh."""
        metrics = self.running.metrics
        counts = await self._store(self.store.session_counts())
        running = self.sessions.running()
        metrics.sessions.labels(state="idle").set(max(0, counts.get("idle", 0) + counts.get("running", 0) - running))
        metrics.sessions.labels(state="running").set(running)
        metrics.sessions.labels(state="failed").set(counts.get("failed", 0))
        metrics.sessions.labels(state="loaded").set(sum(len(c.loaded) for c in self.pool.children.values()))
        metrics.children.set(sum(1 for c in self.pool.children.values() if c.pid is not None))
        await self.approvals.pending()  # sets agentd_approvals_pending
        return metrics.render()

    async def reloads(self, limit: int = 100) -> list[ReloadView]:
        """The newest ``limit`` reloads of every replica on the store, newest first (RFC 0000 §6)."""
        rows = await self._store(self.store.reloads(limit))
        return [
            ReloadView(
                generation=row.generation,
                at=iso(row.at) or "",
                applied=row.applied,
                errors=[ConfigIssue(path, message) for path, message in row.errors],
                changed=list(row.changed),
                swapped_total=row.swapped_total,
                replica=row.replica,
            )
            for row in rows
        ]

    def ready(self) -> list[str]:
        """Reasons the daemon is not ready (empty = ready)."""
        reasons = ["draining"] if self.running.draining else []
        if self.store.failure is not None:
            reasons.append(f"store unavailable: {self.store.failure}")
        if self.pool.start_failure is not None:
            reasons.append(f"no child can start: {self.pool.start_failure}")
        down = sorted({r.assistant for r in self.sessions.values() if r.intel_waiting})
        reasons += [f"all endpoints down for assistant {name!r}" for name in down]
        return reasons

    def _refuse_when_draining(self) -> None:
        if self.running.draining:
            raise Draining("agentd is shutting down and accepts no new work")

    # ------------------------------------------------------------------ sessions

    async def create_session(
        self,
        assistant_name: str | None,
        *,
        session_id: str | None = None,
        resumed: bool = False,
        seeded: Sequence[Message] = (),
        opener: bool = True,
    ) -> SessionView:
        """Open a session on an assistant (the default: the first one); its opener is in the transcript.

        ``session_id``: the id to create it with (an idempotency key chose it); ``resumed``: a
        request before this one may have created it already — then it is answered as it is now.
        ``seeded``: earlier messages the session starts with, after the assistant's prompt (a
        client that kept the conversation itself); ``opener`` False: the assistant does not speak first.
        """
        if resumed and session_id is not None:
            stored = await self._store(self.store.session_summary(session_id))
            if stored is not None:
                return await self.get_session(session_id)
        self._refuse_when_draining()
        config = self.running.config
        name = assistant_name or config.default_assistant.name
        try:
            assistant = config.assistant(name)
        except KeyError:
            names = ", ".join(a.name for a in config.assistants)
            raise BadInput(f"no assistant named {name!r}; assistants: {names}", code="unknown_assistant") from None
        model = effective_intelligence(config, name).model
        session_id = session_id or new_id("s")
        history = [*session_start_history(assistant), *seeded]
        plan = opener_plan(assistant, history)
        if not opener:
            plan = msgspec.structs.replace(plan, kind=OpenerKind.NONE, reason="the client asked for none")
        if plan.kind is OpenerKind.FIRST_MESSAGE:
            history.append(opener_message(plan, turn=None, model=model))
        try:
            await self.store.create_session(
                session_id,
                assistant=name,
                generation=self.running.generation,
                model=model,
                created_at=time.time(),
                transcript=history,
            )
        except StoreUnavailable as exc:
            if not await self._created_after_all(session_id, exc):
                raise store_failure(exc) from None
        except StoreError as exc:
            raise store_failure(exc) from None
        log.info(events.LOG_SESSION_CREATED, session=session_id, assistant=name, model=model)
        if plan.kind is OpenerKind.GENERATED:
            runtime = self.sessions.add(SessionRuntime(session_id, name, "idle", self.running.generation, model))
            turn = await self.turns.accept(runtime, None)
            if turn.elsewhere:
                await self.turns.wait_elsewhere(session_id, turn.id)
            else:
                await turn.done.wait()
        return await self.get_session(session_id)

    async def _created_after_all(self, session_id: str, failure: StoreUnavailable) -> bool:
        """Whether the failed create landed after all (``Membership.created_after_all``); the client
        is answered naming the session when the store cannot say."""
        try:
            return await self.membership.created_after_all(session_id, failure)
        except StoreError:
            raise StoreDown(
                f"the store failed while creating the session, and may have created it as {session_id}: {failure}"
            ) from None

    async def list_sessions(
        self, *, limit: int = 100, after: str | None = None, state: str | None = None, assistant: str | None = None
    ) -> list[SessionSummary]:
        """One page of sessions in creation order (newest last), as the supervisor sees them now;
        only those in ``state`` (as the store has it) and on ``assistant``, when given."""
        if state is not None and state not in SESSION_STATES:
            raise BadInput(f"state must be one of {', '.join(SESSION_STATES)}, not {state!r}", code="bad_state")
        try:
            page = await self.store.list_sessions(limit=limit, after=after, state=state, assistant=assistant)
        except UnknownSession as exc:
            raise BadInput(str(exc), code="bad_cursor") from None
        except StoreError as exc:
            raise store_failure(exc) from None
        cold = [s.id for s in page if s.state == "running" and s.id not in self.sessions]
        awaiting = await self._store(self.store.awaiting_sessions(cold)) if cold else set()
        summaries = []
        for stored in page:
            on, shown, generation, model = self._effective(stored)
            if stored.id in awaiting:
                shown = "awaiting_approval"  # its turn waits for approvals (RFC 0012); not hot here
            summaries.append(
                SessionSummary(
                    id=stored.id,
                    assistant=on,
                    state=shown,
                    generation=generation,
                    model=model,
                    turns=stored.turn_count,
                )
            )
        return summaries

    async def get_session(self, session_id: str) -> SessionView:
        """The session with its whole transcript and every turn."""
        stored = await self._store(self.store.load_session(session_id))
        if stored is None:
            raise NotFound(f"no session {session_id!r}")
        assistant, state, generation, model = self._effective(stored)
        if (
            state in ("idle", "running")
            and self.sessions.get(session_id) is None
            and any(isinstance(t, StartedTurn) for t in stored.turns)
            and await self._store(self.store.awaiting_turn(session_id)) is not None
        ):
            state = "awaiting_approval"  # its turn waits for approvals; the session is not loaded
        runtime = self.sessions.get(session_id)
        child = runtime.child if runtime is not None else None
        return SessionView(
            id=stored.id,
            assistant=assistant,
            state=state,
            generation=generation,
            model=model,
            created_at=iso(stored.created_at),
            transcript=[entry_from_message(e.seq, e.message) for e in stored.transcript],
            turns=[turn_view(t) for t in stored.turns],
            child=child.pid if child is not None else None,
            usage=session_usage(stored.turns),
        )

    async def session_of_turn(self, turn_id: str) -> str:
        """The id of the session that has the turn ``turn_id``; NotFound if none has."""
        found = await self._store(self.store.sessions_of_turn(turn_id))
        if not found:
            raise NotFound(f"no turn {turn_id!r}", code="turn_not_found")
        return found[0]

    async def usage(
        self, group_by: str, *, since: float | None, until: float | None, limit: int, after: str | None = None
    ) -> UsageReport:
        """What turns that ended in [since, until) spent and cost, summed by the store (RFC 0011 §2):
        a page of ``limit`` groups after ``after``; ``next`` names the last one when more may follow."""
        rows = await self._store(self.store.usage_report(group_by, since=since, until=until, limit=limit, after=after))
        page = report(group_by, rows, since, until)
        if len(page.groups) == limit:
            page.next = page.groups[-1].key
        return page

    def _effective(self, stored: StoredSession) -> tuple[str, SessionState, int, str]:
        """(assistant, state, generation, model) as of now: the hot runtime's, else the row's.

        A session that is not hot is not loaded anywhere, so it has taken every swap since its row
        was written (it was idle): it runs the current generation's model for its assistant.
        """
        runtime = self.sessions.get(stored.id)
        if runtime is not None and stored.state != "closed":  # closed is final, wherever it was closed
            return runtime.assistant, runtime.state, runtime.generation, runtime.model
        if stored.state == "closed":
            return stored.assistant, stored.state, stored.generation, stored.model
        model = self.running.model_of(stored.assistant, stored.model)
        return stored.assistant, stored.state, self.running.generation, model

    async def _open_runtime(self, session_id: str) -> SessionRuntime:
        """The hot runtime of an open session, made hot from its row if it was not. NotFound if none."""
        runtime = self.sessions.get(session_id)
        if runtime is None:
            stored = await self._store(self.store.session_summary(session_id))
            if stored is not None and stored.state != "closed":
                runtime = self.sessions.hot(stored)
        if runtime is None or runtime.closing:
            raise NotFound(f"no open session {session_id!r}")
        return runtime

    # ------------------------------------------------------------------ turns

    async def send_message(
        self,
        session_id: str,
        body: PostMessage,
        *,
        turn_id: str | None = None,
        resumed: bool = False,
        trace: Mapping[str, str] | None = None,
    ) -> MessageResult | Accepted:
        """Store the user message, deliver it, and (``wait``) return the finished turn.

        ``turn_id``: the id to begin the turn with (an idempotency key chose it); ``resumed``: a
        request before this one may have stored that turn already — then it is not begun again
        but waited for (``wait``) or named. ``trace`` is the request's W3C trace context, which the
        turn's spans join (RFC 0011 §4).
        """
        if resumed and turn_id is not None:
            found = await self._stored_turn(session_id, turn_id, body.wait)
            if found is not None:
                return found
        self._refuse_when_draining()
        if not body.content.strip() and not body.images:
            raise BadInput("content must not be empty", code="empty_message")
        runtime = await self._open_runtime(session_id)
        if runtime.pending is not None:
            raise Conflict(f"session {session_id} is already running turn {runtime.pending.id}", code="turn_running")
        if runtime.state == "awaiting_approval":
            raise Conflict(f"session {session_id} has a turn awaiting approval", code="awaiting_approval")
        if runtime.state == "failed":
            runtime.resume_failed()  # a new message resumes a failed session
            await self._store(self.store.update_session(runtime.id, state="idle"))
        turn_id = turn_id or new_id("t")
        message = UserMessage(content=body.content, images=tuple(body.images) if body.images else None, turn=turn_id)
        # A waiting client hears nothing before the turn's commit, which syncs its message too.
        turn = await self.turns.accept(runtime, message, durable=not body.wait, trace=trace)
        if not body.wait:
            return Accepted(turn_id=turn_id)
        if turn.elsewhere:
            return await self.turns.wait_elsewhere(runtime.id, turn.id)
        await turn.done.wait()
        return self.turns.result(turn)

    async def _stored_turn(self, session_id: str, turn_id: str, wait: bool) -> MessageResult | Accepted | None:
        """The answer to a message whose turn ``turn_id`` is stored already (None if it is not):
        its result once it ends (``wait``), else its id."""
        ended = await self._store(self.turns.ended_turn(session_id, turn_id))
        if ended is not None:
            record, entries = ended
            return MessageResult(turn=turn_view(record), messages=entries) if wait else Accepted(turn_id=turn_id)
        try:
            pending = await self.store.pending_turn(session_id)
        except UnknownSession:
            return None
        except StoreError as exc:
            raise store_failure(exc) from None
        if pending is None or pending.id != turn_id:
            return None
        if not wait:
            return Accepted(turn_id=turn_id)
        awaiting = await self._store(self.turns.awaiting_result(session_id, pending))
        if awaiting is not None:  # it waits for approvals: answered with them, as when it parked
            return awaiting
        runtime = self.sessions.get(session_id)
        turn = runtime.pending if runtime is not None else None
        if turn is not None and turn.id == turn_id:  # it runs here (a restart resumed it)
            await turn.done.wait()
            return self.turns.result(turn)
        return await self.turns.wait_elsewhere(session_id, turn_id)

    async def subscribe(self, session_id: str) -> MemoryObjectReceiveStream[EventItem]:
        """A stream of the session's events (it stays hot while subscribed)."""
        runtime = await self._open_runtime(session_id)
        was_watched = runtime.watched
        stream = runtime.subscribe()
        turn = runtime.pending
        if not was_watched:
            await self.membership.watching(runtime.id)
        if (
            not was_watched
            and turn is not None
            and turn.child is not None
            and not self.membership.watched_elsewhere(runtime.id)
        ):
            await turn.child.send(Watch(session=runtime.id))  # the turn in flight streams from now on
        return stream

    def unsubscribed(self, session_id: str) -> None:
        """A subscriber went away: a session nobody needs any more is forgotten (it stays in the store)."""
        runtime = self.sessions.get(session_id)
        if runtime is None:
            return
        if not runtime.watched:
            self.membership.unwatched(runtime.id)
            self.turns.stop_streaming(runtime)
        self.sessions.evict_if_cold(runtime)

    async def cancel(self, session_id: str) -> str:
        """Ask the child running the session's turn to cancel it; the turn then ends ``cancelled``."""
        runtime = await self._open_runtime(session_id)
        if runtime.pending is None:  # a turn waiting for approvals ends now, with them
            awaiting = await self._store(self.turns.end_awaiting(runtime, "cancelled while awaiting approval"))
            if awaiting is not None:
                return awaiting
        if runtime.pending is None:  # it may run on another replica: ask it to cancel
            elsewhere = await self.membership.cancel_elsewhere(session_id)
            if elsewhere is not None:
                return elsewhere
            raise Conflict(f"session {session_id} has no turn running", code="no_turn")
        return await self.turns.cancel_here(runtime)

    async def close_session(self, session_id: str) -> SessionSummary:
        """Close the session: unload it, end its turn ``cancelled``; the transcript is kept."""
        runtime = await self._open_runtime(session_id)
        runtime.closing_begins()
        await self.pool.unload(session_id)  # its child gets Close (which cancels a turn in flight there)
        if runtime.pending is not None:
            await self.turns.end_closed(runtime, runtime.pending)
        elif await self._store(self.turns.end_awaiting(runtime, "the session was closed")) is not None:
            pass  # its turn waited for approvals: ended here, with them
        else:  # a turn another replica runs is cancelled there (the session stays closed)
            try:
                await self.membership.cancel_elsewhere(session_id)
            except ServiceError:
                runtime.close_undone(turn_ended=False)
                raise
        runtime.unloaded()
        try:
            await self.store.update_session(session_id, state="closed")
        except StoreError as exc:  # not closed: the session stays open and usable (its turn was cancelled)
            runtime.close_undone(turn_ended=True)
            error = store_failure(exc)
            raise type(error)(f"session {session_id} was not closed (the store failed): {exc}") from None
        runtime.closed()
        self.sessions.discard(session_id)
        await self.membership.closed(session_id)  # other replicas drop what they hold of it
        runtime.log.info(events.LOG_SESSION_CLOSED)
        return SessionSummary(
            id=session_id,
            assistant=runtime.assistant,
            state="closed",
            generation=runtime.generation,
            model=runtime.model,
        )

    # ------------------------------------------------------------------ approvals (RFC 0012 §6)

    async def list_approvals(
        self, *, status: str | None, session: str | None, limit: int, after: str | None
    ) -> list[ApprovalView]:
        """A page of approvals, oldest first."""
        return await self.approvals.page(status=status, session=session, limit=limit, after=after)

    async def get_approval(self, approval_id: str) -> ApprovalView:
        """One approval."""
        return await self.approvals.get(approval_id)

    async def decide_approval(
        self, approval_id: str, decision: str, reason: str | None, arguments: object | None
    ) -> ApprovalView:
        """Approve or reject, once; the turn goes on when nothing of it waits any more."""
        return await self.approvals.decide(approval_id, decision, reason, arguments)

    async def parked_turn(self, session_id: str, turn_id: str, first_seq: int) -> ParkedTurn | None:
        """The turn's parked run — its messages as entries numbered from ``first_seq`` (as the
        turn's commit will number them), the calls that wait — and every approval of the turn;
        None when it has no parked run (it runs, or ended)."""
        found = await self._store(self.store.parked_run(session_id, turn_id))
        if found is None:
            return None
        run, approvals = found
        return ParkedTurn(
            turn=turn_id,
            entries=[entry_from_message(first_seq + i, m) for i, m in enumerate(run.messages)],
            calls=list(run.calls),
            approvals=[approval_view(a) for a in approvals],
        )

    async def _store(self, call: Awaitable[T]) -> T:
        """A store call a request needs; a store that fails refuses the request, naming what failed."""
        try:
            return await call
        except StoreError as exc:
            raise store_failure(exc) from None
