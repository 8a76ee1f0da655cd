"""The store interface every backend implements, its records and its errors (RFC 0003 §3, RFC 0009).

A store keeps sessions, their transcripts and their turns, and — for deployments with several
replicas on one database — which replica owns each session (a lease with a fencing token).
``SqliteStore`` (``agentd.store.sqlite``) and ``PostgresStore`` (``agentd.store.postgres``)
implement ``Store`` with the same semantics, checked by one test-suite run against both: each
call is written once (``agentd.store.sqlstore``, ``agentd.store.operations``) and each backend
only runs it.

Rules every backend keeps:

- A user message is stored (``begin_turn``) before it is delivered to a child; a turn's results
  are written by exactly one transaction (``commit_turn``). A failure inside that transaction
  leaves nothing of it behind and the turn still pending; a retry of a commit that did land
  (its answer was lost) is recognised and writes nothing again.
- While a turn is pending, its side-effecting tool calls are journaled (``journal_start`` before
  a call runs, ``journal_finish`` with its result; RFC 0008 §5) so that a re-run never runs one
  again. The transaction that ends the turn (commit or abandon) deletes its journal.
- Entries are never deleted. A transfer that rewrites history marks the old entries inactive and
  inserts the new transcript; a session's transcript is its active entries in ``seq`` order.
  ``seq`` is per session, increasing, never reused.
- Messages are stored as msgspec JSON of the ``agentd.messages.Message`` union and nothing else
  (``agentd.store.codec``): no configuration, no environment, so no secret reaches the database.
- Once a call that writes has returned, what it wrote is durable. A caller cancelled while its
  call runs does not tear the call: it completes (or rolls back) before the cancellation is
  delivered.
- A write that carries a ``Lease`` is **fenced** (RFC 0009 §4): it is done only if that lease is
  still the session's current one, checked inside the write's own transaction, and otherwise
  refused with ``LeaseLost`` with nothing written.
- Schema migrations are versioned (``agentd.store.migrations``) and run when the store opens.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import msgspec

from agentd.approvals import Approval, ApprovalRequest, ParkedRun
from agentd.budget import Usage
from agentd.config import Price
from agentd.messages import Message, UserMessage
from agentd.records import JournalEntry, SessionState, StartedTurn, TurnRecord

__all__ = [
    "CANCELS",
    "CLOSES",
    "EVENTS",
    "NOTIFY_CHANNELS",
    "ORPHANS",
    "TURNS",
    "WATCHES",
    "CommittedTurn",
    "IdempotencyRecord",
    "Lease",
    "LeaseLost",
    "ReloadRow",
    "ReplicaRow",
    "SpendRow",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "StoredEntry",
    "StoredSession",
    "UnknownSession",
]


#: Notification channels (PostgreSQL LISTEN/NOTIFY): a released session with a pending turn, a
#: turn that ended (payload ``session turn replica``), a cancel asked of the replica running a
#: turn, the sessions a replica has subscribers for, and the progress events relayed to them
#: (``agentd.supervisor.relay``), and a session closed (payload ``session``: other replicas drop
#: what they hold of it).
ORPHANS = "agentd_orphans"
TURNS = "agentd_turns"
CANCELS = "agentd_cancels"
WATCHES = "agentd_watches"
EVENTS = "agentd_events"
CLOSES = "agentd_closes"
NOTIFY_CHANNELS = (ORPHANS, TURNS, CANCELS, WATCHES, EVENTS, CLOSES)


class StoreError(Exception):
    """A store call that cannot be done; the message names the session and turn concerned."""


class StoreUnavailable(StoreError):
    """The database itself failed (I/O error, disk full, locked, unreachable): not the call's fault.

    ``full`` is set when the disk (or the database's size limit) is full.
    """

    def __init__(self, message: str, *, full: bool = False) -> None:
        super().__init__(message)
        self.full = full


class UnknownSession(StoreError):
    """A call named a session the store does not have."""


class LeaseLost(StoreError):
    """A fenced write whose lease is no longer the session's current one; nothing was written.

    Another replica claimed the session since (``holder`` and ``holder_token``), or the lease was
    released (``holder`` None). The replica that gets this must stop acting for the session.
    """

    def __init__(self, lease: Lease, what: str, *, holder: str | None, holder_token: int) -> None:
        now = f"replica {holder} holds it now (token {holder_token})" if holder else "no replica holds it now"
        super().__init__(
            f"{what}: replica {lease.replica} no longer holds the lease of session {lease.session}"
            f" (its token {lease.token}); {now}"
        )
        self.lease = lease
        self.holder = holder
        self.holder_token = holder_token


class UnknownApproval(StoreError):
    """No approval has that id."""


class AlreadyDecided(StoreError):
    """The approval was decided before (here or on another replica): ``approval`` is how it stands."""

    def __init__(self, approval: Approval) -> None:
        super().__init__(f"approval {approval.id} was {approval.status.value} already")
        self.approval = approval


class ParkResult(msgspec.Struct, frozen=True, kw_only=True):
    """What ``park_turn`` left: the turn's pending approvals (in call order), which of them are new
    (to announce), and the pending ones of a discarded run it cancelled."""

    approvals: list[Approval]
    new: list[str]
    cancelled: list[Approval]


class StoredEntry(msgspec.Struct, frozen=True):
    """One transcript entry: its per-session sequence number and the message."""

    seq: int
    message: Message


class SpendRow(msgspec.Struct, frozen=True, kw_only=True, gc=False):  # many per report: not GC-tracked
    """One line of ``Store.usage_report``: what ended turns spent on ``model`` within one group
    (``key``: an assistant, a model or a session) at one price (None: unpriced), summed by the database."""

    key: str
    model: str
    usage: Usage
    price: Price | None


class CommittedTurn(msgspec.Struct, frozen=True):
    """What ``commit_turn`` wrote: the turn's record as stored, and the seqs of the entries it added."""

    record: TurnRecord
    seqs: tuple[int, ...]


class StoredSession(msgspec.Struct, frozen=True, kw_only=True):
    """A session as stored. ``transcript`` and ``turns`` are empty in ``list_sessions`` results.

    ``turns`` are in start order: a ``TurnRecord`` for each turn that ended, a ``StartedTurn``
    for the one still pending (at most one).
    """

    id: str
    assistant: str
    state: SessionState
    generation: int
    model: str
    created_at: float
    updated_at: float
    transcript: list[StoredEntry] = []
    turns: list[TurnRecord | StartedTurn] = []
    turn_count: int = 0  # how many turns the session has had (filled in summaries too)


class Lease(msgspec.Struct, frozen=True, kw_only=True):
    """A replica's ownership of a session (RFC 0009 §3).

    ``token`` is the fencing token: it grows by one with every claim that changes hands, so a
    later owner always holds a larger one. ``expires_at`` is epoch seconds by the store's clock
    (the database server's, for PostgreSQL): until then no other replica can claim the session.
    An expired lease stays valid for fenced writes until another replica claims the session.
    """

    session: str
    replica: str
    token: int
    expires_at: float
    #: Other replicas that had event subscribers for the session when this lease was claimed
    #: (``Store.watch``): the holder relays the events of the turn it runs there. Empty on renewals.
    watchers: tuple[str, ...] = ()


class ReplicaRow(msgspec.Struct, frozen=True, kw_only=True):
    """A replica as the registry has it (RFC 0009 §7): its config generation, how many sessions it
    owned at its last beat, and when that was (epoch seconds by the store's clock)."""

    id: str
    generation: int
    sessions: int
    seen_at: float


class IdempotencyRecord(msgspec.Struct, frozen=True, kw_only=True):
    """An ``Idempotency-Key`` as stored (RFC 0010 §2): the request it was first sent with
    (``fingerprint``), the process answering it now (``owner``, None when none is), the session and
    turn ids chosen for that request before it created anything, and its answer once given
    (``status``, ``answer``, ``headers``; ``status`` None until then). Times are epoch seconds by
    the store's clock."""

    scope: str
    key: str
    fingerprint: str
    owner: str | None
    session: str | None
    turn: str | None
    status: int | None
    answer: str | None
    headers: dict[str, str]
    created_at: float
    expires_at: float


class ReloadRow(msgspec.Struct, frozen=True, kw_only=True):
    """One reload as the history keeps it (RFC 0000 §6, ``GET /v1/reloads``): the generation it left
    running, when (epoch seconds), whether it was applied, its errors as (path, message) pairs,
    the changed field paths, how many sessions it swapped, and the replica that ran it."""

    generation: int
    at: float
    applied: bool
    errors: tuple[tuple[str, str], ...] = ()
    changed: tuple[str, ...] = ()
    swapped_total: int = 0
    replica: str = ""


class Store(abc.ABC):
    """The durable store of the supervisor; open one with ``agentd.store.open_store``.

    ``failure`` holds why the database last failed (``StoreUnavailable``), None once it works
    again (RFC 0003 §3); readiness reports it. SQLite sets it from each batch of writes,
    PostgreSQL from every call (an unreachable server fails reads too).
    ``location`` names the store in messages and logs, and never carries a secret.
    """

    failure: str | None

    @property
    @abc.abstractmethod
    def location(self) -> str:
        """Where the store is: the database file, or the database's URL without credentials."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Close the store after the calls already running have finished. Idempotent; later calls
        get StoreError ("the store is closed")."""

    # ------------------------------------------------------------------ sessions

    @abc.abstractmethod
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
        """Store a new session in state ``idle`` with its initial transcript (e.g. the opener).

        StoreError if a session with this id exists.
        """

    @abc.abstractmethod
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
        """Set the given fields of a session (the others are kept); ``updated_at`` becomes now.

        UnknownSession if the session is unknown, StoreError if ``state`` is not a session state,
        LeaseLost if ``lease`` is given and is no longer the session's.
        """

    @abc.abstractmethod
    async def load_session(self, session_id: str) -> StoredSession | None:
        """The session with its active transcript and all its turns, or None if unknown."""

    @abc.abstractmethod
    async def ended_turn(self, session_id: str, turn_id: str) -> tuple[TurnRecord, list[StoredEntry]] | None:
        """A turn that ended — its record and its active entries, in order — without reading the
        rest of the transcript; None while it is pending, or if the session or turn is unknown."""

    @abc.abstractmethod
    async def session_summary(self, session_id: str) -> StoredSession | None:
        """The session's row only (no transcript, no turns; ``turn_count`` 0), or None if unknown."""

    @abc.abstractmethod
    async def transcript(self, session_id: str, *, exclude_turn: str | None = None) -> list[Message]:
        """The session's active transcript in order; ``exclude_turn``'s entries left out (its input re-runs)."""

    @abc.abstractmethod
    async def list_sessions(
        self, *, limit: int = 100, after: str | None = None, state: str | None = None, assistant: str | None = None
    ) -> list[StoredSession]:
        """One page of sessions (closed ones included) in creation order, newest last; transcript/turns empty.

        ``after`` is the id of the last session of the previous page. UnknownSession if it is unknown.
        ``state`` keeps the sessions in that state as their rows have it (``running`` while a turn
        is pending), ``assistant`` those on that assistant.
        """

    @abc.abstractmethod
    async def interrupted_turns(self) -> list[tuple[StoredSession, StartedTurn]]:
        """Every pending turn of a session that is not closed, oldest first: what a restart resumes."""

    @abc.abstractmethod
    async def sessions_of_turn(self, turn_id: str) -> list[str]:
        """The ids of the sessions that have a turn ``turn_id`` (turn ids are random: one, or none)."""

    @abc.abstractmethod
    async def session_counts(self) -> dict[str, int]:
        """How many sessions are in each state (``idle``, ``running``, ``failed``, ``closed``)."""

    @abc.abstractmethod
    async def usage_report(
        self,
        group_by: str,
        *,
        since: float | None = None,
        until: float | None = None,
        limit: int | None = None,
        after: str | None = None,
    ) -> list[SpendRow]:
        """What turns that ended in [``since``, ``until``) spent, summed in the database per
        ``group_by`` (``assistant``, ``model`` or ``session``), model and price (RFC 0011 §2); with
        ``limit``, only the first ``limit`` groups whose key sorts after ``after``. StoreError for
        another ``group_by``."""

    @abc.abstractmethod
    async def open_sessions_by_assistant(self) -> dict[str, int]:
        """How many sessions that are not closed are on each assistant."""

    # ------------------------------------------------------------------ turns

    @abc.abstractmethod
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
        """Start a turn in one transaction: store its user message, a ``pending`` turn row, state ``running``.

        ``trace``: the W3C trace context of the request (RFC 0011 §4), given back in ``StartedTurn.trace``.

        The message is stored with its ``turn`` field set to ``turn_id``. Returns the message's
        seq, or None for an opener turn (``message`` None). UnknownSession if the session is
        unknown; StoreError if it is closed, already has a pending turn, or already had a turn
        with this id. Not fenced: any replica may accept a message (RFC 0009 §4).

        ``durable`` False: committed (visible, and kept if the daemon's process dies) but not
        synced to disk by itself — the next durable commit syncs it (one sequential log on both
        backends). For a client that hears nothing before the turn's own, durable, commit.
        """

    @abc.abstractmethod
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
        """Write a finished turn in one transaction — the only write for its results.

        Appends ``messages`` as active entries or, when ``transcript`` is given (a transfer
        rewrote history), marks every active entry inactive and inserts ``transcript`` as the new
        active transcript. Sets the turn's status, models, steps, restarts, discarded, usage,
        ended_at and error from ``record``, and the session's ``assistant``, state (``idle``
        unless ``closed``), updated_at, and — when a transfer changed the assistant — ``model``.
        ``record.started_at`` is not written: a turn started when ``begin_turn`` stored it, and
        the returned record carries that time.

        Idempotent: a commit that finds the turn no longer pending because an earlier attempt of
        this very commit ended it (its answer was lost with the connection, so its caller retries)
        writes nothing and returns what that attempt returned — the lease, if any, is still
        current, the turn's row holds these results, and the entries that attempt wrote are
        these messages (``codec.landed_commit_seqs``; RFC 0003 §3).

        UnknownSession if the session is unknown; StoreError if the turn is unknown, or not
        pending and ended otherwise (any other commit of an ended turn writes nothing);
        LeaseLost if ``lease`` is given and is no longer the session's, checked first. If
        anything fails, nothing of the turn is written.
        """

    @abc.abstractmethod
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
        """End a pending turn without results (e.g. its session was closed); its user message stays.

        ``status`` must be a TurnStatus value. A ``running`` session becomes ``idle``; a
        ``failed`` or ``closed`` one keeps its state. ``spent``: what the turn spent before it
        ended (a parked run's model calls, priced), stored like a commit stores it — its steps,
        models, usage, cost and spend per model. StoreError if the turn is unknown or not
        pending; LeaseLost if ``lease`` is given and is no longer the session's.
        """

    @abc.abstractmethod
    async def pending_turn(self, session_id: str) -> StartedTurn | None:
        """The session's pending turn (with its user message), or None. UnknownSession if the session is unknown."""

    @abc.abstractmethod
    async def request_cancel(self, session_id: str, turn_id: str) -> bool:
        """Mark the pending turn as asked to cancel (unfenced: any replica may ask); False if it is
        not pending. Whoever runs it next reads ``StartedTurn.cancel_requested`` and ends it
        ``cancelled`` instead (RFC 0009 §7)."""

    # ------------------------------------------------------------------ the tool journal (RFC 0008 §5)

    @abc.abstractmethod
    async def journal_start(
        self, session_id: str, turn_id: str, entry: JournalEntry, *, lease: Lease | None = None
    ) -> None:
        """Journal that a side-effecting call is about to run (``entry``'s result fields are ignored).

        Durable when this returns: only then may the tool run. StoreError if the turn is not
        pending or the turn already journaled ``entry.seq`` (a call is journaled once); fenced by
        ``lease`` (LeaseLost), like a commit.
        """

    @abc.abstractmethod
    async def journal_finish(
        self, session_id: str, turn_id: str, seq: int, *, content: str, is_error: bool, lease: Lease | None = None
    ) -> None:
        """Journal the result of the call journaled as ``seq``. StoreError if there is no such started
        call or the turn is not pending; fenced by ``lease``."""

    @abc.abstractmethod
    async def journal_entries(self, session_id: str, turn_id: str) -> list[JournalEntry]:
        """The journaled calls of a turn in order (empty once the turn has ended: commit and abandon
        delete them in the transaction that ends the turn)."""

    # ------------------------------------------------------------------ approvals (RFC 0012 §4)

    @abc.abstractmethod
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
        """Store a pending turn's run that stopped for approvals, and a pending approval per request
        (``(new id, request)``) — kept, same id, when a pending one of the turn has the same tool and
        arguments; other pending ones of the turn are cancelled. Fenced by ``lease``."""

    @abc.abstractmethod
    async def decide_approval(
        self, approval_id: str, status: str, *, reason: str | None, arguments: dict[str, Any] | None
    ) -> tuple[Approval, bool]:
        """Decide a pending approval, once: it as decided, and whether its turn can go on now (no
        approval of it waits). UnknownApproval; AlreadyDecided when it was decided before."""

    @abc.abstractmethod
    async def expire_approvals(self, now: float, *, limit: int = 1000) -> tuple[list[Approval], list[tuple[str, str]]]:
        """Pending approvals past their ``expires_at`` become ``expired``: them, and the (session,
        turn) that can go on now."""

    @abc.abstractmethod
    async def next_expiry(self) -> float | None:
        """When the next pending approval expires (None: no pending one will)."""

    @abc.abstractmethod
    async def parked_run(self, session_id: str, turn_id: str) -> tuple[ParkedRun, list[Approval]] | None:
        """The turn's parked run and every approval of the turn (None: it has no parked run)."""

    @abc.abstractmethod
    async def awaiting_turn(self, session_id: str) -> str | None:
        """The session's pending turn if it awaits approval."""

    @abc.abstractmethod
    async def awaiting_sessions(self, session_ids: Sequence[str]) -> set[str]:
        """Which of ``session_ids`` have a turn that awaits approval."""

    @abc.abstractmethod
    async def get_approval(self, approval_id: str) -> Approval | None:
        """One approval."""

    @abc.abstractmethod
    async def list_approvals(
        self, *, status: str | None = None, session: str | None = None, limit: int = 100, after: str | None = None
    ) -> list[Approval]:
        """A page of approvals, oldest first; UnknownApproval when ``after`` is unknown."""

    @abc.abstractmethod
    async def pending_approvals(self) -> int:
        """How many approvals wait for a decision."""

    @abc.abstractmethod
    async def unpark_for_swap(self, assistant: str, model: str) -> list[tuple[str, str]]:
        """Restart-turn: drop the parked runs of ``assistant``'s turns awaiting approval that ran on
        another model than ``model``; those (session, turn), to re-run."""

    # ------------------------------------------------------------------ leases (RFC 0009 §3)

    @abc.abstractmethod
    async def claim(self, session_id: str, replica: str, ttl: float, *, turn: str | None = None) -> Lease | None:
        """Make ``replica`` the owner of the session for ``ttl`` seconds; the lease, or None if another holds it.

        A session nobody holds, or whose lease expired, gets a new lease with a token one larger
        than any before; one ``replica`` already holds keeps its token and is extended. None when
        another replica's lease has not expired. UnknownSession if the session is unknown,
        StoreError if it is closed.

        With ``turn``, only while that turn is still pending: None (and nothing claimed) once it
        ended — another replica's failover scan took it between its ``begin_turn`` and this claim,
        ran it and released the session — so it never runs twice.
        """

    @abc.abstractmethod
    async def renew(self, replica: str, ttl: float) -> dict[str, Lease]:
        """The heartbeat: extend every lease ``replica`` holds to ``ttl`` seconds from now.

        Returns session id → lease for each session it still holds; a session it held and that
        is missing was claimed by another replica since (its writes there are now refused).
        """

    @abc.abstractmethod
    async def release(self, lease: Lease) -> bool:
        """Give the session up (e.g. a drain), so another replica can claim it at once.

        True if ``lease`` was the session's current lease and is now released; False if it was
        not (nothing is changed then). UnknownSession if the session is unknown.
        """

    @abc.abstractmethod
    async def claim_orphaned(self, replica: str, ttl: float, *, limit: int = 100) -> list[Lease]:
        """Claim up to ``limit`` sessions that need an owner: the failover scan.

        Those are the sessions that are not closed, have a pending turn, and whose lease expired
        or that no replica holds, oldest pending turn first; sessions ``replica`` itself holds
        are left to ``renew``. Replicas that scan at the same time get disjoint sets and never
        wait for each other (PostgreSQL: ``FOR UPDATE SKIP LOCKED``).
        """

    @abc.abstractmethod
    async def lease_of(self, session_id: str) -> Lease | None:
        """The session's live lease (not expired), or None when no replica holds one now.

        UnknownSession if the session is unknown.
        """

    # ------------------------------------------------------------------ the replica registry (RFC 0009 §7)

    @abc.abstractmethod
    async def beat(self, replica: str, *, generation: int, sessions: int) -> ReplicaRow:
        """Record that ``replica`` is alive now, running ``generation`` and owning ``sessions``
        sessions (its row is created or replaced); the row as stored, ``seen_at`` by the store's clock."""

    @abc.abstractmethod
    async def record_reload(self, reload: ReloadRow, *, keep: int) -> None:
        """Add ``reload`` to the reload history, keeping only the newest ``keep`` reloads."""

    @abc.abstractmethod
    async def reloads(self, limit: int) -> list[ReloadRow]:
        """The newest ``limit`` reloads of the history, newest first."""

    @abc.abstractmethod
    async def live_replicas(self, max_age: float) -> list[ReplicaRow]:
        """The replicas that beat within the last ``max_age`` seconds (by the store's clock), by id."""

    @abc.abstractmethod
    async def watch(self, replica: str, sessions: Sequence[str], ttl: float) -> None:
        """``replica`` has event subscribers for ``sessions``, for ``ttl`` seconds from now (by the
        store's clock) unless renewed: a claim of one of them meanwhile by another replica lists
        ``replica`` in ``Lease.watchers``. Also deletes every watch that expired."""

    @abc.abstractmethod
    async def unwatch(self, replica: str, sessions: Sequence[str]) -> None:
        """``replica`` no longer has subscribers for ``sessions``."""

    # ------------------------------------------------------------------ idempotency keys (RFC 0010 §2)

    @abc.abstractmethod
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
        """Claim ``key`` in ``scope`` for ``owner`` until ``ttl`` seconds from now (the store's clock),
        with the ids its request will create: None once claimed; else the unexpired record that
        already holds the key (nothing is changed then). Every expired record is deleted."""

    @abc.abstractmethod
    async def idempotency_take_over(self, scope: str, key: str, *, owner: str, previous: str | None) -> bool:
        """``owner`` answers the key from now on — if ``previous`` (None: nobody) still answers it and
        no answer is stored; False, and nothing changed, otherwise (another took it over first)."""

    @abc.abstractmethod
    async def idempotency_release(self, scope: str, key: str, *, owner: str) -> None:
        """``owner`` stops answering the key without an answer (its request failed before creating
        what it would): the next request with the key does it again, with the same ids."""

    @abc.abstractmethod
    async def idempotency_answer(
        self, scope: str, key: str, *, status: int, answer: str, headers: dict[str, str]
    ) -> None:
        """Keep the answer of the key's request: every later request with the key gets it, until it expires."""

    # ------------------------------------------------------------------ notifications between replicas (RFC 0009 §7)

    async def notify(self, channel: str, payload: str) -> None:
        """Tell every replica listening on ``channel`` (``NOTIFY_CHANNELS``) ``payload``, best effort.

        The default does nothing: with one daemon on the store (SQLite) there is nobody to tell.
        Never raises; a notification that cannot be sent is lost, which every user tolerates.
        """
        return None

    async def notify_many(self, notes: Sequence[tuple[str, str]], *, fences: Sequence[Lease | None] = ()) -> str | None:
        """Send ``notes`` (channel, payload) in one transaction, so they are delivered in this order,
        together; None once sent, else why they were not (best effort: never raises). A note whose
        fence (``fences[i]``, when given) was superseded — another holder claimed the session
        since — is not sent: a run whose lease was lost speaks no more, as it commits no more (RFC
        0009 §7). A fence released by its own holder (the turn ended) still holds for its run's
        last events, queued before the release.

        The default sends nothing: with one daemon on the store (SQLite) there is nobody to tell.
        """
        return None

    def take_listen_gap(self) -> float | None:
        """When (epoch seconds) the last gap in listening for notifications began, once this store
        listens again; None if there was none since the last call. The default never has one."""
        return None

    async def next_notification(self, seconds: float) -> tuple[str, str] | None:
        """Wait up to ``seconds`` for a notification on one of ``NOTIFY_CHANNELS``: (channel,
        payload), or None when none came. A release that leaves a pending turn behind notifies
        ``ORPHANS`` by itself. The default sleeps and returns None. Never raises."""
        await anyio.sleep(seconds)
        return None
