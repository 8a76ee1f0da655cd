"""The API's OpenAPI 3.1 document (RFC 0010 §5), generated — never written by hand.

From the one route table (``agentd.api.ALL_ROUTES``), what each route takes and answers
(``RouteDoc``, in the same module) and the body types themselves: their JSON Schemas come from
``msgspec.json.schema_components``, so a field added to a body is in the document at once.
Event streams are ``text/event-stream`` with their event names (``x-agentd-events``); every
error status lists its codes (an ``enum`` on ``error.code``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import msgspec

__all__ = ["COMMON_ERRORS", "RouteDoc", "document"]

REF = "#/components/schemas/{name}"
JSON = "application/json"


class RouteDoc(NamedTuple):
    """What a route takes and answers, as its OpenAPI operation says."""

    summary: str
    #: status -> the body type (None: no JSON body; ``media`` says what it is).
    answers: Mapping[int, Any]
    #: The request body's type, None if the route takes none.
    request: Any = None
    #: Whether the request body may be left out (an empty body is ``{}``).
    optional_body: bool = False
    #: status -> the error codes the route may answer with.
    errors: Mapping[int, Sequence[str]] = {}
    #: The error body's type (the native shape, or the door's).
    error_body: Any = None
    #: Query parameters: name -> (JSON Schema, description).
    query: Mapping[str, tuple[dict[str, Any], str]] = {}
    #: Whether the route takes ``Idempotency-Key`` (RFC 0010 §2).
    keyed: bool = False
    #: Request and response headers beyond it: name -> description.
    headers: Mapping[str, str] = {}
    #: A non-JSON answer's media type (``text/event-stream``, the Prometheus text format).
    media: str | None = None
    #: The names of the events an event stream sends.
    events: Sequence[str] = ()
    #: A route that streams on request (the door's ``stream: true``): the names of what its 200
    #: ``text/event-stream`` answer sends, besides the JSON one.
    streamed: Sequence[str] = ()
    #: ``door`` for the OpenAI-compatible routes, else ``agentd``.
    tag: str = "agentd"


EVENT_STREAM = "text/event-stream"
#: One server-sent event (OpenAPI 3.1 has a ``text/event-stream`` schema describe each event):
#: its ``event`` name, where it has one, and its ``data`` (JSON text, or ``[DONE]``).
SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    "required": ["data"],
}
#: Errors every route may answer with: 401 on TCP without the token, 500 for a bug.
COMMON_ERRORS: Mapping[int, Sequence[str]] = {401: ("unauthorized",), 500: ("internal",)}


def _types(docs: Mapping[str, RouteDoc]) -> list[Any]:
    found: list[Any] = []
    for doc in docs.values():
        for kind in (doc.request, doc.error_body, *doc.answers.values()):
            if kind is not None and kind not in found:
                found.append(kind)
    return found


def _parameters(path: str, doc: RouteDoc) -> list[dict[str, Any]]:
    params: list[dict[str, Any]] = []
    if "{id}" in path:
        params.append({"name": "id", "in": "path", "required": True, "schema": {"type": "string"}})
    for name, (schema, description) in doc.query.items():
        params.append({"name": name, "in": "query", "required": False, "schema": schema, "description": description})
    if doc.keyed:
        params.append(
            {
                "name": "Idempotency-Key",
                "in": "header",
                "required": False,
                "schema": {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^[!-~]+$"},
                "description": "The same key again answers the first request's answer (RFC 0010 §2)",
            }
        )
    for name, description in doc.headers.items():
        params.append(
            {"name": name, "in": "header", "required": False, "schema": {"type": "string"}, "description": description}
        )
    return params


def _error_schema(body: dict[str, Any], codes: Sequence[str]) -> dict[str, Any]:
    return {
        "allOf": [
            body,
            {
                "type": "object",
                "properties": {"error": {"type": "object", "properties": {"code": {"enum": sorted(set(codes))}}}},
            },
        ]
    }


def _operation(
    path: str, method: str, name: str, doc: RouteDoc, schema_of: dict[Any, dict[str, Any]]
) -> dict[str, Any]:
    responses: dict[str, Any] = {}
    for status, kind in doc.answers.items():
        if kind is None:
            content = {doc.media or "text/plain": {"schema": {"type": "string"}}}
        else:
            content = {JSON: {"schema": schema_of[kind]}}
        answer: dict[str, Any] = {"description": f"{status}", "content": content}
        if doc.events:
            answer["description"] = "events: " + ", ".join(doc.events)
            answer["x-agentd-events"] = list(doc.events)
        if doc.streamed and status == 200:
            content[EVENT_STREAM] = {"schema": SSE_EVENT}
            answer["description"] = "JSON; with stream true, text/event-stream of: " + ", ".join(doc.streamed)
            answer["x-agentd-events"] = list(doc.streamed)
        responses[str(status)] = answer
    errors = {**COMMON_ERRORS, **doc.errors}
    if doc.error_body is not None:
        for status in sorted(errors):
            codes = list(errors[status])
            responses[str(status)] = {
                "description": "error codes: " + ", ".join(sorted(set(codes))),
                "content": {JSON: {"schema": _error_schema(schema_of[doc.error_body], codes)}},
            }
    operation: dict[str, Any] = {
        "operationId": name,
        "summary": doc.summary,
        "tags": [doc.tag],
        "responses": responses,
    }
    params = _parameters(path, doc)
    if params:
        operation["parameters"] = params
    if doc.request is not None:
        operation["requestBody"] = {
            "required": not doc.optional_body,
            "content": {JSON: {"schema": schema_of[doc.request]}},
        }
    return operation


def document(
    routes: Sequence[tuple[str, str, str]], docs: Mapping[str, RouteDoc], *, version: str, security: bool = True
) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``routes`` (path, method, handler name), each described by ``docs[name]``."""
    missing = sorted({name for _, _, name in routes} - set(docs))
    if missing:
        raise KeyError(f"routes without a RouteDoc: {', '.join(missing)}")
    types = _types(docs)
    schemas, components = msgspec.json.schema_components(types, ref_template=REF)
    schema_of = dict(zip(types, schemas, strict=True))
    paths: dict[str, dict[str, Any]] = {}
    for path, method, name in routes:
        paths.setdefault(path, {})[method.lower()] = _operation(path, method, name, docs[name], schema_of)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "agentd",
            "version": version,
            "description": "agentd's HTTP API (RFC 0000 §6) and its OpenAI-compatible door (RFC 0010)",
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "AGENTD_API_TOKEN, on TCP"}
            },
        },
        "security": [{"bearer": []}, {}] if security else [],
    }
