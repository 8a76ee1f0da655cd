"""This daemon's membership among replicas (RFC 0009 §7): chosen once, at start, by the store.

On SQLite one daemon owns the state dir (``LocalMembership``): it beats in the registry, resumes
the turns a restart interrupted, and never needs a lease. On PostgreSQL several replicas share
the database (``ReplicatedMembership``): this one claims a session's lease before running its
turn, renews its leases on a heartbeat, refuses to start as a live twin, takes orphaned sessions
over (the failover scan), listens to what other replicas notify (ended turns, cancels, closes,
watches, relayed progress events), catches up after a gap in listening, and relays events to
replicas whose clients watch a session running here.

The API's operations (``agentd.supervisor.operations``) and the turns (``agentd.supervisor.turns``)
ask the ``Membership`` protocol and never which store it is. What membership does to sessions —
cancel a turn, close a session closed elsewhere, resume an adopted turn — goes through
``SessionControl``, which ``agentd.supervisor.turns`` implements.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Protocol

import anyio
import anyio.abc

from agentd import events
from agentd.errors import store_failure
from agentd.obs import get_logger
from agentd.protocol import Watch
from agentd.records import StartedTurn, TurnRecord
from agentd.store import (
    CANCELS,
    CLOSES,
    EVENTS,
    ORPHANS,
    TURNS,
    WATCHES,
    Lease,
    Store,
    StoredSession,
    StoreError,
    StoreUnavailable,
)
from agentd.supervisor.relay import EventRelay, Reassembler, RemoteWatchers, decode_watch, encode_watch
from agentd.supervisor.replica import (
    RenewVerdict,
    heartbeat_interval,
    judge_renewal,
    lease_holder,
    live_twin,
    loaded_copy_is_current,
    new_incarnation,
    replica_id,
    replica_name,
    rivals,
    scan_interval,
)
from agentd.supervisor.running import Running
from agentd.supervisor.session import PendingTurn, SessionRuntime, SessionTable, added_entries
from agentd.views import Entry

__all__ = ["LocalMembership", "Membership", "ReplicatedMembership", "SessionControl", "choose_membership"]

log = get_logger("supervisor")

#: How far apart the clocks of two replicas may be, when a catch-up asks which turns ended since a time.
CLOCK_SLACK = 5.0


class SessionControl(Protocol):
    """What membership does to hot sessions (``agentd.supervisor.turns.Turns``)."""

    async def cancel_here(self, runtime: SessionRuntime) -> str:
        """Cancel the turn this replica runs for ``runtime``; its id."""

    async def close_here(self, session_id: str) -> None:
        """Another replica closed the session: end its turn here, unload it, end its streams."""

    async def resume(self, runtime: SessionRuntime, stored: StoredSession, started: StartedTurn) -> PendingTurn | None:
        """Register an interrupted turn on ``runtime``; the turn to drive, or None if it ended now."""

    async def resume_interrupted(self) -> None:
        """Re-run every turn a restart interrupted (one daemon owns the store)."""

    async def lease_lost(self, runtime: SessionRuntime, reason: str) -> None:
        """Another replica took the session over: stop acting for it."""

    async def unload(self, runtime: SessionRuntime) -> None:
        """Unload the session from its child (a copy that may be stale)."""

    def drive(self, runtime: SessionRuntime, turn: PendingTurn) -> None:
        """Run ``turn`` in the background."""

    async def ended_turn(self, session_id: str, turn_id: str) -> tuple[TurnRecord, list[Entry]] | None:
        """A turn that ended, as committed, or None."""


class Membership(Protocol):
    """This replica among others — or alone."""

    #: Shown to operators (status, registry): the replica id.
    name: str
    #: Known to the store (leases, the registry's row, watches, relayed events): this process.
    replica: str

    @property
    def relay(self) -> EventRelay | None:
        """What this replica relays to others, in order (None: there are no others)."""

    async def find_live_twin(self) -> str | None:
        """Another live process bearing this replica's id (asked before serving), else None."""

    async def start(self, tg: anyio.abc.TaskGroup, control: SessionControl) -> None:
        """Beat once, then keep beating and do this membership's background work in ``tg``."""

    async def stop(self) -> None:
        """Give up what this replica holds (it stops)."""

    async def claim(self, runtime: SessionRuntime, turn: str) -> bool:
        """Whether this replica runs the session's accepted ``turn`` (else another one does, once)."""

    async def created_after_all(self, session_id: str, failure: StoreUnavailable) -> bool:
        """Whether a ``create_session`` that failed for the database's sake landed after all."""

    async def begun_after_all(self, runtime: SessionRuntime, turn: PendingTurn, failure: StoreUnavailable) -> bool:
        """Whether a ``begin_turn`` that failed for the database's sake stored the turn after all."""

    def watched_elsewhere(self, session_id: str) -> bool:
        """Whether another live replica has subscribers for the session."""

    async def watching(self, session_id: str) -> None:
        """The session's first subscriber here: other replicas relay its events here."""

    def unwatched(self, session_id: str) -> None:
        """The session's last subscriber here went away."""

    async def cancel_elsewhere(self, session_id: str) -> str | None:
        """Ask whichever replica runs the session's pending turn to cancel it; its id, or None
        (a store failure refuses as ``agentd.errors.store_failure`` says)."""

    async def closed(self, session_id: str) -> None:
        """This replica closed the session: the others drop what they hold of it."""

    async def holder_alive(self, holder: str) -> bool:
        """Whether the process ``holder`` (a ``replica``) may still be working: this one, or one that
        beat within a lease. StoreError if the registry cannot be read."""


