"""The SQLite store's worker thread: its database calls, one at a time, off the event loop.

A call is handed to one long-lived thread through a queue and its outcome comes back to the
caller's event loop with ``call_soon_threadsafe``. That is all a store call needs, and it is the
whole cost of leaving the loop: ``anyio.to_thread.run_sync`` adds a capacity limiter, a pool of
threads, a shielding cancel scope and two checkpoints (extra turns of the event loop) to every
call, about 50 µs of CPU each on the machines the benchmarks ran on — a turn makes two such calls.

The calls run in the order they were made, on the one thread, so one connection serves them all.
A caller cancelled while its call waits or runs is not answered before the call has ended: a
transaction is never torn. Its cancellation is delivered then, at the ``await`` (the call's result
is dropped; a caller that needs it shields the call). Only that path pays for a shielded wait: the
call itself awaits a plain future. Calls come from one event loop thread (the supervisor's).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import anyio

__all__ = ["Worker"]

T = TypeVar("T")


class _Call(Generic[T]):
    """One call: what to run, the caller's loop, and the future that answers it there."""

    __slots__ = ("answer", "ended", "finished", "fn", "loop")

    def __init__(self, fn: Callable[[], T], loop: asyncio.AbstractEventLoop) -> None:
        self.fn, self.loop = fn, loop
        self.answer: asyncio.Future[T] = loop.create_future()
        self.finished = False  # the call has run (set on the caller's loop)
        self.ended: asyncio.Event | None = None  # made only when a cancelled caller waits for the end


class Worker:
    """One thread that runs calls in order; started by the first call, ended by ``stop``."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._calls: queue.SimpleQueue[_Call[Any] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopped = False

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` in the worker thread, after every call made before it; its result or its exception."""
        if self._stopped:
            raise RuntimeError(f"{self._name}: the worker thread was stopped")
        call = _Call(fn, asyncio.get_running_loop())
        if self._thread is None:
            # A daemon: a database call that never returns must not hold the process's exit.
            self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
            self._thread.start()
        self._calls.put(call)
        try:
            return await call.answer
        except asyncio.CancelledError:
            # Cancelled (asyncio cancelled the future with the task): the call still runs, or is
            # queued. Wait for its end, shielded, then let the cancellation through.
            if not call.finished:
                call.ended = asyncio.Event()
                with anyio.CancelScope(shield=True):
                    await call.ended.wait()
            raise

    @property
    def stopped(self) -> bool:
        """Whether ``stop`` was called."""
        return self._stopped

    def stop(self) -> None:
        """End the thread once the calls already made have run; later calls are refused. Idempotent."""
        if not self._stopped:
            self._stopped = True
            self._calls.put(None)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            try:
                outcome: tuple[bool, Any] = (True, call.fn())
            except BaseException as exc:  # every outcome goes back to its caller
                outcome = (False, exc)
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is left to answer
                call.loop.call_soon_threadsafe(_settle, call, outcome)


def _settle(call: _Call[Any], outcome: tuple[bool, Any]) -> None:
    """On the caller's loop: answer the call, unless its caller was cancelled (then wake it)."""
    call.finished = True
    if not call.answer.done():
        ok, value = outcome
        if ok:
            call.answer.set_result(value)
        else:
            call.answer.set_exception(value)
    if call.ended is not None:
        call.ended.set()
