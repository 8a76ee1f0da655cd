"""Idempotency keys (RFC 0010 §2): the one owner of the store's ``idempotency`` records.

A creating POST that carries ``Idempotency-Key`` claims the key before it creates anything, with
the ids of what it will create (a session, a turn) chosen there and then. So whatever happens
next — the process is killed, the store fails, the client gives up — the request, asked again
with the key, creates nothing new: it finds its answer kept, or is told the key is in progress,
or (nobody answers it any more) takes the key over and does the request again with the same ids,
which resumes what the first attempt created (a session that exists is not created again, a
turn that was stored is waited for, not begun again). What to do with a key found is ``decide``,
a pure function of the record and of whether its owner lives.
"""

from __future__ import annotations

import enum

import msgspec

from agentd import events
from agentd.errors import KeyInUse, KeyReused, store_failure
from agentd.obs import get_logger
from agentd.store import IdempotencyRecord, Store, StoreError
from agentd.supervisor.membership import Membership
from agentd.supervisor.running import Running
from agentd.supervisor.turns import new_id

__all__ = ["Claim", "Found", "Keys", "Replay", "decide"]

log = get_logger("api")


class Found(enum.Enum):
    """What a request does with a key that is already held."""

    REPLAY = "replay"  # its answer is kept: answer that
    REUSED = "reused"  # it was sent with another request: 422
    IN_PROGRESS = "in_progress"  # its owner may still be answering it: 409
    TAKE_OVER = "take_over"  # nobody answers it: do the request again, with its ids


def decide(record: IdempotencyRecord, fingerprint: str, *, owner_alive: bool) -> Found:
    """What a request with ``fingerprint`` does with the key ``record`` holds."""
    if record.fingerprint != fingerprint:
        return Found.REUSED
    if record.status is not None:
        return Found.REPLAY
    if record.owner is not None and owner_alive:
        return Found.IN_PROGRESS
    return Found.TAKE_OVER


class Claim(msgspec.Struct, frozen=True, kw_only=True):
    """A key this process answers now, and the ids its request creates (``resumed``: a request
    before did the same, and may have created them already)."""

    scope: str
    key: str
    session: str
    turn: str
    resumed: bool = False


class Replay(msgspec.Struct, frozen=True, kw_only=True):
    """The answer kept for a key."""

    status: int
    answer: bytes
    headers: dict[str, str]


class Keys:
    """Claims, answers and releases idempotency keys in the store, for this process."""

    def __init__(self, store: Store, membership: Membership, running: Running) -> None:
        self.store = store
        self.membership = membership
        self.ttl = running.config.server.idempotency_ttl  # [server] is restart-only
        self._answering: set[tuple[str, str]] = set()  # (scope, key) of the requests this process answers now

    async def claim(self, scope: str, key: str, fingerprint: str) -> Claim | Replay:
        """Claim ``key`` for a request (``fingerprint``: what it asks); the kept answer if it has one.

        KeyReused if the key was sent with another request, KeyInUse while another request with it
        is being answered; a store failure refuses (nothing was done).
        """
        session, turn = new_id("s"), new_id("t")
        owner = self.membership.replica
        try:
            for _ in range(3):  # a take-over lost to another request: look again
                record = await self.store.idempotency_claim(
                    scope, key, fingerprint=fingerprint, owner=owner, session=session, turn=turn, ttl=self.ttl
                )
                if record is None:
                    self._answering.add((scope, key))
                    return Claim(scope=scope, key=key, session=session, turn=turn)
                alive = await self._owner_alive(record)
                found = decide(record, fingerprint, owner_alive=alive)
                if found is Found.REUSED:
                    raise KeyReused(
                        f"Idempotency-Key {key!r} was first sent with another request; "
                        "a key names one request (send this one with a new key)"
                    )
                if found is Found.REPLAY:
                    assert record.status is not None and record.answer is not None
                    return Replay(status=record.status, answer=record.answer.encode(), headers=record.headers)
                if found is Found.TAKE_OVER and await self.store.idempotency_take_over(
                    scope, key, owner=owner, previous=record.owner
                ):
                    self._answering.add((scope, key))
                    return Claim(
                        scope=scope,
                        key=key,
                        session=record.session or session,
                        turn=record.turn or turn,
                        resumed=True,
                    )
                if found is Found.IN_PROGRESS:
                    break
        except StoreError as exc:
            raise store_failure(exc) from None
        raise KeyInUse(f"a request with Idempotency-Key {key!r} is being answered now; ask again later")

    async def _owner_alive(self, record: IdempotencyRecord) -> bool:
        """Whether the key's owner may still be answering it: this process only while one of its
        requests does (a request that ended unanswered without releasing the key left it)."""
        if record.owner is None:
            return False
        if record.owner == self.membership.replica:
            return (record.scope, record.key) in self._answering
        return await self.membership.holder_alive(record.owner)

    async def answer(self, claim: Claim, status: int, answer: bytes, headers: dict[str, str]) -> None:
        """Keep the answer of ``claim``'s request. Best effort: a key whose answer could not be kept
        is taken over by the next request with it, which finds what this one created."""
        self._answering.discard((claim.scope, claim.key))
        try:
            await self.store.idempotency_answer(
                claim.scope, claim.key, status=status, answer=answer.decode(), headers=headers
            )
        except StoreError as exc:
            log.warning(events.LOG_API_KEY_NOT_KEPT, key=claim.key, error=str(exc))

    async def release(self, claim: Claim) -> None:
        """``claim``'s request ended without an answer: the key is free for the request asked again.
        Best effort: a key not released is taken over once this process is no longer alive."""
        self._answering.discard((claim.scope, claim.key))
        try:
            await self.store.idempotency_release(claim.scope, claim.key, owner=self.membership.replica)
        except StoreError as exc:  # taken over by the next request with the key: this process no longer answers it
            log.warning(events.LOG_API_KEY_NOT_KEPT, key=claim.key, error=str(exc))