def choose_membership(store: Store, running: Running, sessions: SessionTable) -> Membership:
    """Replicated on a shared database (``[store] url``), else local: one daemon owns the state dir."""
    if running.config.store.url:
        return ReplicatedMembership(store, running, sessions)
    return LocalMembership(store, running, sessions)


async def store_quietly(call: Awaitable[object]) -> None:
    """A store call whose failure is only logged."""
    try:
        await call
    except StoreError as exc:
        log.warning(events.LOG_SUPERVISOR_STORE_FAILED, error=str(exc))


class _Registered:
    """A replica in the registry: it beats every ``lease / 3`` (restart-only, like the store itself)."""

    relay: EventRelay | None = None

    def __init__(self, store: Store, running: Running, sessions: SessionTable) -> None:
        self.store = store
        self.running = running
        self.sessions = sessions
        self.name = replica_id()
        self.replica = lease_holder(self.name, new_incarnation())
        self.lease_time = running.config.store.lease
        self._beat_seen: float | None = None  # the store's time of this process's first beat

    def owned_sessions(self) -> int:
        """How many sessions this replica owns, as the registry shows it."""
        return len(self.sessions)

    async def _beat(self) -> None:
        try:
            row = await self.store.beat(
                self.replica, generation=self.running.generation, sessions=self.owned_sessions()
            )
        except StoreError as exc:
            log.warning(events.LOG_REPLICA_BEAT_FAILED, replica=self.replica, error=str(exc))
            return
        if self._beat_seen is None:
            self._beat_seen = row.seen_at
        else:
            await self._beaten()

    async def _beaten(self) -> None:
        """After every beat but the first."""


class LocalMembership(_Registered):
    """The only daemon on its store: it owns every session (SQLite)."""

    async def find_live_twin(self) -> str | None:
        return None  # the state dir's lock refused any other daemon already

    async def start(self, tg: anyio.abc.TaskGroup, control: SessionControl) -> None:
        await self._beat()
        tg.start_soon(self._heartbeat)
        tg.start_soon(control.resume_interrupted)

    async def _heartbeat(self) -> None:
        while True:
            await anyio.sleep(heartbeat_interval(self.lease_time))
            await self._beat()

    async def stop(self) -> None:
        pass  # no leases

    async def claim(self, runtime: SessionRuntime, turn: str) -> bool:
        return True

    async def created_after_all(self, session_id: str, failure: StoreUnavailable) -> bool:
        return False  # SQLite, in-process, does not lose a commit's answer

    async def begun_after_all(self, runtime: SessionRuntime, turn: PendingTurn, failure: StoreUnavailable) -> bool:
        return False

    def watched_elsewhere(self, session_id: str) -> bool:
        return False

    async def watching(self, session_id: str) -> None:
        pass

    def unwatched(self, session_id: str) -> None:
        pass

    async def cancel_elsewhere(self, session_id: str) -> str | None:
        return None

    async def closed(self, session_id: str) -> None:
        pass

    async def holder_alive(self, holder: str) -> bool:
        return holder == self.replica  # the state dir's lock: no other process serves this store


