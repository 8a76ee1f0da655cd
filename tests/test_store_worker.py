"""The SQLite store's worker thread (agentd.store.worker): in order, off the loop, never torn."""

from __future__ import annotations

import threading

import anyio
import anyio.lowlevel
import pytest

from agentd.store.worker import Worker

pytestmark = pytest.mark.anyio


async def test_calls_run_in_one_thread_off_the_loop_in_the_order_they_were_made() -> None:
    worker = Worker("test")
    ran: list[tuple[int, int]] = []

    def record(index: int) -> int:
        ran.append((index, threading.get_ident()))
        return index

    async def call(index: int) -> None:
        assert await worker.run(lambda: record(index)) == index

    async with anyio.create_task_group() as tg:
        for index in range(50):
            tg.start_soon(call, index)
    worker.stop()
    assert [index for index, _ in ran] == list(range(50))
    threads = {thread for _, thread in ran}
    assert len(threads) == 1
    assert threading.get_ident() not in threads


async def test_a_calls_exception_reaches_its_caller_and_the_next_call_still_runs() -> None:
    worker = Worker("test")

    def fails() -> None:
        raise ValueError("the database said no")

    with pytest.raises(ValueError, match="the database said no"):
        await worker.run(fails)
    assert await worker.run(lambda: 7) == 7
    worker.stop()


async def test_a_cancelled_caller_is_answered_only_after_its_call_has_ended() -> None:
    worker = Worker("test")
    started, release = threading.Event(), threading.Event()
    ended: list[str] = []

    def slow() -> None:
        started.set()
        release.wait(timeout=60)  # a deadlock guard only: the test releases it
        ended.append("call")

    scope = anyio.CancelScope()

    async def cancel_once_started() -> None:
        await anyio.to_thread.run_sync(started.wait, 60)
        scope.cancel()
        await anyio.sleep(0.05)  # the caller must still be waiting here
        ended.append("cancelled while the call ran")
        release.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(cancel_once_started)
        with scope:
            try:
                await worker.run(slow)
                await anyio.lowlevel.checkpoint()  # the cancellation is delivered here at the latest
                pytest.fail("the cancellation was not delivered")
            finally:
                ended.append("the caller resumed")
    assert scope.cancelled_caught
    assert ended == ["cancelled while the call ran", "call", "the caller resumed"]
    worker.stop()


async def test_a_stopped_worker_refuses_calls() -> None:
    worker = Worker("test")
    assert await worker.run(lambda: "before") == "before"
    worker.stop()
    worker.stop()  # idempotent
    assert worker.stopped
    with pytest.raises(RuntimeError, match="stopped"):
        await worker.run(lambda: "after")


async def test_a_cancelled_caller_waits_for_its_call_without_spinning_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """While a cancelled caller waits for its call to end, anyio must not deliver the cancellation
    again and again: a waiter it cannot cancel made it retry on every turn of the loop (a core
    burnt for as long as the call ran). Counted, not timed: a shielded wait is visited a few times."""
    from anyio._backends import _asyncio as backend

    deliveries = 0
    deliver = backend.CancelScope._deliver_cancellation

    def counting(self: backend.CancelScope, origin: backend.CancelScope) -> bool:
        nonlocal deliveries
        deliveries += 1
        return deliver(self, origin)

    monkeypatch.setattr(backend.CancelScope, "_deliver_cancellation", counting)
    worker = Worker("test")
    started, release = threading.Event(), threading.Event()

    def slow() -> None:
        started.set()
        release.wait(timeout=60)  # a deadlock guard only: the test releases it

    async def release_later() -> None:
        await anyio.to_thread.run_sync(started.wait, 60)
        scope.cancel()
        await anyio.sleep(0.3)  # the cancelled caller waits all this time
        release.set()

    scope = anyio.CancelScope()
    async with anyio.create_task_group() as tg:
        tg.start_soon(release_later)
        with scope:
            await worker.run(slow)
    worker.stop()
    assert scope.cancelled_caught
    assert deliveries < 50, deliveries
