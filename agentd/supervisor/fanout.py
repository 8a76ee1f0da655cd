"""A reload applied (RFC 0003 §4, RFC 0002 §3): a new generation, fanned out to every child.

``Reloader.reload`` reads and validates the config file (``load_daemon_config``), refuses one that
would strand an open session (``orphaned_sessions``), diffs it (``agentd.supervisor.reload``),
applies it to what runs (``Running.apply``), sends every child one ``SwapIntel``, and swaps the
hot sessions no child holds itself. Reloads are serialized and coalesced by the
``ReloadCoordinator``. The children's acks come back here (``swap_acked``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Mapping

import anyio

from agentd import events
from agentd.config import Config, ConfigError, ConfigIssue, Intelligence, intelligence_map, resolve_swap_policy
from agentd.environment import register_secrets
from agentd.obs import get_logger
from agentd.redact import SECRETS
from agentd.store import ReloadRow, Store, StoreError
from agentd.supervisor.child import Child
from agentd.supervisor.pool import Fanout, Pool
from agentd.supervisor.reload import ReloadCoordinator, plan_reload, sessions_to_swap
from agentd.supervisor.running import Running, load_daemon_config
from agentd.supervisor.session import SessionTable
from agentd.swap import classify_swap
from agentd.views import ReloadResult

__all__ = ["ACK_WAIT", "RELOAD_HISTORY_KEEP", "SWAPPED_LIST_MAX", "Reloader", "reload_row"]

log = get_logger("supervisor")

#: ``swapped_sessions`` of a reload result lists at most this many ids; ``swapped_total`` counts them all.
SWAPPED_LIST_MAX = 100
#: How long a reload waits for its children's acks before its per-session bookkeeping (a hung child
#: is the ping's to find, RFC 0006 §9).
ACK_WAIT = 1.0
#: The reload history (``GET /v1/reloads``) keeps this many reloads, the newest.
RELOAD_HISTORY_KEEP = 1000


def reload_row(result: ReloadResult, *, at: float, replica: str) -> ReloadRow:
    """The history's row of a reload's result; its errors scrubbed of secret values (a config
    issue may quote the value it refuses)."""
    return ReloadRow(
        generation=result.generation,
        at=at,
        applied=result.applied,
        errors=tuple((SECRETS.scrub(i.path), SECRETS.scrub(i.message)) for i in result.errors),
        changed=tuple(result.changed),
        swapped_total=result.swapped_total,
        replica=replica,
    )


class Reloader:
    """Applies reloads to what runs, and fans each new generation out to the children."""

    def __init__(
        self, *, running: Running, store: Store, sessions: SessionTable, pool: Pool, replica: str = ""
    ) -> None:
        self.running = running
        self.store = store
        self.sessions = sessions
        self.pool = pool
        self.replica = replica  # this replica's id, as the reload history names it
        self.reloads: ReloadCoordinator[ReloadResult] = ReloadCoordinator(self._reload_and_record)
        self._newest: Fanout | None = None  # the newest reload's broadcast, until every child acked it
        # Called with the assistants whose intelligence a reload changed, once it fanned out
        # (turns awaiting approval under restart-turn re-run, RFC 0012 §5).
        self.after_swap: Callable[[list[str]], Awaitable[None]] | None = None

    async def reload(self) -> ReloadResult:
        """Reload the config file (serialized; concurrent requests coalesce into one more reload)."""
        try:
            return await self.reloads.request()
        except Exception as exc:  # a reload bug must never take the daemon down; the old config stays
            log.exception(events.LOG_CONFIG_RELOAD, applied=False)
            return ReloadResult(
                generation=self.running.generation,
                applied=False,
                errors=[ConfigIssue("", f"internal error: {type(exc).__name__}: {exc}")],
            )

    async def _reload_and_record(self) -> ReloadResult:
        """One reload, then its row in the reload history (a store that fails loses the row, never the reload)."""
        result = await self._reload()
        try:
            await self.store.record_reload(
                reload_row(result, at=time.time(), replica=self.replica), keep=RELOAD_HISTORY_KEEP
            )
        except StoreError as exc:
            log.warning(events.LOG_CONFIG_RELOAD_UNRECORDED, generation=result.generation, error=str(exc))
        return result

    async def _reload(self) -> ReloadResult:
        running = self.running
        options = running.options
        try:
            # Abandoned when shutdown cancels the reload; shutdown also kills its tool check.
            new = await anyio.to_thread.run_sync(load_daemon_config, options.config_path, abandon_on_cancel=True)
            register_secrets(os.environ, new)  # its secrets are scrubbed from here on, applied or not
            policy = resolve_swap_policy(options.model_swap_flag, os.environ, new.model_swap)
        except ConfigError as exc:
            result = ReloadResult(generation=running.generation, applied=False, errors=exc.issues)
            running.metrics.reloads.labels(result="rejected").inc()
            log.warning(
                events.LOG_CONFIG_RELOAD,
                applied=False,
                generation=running.generation,
                errors=[str(i) for i in exc.issues],
            )
            return result
        orphaned = await self.orphaned_sessions(new)
        if orphaned:
            running.metrics.reloads.labels(result="rejected").inc()
            log.warning(
                events.LOG_CONFIG_RELOAD,
                applied=False,
                generation=running.generation,
                errors=[str(i) for i in orphaned],
            )
            return ReloadResult(generation=running.generation, applied=False, errors=orphaned)
        plan = plan_reload(running.config, new)
        policy_changed = policy != running.policy
        if not plan.changed and not policy_changed:
            result = ReloadResult(generation=running.generation, applied=True, restart_required=plan.restart_required)
            running.metrics.reloads.labels(result="unchanged").inc()
            log.info(
                events.LOG_CONFIG_RELOAD,
                applied=True,
                generation=running.generation,
                changed=[],
                restart_required=plan.restart_required,
            )
            return result
        old_intelligence = intelligence_map(running.config)
        running.apply(plan.config, policy)
        self.pool.changed()  # the pool keys may have changed
        swapped, swapped_total = await self._fan_out(plan.intelligence_changed)
        self._swap_unloaded(old_intelligence)
        if self.after_swap is not None and plan.intelligence_changed:
            await self.after_swap(list(plan.intelligence_changed))
        changed = plan.changed + (
            ["model_swap (effective)"] if policy_changed and "model_swap" not in plan.changed else []
        )
        result = ReloadResult(
            generation=running.generation,
            applied=True,
            changed=changed,
            restart_required=plan.restart_required,
            swapped_sessions=swapped,
            swapped_total=swapped_total,
        )
        running.metrics.reloads.labels(result="applied").inc()
        log.info(
            events.LOG_CONFIG_RELOAD,
            applied=True,
            generation=running.generation,
            changed=changed,
            restart_required=plan.restart_required,
            swapped_sessions=swapped_total,
            policy=policy.policy.value,
            policy_source=policy.source,
        )
        return result

    async def orphaned_sessions(
        self, new: Config, *, by_assistant: Mapping[str, int] | None = None
    ) -> list[ConfigIssue]:
        """A new config must keep every assistant an open session is on (closing them is the operator's call).

        ``by_assistant``: the open sessions by assistant, read already (at start-up, while the
        store was waited for); else read now.
        """
        names = {a.name for a in new.assistants}
        if by_assistant is None:
            by_assistant = await self.store.open_sessions_by_assistant()
        on = {name: count for name, count in by_assistant.items() if name not in names}
        for runtime in self.sessions.values():  # a transfer in flight may have moved a session already
            if runtime.assistant not in names and not runtime.closing:
                on.setdefault(runtime.assistant, 1)
        issues = [
            ConfigIssue(
                "assistants",
                f"assistant {name!r} was removed but {count} open session(s) are on it; keep it until they are closed",
            )
            for name, count in sorted(on.items())
        ]
        # A turn in flight may transfer its session to any destination of its assistant: the
        # supervisor learns of a transfer only when the turn commits, so those must stay too.
        targets: dict[str, str] = {}
        for runtime in self.sessions.values():
            if runtime.pending is None or runtime.closing:
                continue
            try:
                transfers = self.running.config.assistant(runtime.assistant).transfers
            except KeyError:
                continue
            for transfer in transfers:
                if transfer.to not in names and transfer.to not in on:
                    targets.setdefault(transfer.to, runtime.id)
        issues += [
            ConfigIssue(
                "assistants",
                f"assistant {name!r} was removed but a turn in flight on session {session} may transfer to it; "
                "reload again once it has ended",
            )
            for name, session in sorted(targets.items())
        ]
        return issues

    def _swap_unloaded(self, old_intelligence: dict[str, Intelligence]) -> None:
        """Hot sessions that are not loaded (watched, or waiting for a child) take the swap now.

        They are idle, so their boundary is now (RFC 0002 §3); no child reports it for them, so the
        supervisor does: the same ``swap.applied`` event a child would send. A session that waits
        for a child with its turn accepted is loaded on the newest generation, so it swaps too.
        """
        running = self.running
        new_intelligence = intelligence_map(running.config)
        for runtime in self.sessions.values():
            if runtime.child is not None or runtime.closing:
                continue
            runtime.swapped(running.generation)
            old, new = old_intelligence.get(runtime.assistant), new_intelligence.get(runtime.assistant)
            kind = classify_swap(old, new) if old is not None and new is not None else None
            if kind is None or new is None or old is None:
                continue
            runtime.swapped(running.generation, new.model)
            running.metrics.swaps.labels(kind=kind.value).inc()
            runtime.publish(
                events.SWAP_APPLIED,
                None,
                {
                    "generation": running.generation,
                    "kind": kind.value,
                    "model_from": old.model,
                    "model_to": new.model,
                    "policy": running.policy.policy.value,
                },
            )

    async def _fan_out(self, intelligence_changed: list[str]) -> tuple[list[str], int]:
        """Send one SwapIntel per child; return (a bounded list of, and the number of) swapped sessions.

        Every child gets the frame — it carries the whole generation, so a later turn, a later
        transfer and a session loaded later all use it — and each child swaps exactly the sessions
        whose current assistant's intelligence changed. A session not loaded anywhere takes the
        swap at once, without a process: it is opened on the newest generation when it is next
        loaded. The cost does not depend on how many sessions are open.
        """
        frame = self.running.swap_frame()
        # Older generations still waiting for acks are superseded (their children may be gone).
        fanout = self._newest = await self.pool.broadcast(lambda _child: frame)
        for child in fanout.sent:  # logged after every frame is on its way: no log line delays a send
            log.info(
                events.LOG_SWAP_SENT,
                child=child.id,
                pid=child.pid,
                generation=frame.generation,
                sessions=len(child.loaded),
                policy=frame.policy.value,
            )
        self._log_if_acked()
        # The bookkeeping below walks every hot session: it waits until the children have acked
        # (or a moment has passed), so it never sits between a child's ack and its reading.
        with anyio.move_on_after(ACK_WAIT):
            await fanout.done.wait()
        if not intelligence_changed:
            return [], 0
        hot = sessions_to_swap(
            {r.id: r.assistant for r in self.sessions.values() if not r.closing}, intelligence_changed
        )
        try:
            by_assistant = await self.store.open_sessions_by_assistant()
            total = sum(by_assistant.get(name, 0) for name in intelligence_changed)
        except StoreError:
            total = len(hot)
        return hot[:SWAPPED_LIST_MAX], max(total, len(hot))

    def swap_acked(self, child: Child, generation: int) -> None:
        """A child acknowledged the SwapIntel of ``generation`` (the pool's ``Fanout`` counted it first)."""
        log.debug(events.LOG_SWAP_ACKED, child=child.id, generation=generation)
        self._log_if_acked()

    def _log_if_acked(self) -> None:
        """Once, when every child the newest reload reached has acknowledged it."""
        fanout = self._newest
        if fanout is None or not fanout.complete or fanout.seconds is None:
            return
        self._newest = None
        log.info(events.LOG_SWAP_FANOUT_ACKED, generation=fanout.generation, seconds=round(fanout.seconds, 4))
