"""Progress events across replicas (RFC 0009 §7): a subscriber on one replica sees the events of a
turn that another replica runs.

Ownership is per turn, so the replica running a session's turn is often not the one a client
streams the session's events from. Two notification channels of the shared store connect them:

- ``WATCHES``: a replica with subscribers of a session says so (``<replica> + <session>...``) when
  the first subscribes, again every heartbeat while they stay, and ``-`` when the last leaves.
  Every replica keeps what it heard in a ``RemoteWatchers`` table whose entries expire after a
  lease without a refresh, so a watcher that died is forgotten and a lost notice costs at most
  one refresh.
- ``EVENTS``: the replica running a turn of a session watched elsewhere sends each of the turn's
  progress events there. An event travels as one or more notifications (PostgreSQL refuses a
  payload of 8,000 bytes or more) numbered per sender, which also makes two equal events of one
  batch distinct (PostgreSQL delivers identical notifications of a transaction once).

Order: one ``EventRelay`` task sends everything a replica relays, in the order it was queued,
batch after batch, each batch one transaction; PostgreSQL delivers notifications in commit order
and the listener handles them one at a time. The turn's end notice (``TURNS``) goes through the
same queue after the turn's events, so a remote subscriber gets every progress event before
``turn.done``.

The codecs and the watcher table are pure; ``EventRelay`` is the only part doing I/O.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import anyio

from agentd import events
from agentd.obs import get_logger
from agentd.store import Lease

__all__ = [
    "MAX_PAYLOAD",
    "EventRelay",
    "Notifier",
    "Reassembler",
    "RelayedEvent",
    "RemoteWatchers",
    "WatchNotice",
    "decode_watch",
    "encode_event",
    "encode_watch",
    "relay_fence",
]

#: The largest notification payload sent, in bytes: under PostgreSQL's 8,000-byte limit, with room.
MAX_PAYLOAD = 7800
#: Notifications a replica keeps queued while the database is slow; past this the oldest are dropped.
QUEUE_LIMIT = 20_000
#: How many queued notifications one transaction sends.
BATCH = 200

log = get_logger("replica")


# ---------------------------------------------------------------------------- who watches where


class RemoteWatchers:
    """Which sessions other replicas have subscribers for, as heard on ``WATCHES`` (pure: the
    caller passes the time). An entry lasts ``ttl`` seconds unless refreshed."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._until: dict[str, dict[str, float]] = {}  # session -> replica -> expiry

    def note(self, replica: str, sessions: Iterable[str], now: float) -> list[str]:
        """``replica`` watches ``sessions``; returns those that nobody watched remotely before."""
        fresh = []
        for session in sessions:
            replicas = self._until.setdefault(session, {})
            if not any(until > now for until in replicas.values()):
                fresh.append(session)
            replicas[replica] = now + self.ttl
        return fresh

    def forget(self, replica: str, sessions: Iterable[str]) -> None:
        """``replica`` no longer watches ``sessions``."""
        for session in sessions:
            replicas = self._until.get(session)
            if replicas is not None:
                replicas.pop(replica, None)
                if not replicas:
                    del self._until[session]

    def watched(self, session: str, now: float) -> bool:
        """Whether a live replica other than this one has subscribers for ``session``."""
        replicas = self._until.get(session)
        return replicas is not None and any(until > now for until in replicas.values())

    def prune(self, now: float) -> None:
        """Drop the entries that expired (a watcher that died or stopped refreshing)."""
        for session in list(self._until):
            replicas = {replica: until for replica, until in self._until[session].items() if until > now}
            if replicas:
                self._until[session] = replicas
            else:
                del self._until[session]

    def __len__(self) -> int:
        return len(self._until)


class WatchNotice(NamedTuple):
    """One ``WATCHES`` notification: ``replica`` starts (``watching``) or stops watching ``sessions``."""

    replica: str
    watching: bool
    sessions: list[str]


def encode_watch(replica: str, watching: bool, sessions: Iterable[str]) -> list[str]:
    """The ``WATCHES`` payloads saying that ``replica`` watches (or stopped watching) ``sessions``,
    as few as fit ``MAX_PAYLOAD``."""
    head = f"{replica} {'+' if watching else '-'}"
    payloads: list[str] = []
    line = head
    for session in sessions:
        if len(line) + 1 + len(session.encode()) > MAX_PAYLOAD and line != head:
            payloads.append(line)
            line = head
        line = f"{line} {session}"
    if line != head:
        payloads.append(line)
    return payloads