class ReplicatedMembership(_Registered):
    """One replica of several on a shared database (PostgreSQL), with leases."""

    def __init__(self, store: Store, running: Running, sessions: SessionTable) -> None:
        super().__init__(store, running, sessions)
        self._twins_reported: set[str] = set()
        # Progress events across replicas: what this replica relays, in order, and which sessions
        # other replicas have subscribers for.
        self.relay: EventRelay = EventRelay(store, self.replica)
        self.watchers = RemoteWatchers(ttl=self.lease_time)
        self._reassembler = Reassembler()
        self._orphans_released = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None
        self._control: SessionControl | None = None

    @property
    def control(self) -> SessionControl:
        assert self._control is not None, "membership has not started"
        return self._control

    # ------------------------------------------------------------------ start, beat, stop

    async def start(self, tg: anyio.abc.TaskGroup, control: SessionControl) -> None:
        """Other replicas may be running pending turns: take only the orphaned ones."""
        self._tg, self._control = tg, control
        await self._beat()
        tg.start_soon(self._heartbeat)
        tg.start_soon(self.relay.run)
        tg.start_soon(self._failover_scan)
        tg.start_soon(self._listen)

    async def _heartbeat(self) -> None:
        """Every ``lease / 3``: renew this replica's leases and record it in the registry."""
        while True:
            await anyio.sleep(heartbeat_interval(self.lease_time))
            await self._renew()
            await self._announce_watches()
            await self._beat()

    def owned_sessions(self) -> int:
        """The sessions this replica holds a lease on (it runs their turns)."""
        return sum(1 for r in self.sessions.values() if r.lease is not None and r.pending is not None)

    async def _beaten(self) -> None:
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
        """Another live process that bears this replica's id, else None — asked at start, before
        serving. A registry row of the id that beat within a lease is either the process this one
        replaces (dead: it never beats again, and once its last beat is a lease old it holds no
        lease either) or a twin (it beats every ``lease / 3``): watched until one or the other is
        plain, at most a lease."""
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

    async def holder_alive(self, holder: str) -> bool:
        if holder == self.replica:
            return True
        return any(row.id == holder for row in await self.store.live_replicas(self.lease_time))

    async def _start_beat(self) -> None:
        """A beat before serving (``find_live_twin``): StoreError raises, the start fails."""
        row = await self.store.beat(self.replica, generation=self.running.generation, sessions=0)
        if self._beat_seen is None:
            self._beat_seen = row.seen_at

    async def stop(self) -> None:
        """A stopping replica gives up its leases (turns cut by the stop): another replica's scan
        claims them at once instead of after the lease."""
        with anyio.CancelScope(shield=True):
            for runtime in list(self.sessions.values()):
                lease = runtime.give_up_lease()
                if lease is not None:
                    await store_quietly(self.store.release(lease))
                    runtime.log.info(events.LOG_SESSION_RELEASED, token=lease.token)

    # ------------------------------------------------------------------ leases

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
                runtime.hold(renewed)
            elif verdict is RenewVerdict.LOST:
                await self.control.lease_lost(runtime, "the heartbeat found the lease held by another replica")

    async def claim(self, runtime: SessionRuntime, turn: str) -> bool:
        """Claim the session's lease before running its turn; False while another replica holds it,
        or once the turn is no longer pending (another replica's failover scan took it after its
        ``begin_turn``, and may have run it to its end already: it must not run twice).

        A session that another replica held since this one last did is reloaded from the store:
        the copy loaded on a child here (and the runtime's assistant and model) may be stale.
        """
        try:
            lease = await self.store.claim(runtime.id, self.replica, self.lease_time, turn=turn)
        except StoreError as exc:
            runtime.log.warning(events.LOG_SESSION_CLAIM_FAILED, error=str(exc))
            return False
        if lease is None:
            return False
        self._note_watchers(lease)
        await self._take(runtime, lease)
        return True

    async def _take(self, runtime: SessionRuntime, lease: Lease) -> None:
        """Adopt ``lease`` for ``runtime``; refresh what may be stale if another replica held it since."""
        if not loaded_copy_is_current(runtime.last_token, lease.token):
            await self.control.unload(runtime)
            try:
                stored = await self.store.session_summary(runtime.id)
            except StoreError as exc:  # the transcript is reloaded anyway; the row is read next time
                runtime.log.warning(events.LOG_SESSION_CLAIM_FAILED, error=str(exc))
                stored = None
            if stored is not None:
                model = self.running.model_of(stored.assistant, stored.model)
                runtime.refreshed(stored.assistant, model, self.running.generation)
        runtime.hold(lease)

    async def created_after_all(self, session_id: str, failure: StoreUnavailable) -> bool:
        """Whether a ``create_session`` that failed because of the database created it after all
        (its answer lost with the connection while ``COMMIT`` was in flight, like ``begin_turn``):
        then it is answered as created (``session.create_recovered``) rather than 503, so a
        client does not create a second one. StoreError when the store cannot say."""
        try:
            created = await self.store.session_summary(session_id) is not None
        except StoreError as exc:
            log.warning(events.LOG_SESSION_CREATE_UNKNOWN, session=session_id, error=str(exc))
            raise
        if created:
            log.warning(events.LOG_SESSION_CREATE_RECOVERED, session=session_id, error=str(failure))
        return created

    async def begun_after_all(self, runtime: SessionRuntime, turn: PendingTurn, failure: StoreUnavailable) -> bool:
        """Whether a ``begin_turn`` that failed because of the database stored the turn after all.

        On PostgreSQL the connection can be lost while ``COMMIT`` is in flight, after the server
        committed (RFC 0003 §3): the message is then stored and its turn pending — and would run,
        taken by a failover scan, while the client was told nothing was stored. So the store is
        asked: True when the turn is there (it goes on as accepted, ``turn.begin_recovered``);
        False when it is not (nothing was stored). StoreError when the store cannot say.
        """
        try:
            pending = await self.store.pending_turn(runtime.id)
        except StoreError as exc:
            runtime.log.warning(events.LOG_TURN_BEGIN_UNKNOWN, turn=turn.id, error=str(exc))
            raise
        if pending is None or pending.id != turn.id:
            return False
        runtime.log.warning(events.LOG_TURN_BEGIN_RECOVERED, turn=turn.id, error=str(failure))
        return True

    # ------------------------------------------------------------------ orphans

    async def _failover_scan(self) -> None:
        """Every ``lease / 2`` (the first at once): claim orphaned sessions and re-run their turns.

        An orphaned session has a pending turn and no live lease: its replica died (kill -9),
        stopped (a drain released it) or was partitioned past its lease. The journal keeps a tool
        that had run from running again.
        """
        while True:
            if not self.running.draining:
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

    async def _adopt_orphan(self, lease: Lease) -> None:
        """Run the pending turn of a session just claimed by the failover scan."""
        try:
            stored = await self.store.session_summary(lease.session)
            started = await self.store.pending_turn(lease.session)
        except StoreError as exc:
            log.warning(events.LOG_SESSION_ADOPT_FAILED, session=lease.session, error=str(exc))
            return
        runtime = self.sessions.get(lease.session)
        if (
            runtime is not None
            and runtime.pending is not None
            and started is not None
            and runtime.pending.id == started.id
        ):
            # The scan claimed it between this replica's ``begin_turn`` and its own ``claim``: that
            # claim keeps the token of a lease its holder has, so this very lease is the one the
            # turn runs under. Releasing it would pull the lease from under the turn (lease_lost).
            return
        if stored is None or started is None or (runtime is not None and runtime.pending is not None):
            await store_quietly(self.store.release(lease))  # ended meanwhile: nothing to run
            return
        runtime = self.sessions.hot(stored)
        self._note_watchers(lease)
        await self._take(runtime, lease)
        runtime.log.info(events.LOG_SESSION_ADOPTED, turn=started.id, token=lease.token)
        queued = await self.control.resume(runtime, stored, started)
        if queued is not None:
            self.control.drive(runtime, queued)

    # ------------------------------------------------------------------ watches

    def watched_elsewhere(self, session_id: str) -> bool:
        return self.watchers.watched(session_id, time.monotonic())

    def _note_watchers(self, lease: Lease) -> None:
        """The replicas watching a session this replica just claimed: its turn's events go there."""
        for replica in lease.watchers:
            self.watchers.note(replica, [lease.session], time.monotonic())

    async def _announce_watches(self) -> None:
        """Tell the other replicas, again, which sessions have subscribers here (in the store, for
        the replica that claims one next, and notified, for those running one now); forget
        theirs that expired. Nothing to tell, nothing written: this replica's rows went when its
        last subscribers of each session did (and expired rows are ignored by readers)."""
        self.watchers.prune(time.monotonic())
        watched = [runtime.id for runtime in self.sessions.values() if runtime.watched]
        if not watched:
            return
        await store_quietly(self.store.watch(self.replica, watched, self.lease_time))
        for payload in encode_watch(self.replica, True, watched):
            self.relay.send(WATCHES, payload)

    async def watching(self, session_id: str) -> None:
        """A turn another replica claims from now on is relayed here (the store says so at its
        claim); one running now, from when the notice reaches its replica."""
        await store_quietly(self.store.watch(self.replica, [session_id], self.lease_time))
        for payload in encode_watch(self.replica, True, [session_id]):
            self.relay.send(WATCHES, payload)

    def unwatched(self, session_id: str) -> None:
        if self._tg is not None:  # the last one here: stop relaying to this replica
            self._tg.start_soon(self._unwatch, session_id)

    async def _unwatch(self, session_id: str) -> None:
        """No subscriber of the session is left here: other replicas stop relaying its events here."""
        runtime = self.sessions.get(session_id)
        if runtime is not None and runtime.watched:  # subscribed again meanwhile
            return
        for payload in encode_watch(self.replica, False, [session_id]):
            self.relay.send(WATCHES, payload)
        await store_quietly(self.store.unwatch(self.replica, [session_id]))

    # ------------------------------------------------------------------ cancels and closes

    async def cancel_elsewhere(self, session_id: str) -> str | None:
        """Ask whichever replica runs the session's pending turn to cancel it; the turn's id, or
        None when no turn is pending. Kept in the store, so a holder that died meanwhile cannot
        lose it: whoever adopts the turn ends it cancelled; a live holder hears of it at once."""
        try:
            started = await self.store.pending_turn(session_id)
            if started is None:
                return None
            await self.store.request_cancel(session_id, started.id)
        except StoreError as exc:
            raise store_failure(exc) from None
        await self.store.notify(CANCELS, f"{session_id} {started.id}")
        return started.id

    async def closed(self, session_id: str) -> None:
        await self.store.notify(CLOSES, session_id)

    # ------------------------------------------------------------------ listening

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
            await self.control.close_here(fields[0])
        elif channel == CANCELS and len(fields) == 2:
            runtime = self.sessions.get(fields[0])
            if runtime is not None and runtime.pending is not None and runtime.pending.id == fields[1]:
                await self.control.cancel_here(runtime)

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
                    await self.control.close_here(runtime.id)
                    continue
                turn = runtime.pending
                if turn is not None:
                    started = await self.store.pending_turn(runtime.id)
                    if started is not None and started.id == turn.id and started.cancel_requested:
                        await self.control.cancel_here(runtime)
                elif runtime.watched:
                    await self._publish_ended_since(runtime, since)
            except StoreError as exc:
                runtime.log.warning(events.LOG_REPLICA_CATCH_UP_FAILED, replica=self.replica, error=str(exc))

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
                record, added_entries(e for e in stored.transcript if e.message.turn == record.id)
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
                runtime.log.info(
                    events.LOG_SESSION_RELAYED, turn=turn.id, to=replica_name(notice.replica), holder=notice.replica
                )

    async def _turn_ended_elsewhere(self, session_id: str, turn_id: str) -> None:
        """Another replica ended a turn of a session watched here: its subscribers get ``turn.done``."""
        runtime = self.sessions.get(session_id)
        if runtime is None or not runtime.watched or runtime.pending is not None:
            return
        found = await self.control.ended_turn(session_id, turn_id)
        if found is not None:
            runtime.publish_turn_done(*found)
