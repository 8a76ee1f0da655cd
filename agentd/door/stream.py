"""A door turn followed as it runs (RFC 0010 §7): the subscription, the turn, its end.

``begin`` subscribes to the session *before* it posts the message (so the turn's first delta is
heard), and answers errors of the post as the non-streamed door does — nothing has been sent yet.
``followed`` then gives what the stream says (``agentd.door.follow``) until the turn ends, and
the turn as it ended (``Ended``: the same view and entries ``GET /v1/responses/{id}`` shows). A
subscription that ends early (a subscriber too slow is dropped, RFC 0000 §7) loses nothing: the
end is read from the store, and the encoders send what the stream missed (``rest_of``).
A turn that parks for approvals (RFC 0012 §3) stays pending: its ``approval.requested`` ends the
following, and ``Parked`` (the parked run and its approvals, from the store) is how it "ended";
``watch`` follows a turn that goes on after its approvals were decided (RFC 0010 §8).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from agentd import events
from agentd.door.follow import Happening, Sent, follow
from agentd.door.outcome import epoch
from agentd.door.parked import Parked, waiting
from agentd.messages import Message
from agentd.records import PENDING
from agentd.service import Claim, Service
from agentd.supervisor.turns import new_id
from agentd.views import Entry, PostMessage, SessionView, TurnView

__all__ = [
    "KEEP_ALIVE",
    "Ended",
    "Followed",
    "begin",
    "followed",
    "let_go",
    "settled",
    "settled_now",
    "sse",
    "sse_response",
    "texts_of",
    "watch",
]

#: Seconds of silence after which a stream sends a comment, as the native event stream does.
KEEP_ALIVE_SECONDS = 15.0
KEEP_ALIVE = b": keep-alive\n\n"
#: How often the end of a turn is looked for in the store when no event says it.
END_POLL = 0.05
END_POLL_MAX = 1.0


class Ended(msgspec.Struct, frozen=True, kw_only=True):
    """The turn as it ended, with the entries it added (its input left out), and the session's assistant."""

    turn: TurnView
    entries: list[Entry]
    assistant: str


class Followed(msgspec.Struct, kw_only=True):
    """A turn being followed: its session, id, the seq of its user message, the seq of the last
    entry before what this answer shows (``base``: the user message's, or — going on after
    approvals — the parked step's assistant message), the assistant whose steps stream
    (``speaker``) with how many texts of it the turn has up to ``base`` (``texts``: a streamed
    message item's id counts on from it), and the subscription (None: the turn was stored by an
    earlier request with the same key — it is only waited for)."""

    session: str
    turn: str
    user_seq: int
    base: int
    speaker: str = ""
    texts: int = 0
    run: int | None = 0  # the run it is followed from (None: whichever goes on after approvals)
    created: int  # epoch seconds: when the turn began
    events: MemoryObjectReceiveStream[tuple[str, dict[str, Any]]] | None


def _placed(view: SessionView, turn: str) -> tuple[int, int]:
    """The seq of the turn's user message (its entries follow it) and when the turn began."""
    seq = next((e.seq for e in view.transcript if e.turn == turn and e.role == "user"), -1)
    began = next((t.started_at for t in view.turns if t.id == turn), None)
    return seq, epoch(began) if began else int(time.time())


async def session_for(
    service: Service, continued: str | None, assistant: str | None, seeded: list[Message], claim: Claim | None
) -> str:
    """The session a door request posts to: the one it continues, else a new one seeded with the
    request's earlier messages (under the id an idempotency key chose for it, if one did)."""
    if continued is not None:
        return continued
    created = await service.create_session(
        assistant,
        session_id=claim.session if claim else None,
        resumed=claim.resumed if claim else False,
        seeded=seeded,
        opener=False,
    )
    return created.id


async def begin(service: Service, session: str, post: PostMessage, *, turn_id: str | None, resumed: bool) -> Followed:
    """Subscribe to ``session`` and post ``post`` to it (not waiting); the turn to follow."""
    turn = turn_id or new_id("t")
    # Read before the post: the turn may transfer before a read after it, and its steps stream as
    # the assistant it began with.
    view = await service.get_session(session)
    speaker = view.assistant
    if resumed and any(t.id == turn for t in view.turns):  # an earlier request with the key stored it
        seq, created = _placed(view, turn)  # it is not begun again
        return Followed(session=session, turn=turn, user_seq=seq, base=seq, created=created, events=None)
    subscription = await service.subscribe(session)
    try:
        await service.send_message(session, msgspec.structs.replace(post, wait=False), turn_id=turn, resumed=resumed)
        seq, created = _placed(await service.get_session(session), turn)
    except BaseException:
        subscription.close()
        service.unsubscribed(session)
        raise
    return Followed(
        session=session, turn=turn, user_seq=seq, base=seq, speaker=speaker, created=created, events=subscription
    )


