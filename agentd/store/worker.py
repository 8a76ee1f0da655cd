"""The SQLite store's worker thread: its database calls, one at a time, off the event loop.

A call is handed to one long-lived thread through a queue and its outcome comes back to the
caller's event loop with ``call_soon_threadsafe``. That is all a store call needs, and it is the
whole cost of leaving the loop: ``anyio.to_thread.run_sync`` adds a capacity limiter, a pool of
threads and two checkpoints (extra turns of the event loop) to every call, about 50 µs of CPU each
on the machines the benchmarks ran on — a turn makes two such calls.

The calls run in the order they were made, on the one thread, so one connection serves them all.
A caller cancelled while its call waits or runs is answered only once the call has ended: a
transaction is never torn, and the cancellation is delivered after it (as anyio's threads do).
The caller awaits a future that refuses to be cancelled (``_Answer``): asyncio then holds the
cancellation until the future is done and delivers it there, which costs nothing on the way of a
call that is not cancelled (a shielding cancel scope costs two task lookups on every call).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["Worker"]

T = TypeVar("T")

# A call, the loop of its caller, and the future that answers it there.
_Call = tuple[Callable[[], Any], asyncio.AbstractEventLoop, "asyncio.Future[Any]"]


class Worker:
    """One thread that runs calls in order; started by the first call, ended by ``stop``."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopped = False

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` in the worker thread, after every call made before it; its result or its exception."""
        if self._stopped:
            raise RuntimeError(f"{self._name}: the worker thread was stopped")
        loop = asyncio.get_running_loop()
        answer: _Answer[T] = _Answer(loop=loop)
        if self._thread is None:
            # A daemon: a database call that never returns must not hold the process's exit.
            self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
            self._thread.start()
        self._calls.put((fn, loop, answer))
        return await answer

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
            fn, loop, answer = call
            try:
                outcome: tuple[Callable[[Any], None], Any] = (answer.set_result, fn())
            except BaseException as exc:  # every outcome goes back to its caller
                outcome = (answer.set_exception, exc)
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is left to answer
                loop.call_soon_threadsafe(_settle, answer, outcome)


class _Answer(asyncio.Future[T]):
    """A call's answer in its caller's loop. It cannot be cancelled: a task cancelled while it
    awaits one is cancelled once the answer has come, at that ``await`` (asyncio's rule for a
    waiter that refuses), so the call is never abandoned while it runs."""

    def cancel(self, msg: Any | None = None) -> bool:
        return False


def _settle(answer: asyncio.Future[Any], outcome: tuple[Callable[[Any], None], Any]) -> None:
    if not answer.done():
        setter, value = outcome
        setter(value)
