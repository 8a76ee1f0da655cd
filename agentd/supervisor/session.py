"""One session as the supervisor holds it, and the table of the hot ones.

A session is rows in the store; ``SessionRuntime`` is the few hundred bytes the supervisor keeps
while the session is *hot* (loaded on a child, running a turn, or watched by a subscriber): its
assistant, state, generation and model, the turn in flight, where it is loaded, its recent
crashes, and its event subscribers. It holds no transcript (the store has it) and no reference to
the supervisor; the turns (``agentd.supervisor.turns``) act on it, through its methods. ``SessionTable`` is
the one set of hot sessions: only its methods add a session to it or drop one.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, overload

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from agentd import events
from agentd.approvals import Approval, Decision, ParkedRun
from agentd.errors import Conflict
from agentd.messages import UserMessage
from agentd.obs import bound_logger
from agentd.records import SessionState, TurnRecord
from agentd.supervisor.blame import quarantined
from agentd.views import Entry, entry_from_message, turn_done_event

if TYPE_CHECKING:
    from agentd.store import Lease, StoredEntry, StoredSession
    from agentd.supervisor.child import Child
    from agentd.supervisor.running import Running

_T = TypeVar("_T")

__all__ = ["PendingTurn", "SessionRuntime", "SessionTable", "added_entries"]

SUBSCRIBER_BUFFER = 1024
EventItem = tuple[str, dict[str, Any]]


@dataclass(eq=False)
class PendingTurn:
    """A turn that was accepted (its input is stored) and has not ended yet."""

    id: str
    message: UserMessage | None
    started_at: float  # epoch seconds it was accepted
    # Epoch seconds its budget started: its deadline counts from here across re-runs on other
    # children. Moved only by a restart-turn (a fresh budget) and by a daemon restart.
    budget_start: float = 0.0
    done: anyio.Event = field(default_factory=anyio.Event)
    record: TurnRecord | None = None  # as committed (or, for a turn ended without results, as abandoned)
    entries: list[Entry] = field(default_factory=list)  # what the turn added, as the API shows it
    child: Child | None = None  # the child running it now
    lost: anyio.Event = field(default_factory=anyio.Event)  # that child ended before the turn did
    crashed: bool = False  # ... and it was a crash (not a stop the pool asked for)
    runs: int = 0  # how many times it was delivered to a child
    discards: int = 0  # attempts its children threw away (restart-turn): each was a run of its own
    # Accepted by this process just now (not resumed or adopted from the store): before its first
    # run nothing can have been journaled for it, so that run reads no journal.
    fresh: bool = False
    cancel_requested: bool = False
    # The W3C trace context of the request that began it (RFC 0011 §4): its spans join that trace.
    trace: dict[str, str] = field(default_factory=dict)
    # Set when it stopped without ending (the daemon is shutting down): the API answers 503 with this.
    cut: str | None = None
    cut_code: str = "turn_cut"  # the API error code for ``cut``
    # Stored here but run by another replica (it held the session's lease): waited for in the store.
    elsewhere: bool = False
    # RFC 0012: a run that parked for approvals goes on from here (the run, what was decided) ...
    resume: tuple[ParkedRun, list[Decision]] | None = None
    # ... and, once it parked, the approvals it waits for (what a waiting client is answered with).
    awaiting: list[Approval] | None = None

    # Set when the current run settles: the turn ended, or its child was lost (one wait for both).
    settled: anyio.Event = field(default_factory=anyio.Event)
    # Journal frames of this turn being written (RFC 0008 §5); a re-run waits until none is.
    journal_writes: int = 0
    _journal_quiet: anyio.Event = field(default_factory=anyio.Event)

    def __post_init__(self) -> None:
        if not self.budget_start:
            self.budget_start = self.started_at

    def resume_from(self, run: ParkedRun, decisions: list[Decision]) -> None:
        """It goes on from a parked run (RFC 0012 §3); its deadline counts on from what it had used."""
        self.resume = (run, decisions)
        self.budget_start = time.time() - run.elapsed  # the wait for approvals did not count

    def waits_for(self, approvals: list[Approval]) -> None:
        """Its run parked for ``approvals`` (what a waiting client is answered with)."""
        self.awaiting, self.resume = approvals, None

    def journal_landed(self) -> None:
        """One journal write of this turn finished (written or refused)."""
        self.journal_writes -= 1
        if self.journal_writes == 0:
            self._journal_quiet.set()
            self._journal_quiet = anyio.Event()

    async def journal_quiet(self) -> None:
        """Wait until no journal write of this turn is in flight."""
        while self.journal_writes:
            await self._journal_quiet.wait()

    def mark_done(self) -> None:
        """The turn has its answer (a result, or a reason it has none): its waiters go on."""
        self.done.set()
        self.settled.set()

    def cut_off(self, reason: str, code: str = "turn_cut") -> None:
        """It stops here without ending (shutdown, a lost lease): the API answers 503 ``code``."""
        if not self.done.is_set():
            self.cut, self.cut_code = reason, code
            self.mark_done()

    def added(self, entries: list[Entry]) -> None:
        """What its committed results added to the transcript, as the API shows it."""
        self.entries = entries

    def runs_on(self, child: Child) -> None:
        """A new run of it is sent to ``child``."""
        self.child, self.lost, self.crashed, self.settled = child, anyio.Event(), False, anyio.Event()
        self.runs += 1

    def left(self, child: Child) -> None:
        """Its run on ``child`` is over (ended, lost, or cut)."""
        if self.child is child:
            self.child = None

    def ended_with(self, record: TurnRecord) -> bool:
        """It ended as ``record``; False if it had ended already (a close racing the commit): once only."""
        if self.record is not None:
            return False
        self.record = record
        return True

    def restarted_on_child(self) -> None:
        """Its child discarded a run (restart-turn): the re-run is a run of its own, with a fresh
        budget (its deadline counts from now)."""
        self.budget_start = time.time()
        self.discards += 1

    def journal_write_begins(self) -> None:
        """A journal frame of this turn is being written (a re-run waits for it: ``journal_quiet``)."""
        self.journal_writes += 1

    def run_elsewhere(self) -> None:
        """Stored here, run by the replica that holds the session's lease."""
        self.elsewhere = True

    def request_cancel(self) -> None:
        """A client asked to cancel it: it ends cancelled wherever it is."""
        self.cancel_requested = True

    def mark_lost(self, *, crashed: bool) -> None:
        """The child running it ended before the turn did."""
        self.crashed = crashed
        self.lost.set()
        self.settled.set()