def decode_watch(payload: str) -> WatchNotice | None:
    """A ``WATCHES`` payload read back; None when it is not one."""
    fields = payload.split()
    if len(fields) < 3 or fields[1] not in ("+", "-"):
        return None
    return WatchNotice(fields[0], fields[1] == "+", fields[2:])


# ---------------------------------------------------------------------------- events on the wire


class RelayedEvent(NamedTuple):
    """A session event relayed from ``origin``, the replica running its turn."""

    origin: str
    seq: int
    session: str
    turn: str | None
    name: str
    data: dict[str, Any]


def encode_event(origin: str, seq: int, session: str, turn: str | None, name: str, data: dict[str, Any]) -> list[str]:
    """The ``EVENTS`` payloads carrying one event: ``<origin> <seq> <part> <parts> <json chunk>``.

    The JSON is ASCII (non-ASCII escaped), so a chunk boundary never splits a character and every
    payload stays under ``MAX_PAYLOAD`` bytes.
    """
    body = json.dumps({"s": session, "t": turn, "n": name, "d": data}, ensure_ascii=True, separators=(",", ":"))
    size = MAX_PAYLOAD - len(origin) - 64  # the header: origin, then four numbers
    chunks = [body[start : start + size] for start in range(0, len(body), size)] or [""]
    return [f"{origin} {seq} {part} {len(chunks)} {chunk}" for part, chunk in enumerate(chunks)]


class Reassembler:
    """Turns ``EVENTS`` payloads back into events (pure). An event in several parts is complete
    at its last part; parts come in order from one sender, so one partial event per sender is kept.
    ``missed`` counts events known lost: a sender's numbers skipped, or a part missing."""

    def __init__(self) -> None:
        self._partial: dict[str, tuple[int, int, list[str]]] = {}  # origin -> (seq, parts, chunks)
        self._last: dict[str, int] = {}  # origin -> the last seq seen
        self.missed = 0

    def feed(self, payload: str) -> RelayedEvent | None:
        """The event ``payload`` completes, or None (a part of one, or not an event payload)."""
        fields = payload.split(" ", 4)
        if len(fields) != 5:
            return None
        origin, seq_text, part_text, parts_text, chunk = fields
        try:
            seq, part, parts = int(seq_text), int(part_text), int(parts_text)
        except ValueError:
            return None
        if part == 0:
            self._count_gap(origin, seq)
            self._partial.pop(origin, None)
            if parts == 1:
                return _decode_event(origin, seq, chunk)
            self._partial[origin] = (seq, parts, [chunk])
            return None
        held = self._partial.get(origin)
        if held is None or held[0] != seq or len(held[2]) != part:
            self._partial.pop(origin, None)
            self.missed += held is not None
            return None
        held[2].append(chunk)
        if part + 1 < held[1]:
            return None
        del self._partial[origin]
        return _decode_event(origin, seq, "".join(held[2]))

    def _count_gap(self, origin: str, seq: int) -> None:
        last = self._last.get(origin)
        if last is not None and seq > last + 1:
            self.missed += seq - last - 1
        if origin in self._partial:
            self.missed += 1  # its last part never came
        self._last[origin] = seq  # a smaller number: the sender restarted under the same id


def _decode_event(origin: str, seq: int, body: str) -> RelayedEvent | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    session, turn, name, data = value.get("s"), value.get("t"), value.get("n"), value.get("d")
    if not isinstance(session, str) or not isinstance(name, str) or not isinstance(data, dict):
        return None
    if turn is not None and not isinstance(turn, str):
        return None
    return RelayedEvent(origin, seq, session, turn, name, data)


# ---------------------------------------------------------------------------- the sender


class Notifier(Protocol):
    """What the relay needs of the store (``Store.notify_many``)."""

    async def notify_many(self, notes: Sequence[tuple[str, str]], *, fences: Sequence[Lease | None] = ()) -> str | None:
        """Send ``notes`` in one transaction, each only while its fence holds; None once sent, else why not."""


