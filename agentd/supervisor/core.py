"""The supervisor: the daemon's parts, put together once, and their lifecycle (start, drain, stop).

It never calls a model, and holds no state of its own but the parts:

- what runs (``agentd.supervisor.running``): the config generation, its policy, the drain flag;
- the hot sessions (``agentd.supervisor.session.SessionTable``);
- replica membership (``agentd.supervisor.membership``), chosen once by the store: local on
  SQLite, replicated (leases, heartbeat, failover, relay) on PostgreSQL;
- the pool of children (``agentd.supervisor.pool``);
- the turns, each from acceptance to commit across the pool's children, and what children send
  about them (``agentd.supervisor.turns``);
- reloads and their fan-out to the children (``agentd.supervisor.fanout``);
- the API's operations (``agentd.supervisor.operations``), which the supervisor serves as its own
  methods (``agentd.api`` answers them over HTTP).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream

from agentd import events
from agentd.config import Config, ConfigIssue, PolicyChoice
from agentd.messages import Message
from agentd.obs import get_logger
from agentd.store import Store
from agentd.supervisor.approvals import Approvals
from agentd.supervisor.child import Child
from agentd.supervisor.fanout import Reloader
from agentd.supervisor.idempotency import Claim, Keys, Replay
from agentd.supervisor.membership import choose_membership
from agentd.supervisor.operations import Operations
from agentd.supervisor.options import DaemonOptions
from agentd.supervisor.pool import Pool
from agentd.supervisor.running import Running
from agentd.supervisor.session import EventItem, SessionTable
from agentd.supervisor.turns import Turns
from agentd.views import (
    Accepted,
    ApprovalView,
    MessageResult,
    ParkedTurn,
    PostMessage,
    ReloadResult,
    ReloadView,
    SessionSummary,
    SessionView,
    StatusView,
    UsageReport,
)

__all__ = ["Supervisor"]

log = get_logger("supervisor")


class Supervisor:
    """The daemon's parts, wired together, started, drained and stopped together."""

    def __init__(self, options: DaemonOptions, config: Config, policy: PolicyChoice, store: Store) -> None:
        self.store = store
        self.running = Running(options, config, policy)
        self.sessions = SessionTable(self.running)
        self.membership = choose_membership(store, self.running, self.sessions)
        self.approvals = Approvals(
            store=store, running=self.running, sessions=self.sessions, metrics=self.running.metrics
        )
        self.turns = Turns(
            store=store,
            running=self.running,
            metrics=self.running.metrics,
            sessions=self.sessions,
            membership=self.membership,
            approvals=self.approvals,
            on_swap_acked=self._swap_acked,
            on_turn_finished=self._turn_finished,
        )
        self.pool = Pool(
            settings=lambda: self.running.config.supervisor,
            spawn=self.running.spawn_frame,
            env=self.running.child_env,
            owner=self.turns.frames,
        )
        self.reloader = Reloader(
            running=self.running, store=store, sessions=self.sessions, pool=self.pool, replica=self.membership.name
        )
        self.operations = Operations(
            store=store,
            running=self.running,
            sessions=self.sessions,
            pool=self.pool,
            membership=self.membership,
            turns=self.turns,
            approvals=self.approvals,
        )
        self.approvals.attach(emit=self.turns.emit, resume=self._resume_parked)
        self.reloader.after_swap = self._swapped
        self.keys = Keys(store, self.membership, self.running)
        self._turn_ended = anyio.Event()

    @property
    def config(self) -> Config:
        """The running config."""
        return self.running.config

    @property
    def generation(self) -> int:
        """The running generation number."""
        return self.running.generation

    @property
    def replica_name(self) -> str:
        """This replica's id, as operators see it."""
        return self.membership.name

    @property
    def draining(self) -> bool:
        """The daemon accepts no new work."""
        return self.running.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.running.draining = value

    # ------------------------------------------------------------------ lifecycle

    async def find_live_twin(self) -> str | None:
        """Another live process bearing this replica's id (asked at start, before serving), else None."""
        return await self.membership.find_live_twin()

    async def orphaned_sessions(
        self, new: Config, *, by_assistant: Mapping[str, int] | None = None
    ) -> list[ConfigIssue]:
        """What a config would strand (``Reloader.orphaned_sessions``): asked at start as at a reload."""
        return await self.reloader.orphaned_sessions(new, by_assistant=by_assistant)

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        """Start the pool and membership; returns at once.

        No idle session is read: a session is loaded on its next message. Interrupted turns (their
        input stored, their results not) re-run in the background, while new work is served: all
        of them on SQLite, the orphaned ones on a shared store (membership's failover scan).
        """
        await tg.start(self.pool.run)
        self.turns.attach(self.pool, tg)
        await self.membership.start(tg, self.turns)
        tg.start_soon(self.approvals.expire_forever)

    async def drain(self, grace: float) -> bool:
        """Stop accepting turns; wait up to ``grace`` for in-flight turns. True when all ended."""
        self.running.draining = True
        log.info(events.LOG_SUPERVISOR_DRAINING, grace=grace, running=self._running_turns())
        with anyio.move_on_after(grace):
            while self._running_turns():
                self._turn_ended = anyio.Event()
                await self._turn_ended.wait()
        return self._running_turns() == 0

    async def stop(self) -> None:
        """Stop every child (kill ladder, no grace: the drain is over) and close every subscription."""
        self.turns.stop()
        await self.pool.stop(grace=0)
        for runtime in list(self.sessions.values()):
            runtime.close_subscribers()
        await self.membership.stop()

    def _running_turns(self) -> int:
        return sum(1 for r in self.sessions.values() if r.pending is not None and r.pending.cut is None)

    async def _resume_parked(self, session_id: str, turn_id: str) -> None:
        await self.turns.resume_parked(session_id, turn_id)

    async def _swapped(self, assistants: list[str]) -> None:
        """A reload swapped ``assistants``' intelligence: under restart-turn, their turns awaiting
        approval are discarded at once (nothing runs) and re-run on the new model (RFC 0012 §5)."""
        for session_id, turn_id in await self.approvals.unpark_for_swap(assistants):
            await self._resume_parked(session_id, turn_id)

    def _turn_finished(self) -> None:
        self._turn_ended.set()

    def _swap_acked(self, child: Child, generation: int) -> None:
        self.reloader.swap_acked(child, generation)

    # ------------------------------------------------------------------ what the API asks

    async def reload(self) -> ReloadResult:
        """Reload the config file (``Reloader.reload``)."""
        return await self.reloader.reload()

    def ready(self) -> list[str]:
        """Reasons the daemon is not ready (empty = ready)."""
        return self.operations.ready()

    async def status(self) -> StatusView:
        """What ``agentd status`` shows."""
        return await self.operations.status()

    async def metrics_text(self) -> bytes:
        """Prometheus exposition."""
        return await self.operations.metrics_text()

    async def create_session(
        self,
        assistant_name: str | None,
        *,
        session_id: str | None = None,
        resumed: bool = False,
        seeded: Sequence[Message] = (),
        opener: bool = True,
    ) -> SessionView:
        """Open a session (``Operations.create_session``)."""
        return await self.operations.create_session(
            assistant_name, session_id=session_id, resumed=resumed, seeded=seeded, opener=opener
        )

    async def list_sessions(
        self, *, limit: int = 100, after: str | None = None, state: str | None = None, assistant: str | None = None
    ) -> list[SessionSummary]:
        """One page of sessions (``Operations.list_sessions``)."""
        return await self.operations.list_sessions(limit=limit, after=after, state=state, assistant=assistant)

    async def reloads(self, limit: int = 100) -> list[ReloadView]:
        """The reload history, newest first (``Operations.reloads``)."""
        return await self.operations.reloads(limit)

    async def get_session(self, session_id: str) -> SessionView:
        """The session with its transcript (``Operations.get_session``)."""
        return await self.operations.get_session(session_id)

    async def usage(
        self, group_by: str, *, since: float | None, until: float | None, limit: int, after: str | None = None
    ) -> UsageReport:
        """Usage and cost over a time range, a page of groups (``Operations.usage``)."""
        return await self.operations.usage(group_by, since=since, until=until, limit=limit, after=after)

    async def send_message(
        self,
        session_id: str,
        body: PostMessage,
        *,
        turn_id: str | None = None,
        resumed: bool = False,
        trace: Mapping[str, str] | None = None,
    ) -> MessageResult | Accepted:
        """A user message, as a turn (``Operations.send_message``)."""
        return await self.operations.send_message(session_id, body, turn_id=turn_id, resumed=resumed, trace=trace)

    async def session_of_turn(self, turn_id: str) -> str:
        """The session a turn belongs to (``Operations.session_of_turn``)."""
        return await self.operations.session_of_turn(turn_id)

    async def parked_turn(self, session_id: str, turn_id: str, first_seq: int) -> ParkedTurn | None:
        """A turn's parked run and its approvals (``Operations.parked_turn``)."""
        return await self.operations.parked_turn(session_id, turn_id, first_seq)

    async def claim_key(self, scope: str, key: str, fingerprint: str) -> Claim | Replay:
        """Claim an idempotency key for a request (``Keys.claim``)."""
        return await self.keys.claim(scope, key, fingerprint)

    async def answer_key(self, claim: Claim, status: int, answer: bytes, headers: dict[str, str]) -> None:
        """Keep the answer of a claimed key's request (``Keys.answer``)."""
        await self.keys.answer(claim, status, answer, headers)

    async def release_key(self, claim: Claim) -> None:
        """A claimed key's request ended unanswered (``Keys.release``)."""
        await self.keys.release(claim)

    async def subscribe(self, session_id: str) -> MemoryObjectReceiveStream[EventItem]:
        """The session's events (``Operations.subscribe``)."""
        return await self.operations.subscribe(session_id)

    def unsubscribed(self, session_id: str) -> None:
        """A subscriber went away (``Operations.unsubscribed``)."""
        self.operations.unsubscribed(session_id)

    async def cancel(self, session_id: str) -> str:
        """Cancel the session's turn (``Operations.cancel``)."""
        return await self.operations.cancel(session_id)

    async def close_session(self, session_id: str) -> SessionSummary:
        """Close the session (``Operations.close_session``)."""
        return await self.operations.close_session(session_id)

    async def list_approvals(
        self, *, status: str | None = None, session: str | None = None, limit: int = 100, after: str | None = None
    ) -> list[ApprovalView]:
        """A page of approvals (``Operations.list_approvals``)."""
        return await self.operations.list_approvals(status=status, session=session, limit=limit, after=after)

    async def get_approval(self, approval_id: str) -> ApprovalView:
        """One approval (``Operations.get_approval``)."""
        return await self.operations.get_approval(approval_id)

    async def decide_approval(
        self, approval_id: str, decision: str, reason: str | None, arguments: object | None
    ) -> ApprovalView:
        """Approve or reject (``Operations.decide_approval``)."""
        return await self.operations.decide_approval(approval_id, decision, reason, arguments)
