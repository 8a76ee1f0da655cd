"""The supervisor: config generations, the hot sessions, reload fan-out, and the API's operations.

It never calls a model. Sessions are rows in the store; the pool (``agentd.supervisor.pool``)
runs children that host them, the turn runner (``agentd.supervisor.runner``) drives their turns.
This module decides what a reload swaps and turns API calls into stored inputs. API errors are
raised as ``ApiError`` with the HTTP status to answer.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Awaitable, Iterable, Mapping
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream

from agentd import __version__, events
from agentd.budget import TurnStatus
from agentd.config import (
    Config,
    ConfigError,
    ConfigIssue,
    Intelligence,
    PolicyChoice,
    effective_intelligence,
    intelligence_map,
    quickstart_config,
    resolve_swap_policy,
)
from agentd.environment import child_environment, mcp_secrets, passed_through, register_secrets
from agentd.messages import UserMessage
from agentd.obs import Metrics, get_logger
from agentd.protocol import Cancel, ChildEnv, Spawn, SwapIntel, Watch
from agentd.records import SessionState, StartedTurn, TurnRecord
from agentd.store import (
    CANCELS,
    CLOSES,
    EVENTS,
    ORPHANS,
    TURNS,
    WATCHES,
    Lease,
    Store,
    StoredEntry,
    StoredSession,
    StoreError,
    StoreUnavailable,
    UnknownSession,
)
from agentd.supervisor.child import Child
from agentd.supervisor.options import DaemonOptions
from agentd.supervisor.pool import Pool
from agentd.supervisor.relay import EventRelay, Reassembler, RemoteWatchers, decode_watch, encode_watch
from agentd.supervisor.reload import ReloadCoordinator, plan_reload, sessions_to_swap
from agentd.supervisor.replica import (
    RenewVerdict,
    heartbeat_interval,
    judge_renewal,
    lease_holder,
    live_twin,
    loaded_copy_is_current,
    new_incarnation,
    registry_max_age,
    replica_id,
    replica_name,
    replica_views,
    rivals,
    scan_interval,
)
from agentd.supervisor.runner import TurnRunner
from agentd.supervisor.session import EventItem, PendingTurn, SessionRuntime
from agentd.swap import classify_swap
from agentd.transfer import OpenerKind, opener_message, opener_plan, session_start_history
from agentd.views import (
    Accepted,
    ChildView,
    Entry,
    MessageResult,
    PolicyView,
    PostMessage,
    ReloadResult,
    ReplicaView,
    SessionCounts,
    SessionSummary,
    SessionView,
    StatusView,
    entry_from_message,
    turn_view,
)

__all__ = ["ApiError", "Supervisor", "load_daemon_config"]

log = get_logger("supervisor")
T = TypeVar("T")

#: Interrupted turns re-run after a restart at most this many at a time (new work is served meanwhile).
RESUME_CONCURRENCY = 16
#: ``swapped_sessions`` of a reload result lists at most this many ids; ``swapped_total`` counts them all.
SWAPPED_LIST_MAX = 100
#: How long a reload waits for its children's acks before its per-session bookkeeping (a hung child
#: is the ping's to find, RFC 0006 §9).
ACK_WAIT = 1.0
#: How often a ``wait`` for a turn that another replica runs looks at the store (seconds).
ELSEWHERE_POLL = 0.1
#: How far apart the clocks of two replicas may be, when a catch-up asks which turns ended since a time.
CLOCK_SLACK = 5.0


class ApiError(Exception):
    """An API call that cannot be served: the HTTP status, a stable code, a clear message, and the turn."""

    def __init__(self, status: int, code: str, message: str, *, turn: str | None = None) -> None:
        self.status, self.code, self.message, self.turn = status, code, message, turn
        super().__init__(message)


def load_daemon_config(path: Path | None) -> Config:
    """The config file, or the built-in quickstart when no file is given. Raises ConfigError.

    Start-up and every reload validate the file exactly as ``agentd check-config`` does
    (``validate_config_file``: schema, tools resolved as a child resolves them, the wire), so a
    config that passes is applied whole and one that fails changes nothing. Bounded: the read
    times out, and the tool check by the new config's ``spawn_timeout``.
    """
    if path is None:
        return quickstart_config()
    from agentd.validate import validate_config_file

    # Children get our environment without the API token; the tool check gets the same.
    config, issues = validate_config_file(path, environ=os.environ)
    if config is None:
        raise ConfigError(issues, str(path))
    return config


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(6)}"


class Supervisor:
    """Owns the running config generation, the hot sessions, the pool and the API's operations.

    Sessions are rows in the store. ``sessions`` holds only the hot ones (loaded on a child,
    running a turn or watched); any other session is read from the store when it is asked for, so
    start-up and memory do not grow with the number of open sessions (RFC 0006).
    """

    def __init__(self, options: DaemonOptions, config: Config, policy: PolicyChoice, store: Store) -> None:
        self.options = options
        self.config = config
        self.policy = policy
        self.generation = 1
        self.store = store
        # Shown to operators (status, registry): the replica id. Known to the store (leases, the
        # registry's row, watches, relayed events): this process, the id and its incarnation.
        self.replica_name = replica_id()
        self.replica = lease_holder(self.replica_name, new_incarnation())
        self._beat_seen: float | None = None  # the store's time of this process's first beat
        self._twins_reported: set[str] = set()
        # Leases are taken on a shared database only: on SQLite one daemon owns the state dir.
        self.shared_store = bool(config.store.url)
        self.lease_time = config.store.lease  # restart-only, like the store itself
        self.metrics = Metrics()
        self.metrics.generation.set(1)
        self.sessions: dict[str, SessionRuntime] = {}
        self.draining = False
        self.stopping = False
        self.reloads: ReloadCoordinator[ReloadResult] = ReloadCoordinator(self._reload)
        # Progress events across replicas (RFC 0009 §7): what this replica relays, in order, and
        # which sessions other replicas have subscribers for.
        self.relay = EventRelay(store, self.replica)
        self.watchers = RemoteWatchers(ttl=self.lease_time)
        self._reassembler = Reassembler()
        self.runner = TurnRunner(
            store=store,
            metrics=self.metrics,
            running=self,
            sessions=self.sessions,
            on_swap_acked=self._swap_acked,
            on_turn_finished=self._turn_finished,
            replica=self.replica,
            relay=self.relay if self.shared_store else None,
            watched_elsewhere=self.watched_elsewhere,
        )
        self.pool = Pool(
            settings=lambda: self.config.supervisor, spawn=self.spawn_frame, env=self.child_env, owner=self.runner
        )
        self._tg: anyio.abc.TaskGroup | None = None
        self._turn_ended = anyio.Event()
        self._orphans_released = anyio.Event()
        self._awaiting_acks: dict[int, tuple[set[str], float]] = {}
        self._all_acked = anyio.Event()  # set when the newest fan-out's children have all acked

    # ------------------------------------------------------------------ lifecycle

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        """Start the pool and, in the background, resume interrupted turns. Returns at once.

        No idle session is read: a session is loaded on its next message. Interrupted turns (their
        input stored, their results not) re-run, at most ``RESUME_CONCURRENCY`` at a time, while new
        work is served.
        """
        self._tg = tg
        await tg.start(self.pool.run)
        self.runner.attach(self.pool, tg)
        await self._beat()
        tg.start_soon(self._heartbeat)
        if self.shared_store:  # other replicas may be running pending turns: take only the orphaned ones
            tg.start_soon(self.relay.run)
            tg.start_soon(self._failover_scan)
            tg.start_soon(self._listen)
        else:
            tg.start_soon(self._resume_interrupted)

    async def _heartbeat(self) -> None:
        """Every ``lease / 3``: renew this replica's leases and record it in the registry."""
        while True:
            await anyio.sleep(heartbeat_interval(self.lease_time))
            if self.shared_store:
                await self._renew()
                await self._announce_watches()
            await self._beat()

    def watched_elsewhere(self, session_id: str) -> bool:
        """Whether another live replica has subscribers for the session (its events are relayed there)."""
        return self.shared_store and self.watchers.watched(session_id, time.monotonic())

    async def _announce_watches(self) -> None:
        """Tell the other replicas, again, which sessions have subscribers here (in the store, for
        the replica that claims one next, and notified, for those running one now); forget
        theirs that expired. Nothing to tell, nothing written: this replica's rows went when its
        last subscribers of each session did (and expired rows are ignored by readers)."""
        self.watchers.prune(time.monotonic())
        watched = [runtime.id for runtime in self.sessions.values() if runtime.watched]
        if not watched:
            return
        await self._store_quietly(self.store.watch(self.replica, watched, self.lease_time))
        for payload in encode_watch(self.replica, True, watched):
            self.relay.send(WATCHES, payload)

    def _note_watchers(self, lease: Lease) -> None:
        """The replicas watching a session this replica just claimed: its turn's events go there."""
        for replica in lease.watchers:
            self.watchers.note(replica, [lease.session], time.monotonic())

    async def _renew(self) -> None:
        """Extend every lease this replica holds; a session missing from the answer was taken over."""
        before = {r.id: (r.lease, r.pending) for r in self.sessions.values() if r.lease is not None}
        try:
            held = await self.store.renew(self.replica, self.lease_time)
        except StoreError as exc:
            log.warning(events.LOG_REPLICA_RENEW_FAILED, replica=self.replica, error=str(exc))
            return
        for session_id, (asked, pending) in before.items():
            runtime = self.sessions.get(session_id)
            if runtime is None or asked is None:
                continue
            renewed = held.get(session_id)
            same_turn = pending is not None and runtime.pending is pending
            verdict = judge_renewal(asked, runtime.lease, renewed, same_turn=same_turn)
            if verdict is RenewVerdict.RENEWED and renewed is not None:
                runtime.lease = renewed
            elif verdict is RenewVerdict.LOST:
                await self.runner.lease_lost(runtime, "the heartbeat found the lease held by another replica")

    async def _beat(self) -> None:
        try:
            row = await self.store.beat(self.replica, generation=self.generation, sessions=self._owned_sessions())
        except StoreError as exc:
            log.warning(events.LOG_REPLICA_BEAT_FAILED, replica=self.replica, error=str(exc))
            return
        if self._beat_seen is None:
            self._beat_seen = row.seen_at
        elif self.shared_store:
            await self._report_twins()

    async def _report_twins(self) -> None:
        """Say, once per process, that another live process bears this replica's id: one that beat
        after this one's first beat cannot be the dead process this one replaced (one that started
        after this one is refused by ``find_live_twin``, but may have beaten before it exited)."""
        assert self._beat_seen is not None
        try:
            rows = await self.store.live_replicas(self.lease_time)
        except StoreError:
            return  # the next beat looks again
        for rival, seen_at in rivals(rows, self.replica).items():
            if seen_at > self._beat_seen and rival not in self._twins_reported:
                self._twins_reported.add(rival)
                log.error(events.LOG_REPLICA_ID_IN_USE, replica=self.replica, other=rival)

    async def find_live_twin(self) -> str | None:
        """Another live process that bears this replica's id (a shared store), else None — asked at
        start, before serving. A registry row of the id that beat within a lease is either the
        process this one replaces (dead: it never beats again, and once its last beat is a lease
        old it holds no lease either) or a twin (it beats every ``lease / 3``): watched until one
        or the other is plain, at most a lease."""
        if not self.shared_store:
            return None
        # This process's row first, and a beat on every look: of two processes starting at once
        # with one id, each sees the other — whichever writes first is there when the other reads
        # — and sees it beat again; both are refused rather than both served.
        await self._start_beat()
        before = rivals(await self.store.live_replicas(self.lease_time), self.replica)
        if not before:
            return None
        log.info(events.LOG_REPLICA_RIVAL, replica=self.replica, rivals=sorted(before))
        while True:
            await anyio.sleep(heartbeat_interval(self.lease_time) / 4)
            await self._start_beat()
            rows = await self.store.live_replicas(self.lease_time)
            twin = live_twin(before, rows, self.replica)
            if twin is not None or not rivals(rows, self.replica):
                return twin

    async def _start_beat(self) -> None:
        """A beat before serving (``find_live_twin``): StoreError raises, the start fails."""
        row = await self.store.beat(self.replica, generation=self.generation, sessions=0)
        if self._beat_seen is None:
            self._beat_seen = row.seen_at

    def _owned_sessions(self) -> int:
        """How many sessions this replica owns: those it holds a lease on (a shared store), else
        the hot ones (SQLite: this daemon owns every session; the hot ones are those it acts for now)."""
        if self.shared_store:
            return sum(1 for r in self.sessions.values() if r.lease is not None and r.pending is not None)
        return len(self.sessions)

    async def _claim(self, runtime: SessionRuntime, turn: str) -> Lease | None:
        """Claim the session's lease before running its turn; None while another replica holds it,
        or once the turn is no longer pending (another replica's failover scan took it after its
        ``begin_turn``, and may have run it to its end already: it must not run twice).

        A session that another replica held since this one last did is reloaded from the store:
        the copy loaded on a child here (and the runtime's assistant and model) may be stale.
        """
        try:
            lease = await self.store.claim(runtime.id, self.replica, self.lease_time, turn=turn)
        except StoreError as exc:
            log.warning(events.LOG_SESSION_CLAIM_FAILED, session=runtime.id, error=str(exc))
            return None
        if lease is not None:
            self._note_watchers(lease)
            await self._take(runtime, lease)
        return lease

    async def _take(self, runtime: SessionRuntime, lease: Lease) -> None:
        """Adopt ``lease`` for ``runtime``; refresh what may be stale if another replica held it since."""
        if not loaded_copy_is_current(runtime.last_token, lease.token):
            runtime.child = None
            await self.pool.unload(runtime.id)
            try:
                stored = await self.store.session_summary(runtime.id)
            except StoreError as exc:  # the transcript is reloaded anyway; the row is read next time
                log.warning(events.LOG_SESSION_CLAIM_FAILED, session=runtime.id, error=str(exc))
                stored = None
            if stored is not None:
                runtime.assistant = stored.assistant
                runtime.model = self.model_of(stored.assistant, stored.model)
                runtime.generation = self.generation
        runtime.lease, runtime.last_token = lease, lease.token

    async def _failover_scan(self) -> None:
        """Every ``lease / 2`` (the first at once): claim orphaned sessions and re-run their turns.

        An orphaned session has a pending turn and no live lease: its replica died (kill -9),
        stopped (a drain released it) or was partitioned past its lease. The journal keeps a tool
        that had run from running again.
        """
        while True:
            if not self.draining:
                try:
                    claimed = await self.store.claim_orphaned(self.replica, self.lease_time)
                except StoreError as exc:
                    log.warning(events.LOG_REPLICA_SCAN_FAILED, replica=self.replica, error=str(exc))
                    claimed = []
                for lease in claimed:
                    await self._adopt_orphan(lease)
            # A release that left a pending turn (another replica's drain) wakes the scan early.
            with anyio.move_on_after(scan_interval(self.lease_time)):
                await self._orphans_released.wait()
            self._orphans_released = anyio.Event()

    async def _listen(self) -> None:
        """Act on what other replicas notify: orphans to scan for, turns that ended, cancels."""
        while True:
            note = await self.store.next_notification(scan_interval(self.lease_time))
            gap = self.store.take_listen_gap()
            if gap is not None:
                try:
                    await self._catch_up(gap)
                except Exception:  # best effort, like the notifications it stands in for
                    log.exception(events.LOG_REPLICA_CATCH_UP_FAILED, replica=self.replica)
            if note is None:
                continue
            channel, payload = note
            try:
                await self._on_notification(channel, payload)
            except Exception:  # a notification must never take the listener down
                log.exception(events.LOG_REPLICA_NOTIFICATION_FAILED, channel=channel)

    async def _on_notification(self, channel: str, payload: str) -> None:
        if channel == EVENTS:  # payloads of their own format (agentd.supervisor.relay)
            self._relayed_event(payload)
            return
        if channel == WATCHES:
            await self._watch_notice(payload)
            return
        fields = payload.split()
        if channel == ORPHANS:
            self._orphans_released.set()
        elif channel == TURNS and len(fields) == 3 and fields[2] != self.replica:
            await self._turn_ended_elsewhere(fields[0], fields[1])
        elif channel == CLOSES and len(fields) == 1:
            await self._closed_elsewhere(fields[0])
        elif channel == CANCELS and len(fields) == 2:
            runtime = self.sessions.get(fields[0])
            if runtime is not None and runtime.pending is not None and runtime.pending.id == fields[1]:
                await self._cancel_here(runtime)

    async def _catch_up(self, since: float) -> None:
        """Listening again after a gap that began at ``since``: act on what was notified meanwhile
        and is kept in the store — turns that ended (their ``turn.done`` to subscribers here),
        cancels asked of turns running here, sessions closed."""
        log.warning(events.LOG_REPLICA_LISTEN_GAP, replica=self.replica, since=since)
        # Only what a missed notice would change: streams here, and turns running here (a loaded,
        # idle copy of a session closed elsewhere is refused by the store when it is used).
        for runtime in [r for r in self.sessions.values() if r.pending is not None or r.watched]:
            try:
                stored = await self.store.session_summary(runtime.id)
                if stored is None or stored.state == "closed":
                    await self._closed_elsewhere(runtime.id)
                    continue
                turn = runtime.pending
                if turn is not None:
                    started = await self.store.pending_turn(runtime.id)
                    if started is not None and started.id == turn.id and started.cancel_requested:
                        await self._cancel_here(runtime)
                elif runtime.watched:
                    await self._publish_ended_since(runtime, since)
            except StoreError as exc:
                log.warning(
                    events.LOG_REPLICA_CATCH_UP_FAILED, replica=self.replica, session=runtime.id, error=str(exc)
                )

    async def _publish_ended_since(self, runtime: SessionRuntime, since: float) -> None:
        """Publish the ``turn.done`` of every turn of the session that ended since ``since`` (by the
        clocks of the replicas that ran them, give or take ``CLOCK_SLACK``) and was not published here."""
        stored = await self.store.load_session(runtime.id)
        if stored is None:
            return
        for record in stored.turns:
            if not isinstance(record, TurnRecord) or record.ended_at < since - CLOCK_SLACK:
                continue
            runtime.publish_turn_done(
                record, _added_entries(e for e in stored.transcript if e.message.turn == record.id)
            )

    def _relayed_event(self, payload: str) -> None:
        """A progress event of a turn another replica runs: published to this replica's subscribers."""
        if payload.startswith(f"{self.replica} "):  # its own, echoed back: not even decoded
            return
        missed = self._reassembler.missed
        event = self._reassembler.feed(payload)
        if self._reassembler.missed > missed:
            log.warning(
                events.LOG_REPLICA_EVENTS_MISSED, replica=self.replica, missed=self._reassembler.missed - missed
            )
        if event is None or event.origin == self.replica:
            return
        runtime = self.sessions.get(event.session)
        if runtime is None or not runtime.watched:
            return
        turn = runtime.pending
        if turn is not None and turn.id == event.turn and turn.child is not None:
            return  # this replica runs that turn itself now (it adopted it): its own events stand
        runtime.publish(event.name, event.turn, event.data)

    async def _watch_notice(self, payload: str) -> None:
        """Another replica has (or no longer has) subscribers for some sessions: relay their events
        there. A turn already running here streams its events from now on."""
        notice = decode_watch(payload)
        if notice is None or notice.replica == self.replica:
            return
        if not notice.watching:
            self.watchers.forget(notice.replica, notice.sessions)
            return
        for session_id in self.watchers.note(notice.replica, notice.sessions, time.monotonic()):
            runtime = self.sessions.get(session_id)
            turn = runtime.pending if runtime is not None else None
            if runtime is not None and turn is not None and turn.child is not None and not runtime.watched:
                await turn.child.send(Watch(session=runtime.id))
                log.info(
                    events.LOG_SESSION_RELAYED,
                    session=runtime.id,
                    turn=turn.id,
                    to=replica_name(notice.replica),
                    holder=notice.replica,
                )

    async def _turn_ended_elsewhere(self, session_id: str, turn_id: str) -> None:
        """Another replica ended a turn of a session watched here: its subscribers get ``turn.done``."""
        runtime = self.sessions.get(session_id)
        if runtime is None or not runtime.watched or runtime.pending is not None:
            return
        found = await self._ended_turn(session_id, turn_id)
        if found is not None:
            runtime.publish_turn_done(*found)

    async def _adopt_orphan(self, lease: Lease) -> None:
        """Run the pending turn of a session just claimed by the failover scan."""
        try:
            stored = await self.store.session_summary(lease.session)
            started = await self.store.pending_turn(lease.session)
        except StoreError as exc:
            log.warning(events.LOG_SESSION_ADOPT_FAILED, session=lease.session, error=str(exc))
            return
        runtime = self.sessions.get(lease.session)
        if stored is None or started is None or (runtime is not None and runtime.pending is not None):
            await self._store_quietly(self.store.release(lease))  # ended meanwhile: nothing to run
            return
        runtime = self.sessions.setdefault(stored.id, self._runtime_from_row(stored))
        self._note_watchers(lease)
        await self._take(runtime, lease)
        log.info(events.LOG_SESSION_ADOPTED, session=stored.id, turn=started.id, token=lease.token)
        queued = await self._register_interrupted(runtime, stored, started)
        if queued is not None:
            self.runner.start(runtime, queued)

    async def _register_interrupted(
        self, runtime: SessionRuntime, stored: StoredSession, started: StartedTurn
    ) -> PendingTurn | None:
        """Register an interrupted turn on its runtime; the turn to drive, or None if it ended now."""
        # A restart (or failover) is not the turn's fault: its deadline starts again now.
        turn = PendingTurn(
            id=started.id, message=started.message, started_at=started.started_at, budget_start=time.time()
        )
        runtime.pending = turn
        if stored.state == "failed":  # it failed before the restart: its turn ends as it would have
            await self.runner.end_without_result(runtime, turn, TurnStatus.FAILED, "the session had failed")
            return None
        if started.cancel_requested:  # asked on a replica that did not run it (RFC 0009 §7)
            await self.runner.end_without_result(runtime, turn, TurnStatus.CANCELLED, "cancelled before it resumed")
            return None
        runtime.state = "running"
        return turn

    async def _store_quietly(self, call: Awaitable[object]) -> None:
        try:
            await call
        except StoreError as exc:
            log.warning(events.LOG_SUPERVISOR_STORE_FAILED, error=str(exc))

    async def _resume_interrupted(self) -> None:
        try:
            interrupted = await self.store.interrupted_turns()
        except StoreError as exc:
            log.error(events.LOG_SUPERVISOR_RESUME_FAILED, error=str(exc))
            return
        log.info(events.LOG_SUPERVISOR_RESTORED, pending=len(interrupted))
        limiter = anyio.CapacityLimiter(RESUME_CONCURRENCY)
        # Every interrupted turn is registered at once — so a cancel, a close or a new message sees
        # it while it waits for its turn to resume — and driven at most RESUME_CONCURRENCY at a time.
        queued: list[tuple[SessionRuntime, PendingTurn]] = []
        for stored, started in interrupted:
            runtime = self.sessions.setdefault(stored.id, self._runtime_from_row(stored))
            if runtime.pending is not None:
                continue
            turn = await self._register_interrupted(runtime, stored, started)
            if turn is not None:
                queued.append((runtime, turn))

        async def resume(runtime: SessionRuntime, turn: PendingTurn) -> None:
            async with limiter:
                if not turn.done.is_set() and not runtime.closing:
                    await self.runner.drive(runtime, turn)

        async with anyio.create_task_group() as tg:
            for runtime, turn in queued:
                tg.start_soon(resume, runtime, turn)

    async def drain(self, grace: float) -> bool:
        """Stop accepting turns; wait up to ``grace`` for in-flight turns. True when all ended."""
        self.draining = True
        log.info(events.LOG_SUPERVISOR_DRAINING, grace=grace, running=self._running_turns())
        with anyio.move_on_after(grace):
            while self._running_turns():
                self._turn_ended = anyio.Event()
                await self._turn_ended.wait()
        return self._running_turns() == 0

    async def stop(self) -> None:
        """Stop every child (kill ladder, no grace: the drain is over) and close every subscription."""
        self.stopping = True
        self.runner.stop()
        await self.pool.stop(grace=0)
        for runtime in list(self.sessions.values()):
            runtime.close_subscribers()
        await self._release_all()

    async def _release_all(self) -> None:
        """A stopping replica gives up its leases (turns cut by the stop): another replica's scan
        claims them at once instead of after the lease."""
        with anyio.CancelScope(shield=True):
            for runtime in list(self.sessions.values()):
                lease, runtime.lease = runtime.lease, None
                if lease is not None:
                    await self._store_quietly(self.store.release(lease))
                    log.info(events.LOG_SESSION_RELEASED, session=runtime.id, token=lease.token)

    def _running_turns(self) -> int:
        return sum(1 for r in self.sessions.values() if r.pending is not None and r.pending.cut is None)

    def _turn_finished(self) -> None:
        self._turn_ended.set()

    # ------------------------------------------------------------------ what children are given

    def child_env(self) -> dict[str, str]:
        """The environment a child starts with: an allowlist, never the daemon's whole environment."""
        env = child_environment(os.environ, self.config)
        env["AGENTD_LOG_LEVEL"] = self.options.log_level
        return env

    def spawn_frame(self, child_id: str) -> Spawn:
        """The Spawn for a new child: always the newest generation."""
        return Spawn(
            child_id=child_id,
            generation=self.generation,
            policy=self.policy.policy,
            config=self.config,
            secrets=ChildEnv(values=mcp_secrets(os.environ, self.config)),
        )

    def swap_frame(self) -> SwapIntel:
        """The SwapIntel describing the running generation (its whole config included)."""
        return SwapIntel(
            generation=self.generation,
            policy=self.policy.policy,
            intelligence=intelligence_map(self.config),
            limits=self.config.limits,
            config=self.config,
            env=ChildEnv(values=passed_through(os.environ, self.config)),
            secrets=ChildEnv(values=mcp_secrets(os.environ, self.config)),
        )

    def model_of(self, assistant: str, fallback: str) -> str:
        """The running generation's model for ``assistant`` (``fallback`` if the config no longer has it)."""
        try:
            return effective_intelligence(self.config, assistant).model
        except KeyError:
            return fallback

    def _swap_acked(self, child: Child, generation: int) -> None:
        log.debug(events.LOG_SWAP_ACKED, child=child.id, generation=generation)
        waiting = self._awaiting_acks.get(generation)
        if waiting is None:
            return
        children, started = waiting
        children.discard(child.id)
        if not children:
            del self._awaiting_acks[generation]
            self._all_acked.set()
            log.info(events.LOG_SWAP_FANOUT_ACKED, generation=generation, seconds=round(time.monotonic() - started, 4))

    # ------------------------------------------------------------------ reload

    async def reload(self) -> ReloadResult:
        """Reload the config file (serialized; concurrent requests coalesce into one more reload)."""
        try:
            return await self.reloads.request()
        except Exception as exc:  # a reload bug must never take the daemon down; the old config stays
            log.exception(events.LOG_CONFIG_RELOAD, applied=False)
            return ReloadResult(
                generation=self.generation,
                applied=False,
                errors=[ConfigIssue("", f"internal error: {type(exc).__name__}: {exc}")],
            )

    async def _reload(self) -> ReloadResult:
        path = self.options.config_path
        try:
            # Abandoned when shutdown cancels the reload; shutdown also kills its tool check.
            new = await anyio.to_thread.run_sync(load_daemon_config, path, abandon_on_cancel=True)
            register_secrets(os.environ, new)  # its secrets are scrubbed from here on, applied or not
            policy = resolve_swap_policy(self.options.model_swap_flag, os.environ, new.model_swap)
        except ConfigError as exc:
            result = ReloadResult(generation=self.generation, applied=False, errors=exc.issues)
            self.metrics.reloads.labels(result="rejected").inc()
            log.warning(
                events.LOG_CONFIG_RELOAD, applied=False, generation=self.generation, errors=[str(i) for i in exc.issues]
            )
            return result
        orphaned = await self.orphaned_sessions(new)
        if orphaned:
            self.metrics.reloads.labels(result="rejected").inc()
            log.warning(
                events.LOG_CONFIG_RELOAD, applied=False, generation=self.generation, errors=[str(i) for i in orphaned]
            )
            return ReloadResult(generation=self.generation, applied=False, errors=orphaned)
        plan = plan_reload(self.config, new)
        policy_changed = policy != self.policy
        if not plan.changed and not policy_changed:
            result = ReloadResult(generation=self.generation, applied=True, restart_required=plan.restart_required)
            self.metrics.reloads.labels(result="unchanged").inc()
            log.info(
                events.LOG_CONFIG_RELOAD,
                applied=True,
                generation=self.generation,
                changed=[],
                restart_required=plan.restart_required,
            )
            return result
        old_intelligence = intelligence_map(self.config)
        self.config, self.policy = plan.config, policy
        self.generation += 1
        self.metrics.generation.set(self.generation)
        self.pool.changed()  # the pool keys may have changed
        swapped, swapped_total = await self._fan_out(plan.intelligence_changed)
        self._swap_unloaded(old_intelligence)
        changed = plan.changed + (
            ["model_swap (effective)"] if policy_changed and "model_swap" not in plan.changed else []
        )
        result = ReloadResult(
            generation=self.generation,
            applied=True,
            changed=changed,
            restart_required=plan.restart_required,
            swapped_sessions=swapped,
            swapped_total=swapped_total,
        )
        self.metrics.reloads.labels(result="applied").inc()
        log.info(
            events.LOG_CONFIG_RELOAD,
            applied=True,
            generation=self.generation,
            changed=changed,
            restart_required=plan.restart_required,
            swapped_sessions=swapped_total,
            policy=policy.policy.value,
            policy_source=policy.source,
        )
        return result

    async def orphaned_sessions(
        self, new: Config, *, by_assistant: Mapping[str, int] | None = None
    ) -> list[ConfigIssue]:
        """A new config must keep every assistant an open session is on (closing them is the operator's call).

        ``by_assistant``: the open sessions by assistant, read already (at start-up, while the
        store was waited for); else read now.
        """
        names = {a.name for a in new.assistants}
        if by_assistant is None:
            by_assistant = await self.store.open_sessions_by_assistant()
        on = {name: count for name, count in by_assistant.items() if name not in names}
        for runtime in self.sessions.values():  # a transfer in flight may have moved a session already
            if runtime.assistant not in names and not runtime.closing:
                on.setdefault(runtime.assistant, 1)
        issues = [
            ConfigIssue(
                "assistants",
                f"assistant {name!r} was removed but {count} open session(s) are on it; keep it until they are closed",
            )
            for name, count in sorted(on.items())
        ]
        # A turn in flight may transfer its session to any destination of its assistant: the
        # supervisor learns of a transfer only when the turn commits, so those must stay too.
        targets: dict[str, str] = {}
        for runtime in self.sessions.values():
            if runtime.pending is None or runtime.closing:
                continue
            try:
                transfers = self.config.assistant(runtime.assistant).transfers
            except KeyError:
                continue
            for transfer in transfers:
                if transfer.to not in names and transfer.to not in on:
                    targets.setdefault(transfer.to, runtime.id)
        issues += [
            ConfigIssue(
                "assistants",
                f"assistant {name!r} was removed but a turn in flight on session {session} may transfer to it; "
                "reload again once it has ended",
            )
            for name, session in sorted(targets.items())
        ]
        return issues

    def _swap_unloaded(self, old_intelligence: dict[str, Intelligence]) -> None:
        """Hot sessions that are not loaded (watched, or waiting for a child) take the swap now.

        They are idle, so their boundary is now (RFC 0002 §3); no child reports it for them, so the
        supervisor does: the same ``swap.applied`` event a child would send. A session that waits
        for a child with its turn accepted is loaded on the newest generation, so it swaps too.
        """
        new_intelligence = intelligence_map(self.config)
        for runtime in self.sessions.values():
            if runtime.child is not None or runtime.closing:
                continue
            runtime.generation = self.generation
            old, new = old_intelligence.get(runtime.assistant), new_intelligence.get(runtime.assistant)
            kind = classify_swap(old, new) if old is not None and new is not None else None
            if kind is None or new is None or old is None:
                continue
            runtime.model = new.model
            self.metrics.swaps.labels(kind=kind.value).inc()
            runtime.publish(
                events.SWAP_APPLIED,
                None,
                {
                    "generation": self.generation,
                    "kind": kind.value,
                    "model_from": old.model,
                    "model_to": new.model,
                    "policy": self.policy.policy.value,
                },
            )

    async def _fan_out(self, intelligence_changed: list[str]) -> tuple[list[str], int]:
        """Send one SwapIntel per child; return (a bounded list of, and the number of) swapped sessions.

        Every child gets the frame — it carries the whole generation, so a later turn, a later
        transfer and a session loaded later all use it — and each child swaps exactly the sessions
        whose current assistant's intelligence changed. A session not loaded anywhere takes the
        swap at once, without a process: it is opened on the newest generation when it is next
        loaded. The cost does not depend on how many sessions are open.
        """
        frame = self.swap_frame()
        children = [c for c in self.pool.children.values() if c.usable]
        # Older generations still waiting for acks are superseded (their children may be gone).
        self._awaiting_acks = {frame.generation: ({c.id for c in children}, time.monotonic())}
        self._all_acked = anyio.Event()
        if not children:
            self._all_acked.set()

        sent: list[Child] = []

        async def send(child: Child) -> None:
            if await child.send(frame):
                sent.append(child)

        async with anyio.create_task_group() as tg:  # all at once: one slow child delays no other
            for child in children:
                tg.start_soon(send, child)
        for child in sent:  # logged after every frame is on its way: no log line delays a send
            log.info(
                events.LOG_SWAP_SENT,
                child=child.id,
                pid=child.pid,
                generation=frame.generation,
                sessions=len(child.loaded),
                policy=frame.policy.value,
            )
        # The bookkeeping below walks every hot session: it waits until the children have acked
        # (or a moment has passed), so it never sits between a child's ack and its reading.
        with anyio.move_on_after(ACK_WAIT):
            await self._all_acked.wait()
        if not intelligence_changed:
            return [], 0
        hot = sessions_to_swap(
            {r.id: r.assistant for r in self.sessions.values() if not r.closing}, intelligence_changed
        )
        try:
            by_assistant = await self.store.open_sessions_by_assistant()
            total = sum(by_assistant.get(name, 0) for name in intelligence_changed)
        except StoreError:
            total = len(hot)
        return hot[:SWAPPED_LIST_MAX], max(total, len(hot))

    # ------------------------------------------------------------------ API operations

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
        counts = await self._store_or_503(self.store.session_counts())
        sessions = SessionCounts(
            open=sum(n for state, n in counts.items() if state != "closed"),
            loaded=sum(len(c.loaded) for c in self.pool.children.values()),
            running=sum(1 for r in self.sessions.values() if r.pending is not None),
            failed=counts.get("failed", 0),
        )
        return StatusView(
            pid=os.getpid(),
            version=__version__,
            generation=self.generation,
            model_swap=PolicyView(policy=self.policy.policy.value, source=self.policy.source),
            config_path=str(self.options.config_path) if self.options.config_path else None,
            children=children,
            sessions=sessions,
            draining=self.draining,
            replica=self.replica_name,
            replicas=await self._live_replicas(),
        )

    async def _live_replicas(self) -> list[ReplicaView]:
        rows = replica_views(await self._store_or_503(self.store.live_replicas(registry_max_age(self.lease_time))))
        return [ReplicaView(id=r.id, generation=r.generation, sessions=r.sessions, seen_at=r.seen_at) for r in rows]

    async def metrics_text(self) -> bytes:
        """Prometheus exposition, with the gauges read fresh."""
        counts = await self._store_or_503(self.store.session_counts())
        running = sum(1 for r in self.sessions.values() if r.pending is not None)
        self.metrics.sessions.labels(state="idle").set(
            max(0, counts.get("idle", 0) + counts.get("running", 0) - running)
        )
        self.metrics.sessions.labels(state="running").set(running)
        self.metrics.sessions.labels(state="failed").set(counts.get("failed", 0))
        self.metrics.sessions.labels(state="loaded").set(sum(len(c.loaded) for c in self.pool.children.values()))
        self.metrics.children.set(sum(1 for c in self.pool.children.values() if c.pid is not None))
        return self.metrics.render()

    def ready(self) -> list[str]:
        """Reasons the daemon is not ready (empty = ready)."""
        reasons = ["draining"] if self.draining else []
        if self.store.failure is not None:
            reasons.append(f"store unavailable: {self.store.failure}")
        if self.pool.start_failure is not None:
            reasons.append(f"no child can start: {self.pool.start_failure}")
        down = sorted({r.assistant for r in self.sessions.values() if r.intel_waiting})
        reasons += [f"all endpoints down for assistant {name!r}" for name in down]
        return reasons

    def _refuse_when_draining(self) -> None:
        if self.draining:
            raise ApiError(503, "draining", "agentd is shutting down and accepts no new work")

    async def create_session(self, assistant_name: str | None) -> SessionView:
        """Open a session on an assistant (the default: the first one); its opener is in the transcript."""
        self._refuse_when_draining()
        config = self.config
        name = assistant_name or config.default_assistant.name
        try:
            assistant = config.assistant(name)
        except KeyError:
            names = ", ".join(a.name for a in config.assistants)
            raise ApiError(400, "unknown_assistant", f"no assistant named {name!r}; assistants: {names}") from None
        model = effective_intelligence(config, name).model
        session_id = _new_id("s")
        history = session_start_history(assistant)
        plan = opener_plan(assistant, history)
        if plan.kind is OpenerKind.FIRST_MESSAGE:
            history.append(opener_message(plan, turn=None, model=model))
        try:
            await self.store.create_session(
                session_id,
                assistant=name,
                generation=self.generation,
                model=model,
                created_at=time.time(),
                transcript=history,
            )
        except StoreUnavailable as exc:
            if not await self._created_after_all(session_id, exc):
                raise _store_error(exc) from None
        except StoreError as exc:
            raise _store_error(exc) from None
        log.info(events.LOG_SESSION_CREATED, session=session_id, assistant=name, model=model)
        if plan.kind is OpenerKind.GENERATED:
            runtime = self.sessions.setdefault(
                session_id, SessionRuntime(session_id, name, "idle", self.generation, model)
            )
            turn = await self._start_turn(runtime, None)
            if turn.elsewhere:
                await self._wait_elsewhere(session_id, turn.id)
            else:
                await turn.done.wait()
        return await self.get_session(session_id)

    async def list_sessions(self, *, limit: int = 100, after: str | None = None) -> list[SessionSummary]:
        """One page of sessions in creation order (newest last), as the supervisor sees them now."""
        try:
            page = await self.store.list_sessions(limit=limit, after=after)
        except UnknownSession as exc:
            raise ApiError(400, "bad_cursor", str(exc)) from None
        except StoreError as exc:
            raise _store_error(exc) from None
        summaries = []
        for stored in page:
            assistant, state, generation, model = self._effective(stored)
            summaries.append(
                SessionSummary(
                    id=stored.id,
                    assistant=assistant,
                    state=state,
                    generation=generation,
                    model=model,
                    turns=stored.turn_count,
                )
            )
        return summaries

    async def get_session(self, session_id: str) -> SessionView:
        """The session with its whole transcript and every turn."""
        stored = await self._store_or_503(self.store.load_session(session_id))
        if stored is None:
            raise ApiError(404, "not_found", f"no session {session_id!r}")
        assistant, state, generation, model = self._effective(stored)
        runtime = self.sessions.get(session_id)
        child = runtime.child if runtime is not None else None
        return SessionView(
            id=stored.id,
            assistant=assistant,
            state=state,
            generation=generation,
            model=model,
            transcript=[entry_from_message(e.seq, e.message) for e in stored.transcript],
            turns=[turn_view(t) for t in stored.turns],
            child=child.pid if child is not None else None,
        )

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
        return stored.assistant, stored.state, self.generation, self.model_of(stored.assistant, stored.model)

    def _runtime_from_row(self, stored: StoredSession) -> SessionRuntime:
        """A hot runtime for a session read from its row: not loaded anywhere, so it has taken every
        swap since the row was written (RFC 0006 §7): it runs the current generation."""
        state: SessionState = "failed" if stored.state == "failed" else "idle"
        model = self.model_of(stored.assistant, stored.model)
        return SessionRuntime(stored.id, stored.assistant, state, self.generation, model)

    def unsubscribed(self, session_id: str) -> None:
        """A subscriber went away: a session nobody needs any more is forgotten (it stays in the store)."""
        runtime = self.sessions.get(session_id)
        if runtime is None:
            return
        if self.shared_store and not runtime.watched and self._tg is not None:
            # The last one here: stop relaying to this replica.
            self._tg.start_soon(self._unwatch, runtime.id)
        self.runner.evict_if_cold(runtime)

    async def _unwatch(self, session_id: str) -> None:
        """No subscriber of the session is left here: other replicas stop relaying its events here."""
        runtime = self.sessions.get(session_id)
        if runtime is not None and runtime.watched:  # subscribed again meanwhile
            return
        for payload in encode_watch(self.replica, False, [session_id]):
            self.relay.send(WATCHES, payload)
        await self._store_quietly(self.store.unwatch(self.replica, [session_id]))

    async def _open_runtime(self, session_id: str) -> SessionRuntime:
        """The hot runtime of an open session, made hot from its row if it was not. 404 if none."""
        runtime = self.sessions.get(session_id)
        if runtime is None:
            stored = await self._store_or_503(self.store.session_summary(session_id))
            if stored is not None and stored.state != "closed":
                runtime = self.sessions.setdefault(session_id, self._runtime_from_row(stored))
        if runtime is None or runtime.closing:
            raise ApiError(404, "not_found", f"no open session {session_id!r}")
        return runtime

    async def send_message(self, session_id: str, body: PostMessage) -> MessageResult | Accepted:
        """Store the user message, deliver it, and (``wait``) return the finished turn."""
        self._refuse_when_draining()
        if not body.content.strip() and not body.images:
            raise ApiError(400, "empty_message", "content must not be empty")
        runtime = await self._open_runtime(session_id)
        if runtime.pending is not None:
            raise ApiError(409, "turn_running", f"session {session_id} is already running turn {runtime.pending.id}")
        if runtime.state == "failed":
            runtime.state = "idle"  # a new message resumes a failed session
            runtime.crashes, runtime.quarantined = (), False
            await self._store_or_503(self.store.update_session(runtime.id, state="idle"))
        turn_id = _new_id("t")
        message = UserMessage(content=body.content, images=tuple(body.images) if body.images else None, turn=turn_id)
        # A waiting client hears nothing before the turn's commit, which syncs its message too.
        turn = await self._start_turn(runtime, message, durable=not body.wait)
        if not body.wait:
            return Accepted(turn_id=turn_id)
        if turn.elsewhere:
            return await self._wait_elsewhere(runtime.id, turn.id)
        await turn.done.wait()
        return self._turn_result(turn)

    async def _start_turn(
        self, runtime: SessionRuntime, message: UserMessage | None, *, durable: bool = True
    ) -> PendingTurn:
        turn = PendingTurn(
            id=message.turn if message and message.turn else _new_id("t"),
            message=message,
            started_at=time.time(),
            fresh=True,
        )
        if runtime.pending is not None:
            raise ApiError(409, "turn_running", f"session {runtime.id} is already running turn {runtime.pending.id}")
        runtime.pending, runtime.state = turn, "running"  # reserve synchronously: a concurrent request gets 409
        # Stored before delivered: the runner only sees the turn once begin_turn has committed its input.
        with anyio.CancelScope(shield=True):
            try:
                await self.store.begin_turn(runtime.id, turn.id, message, turn.started_at, durable=durable)
            except StoreUnavailable as exc:
                if not await self._begun_after_all(runtime, turn, exc):
                    runtime.pending, runtime.state = None, "idle"
                    raise _store_error(exc) from None
            except StoreError as exc:
                runtime.pending, runtime.state = None, "idle"
                raise ApiError(409, "turn_refused", str(exc)) from None
            if self.shared_store and await self._claim(runtime, turn.id) is None:
                # Another replica holds the session (its previous turn is ending, or its failover
                # scan took this one — and may have ended it already): the turn is stored, and the
                # holder or the scan runs it, once.
                runtime.pending, runtime.state, turn.elsewhere = None, "idle", True
                log.info(events.LOG_SESSION_ELSEWHERE, session=runtime.id, turn=turn.id)
                self.runner.evict_if_cold(runtime)
                return turn
        self.runner.start(runtime, turn)
        return turn

    async def _created_after_all(self, session_id: str, failure: StoreUnavailable) -> bool:
        """Whether a ``create_session`` that failed because of the database created it after all
        (its answer lost with the connection while ``COMMIT`` was in flight, like ``begin_turn``
        below): then it is answered as created (``session.create_recovered``) rather than 503, so
        a client does not create a second one. 503 naming the session when the store cannot say."""
        if not self.shared_store:
            return False
        try:
            created = await self.store.session_summary(session_id) is not None
        except StoreError as exc:
            log.warning(events.LOG_SESSION_CREATE_UNKNOWN, session=session_id, error=str(exc))
            raise ApiError(
                503,
                "store_unavailable",
                f"the store failed while creating the session, and may have created it as {session_id}: {failure}",
            ) from None
        if created:
            log.warning(events.LOG_SESSION_CREATE_RECOVERED, session=session_id, error=str(failure))
        return created

    async def _begun_after_all(self, runtime: SessionRuntime, turn: PendingTurn, failure: StoreUnavailable) -> bool:
        """Whether a ``begin_turn`` that failed because of the database stored the turn after all.

        On PostgreSQL the connection can be lost while ``COMMIT`` is in flight, after the server
        committed (RFC 0003 §3): the message is then stored and its turn pending — and would run,
        taken by a failover scan, while the client was told nothing was stored. So the store is
        asked: True when the turn is there (it goes on as accepted, ``turn.begin_recovered``);
        False when it is not (nothing was stored). When the store cannot say either, the client is
        answered 503 naming the turn, which may have been stored (and then runs, once). SQLite,
        in-process, does not lose a commit's answer this way: False at once.
        """
        if not self.shared_store:
            return False
        try:
            pending = await self.store.pending_turn(runtime.id)
        except StoreError as exc:
            runtime.pending, runtime.state = None, "idle"
            log.warning(events.LOG_TURN_BEGIN_UNKNOWN, session=runtime.id, turn=turn.id, error=str(exc))
            raise ApiError(
                503,
                "store_unavailable",
                f"the store failed while storing the message, and may have stored it as turn {turn.id}"
                f" (then it runs, once; GET the session to see): {failure}",
                turn=turn.id,
            ) from None
        if pending is None or pending.id != turn.id:
            return False
        log.warning(events.LOG_TURN_BEGIN_RECOVERED, session=runtime.id, turn=turn.id, error=str(failure))
        return True

    async def _wait_elsewhere(self, session_id: str, turn_id: str) -> MessageResult:
        """``wait`` for a turn another replica runs: poll the store until the turn has ended there."""
        bound = self.config.limits.deadline + 3 * self.lease_time + 10.0
        with anyio.move_on_after(bound):
            while True:
                pending = await self._store_or_503(self.store.pending_turn(session_id))
                if pending is None or pending.id != turn_id:
                    break
                await anyio.sleep(ELSEWHERE_POLL)
        found = await self._store_or_503(self._ended_turn(session_id, turn_id))
        if found is None:
            raise ApiError(
                503, "turn_elsewhere", f"turn {turn_id} runs on another replica and has not ended yet", turn=turn_id
            )
        record, entries = found
        return MessageResult(turn=turn_view(record), messages=entries)

    async def _ended_turn(self, session_id: str, turn_id: str) -> tuple[TurnRecord, list[Entry]] | None:
        """A turn that ended, as committed (its record and the entries it added), or None if it has not."""
        found = await self.store.ended_turn(session_id, turn_id)
        if found is None:
            return None
        record, stored = found
        return record, _added_entries(stored)

    def _turn_result(self, turn: PendingTurn) -> MessageResult:
        if turn.record is None:  # stopped without ending: the daemon is shutting down
            status = 507 if turn.cut_code == "store_full" else 503
            raise ApiError(status, turn.cut_code, f"turn {turn.id}: {turn.cut or 'not finished'}", turn=turn.id)
        # The record as stored, so this answer and GET /v1/sessions show the same turn (same started_at).
        return MessageResult(turn=turn_view(turn.record), messages=turn.entries)

    async def subscribe(self, session_id: str) -> MemoryObjectReceiveStream[EventItem]:
        """A stream of the session's events (it stays hot while subscribed)."""
        runtime = await self._open_runtime(session_id)
        was_watched = runtime.watched
        stream = runtime.subscribe()
        turn = runtime.pending
        if not was_watched and self.shared_store:
            # A turn another replica claims from now on is relayed here (the store says so at its
            # claim); one running now, from when the notice reaches its replica.
            await self._store_quietly(self.store.watch(self.replica, [runtime.id], self.lease_time))
            for payload in encode_watch(self.replica, True, [runtime.id]):
                self.relay.send(WATCHES, payload)
        if not was_watched and turn is not None and turn.child is not None and not self.watched_elsewhere(runtime.id):
            await turn.child.send(Watch(session=runtime.id))  # the turn in flight streams from now on
        return stream

    async def cancel(self, session_id: str) -> str:
        """Ask the child running the session's turn to cancel it; the turn then ends ``cancelled``."""
        runtime = await self._open_runtime(session_id)
        turn = runtime.pending
        if turn is None and self.shared_store:  # it may run on another replica: ask it to cancel
            elsewhere = await self._cancel_elsewhere(session_id)
            if elsewhere is not None:
                return elsewhere
        if turn is None:
            raise ApiError(409, "no_turn", f"session {session_id} has no turn running")
        return await self._cancel_here(runtime)

    async def _cancel_elsewhere(self, session_id: str) -> str | None:
        """Ask whichever replica runs the session's pending turn to cancel it; the turn's id, or
        None when no turn is pending. Kept in the store, so a holder that died meanwhile cannot
        lose it: whoever adopts the turn ends it cancelled; a live holder hears of it at once."""
        started = await self._store_or_503(self.store.pending_turn(session_id))
        if started is None:
            return None
        await self._store_or_503(self.store.request_cancel(session_id, started.id))
        await self.store.notify(CANCELS, f"{session_id} {started.id}")
        return started.id

    async def _closed_elsewhere(self, session_id: str) -> None:
        """Another replica closed the session: end its turn here (cancelled), unload it, end its streams."""
        runtime = self.sessions.get(session_id)
        if runtime is None or runtime.closing:
            return
        runtime.closing = True
        turn = runtime.pending
        if turn is not None:
            await self._cancel_here(runtime)
            assert self._tg is not None
            self._tg.start_soon(self._forget_closed, runtime, turn)
        else:
            await self._forget_closed(runtime, None)

    async def _forget_closed(self, runtime: SessionRuntime, turn: PendingTurn | None) -> None:
        if turn is not None:
            await turn.done.wait()
        await self.pool.unload(runtime.id)
        runtime.child, runtime.state = None, "closed"
        runtime.close_subscribers()
        if self.sessions.get(runtime.id) is runtime:
            del self.sessions[runtime.id]
        log.info(events.LOG_SESSION_CLOSED, session=runtime.id, elsewhere=True)

    async def _cancel_here(self, runtime: SessionRuntime) -> str:
        """Cancel the turn this replica runs for ``runtime``."""
        turn = runtime.pending
        assert turn is not None
        turn.cancel_requested = True
        if turn.child is not None:
            await turn.child.send(Cancel(session=runtime.id, turn=turn.id))
        else:  # not on a child yet (waiting for one, or being loaded): it ends now and never starts
            await self.runner.end_without_result(runtime, turn, TurnStatus.CANCELLED, "cancelled before it started")
        return turn.id

    async def close_session(self, session_id: str) -> SessionSummary:
        """Close the session: unload it, end its turn ``cancelled``; the transcript is kept."""
        runtime = await self._open_runtime(session_id)
        runtime.closing = True
        await self.pool.unload(session_id)  # its child gets Close (which cancels a turn in flight there)
        if runtime.pending is not None:
            await self.runner.end_without_result(
                runtime, runtime.pending, TurnStatus.CANCELLED, "the session was closed"
            )
        elif self.shared_store:  # a turn another replica runs is cancelled there (the session stays closed)
            try:
                await self._cancel_elsewhere(session_id)
            except ApiError:
                runtime.closing = False
                raise
        runtime.child = None
        try:
            await self.store.update_session(session_id, state="closed")
        except StoreError as exc:  # not closed: the session stays open and usable (its turn was cancelled)
            runtime.closing = False
            if runtime.state != "failed":
                runtime.state = "idle"
            error = _store_error(exc)
            raise ApiError(
                error.status, error.code, f"session {session_id} was not closed (the store failed): {exc}"
            ) from None
        runtime.state = "closed"
        runtime.close_subscribers()
        self.sessions.pop(session_id, None)
        if self.shared_store:  # other replicas drop what they hold of it (a loaded copy, streams)
            await self.store.notify(CLOSES, session_id)
        log.info(events.LOG_SESSION_CLOSED, session=session_id)
        return SessionSummary(
            id=session_id,
            assistant=runtime.assistant,
            state="closed",
            generation=runtime.generation,
            model=runtime.model,
        )

    async def _store_or_503(self, call: Awaitable[T]) -> T:
        """A store call an API request needs; a store that fails answers 503 naming what failed."""
        try:
            return await call
        except StoreError as exc:
            raise _store_error(exc) from None


def _added_entries(stored: Iterable[StoredEntry]) -> list[Entry]:
    """The entries a turn added, as the API shows them: its stored entries but its input."""
    return [entry_from_message(e.seq, e.message) for e in stored if not isinstance(e.message, UserMessage)]


def _store_error(exc: StoreError) -> ApiError:
    """A store failure as the API answers it: 507 when the disk is full, else 503; nothing was stored."""
    if isinstance(exc, StoreUnavailable) and exc.full:
        return ApiError(507, "store_full", f"the store is full; nothing was stored: {exc}")
    return ApiError(503, "store_unavailable", f"the store cannot be written; nothing was stored: {exc}")
