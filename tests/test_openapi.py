"""The OpenAPI document (RFC 0010 §5): generated from the route table and the body types, valid 3.1."""

from __future__ import annotations

from typing import Any

import pytest
from openapi_spec_validator import validate

from agentd import events
from agentd.api import ALL_ROUTES, DOCS, DOOR_ROUTES
from agentd.openapi import RouteDoc, document


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return document(ALL_ROUTES, DOCS, version="test")


def test_the_document_is_valid_openapi_3_1(doc: dict[str, Any]) -> None:
    assert doc["openapi"] == "3.1.0"
    validate(doc)


def test_every_route_is_an_operation_with_its_errors(doc: dict[str, Any]) -> None:
    for path, method, name in ALL_ROUTES:
        operation = doc["paths"][path][method.lower()]
        assert operation["operationId"] == name
        assert "500" in operation["responses"], (path, method)
    assert {op["operationId"] for ops in doc["paths"].values() for op in ops.values()} == {n for _, _, n in ALL_ROUTES}


def test_error_codes_are_listed_per_status_in_each_shape(doc: dict[str, Any]) -> None:
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    codes = chat["409"]["content"]["application/json"]["schema"]["allOf"][1]["properties"]["error"]["properties"]
    assert {"idempotency_in_progress", "turn_running", "turn_cancelled"} <= set(codes["code"]["enum"])
    assert chat["409"]["content"]["application/json"]["schema"]["allOf"][0] == {
        "$ref": "#/components/schemas/DoorErrorBody"
    }
    native = doc["paths"]["/v1/sessions/{id}/messages"]["post"]["responses"]["422"]
    assert native["content"]["application/json"]["schema"]["allOf"][0] == {"$ref": "#/components/schemas/ErrorBody"}
    for path, method, _ in DOOR_ROUTES:
        for status, answer in doc["paths"][path][method.lower()]["responses"].items():
            if int(status) >= 400:
                assert "DoorErrorBody" in str(answer), (path, status)


def test_the_event_stream_is_text_event_stream_with_its_event_names(doc: dict[str, Any]) -> None:
    answer = doc["paths"]["/v1/sessions/{id}/events"]["get"]["responses"]["200"]
    assert list(answer["content"]) == ["text/event-stream"]
    assert set(answer["x-agentd-events"]) == set(events.SESSION_EVENTS)


def test_creating_posts_take_an_idempotency_key(doc: dict[str, Any]) -> None:
    keyed = {
        (path, method)
        for path, ops in doc["paths"].items()
        for method, op in ops.items()
        if any(p["name"] == "Idempotency-Key" for p in op.get("parameters", []))
    }
    assert keyed == {
        ("/v1/sessions", "post"),
        ("/v1/sessions/{id}/messages", "post"),
        ("/v1/chat/completions", "post"),
        ("/v1/responses", "post"),
        ("/v1/conversations", "post"),
    }


def test_a_route_without_a_description_is_refused() -> None:
    with pytest.raises(KeyError, match="nowhere"):
        document((("/x", "GET", "nowhere"),), {"health": RouteDoc("x", {200: None})}, version="t")
