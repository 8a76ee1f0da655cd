"""Token deltas from a child to its supervisor: a step's text while the model writes it (RFC 0005 §7).

The provider hands each piece of content and thinking to the turn's ``DeltaStream`` (a
``StreamSink``) without ever waiting: pieces go into a ``DeltaBuffer``, and a flusher task sends
what piled up as one ``delta`` event at most every ``COALESCE_SECONDS`` — but only while someone
watches the session (``ChildSession.watched``), so an unwatched session sends no delta frame at
all. A slow supervisor slows only the flusher, never the model call; what waits meanwhile is the
step's own text, which the provider holds anyway, so memory stays bounded by the answer.

At the step's end (``end_step``, before ``step.done``) the rest goes out, reconciled with the whole
answer: the deltas of a step add up to exactly its ``content``. A model call retried after text
went out is announced by ``step.reset`` before the new text. ``DeltaBuffer`` is pure (the caller
passes the time); ``DeltaStream`` does the sending.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Coroutine
from typing import Any

import anyio

from agentd import events
from agentd.child.session import ChildSession
from agentd.protocol import Event

__all__ = ["COALESCE_SECONDS", "DeltaBuffer", "DeltaOp", "DeltaStream"]

#: At most one delta frame per session per this many seconds.
COALESCE_SECONDS = 0.02

#: One event to send: (name, data without ``session``/``turn``).
DeltaOp = tuple[str, dict[str, Any]]

_MISMATCH = "the answer differs from the text streamed"


class DeltaBuffer:
    """One session's streamed text, coalesced: what was sent of the current step and what waits.

    ``begin`` opens a step; ``content``/``thinking`` add pieces; ``reset`` voids the step's text so
    far (a ``step.reset`` is owed only when some of it was sent); ``take`` returns the events to
    send now; ``finish`` reconciles the step with its whole answer and returns the last events.
    """

    def __init__(self, interval: float = COALESCE_SECONDS) -> None:
        self.interval = interval
        self._key: dict[str, Any] | None = None  # run, step, model of the step streaming
        self._pending: tuple[list[str], list[str]] = ([], [])  # content, thinking not sent yet
        self._sent: tuple[list[str], list[str]] = ([], [])  # content, thinking sent since the last reset
        self._reset: str | None = None  # a step.reset owed before the next delta (its reason)
        self._last = -math.inf

    def begin(self, run: int, step: int, model: str) -> None:
        """A new step (a model call) starts streaming; anything left of the last one is dropped."""
        self._key = {"run": run, "step": step, "model": model}
        self._pending, self._sent, self._reset = ([], []), ([], []), None

    def content(self, text: str) -> None:
        """A piece of content arrived."""
        if self._key is not None and text:
            self._pending[0].append(text)

    def thinking(self, text: str) -> None:
        """A piece of thinking arrived."""
        if self._key is not None and text:
            self._pending[1].append(text)

    def reset(self, reason: str) -> None:
        """The model call starts over: void the step's text; announce it if any went out."""
        if self._sent[0] or self._sent[1] or self._reset is not None:
            self._reset = reason
        self._pending, self._sent = ([], []), ([], [])

    @property
    def waiting(self) -> bool:
        """Whether something waits to be sent."""
        return bool(self._pending[0] or self._pending[1] or self._reset is not None)

    def due_at(self) -> float:
        """When the next frame may go (``interval`` after the last)."""
        return self._last + self.interval

    def take(self, now: float) -> list[DeltaOp]:
        """The events to send now: an owed ``step.reset``, then one ``delta`` with all that waited."""
        if self._key is None:
            return []
        ops: list[DeltaOp] = []
        if self._reset is not None:
            ops.append((events.STEP_RESET, {"run": self._key["run"], "step": self._key["step"], "reason": self._reset}))
            self._reset = None
        content, thinking = "".join(self._pending[0]), "".join(self._pending[1])
        if content or thinking:
            data = dict(self._key)
            if content:
                data["content"] = content
                self._sent[0].append(content)
            if thinking:
                data["thinking"] = thinking
                self._sent[1].append(thinking)
            ops.append((events.DELTA, data))
        self._pending = ([], [])
        if ops:
            self._last = now
        return ops

    def finish(self, content: str, thinking: str | None, now: float) -> list[DeltaOp]:
        """The step's answer is whole: the last events, so that its deltas add up to ``content``.

        Text streamed that the answer does not start with (a provider that rewrote it) is voided
        by a ``step.reset`` and the whole answer sent again. Thinking is completed when it extends
        what was streamed; otherwise it stays as streamed (``step.done`` has it trimmed).
        """
        streamed = "".join(self._sent[0]) + "".join(self._pending[0])
        if content.startswith(streamed):
            self._pending[0][:] = [streamed[len("".join(self._sent[0])) :], content[len(streamed) :]]
            streamed_thinking = "".join(self._sent[1]) + "".join(self._pending[1])
            if thinking and thinking.startswith(streamed_thinking):
                self._pending[1].append(thinking[len(streamed_thinking) :])
        else:
            self.reset(_MISMATCH)
            self._pending = ([content], [thinking or ""])
        ops = self.take(now)
        self._key = None
        return ops

    def drop(self) -> None:
        """Forget the step without sending anything (nobody watches)."""
        self._key = None
        self._pending, self._sent, self._reset = ([], []), ([], []), None