class EventRelay:
    """Sends this replica's relayed notifications (events, watch notices, turn ends) in order.

    ``send`` never waits: it queues. ``run`` (a task for the daemon's life) sends the queue batch
    by batch; a batch the database refuses is dropped (notifications are best effort, like every
    other one: a lost ``turn.done`` notice is covered by the subscriber's own reads, a lost event
    is one a remote subscriber misses) and logged. ``flush`` waits until what was queued before it
    has been sent, bounded.
    """

    def __init__(self, store: Notifier, replica: str) -> None:
        self.store = store
        self.replica = replica
        # (channel, payload, fence): an event goes out only while the lease it was produced under holds.
        self._queue: collections.deque[tuple[str, str, Lease | None]] = collections.deque()
        self._queued = 0  # notifications ever queued
        self._sent = 0  # ... and sent or given up on
        self._seq = 0
        self._wake = anyio.Event()
        self._progress = anyio.Event()
        self.dropped = 0
        self.fenced = 0  # events of a run that no longer runs here, not relayed

    def send(self, channel: str, payload: str, *, fence: Lease | None = None) -> None:
        """Queue one notification; with a ``fence``, the store sends it only while that lease is current."""
        self._queue.append((channel, payload, fence))
        self._queued += 1
        if len(self._queue) > QUEUE_LIMIT:  # the database cannot keep up: bound the memory
            self._queue.popleft()
            self._sent += 1
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning(events.LOG_REPLICA_RELAY_DROPPED, replica=self.replica, dropped=self.dropped)
        self._wake.set()

    def send_event(
        self,
        channel: str,
        session: str,
        turn: str | None,
        name: str,
        data: dict[str, Any],
        *,
        fence: Lease | None = None,
    ) -> None:
        """Queue one session event for the replicas watching ``session``; with a ``fence`` (the
        lease of the run that produced it) the store sends it only while that lease is current —
        fenced like a commit (RFC 0009 §7): once another replica holds the session, a subscriber
        must not get this run's events among (or after) the new run's."""
        self._seq += 1
        for payload in encode_event(self.replica, self._seq, session, turn, name, data):
            self.send(channel, payload, fence=fence)

    def fence_stale(self) -> None:
        """Count an event not relayed: its run no longer runs here (``relay_fence``)."""
        self.fenced += 1
        if self.fenced == 1 or self.fenced % 100 == 0:  # the first, then one line per hundred
            log.info(events.LOG_REPLICA_EVENTS_FENCED, replica=self.replica, total=self.fenced)

    async def flush(self, bound: float) -> bool:
        """Wait (at most ``bound`` seconds) until everything queued so far was sent; whether it was."""
        target = self._queued
        with anyio.move_on_after(bound):
            while self._sent < target:
                await self._progress.wait()
        return self._sent >= target

    async def run(self) -> None:
        """Send the queue, batch after batch, for as long as the daemon runs."""
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            while self._queue:
                taken = list(_take(self._queue, BATCH))
                batch = [(channel, payload) for channel, payload, _ in taken]
                try:
                    failure = await self.store.notify_many(batch, fences=[fence for _, _, fence in taken])
                except Exception as exc:  # never the daemon's end: these are best effort
                    log.exception(
                        events.LOG_REPLICA_RELAY_FAILED, replica=self.replica, lost=len(batch), error=str(exc)
                    )
                    failure = None
                if failure is not None:
                    log.warning(events.LOG_REPLICA_RELAY_FAILED, replica=self.replica, lost=len(batch), error=failure)
                self._sent += len(batch)
                progress, self._progress = self._progress, anyio.Event()
                progress.set()


def relay_fence(turn: str | None, running: str | None, lease: Lease | None) -> tuple[bool, Lease | None]:
    """Whether an event of ``turn`` may be relayed by the replica where ``running`` (the session's
    turn running here, if any) runs under ``lease``, and the fence it goes out under. An event of
    no turn is the session's (a swap of an idle session): unfenced. One of a turn that no longer
    runs here comes from a run whose lease was found lost: never relayed."""
    if turn is None:
        return True, None
    if turn != running:
        return False, None
    return True, lease


def _take(
    queue: collections.deque[tuple[str, str, Lease | None]], count: int
) -> Iterator[tuple[str, str, Lease | None]]:
    for _ in range(min(count, len(queue))):
        yield queue.popleft()
