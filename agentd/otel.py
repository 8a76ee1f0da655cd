"""OpenTelemetry GenAI traces (RFC 0011 §4): on only when the standard variables say so.

Tracing is on when ``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or
``OTEL_TRACES_EXPORTER`` is set (and neither ``OTEL_SDK_DISABLED=true`` nor
``OTEL_TRACES_EXPORTER=none`` turns it off). Off, nothing of OpenTelemetry is imported: every call
here goes to ``Tracing``, whose methods do nothing and return one shared no-op context manager.
On, a child installs ``agentd.otel_sdk.SdkTracing`` (the extra ``agentd[otel]``), which makes the
spans ``invoke_agent {assistant}``, ``chat {model}`` and ``execute_tool {tool}``.

The supervisor makes no spans: it reads the client's W3C ``traceparent``/``tracestate``
(``trace_carrier``), stores it with the turn (so the replica that runs it, or adopts it after a
failover, continues the same trace) and hands it to the child in ``Input.trace``; it gives the
child the ``OTEL_*`` variables in ``Spawn.telemetry``, never in its environment (an exporter's
headers may hold credentials, which tools must not read).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Final, Protocol

__all__ = [
    "CAPTURE_CONTENT",
    "NO_SPAN",
    "Span",
    "Tracer",
    "Tracing",
    "configured",
    "install",
    "setup",
    "telemetry_environment",
    "trace_carrier",
    "tracing",
    "tracing_unavailable",
]

#: Any of these set turns tracing on (the OpenTelemetry SDK's own variables).
TRIGGERS: Final = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER")
#: Message content (prompts, answers, tool arguments and results) goes into spans only when this is ``true``.
CAPTURE_CONTENT: Final = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_TRACESTATE = re.compile(r"[\x20-\x7e]{1,512}")


def configured(environ: Mapping[str, str]) -> bool:
    """Whether the standard ``OTEL_*`` variables in ``environ`` ask for traces."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = {part.strip().lower() for part in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if part.strip()}
    if exporters == {"none"}:
        return False
    return any(environ.get(name, "").strip() for name in TRIGGERS)


def tracing_unavailable(environ: Mapping[str, str]) -> str | None:
    """Why the traces ``environ`` asks for cannot be made (``agentd[otel]`` is not installed), or None.

    Looked up without importing anything of it (``importlib.util.find_spec`` of the exporter's
    package), and only when traces are asked for.
    """
    if not configured(environ):
        return None
    try:
        found = importlib.util.find_spec("opentelemetry.exporter.otlp.proto.http") is not None
    except ModuleNotFoundError:  # a parent package is missing
        found = False
    if found:
        return None
    asked = ", ".join(name for name in TRIGGERS if environ.get(name, "").strip())
    return f"OpenTelemetry traces are asked for ({asked}) but not installed: pip install 'agentd[otel]'"


def telemetry_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The ``OTEL_*`` variables a child sets its tracing up with (empty when tracing is off)."""
    if not configured(environ):
        return {}
    return {name: value for name, value in environ.items() if name.startswith("OTEL_")}


def trace_carrier(headers: Mapping[str, str]) -> dict[str, str]:
    """The W3C trace context of a request's headers, when well formed: ``traceparent`` and, with
    it, ``tracestate``. Anything else is ignored (a malformed header starts a new trace)."""
    parent = headers.get("traceparent", "").strip().lower()
    if not _TRACEPARENT.fullmatch(parent) or parent.startswith("ff") or parent[3:35] == "0" * 32:
        return {}
    carrier = {"traceparent": parent}
    state = headers.get("tracestate", "").strip()
    if state and _TRACESTATE.fullmatch(state):
        carrier["tracestate"] = state
    return carrier


class Span(Protocol):
    """What agentd records on a span: attributes, events, and a failure's ``error.type``."""

    def set(self, attributes: Mapping[str, Any]) -> None: ...
    def event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None: ...
    def fail(self, error_type: str) -> None: ...


class SpanScope(Protocol):
    def __enter__(self) -> Span: ...
    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None: ...


class Tracer(Protocol):
    """The spans of a turn (RFC 0011 §4); ``Tracing`` when off, ``agentd.otel_sdk.SdkTracing`` when on."""

    enabled: bool
    capture: bool

    def invoke_agent(
        self, *, assistant: str, session: str, turn: str, generation: int, run: int, carrier: Mapping[str, str]
    ) -> SpanScope: ...
    def chat(self, *, provider: str, model: str, turn: str, generation: int, run: int) -> SpanScope: ...
    def execute_tool(self, *, tool: str, call_id: str, turn: str, generation: int, run: int) -> SpanScope: ...
    def event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None: ...
    def shutdown(self) -> None: ...


class _NoSpan:
    def set(self, attributes: Mapping[str, Any]) -> None:
        return None

    def event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        return None

    def fail(self, error_type: str) -> None:
        return None


NO_SPAN: Final = _NoSpan()


class _NoScope:
    def __enter__(self) -> Span:
        return NO_SPAN

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        return None


_NO_SCOPE: Final = _NoScope()


class Tracing:
    """Tracing off: every span is the one shared no-op, and nothing is imported or allocated."""

    enabled = False
    capture = False

    def invoke_agent(
        self, *, assistant: str, session: str, turn: str, generation: int, run: int, carrier: Mapping[str, str]
    ) -> SpanScope:
        return _NO_SCOPE

    def chat(self, *, provider: str, model: str, turn: str, generation: int, run: int) -> SpanScope:
        return _NO_SCOPE

    def execute_tool(self, *, tool: str, call_id: str, turn: str, generation: int, run: int) -> SpanScope:
        return _NO_SCOPE

    def event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        return None

    def shutdown(self) -> None:
        return None


_current: Tracer = Tracing()


def tracing() -> Tracer:
    """This process's tracer (the no-op one until ``setup`` or ``install``)."""
    return _current


def install(tracer: Tracer) -> Tracer:
    """Make ``tracer`` this process's (tests install one over an in-memory exporter); the previous one."""
    global _current
    previous, _current = _current, tracer
    return previous


def setup(environ: Mapping[str, str]) -> Tracer:
    """Turn tracing on in this process when ``environ`` (the ``OTEL_*`` variables) asks for it.

    Without ``agentd[otel]`` installed the traces asked for cannot be made: ImportError names the
    extra (the child reports it and exits, as for any spawn it cannot honour).
    """
    if not configured(environ):
        return _current
    try:
        from agentd.otel_sdk import SdkTracing
    except ImportError as exc:  # pragma: no cover - the test extra installs it
        raise ImportError(
            f"OpenTelemetry is configured but not installed: pip install 'agentd[otel]' ({exc})"
        ) from None
    install(SdkTracing(environ))
    return _current
