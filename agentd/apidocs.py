"""What each route of the API takes and answers (``DOCS``, by handler name): the OpenAPI document
of ``GET /v1/openapi.json`` is generated from it and the route table in ``agentd.api``
(``agentd.openapi``, RFC 0010 §5), never written by hand."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agentd import events
from agentd.apicommon import (
    MAX_PAGE,
    RELOAD_HISTORY_MAX,
    USAGE_GROUP_BY,
)
from agentd.door.chatstream import STREAM_EVENTS as CHAT_STREAM_EVENTS
from agentd.door.responsestream import STREAM_EVENTS as RESPONSE_STREAM_EVENTS
from agentd.door.shapes import (
    ChatCompletion,
    ChatRequest,
    ConversationCreate,
    ConversationDeleted,
    ConversationObject,
    DoorErrorBody,
    ItemList,
    ModelList,
    ModelObject,
    ResponseObject,
    ResponsesRequest,
)
from agentd.openapi import RouteDoc
from agentd.views import (
    Accepted,
    ApprovalView,
    Cancelling,
    CreateSession,
    Decide,
    ErrorBody,
    Health,
    MessageResult,
    PostMessage,
    Readiness,
    ReloadResult,
    ReloadView,
    SessionSummary,
    SessionView,
    StatusView,
    UsageReport,
)


def _codes(*groups: Mapping[int, Sequence[str]]) -> dict[int, tuple[str, ...]]:
    """Error codes by status, the groups merged."""
    merged: dict[int, tuple[str, ...]] = {}
    for group in groups:
        for status, codes in group.items():
            merged[status] = (*merged.get(status, ()), *codes)
    return merged


STORE = {503: ("store_unavailable",)}
BODY = {400: ("invalid_body", "malformed_json"), 413: ("too_large",)}
CREATING = {
    400: ("bad_idempotency_key",),
    409: ("idempotency_in_progress",),
    422: ("idempotency_key_reused",),
    503: ("draining", "store_unavailable"),
    507: ("store_full",),
}
TURN = {
    400: ("empty_message",),
    404: ("not_found",),
    409: ("turn_running", "turn_refused", "awaiting_approval"),
    503: ("turn_cut", "turn_elsewhere", "lease_lost"),
}
DOOR_BODY = {400: ("unknown_parameter", "unsupported_parameter", "invalid_value"), 404: ("model_not_found",)}
DOOR_TURN = {409: ("turn_cancelled",), 500: ("turn_failed",), 503: ("turn_intel_unavailable",)}
SESSION_HEADER = {"X-Agentd-Session": "chat: the session to continue (request); the session answered (response)"}
LIMIT = ({"type": "integer", "minimum": 1, "maximum": MAX_PAGE}, "page size")

#: What each route (by handler name) takes and answers: its OpenAPI operation (``agentd.openapi``).
DOCS: dict[str, RouteDoc] = {
    "health": RouteDoc("liveness", {200: Health}, error_body=ErrorBody),
    "ready": RouteDoc("readiness", {200: Readiness, 503: Readiness}, error_body=ErrorBody),
    "status": RouteDoc("the daemon's status", {200: StatusView}, errors=STORE, error_body=ErrorBody),
    "reload": RouteDoc(
        "reload the config file", {200: ReloadResult, 422: ReloadResult}, errors=STORE, error_body=ErrorBody
    ),
    "create_session": RouteDoc(
        "open a session",
        {201: SessionView},
        CreateSession,
        optional_body=True,
        errors=_codes(BODY, CREATING, {400: ("unknown_assistant",)}),
        keyed=True,
        error_body=ErrorBody,
    ),
    "list_sessions": RouteDoc(
        "a page of sessions",
        {200: list[SessionSummary]},
        errors=_codes(STORE, {400: ("bad_limit", "bad_cursor", "bad_state")}),
        query={
            "limit": LIMIT,
            "after": ({"type": "string"}, "the last session id of the page before"),
            "state": ({"type": "string"}, "only sessions in this state (idle, running, failed, closed)"),
            "assistant": ({"type": "string"}, "only sessions of this assistant"),
        },
        error_body=ErrorBody,
    ),
    "reloads": RouteDoc(
        "the reload history, newest first",
        {200: list[ReloadView]},
        errors=_codes(STORE, {400: ("bad_limit",)}),
        query={"limit": ({"type": "integer", "minimum": 1, "maximum": RELOAD_HISTORY_MAX}, "how many (default 100)")},
        error_body=ErrorBody,
    ),
    "usage": RouteDoc(
        "usage and cost of the turns that ended in a time range, grouped",
        {200: UsageReport},
        errors=_codes(STORE, {400: ("bad_usage_query", "bad_limit")}),
        query={
            "group_by": ({"type": "string", "enum": list(USAGE_GROUP_BY)}, "what to group by (default model)"),
            "limit": ({"type": "integer", "minimum": 1, "maximum": MAX_PAGE}, "groups in the page (default 1000)"),
            "after": ({"type": "string"}, "the page's groups sort after this key (the previous page's next)"),
            "since": ({"type": "string"}, "epoch seconds or an ISO 8601 time: turns that ended at or after it"),
            "until": ({"type": "string"}, "epoch seconds or an ISO 8601 time: turns that ended before it"),
        },
        error_body=ErrorBody,
    ),
    "get_session": RouteDoc(
        "a session", {200: SessionView}, errors=_codes(STORE, {404: ("not_found",)}), error_body=ErrorBody
    ),
    "close_session": RouteDoc(
        "close a session",
        {200: SessionSummary},
        errors=_codes(STORE, {404: ("not_found",), 507: ("store_full",)}),
        error_body=ErrorBody,
    ),
    "post_message": RouteDoc(
        "send a message: a turn",
        {200: MessageResult, 202: Accepted},
        PostMessage,
        errors=_codes(BODY, CREATING, TURN),
        keyed=True,
        error_body=ErrorBody,
    ),
    "session_events": RouteDoc(
        "the session's events",
        {200: None},
        errors=_codes(STORE, {404: ("not_found",)}),
        media="text/event-stream",
        events=sorted(events.SESSION_EVENTS),
        error_body=ErrorBody,
    ),
    "cancel": RouteDoc(
        "cancel the running turn",
        {202: Cancelling},
        errors=_codes(STORE, {404: ("not_found",), 409: ("no_turn",)}),
        error_body=ErrorBody,
    ),
    "list_approvals": RouteDoc(
        "a page of tool-call approvals (RFC 0012 §6)",
        {200: list[ApprovalView]},
        errors=_codes(STORE, {400: ("bad_status", "bad_limit", "bad_cursor")}),
        query={
            "status": (
                {"enum": ["pending", "approved", "rejected", "expired", "cancelled"]},
                "only approvals with this status",
            ),
            "session": ({"type": "string"}, "only this session's"),
            "limit": LIMIT,
            "after": ({"type": "string"}, "the last approval id of the page before"),
        },
        error_body=ErrorBody,
    ),
    "get_approval": RouteDoc(
        "an approval", {200: ApprovalView}, errors=_codes(STORE, {404: ("not_found",)}), error_body=ErrorBody
    ),
    "decide_approval": RouteDoc(
        "approve or reject a tool call, once",
        {200: ApprovalView},
        Decide,
        errors=_codes(
            BODY,
            STORE,
            {400: ("bad_decision", "bad_arguments"), 404: ("not_found",), 409: ("already_decided",)},
        ),
        error_body=ErrorBody,
    ),
    "metrics": RouteDoc("Prometheus metrics", {200: None}, errors=STORE, media="text/plain", error_body=ErrorBody),
    "openapi": RouteDoc("this document", {200: dict[str, Any]}, error_body=ErrorBody),
    "list_models": RouteDoc("the models: agentd's assistants", {200: ModelList}, error_body=DoorErrorBody, tag="door"),
    "get_model": RouteDoc(
        "a model", {200: ModelObject}, errors={404: ("model_not_found",)}, error_body=DoorErrorBody, tag="door"
    ),
    "chat_completion": RouteDoc(
        "a chat completion: a turn (streamed with stream true: RFC 0010 §7); 409 approval_required"
        " while the turn waits for approvals (RFC 0010 §8)",
        {200: ChatCompletion},
        ChatRequest,
        errors=_codes(BODY, CREATING, TURN, DOOR_BODY, DOOR_TURN, {409: ("approval_required",)}),
        keyed=True,
        headers=SESSION_HEADER,
        streamed=CHAT_STREAM_EVENTS,
        error_body=DoorErrorBody,
        tag="door",
    ),
    "create_response": RouteDoc(
        "a response: a turn (streamed with stream true: RFC 0010 §7); a turn that waits for approvals"
        " answers mcp_approval_request items, and mcp_approval_response items in input decide them"
        " (RFC 0010 §8)",
        {200: ResponseObject},
        ResponsesRequest,
        errors=_codes(
            BODY,
            CREATING,
            TURN,
            DOOR_BODY,
            {400: ("previous_response_not_latest", "conflicting_parameters", "not_found"), 404: ("turn_not_found",)},
            {409: ("already_decided",)},
        ),
        keyed=True,
        streamed=RESPONSE_STREAM_EVENTS,
        error_body=DoorErrorBody,
        tag="door",
    ),
    "get_response": RouteDoc(
        "a response",
        {200: ResponseObject},
        errors=_codes(STORE, {404: ("not_found", "turn_not_found")}),
        error_body=DoorErrorBody,
        tag="door",
    ),
    "cancel_response": RouteDoc(
        "cancel a response in progress",
        {200: ResponseObject},
        errors=_codes(STORE, {404: ("not_found", "turn_not_found"), 409: ("not_in_progress", "no_turn")}),
        error_body=DoorErrorBody,
        tag="door",
    ),
    "create_conversation": RouteDoc(
        "a conversation: a new session",
        {200: ConversationObject},
        ConversationCreate,
        optional_body=True,
        errors=_codes(BODY, CREATING, DOOR_BODY, {400: ("unknown_assistant",)}),
        keyed=True,
        error_body=DoorErrorBody,
        tag="door",
    ),
    "get_conversation": RouteDoc(
        "a conversation",
        {200: ConversationObject},
        errors=_codes(STORE, {404: ("not_found",)}),
        error_body=DoorErrorBody,
        tag="door",
    ),
    "list_conversation_items": RouteDoc(
        "a conversation's items",
        {200: ItemList},
        errors=_codes(STORE, {400: ("invalid_value",), 404: ("not_found",)}),
        query={
            "limit": ({"type": "integer", "minimum": 1, "maximum": 100}, "page size (20)"),
            "order": ({"enum": ["asc", "desc"]}, "desc (newest first) or asc"),
            "after": ({"type": "string"}, "the last item id of the page before"),
        },
        error_body=DoorErrorBody,
        tag="door",
    ),
    "delete_conversation": RouteDoc(
        "delete a conversation: its session is closed",
        {200: ConversationDeleted},
        errors=_codes(STORE, {404: ("not_found",), 507: ("store_full",)}),
        error_body=DoorErrorBody,
        tag="door",
    ),
}
