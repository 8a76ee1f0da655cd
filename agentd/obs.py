"""Observability: structlog configuration shared by supervisor and children.

JSON lines when the stream is not a TTY (journald, Kubernetes), a readable console otherwise.
Event names come from agentd.events. No line carries a secret value: every line passes
``agentd.redact.scrub_log_secrets`` before it is rendered, whatever field it is in.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TextIO

import structlog

from agentd.redact import scrub_log_secrets

if TYPE_CHECKING:
    from agentd.records import ModelSpend

__all__ = ["LogFormat", "LogLimiter", "Metrics", "bound_logger", "configure_logging", "get_logger"]

LogFormat = Literal["json", "console", "auto"]


def configure_logging(
    fmt: LogFormat = "auto", level: str = "info", stream: TextIO | None = None, **context: object
) -> None:
    """Route structlog to ``stream`` (stderr by default) with ``context`` bound to every line."""
    out = stream or sys.stderr
    use_json = fmt == "json" or (fmt == "auto" and not out.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=out.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            scrub_log_secrets,  # last before rendering: every field, a formatted traceback included
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    if context:
        structlog.contextvars.bind_contextvars(**context)
    _route_stdlib_logging()


class _StdlibLogs(logging.Handler):
    """Records of the standard ``logging`` module (uvicorn's ``uvicorn.error``, libraries) as one
    structured ``stdlib.log`` line each — never Python's plain-text last-resort output, never a
    multi-line traceback: an exception is its type and message."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields: dict[str, object] = {"logger": record.name, "message": " ".join(record.getMessage().split())}
            if record.exc_info and record.exc_info[1] is not None:
                exc = record.exc_info[1]
                fields["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
            level = record.levelname.lower()
            logger = get_logger("stdlib")
            getattr(logger, level if level in ("debug", "info", "warning", "error", "critical") else "warning")(
                "stdlib.log", **fields
            )
        except Exception:
            self.handleError(record)


def _route_stdlib_logging() -> None:
    root = logging.getLogger()
    if not any(isinstance(handler, _StdlibLogs) for handler in root.handlers):
        root.addHandler(_StdlibLogs())
    if root.level == logging.NOTSET or root.level > logging.WARNING:
        root.setLevel(logging.WARNING)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi"):
        logging.getLogger(name).propagate = True  # to the root handler above (log_config=None)


def bound_logger(component: str, **context: object) -> structlog.typing.FilteringBoundLogger:
    """``get_logger`` bound now, for an object that logs on every turn (a hot session): a lazy
    logger builds itself again on every call (about 13 µs). It keeps the level and output in force
    when it is made (``configure_logging`` runs at start, before any session); processors that are
    reconfigured later (``structlog.testing.capture_logs``) still apply."""
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(component=component, **context).bind()
    return logger


def get_logger(component: str, **context: object) -> structlog.typing.FilteringBoundLogger:
    """A logger whose lines carry ``component`` and ``context`` (e.g. the session they are about)."""
    # get_logger(**initial) stays lazy: a module-level logger follows configure_logging() called later.
    # structlog.get_logger is typed Any (its return depends on configure()); this project configures a filtering
    # bound logger, so name that type here.
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(component=component, **context)
    return logger


@dataclass
class _Window:
    start: float
    logged: int = 0
    dropped: int = 0


class LogLimiter:
    """At most ``limit`` lines of one kind (``key``) in each ``window`` seconds; the rest are counted.

    For lines whose number someone else decides: a child's stderr, a library's log records (a stdio
    MCP server that writes what is not JSON to its stdout makes the SDK log one error per line,
    tens of thousands a second). ``due`` says how many lines of each kind were dropped in windows
    that have ended — the caller logs that count, so nothing disappears without a trace. Pure: the
    clock is injected, and nothing here depends on when ``due`` is called except when counts are
    reported.
    """

    def __init__(self, limit: int = 100, window: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.window = limit, window
        self._clock = clock
        self._windows: dict[Hashable, _Window] = {}
        self._due: list[tuple[Hashable, int]] = []

    def admit(self, key: Hashable) -> bool:
        """Whether a line of kind ``key`` may be logged now (False: it is counted as dropped)."""
        now = self._clock()
        window = self._windows.get(key)
        if window is None or now - window.start >= self.window:
            if window is not None and window.dropped:
                self._due.append((key, window.dropped))
            window = self._windows[key] = _Window(now)
        if window.logged < self.limit:
            window.logged += 1
            return True
        window.dropped += 1
        return False

    def due(self, *, everything: bool = False) -> list[tuple[Hashable, int]]:
        """The drop counts to report: of every window that has ended (``everything``: of all)."""
        now = self._clock()
        for key, window in list(self._windows.items()):
            if everything or now - window.start >= self.window:
                del self._windows[key]  # an idle kind costs nothing until it logs again
                if window.dropped:
                    self._due.append((key, window.dropped))
        due, self._due = self._due, []
        return due


class Metrics:
    """The supervisor's Prometheus metrics, on a registry of its own (served at ``/metrics``)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self._children: dict[tuple[object, tuple[str, ...]], Any] = {}
        self.turns = Counter("agentd_turns", "Turns ended, by status", ["status"], registry=self.registry)
        self.swaps = Counter(
            "agentd_swaps_applied", "Swaps applied by sessions, by kind", ["kind"], registry=self.registry
        )
        self.reloads = Counter("agentd_reloads", "Config reloads, by result", ["result"], registry=self.registry)
        self.turn_seconds = Histogram(
            "agentd_turn_duration_seconds",
            "Turn duration",
            registry=self.registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )
        self.generation = Gauge("agentd_config_generation", "Running config generation", registry=self.registry)
        self.sessions = Gauge("agentd_sessions", "Sessions by state", ["state"], registry=self.registry)
        self.children = Gauge("agentd_children", "Child processes running", registry=self.registry)
        self.session_loads = Counter(
            "agentd_session_loads", "Sessions loaded on a child from the store", registry=self.registry
        )
        self.session_unloads = Counter(
            "agentd_session_unloads", "Idle sessions unloaded from their child", registry=self.registry
        )
        self.child_crashes = Counter(
            "agentd_child_crashes", "Children that ended without being asked to", registry=self.registry
        )
        self.turn_reruns = Counter(
            "agentd_turn_reruns", "Turns re-run on another child after theirs ended", registry=self.registry
        )
        # RFC 0012 §6: approvals waiting now (read fresh from the store), and decisions by outcome.
        self.approvals_pending = Gauge(
            "agentd_approvals_pending", "Tool-call approvals waiting for a decision", registry=self.registry
        )
        self.approvals = Counter(
            "agentd_approvals", "Tool-call approvals decided, by decision", ["decision"], registry=self.registry
        )
        self.delta_frames = Counter(
            "agentd_delta_frames",
            "delta and step.reset event frames received from children, by event",
            ["event"],
            registry=self.registry,
        )
        # RFC 0011 §3: what committed turns spent, discarded attempts included.
        self.tokens = Counter(
            "agentd_tokens",
            "Tokens spent by ended turns, by model and type (input, output, cached_input, reasoning)",
            ["model", "type"],
            registry=self.registry,
        )
        self.cost = Counter(
            "agentd_cost",
            "What ended turns cost, by model and currency (exact figures: GET /v1/usage)",
            ["model", "currency"],
            registry=self.registry,
        )

    def labelled(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)`` (in the order of its label names), kept once made: every turn
        counts several, and prometheus_client validates the values and takes a lock on each lookup."""
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def count_spend(self, spend: Iterable[ModelSpend]) -> None:
        """Add a committed turn's per-model spend to ``agentd_tokens_total`` and ``agentd_cost_total``."""
        for part in spend:
            usage = part.usage
            for kind, count in (
                ("input", usage.input_tokens),
                ("output", usage.output_tokens),
                ("cached_input", usage.cached_input_tokens),
                ("reasoning", usage.reasoning_tokens),
            ):
                if count:
                    self.labelled(self.tokens, part.model, kind).inc(count)
            if part.cost is not None:
                self.labelled(self.cost, part.model, part.cost.currency).inc(float(part.cost.amount))

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