class SessionRuntime:
    """Supervisor-side state of one hot session."""

    def __init__(self, session_id: str, assistant: str, state: SessionState, generation: int, model: str) -> None:
        self.id = session_id
        self.log = bound_logger("supervisor", session=session_id)  # its lines name the session
        self.assistant = assistant
        self.state: SessionState = state
        self.generation = generation
        self.model = model
        self.pending: PendingTurn | None = None
        self.child: Child | None = None  # the child the session is opened on, if loaded
        self.intel_waiting = False  # a turn is waiting because every endpoint is down
        self.quarantined = False  # its turns run on a child of its own (RFC 0006 §5)
        self.crashes: tuple[float, ...] = ()  # monotonic times of crashes it was blamed for
        self.idle_since = time.monotonic()
        self.closing = False
        # On a shared store (RFC 0009 §7): the lease this replica holds while it runs the session's
        # turn (its writes are fenced by it), and the token of the last lease it held here.
        self.lease: Lease | None = None
        self.last_token: int | None = None
        # Events that arrived after a TurnDone still being committed; published after its turn.done.
        self.backlog: list[tuple[str, str | None, dict[str, Any]]] | None = None
        self._subscribers: set[MemoryObjectSendStream[EventItem]] = set()
        # The turns whose turn.done this replica published last (a catch-up never repeats one).
        self.done_published: collections.deque[str] = collections.deque(maxlen=32)

    # ------------------------------------------------------------------ its turn

    def reserve(self, turn: PendingTurn) -> None:
        """Make ``turn`` the session's turn in flight; Conflict while another one is."""
        if self.pending is not None:
            raise Conflict(f"session {self.id} is already running turn {self.pending.id}", code="turn_running")
        self.pending, self.state = turn, "running"

    def unreserve(self, turn: PendingTurn) -> None:
        """``turn`` does not run here after all (not stored, or another replica runs it)."""
        self.pending, self.state = None, "idle"

    def restore(self, turn: PendingTurn) -> None:
        """An interrupted turn (a restart, a failover) is the session's turn in flight again."""
        self.pending = turn

    def run_restored(self) -> None:
        """The restored turn runs (it did not end at once)."""
        self.state = "running"

    def turn_ended(self) -> None:
        """Its turn ended: the session is idle again (unless it failed), and idle from now."""
        if self.child is not None:  # a swap parked during the turn was adopted at its end
            self.generation = max(self.generation, self.child.generation)
        self.pending = None
        self.intel_waiting = False
        self.idle_since = time.monotonic()
        if self.state != "failed":
            self.state = "idle"

    def turn_awaiting(self) -> None:
        """Its turn waits for approvals (RFC 0012): nothing in flight here, no child slot held; the
        session may unload. The turn stays pending in the store, and resumes once decided."""
        self.pending = None
        self.intel_waiting = False
        self.idle_since = time.monotonic()
        self.state = "awaiting_approval"

    def turn_dropped(self) -> None:
        """Its turn is another replica's now (the lease was lost): nothing in flight here."""
        self.pending = None
        if self.state == "running":
            self.state = "idle"

    def failed(self) -> None:
        """The session failed (kept, visible, resumable by a new message)."""
        self.state = "failed"

    def resume_failed(self) -> None:
        """A failed session takes a new message: it is idle again, its crashes forgiven."""
        self.state = "idle"
        self.crashes, self.quarantined = (), False

    def closing_begins(self) -> None:
        """A close is under way: the session takes no new request."""
        self.closing = True

    def close_undone(self, *, turn_ended: bool) -> None:
        """The close did not happen: the session is open and usable (``turn_ended``: its turn was
        cancelled on the way, so it is idle unless it failed)."""
        self.closing = False
        if turn_ended and self.state != "failed":
            self.state = "idle"

    def unloaded(self, child: Child | None = None) -> None:
        """The session is not loaded on a child (any more); with ``child``: if it was loaded there."""
        if child is None or self.child is child:
            self.child = None

    def loaded_on(self, child: Child) -> None:
        """The session was opened on ``child``."""
        self.child = child

    def waiting_for_intel(self, waiting: bool) -> None:
        """Its turn waits (or no longer waits) because every endpoint is down."""
        self.intel_waiting = waiting

    def place_quarantined(self, now: float) -> bool:
        """Whether its turn must run on a child of its own now (RFC 0006 §5): its recent crashes decide."""
        self.quarantined = quarantined(self.crashes, now)
        return self.quarantined

    def blamed(self, crashes: tuple[float, ...], *, quarantine: bool) -> bool:
        """A crash was counted against it (``crashes``: the ones that still count); True if that
        quarantines it now."""
        self.crashes = crashes
        newly = quarantine and not self.quarantined
        self.quarantined = self.quarantined or quarantine
        return newly

    def transferred(self, assistant: str, model: str) -> None:
        """A transfer committed: the session runs ``assistant`` on ``model`` from now on."""
        self.assistant, self.model = assistant, model

    # ------------------------------------------------------------------ events held behind a commit

    def hold_events(self) -> None:
        """A TurnDone is being committed: later events wait (``held``) so turn.done comes first."""
        self.backlog = []

    def held(self, name: str, turn: str | None, data: dict[str, Any]) -> bool:
        """Keep an event behind the commit under way; False when none is (publish it now)."""
        if self.backlog is None:
            return False
        self.backlog.append((name, turn, data))
        return True

    def release_events(self) -> list[tuple[str, str | None, dict[str, Any]]]:
        """The commit is over: the events held behind it, in order."""
        backlog, self.backlog = self.backlog or [], None
        return backlog

    # ------------------------------------------------------------------ its generation and leases

    def swapped(self, generation: int, model: str | None = None) -> None:
        """The session runs ``generation`` (and ``model``, when that changed) from now on."""
        self.generation = generation
        if model is not None:
            self.model = model

    def took_generation(self, generation: int, model: str | None = None) -> None:
        """Its child applied ``generation`` to it (frames can arrive after a newer one: never back)."""
        # ``swapped``, inline: a reload calls this for every loaded session.
        if generation > self.generation:
            self.generation = generation
        if model is not None:
            self.model = model

    def refreshed(self, assistant: str, model: str, generation: int) -> None:
        """What the store says of the session, read again (another replica may have changed it)."""
        self.assistant, self.model, self.generation = assistant, model, generation

    def hold(self, lease: Lease) -> None:
        """This replica holds the session's lease (claimed or renewed)."""
        self.lease, self.last_token = lease, lease.token

    def give_up_lease(self) -> Lease | None:
        """This replica no longer holds the session's lease: the one it held, to release."""
        lease, self.lease = self.lease, None
        return lease

    def closed(self) -> None:
        """The session is closed: it ends its streams."""
        self.state = "closed"
        self.close_subscribers()

    @property
    def running(self) -> bool:
        """A turn is in flight (accepted, not ended)."""
        return self.pending is not None

    @property
    def hot(self) -> bool:
        """Whether the supervisor must keep this object: loaded, running, or watched."""
        return self.child is not None or self.pending is not None or bool(self._subscribers)

    # ------------------------------------------------------------------ events

    def subscribe(self) -> MemoryObjectReceiveStream[EventItem]:
        """A stream of (event name, data) for this session; closed when the session is."""
        send, receive = anyio.create_memory_object_stream[EventItem](SUBSCRIBER_BUFFER)
        self._subscribers.add(send)
        return receive

    @property
    def watched(self) -> bool:
        """Someone subscribed to this session's events (children stream progress events only then)."""
        if not self._subscribers:
            return False
        self.prune_subscribers()
        return bool(self._subscribers)

    def publish(self, name: str, turn: str | None, data: dict[str, Any]) -> None:
        """Fan an event out to subscribers; a subscriber too slow to keep up is dropped, never waited for."""
        if not self._subscribers:
            return
        if turn is not None and turn in self.done_published:
            return  # a superseded run's late event (RFC 0009 §7): the turn's end was told already
        payload = {"session": self.id, "turn": turn, **data}
        for subscriber in list(self._subscribers):
            try:
                subscriber.send_nowait((name, payload))
            except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._subscribers.discard(subscriber)
                subscriber.close()

    def publish_turn_done(self, record: TurnRecord, entries: list[Entry]) -> None:
        """Publish the turn's ``turn.done`` — once: a turn this replica heard of twice (its end
        notice, and a catch-up after a gap in listening) is not told twice."""
        if record.id in self.done_published:
            return
        self.publish(events.TURN_DONE, record.id, turn_done_event(record, entries))
        self.done_published.append(record.id)

    def close_subscribers(self) -> None:
        """End every subscription (the session was closed or the daemon stops)."""
        for subscriber in self._subscribers:
            subscriber.close()
        self._subscribers.clear()

    def prune_subscribers(self) -> None:
        """Forget subscriptions whose reader went away."""
        for subscriber in list(self._subscribers):
            if subscriber.statistics().open_receive_streams == 0:
                self._subscribers.discard(subscriber)
                subscriber.close()


