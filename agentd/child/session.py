"""One session hosted by a child: its transcript, its provider, and its swap slot.

This is where a swap gets applied. ``park`` puts a SwapIntel in the slot (latest wins) the moment
it arrives; ``apply_parked`` drains the slot at a turn boundary — the top of a turn, the end of a
turn, or at once when the session is idle — rebuilding the provider client and adopting the model.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from agentd import events
from agentd.child.spans import event_attributes
from agentd.config import Assistant, Config, Intelligence, Limits, SwapPolicy
from agentd.intel import Completion, CompletionRequest, IntelError, Provider, build_provider
from agentd.intel.base import IntelErrorKind
from agentd.messages import Message
from agentd.obs import bound_logger, get_logger
from agentd.otel import tracing
from agentd.protocol import Event, Frame, SwapApplied, SwapIntel, SwapKind
from agentd.swap import classify_swap, restart_due

__all__ = ["ChildSession", "SendFrame", "UnbuildableProvider"]

SendFrame = Callable[[Frame], Awaitable[None]]
log = get_logger("child")


class UnbuildableProvider:
    """Stands in for a provider that could not be built: every call fails with why (a request
    error, so the turn ends ``failed`` with that error instead of waiting)."""

    failing = False

    def __init__(self, intelligence: Intelligence, error: str) -> None:
        self.intelligence = intelligence
        self.error = error

    async def complete(self, request: CompletionRequest) -> Completion:
        raise IntelError(IntelErrorKind.REQUEST, self.error)

    async def aclose(self) -> None:
        return None


class ChildSession:
    """State of one session inside a child process."""

    def __init__(
        self,
        session_id: str,
        assistant: str,
        transcript: list[Message],
        config: Config,
        intelligence: dict[str, Intelligence],
        limits: Limits,
        generation: int,
        policy: SwapPolicy,
        send: SendFrame,
    ) -> None:
        if assistant not in intelligence:
            raise KeyError(assistant)
        self.id = session_id
        self.log = bound_logger("child", session=session_id)  # its lines name the session
        self.config = config  # assistants' prompts, tools and transfers of the generation it runs
        self.assistant = assistant
        self.transcript = transcript
        self.generation = generation
        self.turn_run = 1  # which delivery of its turn this is (``Input.run``: agentd.turn.run on its spans)
        self.policy = policy
        self.limits = limits
        self.intelligence = dict(intelligence)
        # A turn that waited for approvals finishes on what it started on (finish-on-old, RFC 0012 §5).
        self.pinned: Intelligence | None = None
        self.provider: Provider = build_provider(self.current_intelligence)
        self.provider_stale = False  # a swap was adopted while idle: rebuild before the next call
        self.parked: SwapIntel | None = None
        # The parked swap was reported when it arrived (the session was idle: RFC 0002 §3), so the
        # next turn adopts it without reporting it again.
        self.parked_reported = False
        self.turn_id: str | None = None
        self.turn_scope: anyio.CancelScope | None = None
        self.swap_parked_event = anyio.Event()
        self.watched = True  # someone subscribed to the session's events (set per turn, and by Watch)
        self.send = send

    @property
    def current_intelligence(self) -> Intelligence:
        """The effective intelligence of the session's current assistant (or the turn's pinned one)."""
        return self.pinned or self.intelligence[self.assistant]

    @property
    def assistant_config(self) -> Assistant:
        """The current assistant's definition."""
        return self.config.assistant(self.assistant)

    @property
    def running(self) -> bool:
        return self.turn_id is not None

    async def emit(self, event: str, turn: str | None = None, /, **data: Any) -> None:
        """Stream a session event to the supervisor (progress events only while someone watches)."""
        if event in events.SPAN_EVENTS and (tracer := tracing()).enabled:  # on the current span too
            tracer.event(event, event_attributes(data))
        if self.watched or event in events.SUPERVISOR_EVENTS:
            await self.send(Event(session=self.id, turn=turn, name=event, data=data))

    async def park(self, frame: SwapIntel) -> bool:
        """Put a swap in the slot (latest wins) of a session with a turn in flight; it is applied at
        the turn's next boundary. Idle sessions are swapped by the runtime, all at once (``park_idle``)."""
        self.parked, self.parked_reported = frame, False
        # Wake whoever waits for a park, and give the next wait a fresh event.
        self.swap_parked_event.set()
        self.swap_parked_event = anyio.Event()
        if not self.running:
            await self.apply_parked(turn=None)
            return False
        target = frame.intelligence.get(self.assistant, self.current_intelligence)
        if classify_swap(self.current_intelligence, target) is None:
            return False  # another assistant changed: adopted at the boundary, no swap for this session
        # Debug per session; the runtime logs one line for all its running sessions (a reload with
        # many turns in flight must not cost a log line each on its way to being acknowledged).
        self.log.debug(
            events.LOG_SWAP_PARKED,
            turn=self.turn_id,
            generation=frame.generation,
            model_from=self.current_intelligence.model,
            model_to=target.model,
            policy=frame.policy.value,
        )
        await self.emit(
            events.SWAP_PARKED,
            self.turn_id,
            generation=frame.generation,
            model_from=self.current_intelligence.model,
            model_to=target.model,
            policy=frame.policy.value,
        )
        return True

    def restart_due(self, restarts: int) -> bool:
        """Whether the in-flight turn must be discarded and re-run (restart-turn, model changed)."""
        return restart_due(
            self.parked, self.assistant, self.current_intelligence, restarts, self.limits.max_turn_restarts
        )

    def repoint_parked(self) -> bool:
        """Whether the slot holds a swap that leaves this session's model unchanged but changes its endpoints."""
        if self.parked is None:
            return False
        target = self.parked.intelligence.get(self.assistant, self.current_intelligence)
        return classify_swap(self.current_intelligence, target) is SwapKind.REPOINT

    def park_idle(self, frame: SwapIntel) -> None:
        """An idle session takes a swap at once (RFC 0002 §3): the child reports it for all its idle
        sessions together; the session itself adopts it, silently, at the top of its next turn."""
        self.parked, self.parked_reported = frame, True

    def adopt_parked(self) -> tuple[SwapKind, str, str] | None:
        """Drain the slot: adopt the new generation; (kind, model from, model to) if this session's
        intelligence changed.

        No I/O: the provider client is rebuilt before the session's next model call (``ready_provider``).
        """
        frame, self.parked = self.parked, None
        if frame is None:
            return None
        old = self.current_intelligence
        # Merged, not replaced: an assistant dropped from the config keeps its last intelligence
        # for the sessions still on it.
        self.intelligence = {**self.intelligence, **frame.intelligence}
        if frame.config is not None:
            self.config = frame.config
        self.generation = frame.generation
        self.policy = frame.policy
        self.limits = frame.limits
        new = self.current_intelligence
        kind = classify_swap(old, new)
        if kind is None:
            return None
        self.provider_stale = True
        return kind, old.model, new.model

    async def apply_parked(self, turn: str | None) -> SwapKind | None:
        """At a turn boundary: drain the slot and report the swap (log, ``swap_applied``, event)."""
        frame, reported = self.parked, self.parked_reported
        self.parked_reported = False
        applied = self.adopt_parked()
        if frame is None or applied is None:
            return None
        kind, old, new = applied
        await self.ready_provider()
        if reported:
            return kind
        self.log.info(
            events.LOG_SWAP_APPLIED,
            turn=turn,
            generation=frame.generation,
            kind=kind.value,
            model_from=old,
            model_to=new,
            policy=frame.policy.value,
        )
        await self.send(
            SwapApplied(
                session=self.id,
                generation=frame.generation,
                kind=kind,
                model_from=old,
                model_to=new,
                policy=frame.policy,
                turn=turn,
            )
        )
        await self.emit(
            events.SWAP_APPLIED,
            turn,
            generation=frame.generation,
            kind=kind.value,
            model_from=old,
            model_to=new,
            policy=frame.policy.value,
        )
        return kind

    async def pin(self, intelligence: Intelligence) -> None:
        """Run the rest of this turn on ``intelligence`` (the one a parked run started on)."""
        if intelligence == self.current_intelligence:
            return
        self.pinned = intelligence
        await self.replace_provider()

    def unpin(self) -> None:
        """The turn ended: the session's own intelligence again, its client rebuilt before the next call."""
        if self.pinned is not None:
            self.pinned = None
            self.provider_stale = True

    async def ready_provider(self) -> None:
        """Rebuild the provider client if a swap adopted while idle left it stale."""
        if self.provider_stale:
            await self.replace_provider()

    async def replace_provider(self) -> None:
        """A fresh client for the current intelligence (fresh endpoint health). One that cannot be
        built (options it cannot take) fails each model call with why, never the child."""
        intelligence = self.current_intelligence
        try:
            provider: Provider = build_provider(intelligence)
        except Exception as exc:  # validation refuses such options first; never take the child down
            provider = UnbuildableProvider(intelligence, f"cannot build the {intelligence.provider} provider: {exc}")
        old, self.provider = self.provider, provider
        self.provider_stale = False
        with anyio.CancelScope(shield=True):
            await old.aclose()

    def switch_assistant(self, name: str) -> Intelligence:
        """After a transfer: the session now runs on ``name``'s effective intelligence."""
        self.assistant = name
        self.pinned = None
        return self.current_intelligence