async def watch(service: Service, session: str, turn_id: str, base: int, texts: int) -> Followed:
    """Subscribe to ``session`` to follow its stored turn ``turn_id`` from ``base`` on (a turn that
    goes on once its approvals are decided: subscribed before they are, so its first delta is
    heard); ``texts``: the assistant's texts of the turn up to ``base``."""
    subscription = await service.subscribe(session)
    try:
        view = await service.get_session(session)  # the turn waits: its assistant is the session's
        seq, created = _placed(view, turn_id)
    except BaseException:
        subscription.close()
        service.unsubscribed(session)
        raise
    return Followed(
        session=session,
        turn=turn_id,
        user_seq=seq,
        base=base,
        speaker=view.assistant,
        texts=texts,
        run=None,
        created=created,
        events=subscription,
    )


def let_go(service: Service, turn: Followed) -> None:
    """End the subscription of a turn that will not be followed after all."""
    if turn.events is not None:
        turn.events.close()
        service.unsubscribed(turn.session)


async def settled_now(service: Service, session: str, turn_id: str) -> Ended | Parked | None:
    """The turn if it ended, or waits for approvals (``Parked``); None while it runs."""
    view = await service.get_session(session)
    turn = next((t for t in view.turns if t.id == turn_id), None)
    if turn is None:
        return None
    if turn.status != PENDING:
        entries = [e for e in view.transcript if e.turn == turn_id and e.role != "user"]
        return Ended(turn=turn, entries=entries, assistant=view.assistant)
    seq, _ = _placed(view, turn_id)
    parked = await service.parked_turn(session, turn_id, seq + 1)
    if parked is not None and waiting(parked):
        return Parked(turn=turn, parked=parked, assistant=view.assistant)
    return None


async def settled(service: Service, session: str, turn_id: str) -> Ended | Parked:
    """The turn once it ended, or parked for approvals, as the store has it (looked for less often
    the longer it runs: a stream that follows the turn asks once it heard ``turn.done`` or
    ``approval.requested``; a short stream waits)."""
    pause = END_POLL
    while True:
        found = await settled_now(service, session, turn_id)
        if found is not None:
            return found
        await anyio.sleep(pause)
        pause = min(pause * 2, END_POLL_MAX)


async def followed(
    service: Service, turn: Followed, *, shows_tools: bool
) -> AsyncIterator[Happening | Ended | Parked | None]:
    """What the stream says as the turn runs (None: a keep-alive is due), then how it ended (or parked)."""
    subscription = turn.events  # closed, and unsubscribed, by the response (``sse_response``)
    if turn.run is None and (found := await settled_now(service, turn.session, turn.turn)) is not None:
        yield found  # after decisions: another approval of the step still waits (or it ended already)
        return
    if subscription is not None:
        sent = Sent(run=turn.run, shows_tools=shows_tools)
        while True:
            with anyio.move_on_after(KEEP_ALIVE_SECONDS) as idle:
                try:
                    name, data = await subscription.receive()
                except anyio.EndOfStream:
                    break  # dropped or closed: the end is read from the store
            if idle.cancelled_caught:
                # A silent turn may wait for approvals whose request this stream did not hear (a
                # restart-turn re-run keeps an approval without asking again): the store says.
                found = await settled_now(service, turn.session, turn.turn)
                if found is not None:
                    yield found
                    return
                yield None
                continue
            if data.get("turn") != turn.turn:
                continue
            if name in (events.TURN_DONE, events.APPROVAL_REQUESTED):
                break  # stored before announced: the store has the end, or the parked run
            sent, happened = follow(sent, name, data)
            for happening in happened:
                yield happening
    yield await settled(service, turn.session, turn.turn)


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event: ``data`` as JSON (``event:`` named when given)."""
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + msgspec.json.encode(data) + b"\n\n"


class _TurnStream(StreamingResponse):
    """A stream that lets go of its subscription once it was sent, or failed to be — even when its
    body never started (a client gone before the first byte)."""

    def __init__(self, body: AsyncIterator[bytes], turn: Followed, service: Service, headers: dict[str, str]) -> None:
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self.turn = turn
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.turn.events is not None:
                self.turn.events.close()
                self.service.unsubscribed(self.turn.session)  # the session need not stay hot for it


def sse_response(
    service: Service, turn: Followed, body: AsyncIterator[bytes], headers: dict[str, str] | None = None
) -> StreamingResponse:
    """``body``, the stream of ``turn``, as a ``text/event-stream`` answer (not buffered by proxies)."""
    sent = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
    return _TurnStream(body, turn, service, sent)


def texts_of(entries: Sequence[Entry]) -> list[str]:
    """The assistant's texts of a turn, as the non-streamed door shows them."""
    return [e.content for e in entries if e.role == "assistant" and e.content]