class DeltaStream:
    """The ``StreamSink`` of one turn of one session (see the module docstring).

    The flusher (``run``) is started with ``spawn`` (the child's task group) the first time there is
    something to send, so a turn nobody watches costs no task, and runs until ``close``. Sends
    happen under one lock, and ``end_step`` takes the last events under it, so a step's deltas
    always precede its ``step.done``.
    """

    def __init__(
        self,
        session: ChildSession,
        turn: str,
        spawn: Callable[[Callable[[], Coroutine[Any, Any, None]]], object],
        interval: float = COALESCE_SECONDS,
    ) -> None:
        self.session = session
        self.turn = turn
        self.buffer = DeltaBuffer(interval)
        self.frames = 0  # delta and step.reset frames sent (bench figures)
        self._spawn = spawn
        self._closed = False
        # Made when the flusher starts (a turn nobody watches makes none of them).
        self._wake: anyio.Event | None = None
        self._lock: anyio.Lock | None = None
        self._scope: anyio.CancelScope | None = None

    # ------------------------------------------------------------------ StreamSink (never blocks)

    def content(self, text: str) -> None:
        self.buffer.content(text)
        self._poke()

    def thinking(self, text: str) -> None:
        self.buffer.thinking(text)
        self._poke()

    def reset(self, reason: str) -> None:
        self.buffer.reset(reason)
        self._poke()

    def _poke(self) -> None:
        if not self.session.watched or self._closed:  # unwatched: nothing is sent, so nothing to wake for
            return
        if self._wake is None:
            self._wake, self._lock, self._scope = anyio.Event(), anyio.Lock(), anyio.CancelScope()
            self._spawn(self.run)
        self._wake.set()

    # ------------------------------------------------------------------ the loop's side

    def begin(self, run: int, step: int, model: str) -> None:
        """A step's model call starts."""
        self.buffer.begin(run, step, model)

    async def end_step(self, content: str, thinking: str | None) -> None:
        """The step's answer is whole: send the rest (reconciled) before the caller sends ``step.done``."""
        if self._lock is None:  # no flusher: nothing else sends
            await self._finish_step(content, thinking)
            return
        async with self._lock:
            await self._finish_step(content, thinking)

    async def _finish_step(self, content: str, thinking: str | None) -> None:
        if self.session.watched:
            await self._send(self.buffer.finish(content, thinking, anyio.current_time()))
        else:
            self.buffer.drop()

    async def run(self) -> None:
        """The flusher: send what waits, at most one frame per interval, while someone watches."""
        assert self._scope is not None and self._lock is not None and self._wake is not None, "started by _poke"
        with self._scope:
            while True:
                await self._wake.wait()
                self._wake = anyio.Event()
                delay = self.buffer.due_at() - anyio.current_time()
                if delay > 0:
                    await anyio.sleep(delay)
                async with self._lock:
                    if self.session.watched and self.buffer.waiting:
                        await self._send(self.buffer.take(anyio.current_time()))

    def close(self) -> None:
        """The turn ended: stop the flusher (what still waits belongs to no step.done: dropped)."""
        self._closed = True
        if self._scope is not None:  # a cancel scope's cancel is not free (anyio describes the task in it)
            self._scope.cancel()

    async def _send(self, ops: list[DeltaOp]) -> None:
        # Shielded: ``close`` (or a Cancel) stops the flusher between frames, never in the middle
        # of one (a frame cut short would break the channel for every session of the child).
        with anyio.CancelScope(shield=True):
            for name, data in ops:
                self.frames += 1
                await self.session.send(Event(session=self.session.id, turn=self.turn, name=name, data=data))
