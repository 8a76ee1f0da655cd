"""The supervisor: config generations, the session registry, reload fan-out, and the API's operations.

It never calls a model. Each open session has a ``SessionRuntime`` task that keeps a child process
for it; the supervisor decides which sessions a reload swaps and turns API calls into stored
inputs and ``Input`` frames. API errors are raised as ``ApiError`` with the HTTP status to answer.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import anyio

from agentd import __version__, events
from agentd.budget import TurnStatus
from agentd.config import (
    Config,
    ConfigError,
    ConfigIssue,
    PolicyChoice,
    effective_intelligence,
    intelligence_map,
    load_config,
    quickstart_config,
    resolve_swap_policy,
)
from agentd.messages import UserMessage
from agentd.obs import Metrics, get_logger
from agentd.protocol import Spawn, SwapIntel
from agentd.records import StartedTurn
from agentd.store import Store, StoredSession, StoreError
from agentd.supervisor.options import DaemonOptions
from agentd.supervisor.reload import ReloadCoordinator, plan_reload, sessions_to_swap
from agentd.supervisor.session import PendingTurn, SessionRuntime
from agentd.transfer import OpenerKind, opener_message, opener_plan, session_start_history
from agentd.views import (
    Accepted,
    ChildView,
    MessageResult,
    PolicyView,
    PostMessage,
    ReloadResult,
    SessionCounts,
    SessionSummary,
    SessionView,
    StatusView,
    entry_from_message,
    turn_view,
)

__all__ = ["ApiError", "Supervisor", "load_daemon_config"]

log = get_logger("supervisor")


class ApiError(Exception):
    """An API call that cannot be served: the HTTP status, a stable code, and a clear message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        self.status, self.code, self.message = status, code, message
        super().__init__(message)


def load_daemon_config(path: Path | None) -> Config:
    """The config file, or the built-in quickstart when no file is given. Raises ConfigError."""
    return load_config(path) if path is not None else quickstart_config()


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(6)}"