def added_entries(stored: Iterable[StoredEntry]) -> list[Entry]:
    """The entries a turn added, as the API shows them: its stored entries but its input."""
    return [entry_from_message(e.seq, e.message) for e in stored if not isinstance(e.message, UserMessage)]


class SessionTable(Mapping[str, SessionRuntime]):
    """The hot sessions by id, read by everyone who acts on sessions; only these methods change the set.

    Any other session is read from the store when it is asked for, so start-up and memory do not
    grow with the number of open sessions (RFC 0006).
    """

    def __init__(self, running: Running) -> None:
        self._running = running
        self._by_id: dict[str, SessionRuntime] = {}

    def __getitem__(self, session_id: str) -> SessionRuntime:
        return self._by_id[session_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)

    # The reads straight from the dict: ``Mapping``'s own go through ``__getitem__`` (a lookup that
    # misses raises and catches KeyError), and a reload reads every hot session several times.

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._by_id

    @overload
    def get(self, session_id: str, /) -> SessionRuntime | None: ...
    @overload
    def get(self, session_id: str, /, default: SessionRuntime | _T) -> SessionRuntime | _T: ...
    def get(self, session_id: str, /, default: object = None) -> object:
        """The session's runtime, or ``default``."""
        return self._by_id.get(session_id, default)

    @property
    def lookup(self) -> Callable[[str], SessionRuntime | None]:
        """``get`` as the dict's own method (no Python call in between), for a loop over many sessions."""
        return self._by_id.get

    def keys(self) -> KeysView[str]:
        return self._by_id.keys()

    def values(self) -> ValuesView[SessionRuntime]:
        return self._by_id.values()

    def items(self) -> ItemsView[str, SessionRuntime]:
        return self._by_id.items()

    def add(self, runtime: SessionRuntime) -> SessionRuntime:
        """``runtime`` made hot — or the session's runtime, if it is hot already."""
        return self._by_id.setdefault(runtime.id, runtime)

    def hot(self, stored: StoredSession) -> SessionRuntime:
        """The session's runtime, made hot from its row if it was not: not loaded anywhere, so it
        has taken every swap since the row was written (RFC 0006 §7): it runs the current generation."""
        runtime = self._by_id.get(stored.id)
        if runtime is not None:
            return runtime
        state: SessionState = "failed" if stored.state == "failed" else "idle"
        model = self._running.model_of(stored.assistant, stored.model)
        return self.add(SessionRuntime(stored.id, stored.assistant, state, self._running.generation, model))

    def evict_if_cold(self, runtime: SessionRuntime) -> None:
        """Forget a runtime that is no longer loaded, running or watched (the store has the session)."""
        runtime.prune_subscribers()
        if not runtime.hot:
            self.forget(runtime)

    def forget(self, runtime: SessionRuntime) -> None:
        """Drop ``runtime`` (if it is still the session's hot runtime)."""
        if self._by_id.get(runtime.id) is runtime:
            del self._by_id[runtime.id]

    def discard(self, session_id: str) -> None:
        """Drop whatever runtime the session has here."""
        self._by_id.pop(session_id, None)

    def running(self) -> int:
        """How many hot sessions have a turn in flight."""
        return sum(1 for r in self._by_id.values() if r.pending is not None)
