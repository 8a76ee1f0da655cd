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

from agentd.obs import get_logger

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

    async def notify_many(self, notes: Sequence[tuple[str, str]]) -> str | None:
        """Send ``notes`` in one transaction; None once sent, else why not."""


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
        self._queue: collections.deque[tuple[str, str]] = collections.deque()
        self._queued = 0  # notifications ever queued
        self._sent = 0  # ... and sent or given up on
        self._seq = 0
        self._wake = anyio.Event()
        self._progress = anyio.Event()
        self.dropped = 0

    def send(self, channel: str, payload: str) -> None:
        """Queue one notification."""
        self._queue.append((channel, payload))
        self._queued += 1
        if len(self._queue) > QUEUE_LIMIT:  # the database cannot keep up: bound the memory
            self._queue.popleft()
            self._sent += 1
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("replica.relay_dropped", replica=self.replica, dropped=self.dropped)
        self._wake.set()

    def send_event(self, channel: str, session: str, turn: str | None, name: str, data: dict[str, Any]) -> None:
        """Queue one session event for the replicas watching ``session``."""
        self._seq += 1
        for payload in encode_event(self.replica, self._seq, session, turn, name, data):
            self.send(channel, payload)

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
                batch = list(_take(self._queue, BATCH))
                try:
                    failure = await self.store.notify_many(batch)
                except Exception as exc:  # never the daemon's end: these are best effort
                    log.exception("replica.relay_failed", replica=self.replica, lost=len(batch), error=str(exc))
                    failure = None
                if failure is not None:
                    log.warning("replica.relay_failed", replica=self.replica, lost=len(batch), error=failure)
                self._sent += len(batch)
                progress, self._progress = self._progress, anyio.Event()
                progress.set()


def _take(queue: collections.deque[tuple[str, str]], count: int) -> Iterator[tuple[str, str]]:
    for _ in range(min(count, len(queue))):
        yield queue.popleft()