class Supervisor:
    """Owns the running config generation and every open session."""

    def __init__(self, options: DaemonOptions, config: Config, policy: PolicyChoice, store: Store) -> None:
        self.options = options
        self.config = config
        self.policy = policy
        self.generation = 1
        self.store = store
        self.metrics = Metrics()
        self.metrics.generation.set(1)
        self.sessions: dict[str, SessionRuntime] = {}
        self.draining = False
        self.stopping = False
        self.reloads: ReloadCoordinator[ReloadResult] = ReloadCoordinator(self._reload)
        self._tg: anyio.abc.TaskGroup | None = None
        self._turn_ended = anyio.Event()
        self._awaiting_acks: dict[int, tuple[set[str], float]] = {}

    # ------------------------------------------------------------------ lifecycle

    async def start(self, tg: anyio.abc.TaskGroup) -> int:
        """Restore every open session from the store and start its runtime. Returns how many."""
        self._tg = tg
        restored = await self.store.open_sessions()
        for stored in restored:
            runtime = self._runtime_from_store(stored, await self.store.pending_turn(stored.id))
            self.sessions[stored.id] = runtime
            tg.start_soon(self._run_session, runtime)
        log.info(
            "supervisor.restored",
            sessions=len(restored),
            pending=sum(1 for r in self.sessions.values() if r.pending is not None),
        )
        return len(restored)

    def _runtime_from_store(self, stored: StoredSession, pending: StartedTurn | None) -> SessionRuntime:
        transcript = [e.message for e in stored.transcript if pending is None or e.message.turn != pending.id]
        state = "failed" if stored.state == "failed" else "idle"
        runtime = SessionRuntime(self, stored.id, stored.assistant, state, stored.generation, stored.model, transcript)
        if pending is not None:
            # An interrupted turn: its input is stored, its results are not. It re-runs.
            runtime.pending = PendingTurn(
                id=pending.id, message=pending.message, started_at=pending.started_at, stored=True
            )
            runtime.state = "running" if state != "failed" else state
        return runtime

    async def _run_session(self, runtime: SessionRuntime) -> None:
        """A session's task. A bug in one session marks it failed; it never takes the daemon down."""
        try:
            await runtime.run()
        except Exception as exc:
            log.exception("session.crashed", session=runtime.id)
            with anyio.CancelScope(shield=True):
                await runtime.fail(f"internal error: {type(exc).__name__}: {exc}")
        finally:
            if self.sessions.get(runtime.id) is runtime and runtime.closing and not self.stopping:
                del self.sessions[runtime.id]

    def spawn_task(self, coro: Awaitable[Any]) -> None:
        """Run a coroutine in the supervisor's task group (fire and forget, logged on failure)."""
        assert self._tg is not None

        async def run() -> None:
            try:
                await coro
            except Exception:
                log.exception("supervisor.task_failed")

        self._tg.start_soon(run)

    async def drain(self, grace: float) -> bool:
        """Stop accepting turns; wait up to ``grace`` for in-flight turns. True when all ended."""
        self.draining = True
        log.info("supervisor.draining", grace=grace, running=self._running_turns())
        with anyio.move_on_after(grace):
            while self._running_turns():
                self._turn_ended = anyio.Event()
                await self._turn_ended.wait()
        return self._running_turns() == 0

    async def stop(self) -> None:
        """Stop every child (kill ladder) and end the session tasks."""
        self.stopping = True
        for runtime in list(self.sessions.values()):
            await runtime.close()

    def _running_turns(self) -> int:
        return sum(1 for r in self.sessions.values() if r.pending is not None and r.state != "failed")

    def turn_finished(self) -> None:
        self._turn_ended.set()

    # ------------------------------------------------------------------ what children are given

    def child_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "AGENTD_API_TOKEN"}  # tools need no API token
        env["AGENTD_LOG_LEVEL"] = self.options.log_level
        return env

    def spawn_frame(self, child_id: str) -> tuple[int, Spawn]:
        """The Spawn for a new child: always the newest generation."""
        return self.generation, Spawn(
            child_id=child_id, generation=self.generation, policy=self.policy.policy, config=self.config
        )

    def swap_frame(self) -> SwapIntel:
        """The SwapIntel describing the running generation."""
        return SwapIntel(
            generation=self.generation,
            policy=self.policy.policy,
            intelligence=intelligence_map(self.config),
            limits=self.config.limits,
        )

    def model_of(self, assistant: str, fallback: str) -> str:
        """The running generation's model for ``assistant`` (``fallback`` if the config no longer has it)."""
        try:
            return effective_intelligence(self.config, assistant).model
        except KeyError:
            return fallback

    def swap_acked(self, runtime: SessionRuntime, generation: int) -> None:
        log.debug(events.LOG_SWAP_ACKED, session=runtime.id, generation=generation)
        waiting = self._awaiting_acks.get(generation)
        if waiting is None:
            return
        sessions, started = waiting
        sessions.discard(runtime.id)
        if not sessions:
            del self._awaiting_acks[generation]
            log.info(events.LOG_SWAP_FANOUT_ACKED, generation=generation, seconds=round(time.monotonic() - started, 4))

    # ------------------------------------------------------------------ reload

    async def reload(self) -> ReloadResult:
        """Reload the config file (serialized; concurrent requests coalesce into one more reload)."""
        try:
            return await self.reloads.request()
        except Exception as exc:  # a reload bug must never take the daemon down; the old config stays
            log.exception(events.LOG_CONFIG_RELOAD, applied=False)
            return ReloadResult(
                generation=self.generation,
                applied=False,
                errors=[ConfigIssue("", f"internal error: {type(exc).__name__}: {exc}")],
            )

    async def _reload(self) -> ReloadResult:
        path = self.options.config_path
        try:
            new = await anyio.to_thread.run_sync(load_daemon_config, path)
            policy = resolve_swap_policy(self.options.model_swap_flag, os.environ, new.model_swap)
        except ConfigError as exc:
            result = ReloadResult(generation=self.generation, applied=False, errors=exc.issues)
            self.metrics.reloads.labels(result="rejected").inc()
            log.warning(
                events.LOG_CONFIG_RELOAD, applied=False, generation=self.generation, errors=[str(i) for i in exc.issues]
            )
            return result
        orphaned = self._orphaned_sessions(new)
        if orphaned:
            self.metrics.reloads.labels(result="rejected").inc()
            log.warning(
                events.LOG_CONFIG_RELOAD, applied=False, generation=self.generation, errors=[str(i) for i in orphaned]
            )
            return ReloadResult(generation=self.generation, applied=False, errors=orphaned)
        plan = plan_reload(self.config, new)
        policy_changed = policy != self.policy
        if not plan.changed and not policy_changed:
            result = ReloadResult(generation=self.generation, applied=True, restart_required=plan.restart_required)
            self.metrics.reloads.labels(result="unchanged").inc()
            log.info(
                events.LOG_CONFIG_RELOAD,
                applied=True,
                generation=self.generation,
                changed=[],
                restart_required=plan.restart_required,
            )
            return result
        old_limits = self.config.limits
        self.config, self.policy = plan.config, policy
        self.generation += 1
        self.metrics.generation.set(self.generation)
        swapped = await self._fan_out(plan.intelligence_changed, limits_changed=plan.config.limits != old_limits)
        changed = plan.changed + (
            ["model_swap (effective)"] if policy_changed and "model_swap" not in plan.changed else []
        )
        result = ReloadResult(
            generation=self.generation,
            applied=True,
            changed=changed,
            restart_required=plan.restart_required,
            swapped_sessions=swapped,
        )
        self.metrics.reloads.labels(result="applied").inc()
        log.info(
            events.LOG_CONFIG_RELOAD,
            applied=True,
            generation=self.generation,
            changed=changed,
            restart_required=plan.restart_required,
            swapped_sessions=len(swapped),
            policy=policy.policy.value,
            policy_source=policy.source,
        )
        return result

    def _orphaned_sessions(self, new: Config) -> list[ConfigIssue]:
        """A new config must keep every assistant an open session is on (closing them is the operator's call)."""
        names = {a.name for a in new.assistants}
        on: dict[str, int] = {}
        for runtime in self.sessions.values():
            if runtime.assistant not in names:
                on[runtime.assistant] = on.get(runtime.assistant, 0) + 1
        return [
            ConfigIssue(
                "assistants",
                f"assistant {name!r} was removed but {count} open session(s) are on it; keep it until they are closed",
            )
            for name, count in sorted(on.items())
        ]

    async def _fan_out(self, intelligence_changed: list[str], *, limits_changed: bool = False) -> list[str]:
        """Send SwapIntel where it matters; return the sessions whose current assistant's intelligence changed.

        Every child hosting a session gets the frame when any assistant's intelligence changed — it
        carries every assistant's intelligence so a later transfer uses the new model — but only
        sessions whose *current* assistant changed are swapped (the child compares, per session).
        A change of limits alone is sent too: children adopt it at their next boundary.
        """
        if not intelligence_changed and not limits_changed:
            return []  # prompt/tool/transfer changes apply to new sessions; nothing to tell children
        frame = self.swap_frame()
        runtimes = [r for r in self.sessions.values() if not r.closing]
        # Older generations still waiting for acks are superseded (their children may be gone).
        self._awaiting_acks = {
            frame.generation: ({r.id for r in runtimes if r.child_state == "ready"}, time.monotonic())
        }
        swapped = sessions_to_swap({r.id: r.assistant for r in runtimes}, intelligence_changed)
        async with anyio.create_task_group() as tg:
            for runtime in runtimes:
                tg.start_soon(self._send_swap, runtime, frame, runtime.id in swapped)
        return swapped

    async def _send_swap(self, runtime: SessionRuntime, frame: SwapIntel, affected: bool) -> None:
        if await runtime.send_swap(frame) and affected:
            log.info(
                events.LOG_SWAP_SENT,
                session=runtime.id,
                pid=runtime.child.pid if runtime.child else None,
                generation=frame.generation,
                assistant=runtime.assistant,
                model_to=frame.intelligence[runtime.assistant].model
                if runtime.assistant in frame.intelligence
                else None,
                policy=frame.policy.value,
            )

    # ------------------------------------------------------------------ API operations

    def status(self) -> StatusView:
        children = [
            ChildView(
                pid=r.child.pid if r.child else None,
                sessions=[r.id],
                state=r.child_state,
                generation=r.child_generation,
                restarts=r.child_restarts,
            )
            for r in self.sessions.values()
            if r.child is not None or r.child_restarts
        ]
        counts = SessionCounts(
            open=sum(1 for r in self.sessions.values() if r.state != "failed"),
            failed=sum(1 for r in self.sessions.values() if r.state == "failed"),
        )
        return StatusView(
            pid=os.getpid(),
            version=__version__,
            generation=self.generation,
            model_swap=PolicyView(policy=self.policy.policy.value, source=self.policy.source),
            config_path=str(self.options.config_path) if self.options.config_path else None,
            children=children,
            sessions=counts,
            draining=self.draining,
        )

    def metrics_text(self) -> bytes:
        """Prometheus exposition, with the gauges read fresh."""
        for state in ("idle", "running", "failed"):
            self.metrics.sessions.labels(state=state).set(sum(1 for r in self.sessions.values() if r.state == state))
        self.metrics.children.set(sum(1 for r in self.sessions.values() if r.child is not None))
        return self.metrics.render()

    def ready(self) -> list[str]:
        """Reasons the daemon is not ready (empty = ready)."""
        reasons = ["draining"] if self.draining else []
        down = sorted({r.assistant for r in self.sessions.values() if r.intel_waiting})
        reasons += [f"all endpoints down for assistant {name!r}" for name in down]
        return reasons

    def _refuse_when_draining(self) -> None:
        if self.draining:
            raise ApiError(503, "draining", "agentd is shutting down and accepts no new work")

    async def create_session(self, assistant_name: str | None) -> SessionView:
        """Open a session on an assistant (the default: the first one); its opener is in the transcript."""
        self._refuse_when_draining()
        config = self.config
        name = assistant_name or config.default_assistant.name
        try:
            assistant = config.assistant(name)
        except KeyError:
            names = ", ".join(a.name for a in config.assistants)
            raise ApiError(400, "unknown_assistant", f"no assistant named {name!r}; assistants: {names}") from None
        model = effective_intelligence(config, name).model
        session_id = _new_id("s")
        history = session_start_history(assistant)
        plan = opener_plan(assistant, history)
        if plan.kind is OpenerKind.FIRST_MESSAGE:
            history.append(opener_message(plan, turn=None, model=model))
        await self.store.create_session(
            session_id,
            assistant=name,
            generation=self.generation,
            model=model,
            created_at=time.time(),
            transcript=history,
        )
        runtime = SessionRuntime(self, session_id, name, "idle", self.generation, model, history)
        self.sessions[session_id] = runtime
        assert self._tg is not None
        self._tg.start_soon(self._run_session, runtime)
        log.info("session.created", session=session_id, assistant=name, model=model)
        if plan.kind is OpenerKind.GENERATED:
            turn = await self._start_turn(runtime, None)
            await turn.done.wait()
        return await self.get_session(session_id)

    async def list_sessions(self) -> list[SessionSummary]:
        summaries = []
        for stored in await self.store.list_sessions():
            runtime = self.sessions.get(stored.id)
            summaries.append(
                SessionSummary(
                    id=stored.id,
                    assistant=runtime.assistant if runtime else stored.assistant,
                    state=runtime.state if runtime else stored.state,
                    generation=runtime.generation if runtime else stored.generation,
                    model=runtime.model if runtime else stored.model,
                    turns=stored.turn_count,
                )
            )
        return summaries

    async def get_session(self, session_id: str) -> SessionView:
        stored = await self.store.load_session(session_id)
        if stored is None:
            raise ApiError(404, "not_found", f"no session {session_id!r}")
        runtime = self.sessions.get(session_id)
        return SessionView(
            id=stored.id,
            assistant=runtime.assistant if runtime else stored.assistant,
            state=runtime.state if runtime else stored.state,
            generation=runtime.generation if runtime else stored.generation,
            model=runtime.model if runtime else stored.model,
            transcript=[entry_from_message(e.seq, e.message) for e in stored.transcript],
            turns=[turn_view(t) for t in stored.turns],
        )

    def _open_runtime(self, session_id: str) -> SessionRuntime:
        runtime = self.sessions.get(session_id)
        if runtime is None or runtime.closing:
            raise ApiError(404, "not_found", f"no open session {session_id!r}")
        return runtime

    async def send_message(self, session_id: str, body: PostMessage) -> MessageResult | Accepted:
        """Store the user message, deliver it, and (``wait``) return the finished turn."""
        self._refuse_when_draining()
        runtime = self._open_runtime(session_id)
        if not body.content.strip() and not body.images:
            raise ApiError(400, "empty_message", "content must not be empty")
        if runtime.pending is not None and runtime.state != "failed":
            raise ApiError(409, "turn_running", f"session {session_id} is already running turn {runtime.pending.id}")
        if runtime.state == "failed":
            await self._resume_failed(runtime)
        turn_id = _new_id("t")
        message = UserMessage(content=body.content, images=tuple(body.images) if body.images else None, turn=turn_id)
        turn = await self._start_turn(runtime, message)
        if not body.wait:
            return Accepted(turn_id=turn_id)
        await turn.done.wait()
        return await self._turn_result(session_id, turn)

    async def _resume_failed(self, runtime: SessionRuntime) -> None:
        await runtime.abandon(TurnStatus.FAILED, "superseded by a new message after the session failed")
        await self.store.update_session(runtime.id, state="idle")
        runtime.resume()

    async def _start_turn(self, runtime: SessionRuntime, message: UserMessage | None) -> PendingTurn:
        turn = PendingTurn(
            id=message.turn if message and message.turn else _new_id("t"), message=message, started_at=time.time()
        )
        runtime.pending, runtime.state = turn, "running"  # reserve synchronously: a concurrent request gets 409
        # Stored before delivered: deliver() only sends once begin_turn has committed the input.
        with anyio.CancelScope(shield=True):
            try:
                await self.store.begin_turn(runtime.id, turn.id, message, turn.started_at)
            except StoreError as exc:
                runtime.pending, runtime.state = None, "idle"
                raise ApiError(409, "turn_refused", str(exc)) from None
            await runtime.deliver(turn)
        return turn

    async def _turn_result(self, session_id: str, turn: PendingTurn) -> MessageResult:
        # The record as stored, so this answer and GET /v1/sessions show the same turn (same started_at).
        assert turn.result is not None
        return MessageResult(turn=turn_view(turn.result), messages=turn.entries)

    def subscribe(self, session_id: str) -> Any:
        return self._open_runtime(session_id).subscribe()

    async def cancel(self, session_id: str) -> str:
        runtime = self._open_runtime(session_id)
        if runtime.pending is None:
            raise ApiError(409, "no_turn", f"session {session_id} has no turn running")
        return await runtime.cancel_turn()

    async def close_session(self, session_id: str) -> SessionSummary:
        runtime = self._open_runtime(session_id)
        await runtime.close()
        await runtime.abandon(TurnStatus.CANCELLED, "the session was closed")
        runtime.state = "closed"
        await self.store.update_session(session_id, state="closed")
        self.sessions.pop(session_id, None)
        log.info("session.closed", session=session_id)
        return SessionSummary(
            id=session_id,
            assistant=runtime.assistant,
            state="closed",
            generation=runtime.generation,
            model=runtime.model,
        )
