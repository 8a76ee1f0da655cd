"""Tracing on (RFC 0011 §4): the OpenTelemetry SDK behind ``agentd.otel``'s ``Tracer`` interface.

Imported only when the ``OTEL_*`` variables ask for traces (``agentd.otel.setup``), from the extra
``agentd[otel]``: ``opentelemetry-sdk`` and its OTLP/HTTP (protobuf) exporter. The SDK reads its
standard variables itself — endpoint, headers, timeout, sampler, batch sizes, service name and
resource attributes — from the variables the supervisor handed over, set in this process's
environment only while the exporter and provider are built (an exporter's headers may hold
credentials: they are gone from the environment, which tools can read, before any tool runs, and
they are scrubbed from everything agentd writes).

Span attributes follow the OpenTelemetry GenAI semantic conventions, plus agentd's own
(``agentd.turn.id``, ``agentd.generation``, ``agentd.turn.run``). No attribute carries a secret:
message content only with ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true``, and then
scrubbed (``agentd.redact``); errors are named by kind (``error.type``), never by their text.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Final
from urllib.parse import unquote

from opentelemetry.context import Context, attach, detach
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Span as OtelSpan
from opentelemetry.trace import SpanKind, Status, StatusCode, get_current_span, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from agentd import __version__
from agentd.redact import SECRETS

__all__ = ["SdkTracing", "header_secrets"]

_CAPTURE: Final = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
_HEADERS: Final = ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS")


def header_secrets(environ: Mapping[str, str]) -> set[str]:
    """The values of the exporter's headers (``key=value,…``, URL-encoded): credentials, scrubbed everywhere."""
    values: set[str] = set()
    for name in _HEADERS:
        for pair in environ.get(name, "").split(","):
            _, sep, value = pair.partition("=")
            value = unquote(value).strip()
            if sep and value:
                values.add(value)
                scheme, _, credentials = value.partition(" ")
                if scheme and credentials.strip():
                    values.add(credentials.strip())
    return values


@contextmanager
def _environment(environ: Mapping[str, str]) -> Iterator[None]:
    """``environ``'s ``OTEL_*`` variables in ``os.environ`` while the SDK reads them, then as before."""
    names = [name for name in environ if name.startswith("OTEL_")]
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update({name: environ[name] for name in names})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _exporters(environ: Mapping[str, str]) -> list[SpanExporter]:
    """The exporters ``OTEL_TRACES_EXPORTER`` names (default ``otlp``: OTLP over HTTP/protobuf)."""
    names = [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if n.strip()]
    found: list[SpanExporter] = []
    for name in names or ["otlp"]:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            found.append(OTLPSpanExporter())
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            found.append(ConsoleSpanExporter(out=sys.stderr))  # stdout may be a frame channel's neighbour
    return found


class _Span:
    """An SDK span seen through ``agentd.otel.Span``."""

    __slots__ = ("span",)

    def __init__(self, span: OtelSpan) -> None:
        self.span = span

    def set(self, attributes: Mapping[str, Any]) -> None:
        self.span.set_attributes({k: v for k, v in attributes.items() if v is not None})

    def event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        self.span.add_event(name, {k: v for k, v in (attributes or {}).items() if v is not None})

    def fail(self, error_type: str) -> None:
        self.span.set_attribute("error.type", error_type)
        self.span.set_status(Status(StatusCode.ERROR))


class _Scope:
    """Starts a span and makes it the current one until the block ends; an exception leaving the
    block is named by its type only (``error.type``), never by its text."""

    __slots__ = ("_attributes", "_kind", "_name", "_parent", "_span", "_token", "_tracer")

    def __init__(
        self, tracing: SdkTracing, name: str, kind: SpanKind, attributes: dict[str, Any], parent: Context | None
    ) -> None:
        self._tracer, self._name, self._kind, self._attributes, self._parent = (
            tracing.tracer,
            name,
            kind,
            attributes,
            parent,
        )
        self._span: _Span | None = None
        self._token: object = None

    def __enter__(self) -> _Span:
        # start_span + attach rather than start_as_current_span: no generator per span, and no
        # exception recording (record_exception would put an exception's text in the span).
        span = self._tracer.start_span(self._name, context=self._parent, kind=self._kind, attributes=self._attributes)
        self._token = attach(set_span_in_context(span))
        self._span = _Span(span)
        return self._span

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool | None:
        span = self._span
        assert span is not None
        try:
            if exc is not None and "error.type" not in (getattr(span.span, "attributes", None) or {}):
                span.fail(type(exc).__qualname__)
        finally:
            detach(self._token)  # type: ignore[arg-type]
            span.span.end()
        return None


class SdkTracing:
    """Tracing on: GenAI spans exported by the SDK (see the module docstring)."""

    enabled = True

    def __init__(self, environ: Mapping[str, str], *, exporter: SpanExporter | None = None) -> None:
        """Build the provider from ``environ``'s ``OTEL_*`` variables; ``exporter`` (tests: an
        in-memory one) replaces the configured ones and exports each span as it ends."""
        SECRETS.add(header_secrets(environ))
        with _environment(environ):
            self.provider = TracerProvider(resource=Resource.create(_service(environ)))
            if exporter is not None:
                self.provider.add_span_processor(SimpleSpanProcessor(exporter))
            else:
                for configured in _exporters(environ):
                    self.provider.add_span_processor(BatchSpanProcessor(configured))
        self.tracer = self.provider.get_tracer("agentd", __version__)
        self.capture = environ.get(_CAPTURE, "").strip().lower() == "true"
        self._propagator = TraceContextTextMapPropagator()

    def invoke_agent(
        self, *, assistant: str, session: str, turn: str, generation: int, run: int, carrier: Mapping[str, str]
    ) -> _Scope:
        parent = self._propagator.extract(dict(carrier)) if carrier else Context()  # no carrier: a new trace
        attributes = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": assistant,
            "gen_ai.conversation.id": session,
            **_own(turn, generation, run),
        }
        return _Scope(self, f"invoke_agent {assistant}", SpanKind.INTERNAL, attributes, parent)

    def chat(self, *, provider: str, model: str, turn: str, generation: int, run: int) -> _Scope:
        attributes = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": provider,
            "gen_ai.request.model": model,
            **_own(turn, generation, run),
        }
        return _Scope(self, f"chat {model}", SpanKind.CLIENT, attributes, None)

    def execute_tool(self, *, tool: str, call_id: str, turn: str, generation: int, run: int) -> _Scope:
        attributes = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": tool,
            "gen_ai.tool.call.id": call_id,
            "gen_ai.tool.type": "function",
            **_own(turn, generation, run),
        }
        return _Scope(self, f"execute_tool {tool}", SpanKind.INTERNAL, attributes, None)

    def event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        span = get_current_span()
        if span.is_recording():
            span.add_event(name, {k: v for k, v in (attributes or {}).items() if v is not None})

    def shutdown(self) -> None:
        """Export what is buffered (bounded by the SDK's export timeout) and stop."""
        self.provider.shutdown()


def _own(turn: str, generation: int, run: int) -> dict[str, Any]:
    return {"agentd.turn.id": turn, "agentd.generation": generation, "agentd.turn.run": run}


def _service(environ: Mapping[str, str]) -> dict[str, str]:
    # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES itself; "agentd" is
    # only the default when neither names the service.
    named = environ.get("OTEL_SERVICE_NAME") or "service.name=" in environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    return {} if named else {"service.name": "agentd"}
