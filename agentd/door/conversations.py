"""``/v1/conversations`` (RFC 0010 §1): a conversation is an ordinary session, by the session's id.

``metadata.assistant`` picks the assistant a conversation is created on (the default: the first);
``items`` seed it. Its items are its transcript as ``message`` and ``mcp_call`` items. Deleting
it closes the session (its transcript is kept, as for every closed session).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from agentd.apicommon import MESSAGE_LIMIT, JSONResponse, decode_bytes, is_number, read_body
from agentd.apikeys import idempotent
from agentd.door.errors import ParamError, Unsupported
from agentd.door.inputs import assistant_of, message_of
from agentd.door.outcome import epoch, items_of
from agentd.door.shapes import ConversationCreate, ConversationDeleted, ConversationObject, ItemList
from agentd.errors import NotFound
from agentd.service import Claim, Service
from agentd.views import SessionView

__all__ = ["create", "delete", "items", "retrieve"]

ROUTE = "/v1/conversations"
ASSISTANT_KEY = "assistant"
DEFAULT_ITEMS, MAX_ITEMS = 20, 100


def _conversation(view: SessionView) -> ConversationObject:
    return ConversationObject(id=view.id, created_at=epoch(view.created_at), metadata={ASSISTANT_KEY: view.assistant})


async def _open(service: Service, conversation: str) -> SessionView:
    view = await service.get_session(conversation)
    if view.state == "closed":
        raise NotFound(f"no conversation {conversation!r} (it was deleted)", code="not_found")
    return view


async def create(service: Service, request: Request) -> Response:
    """``POST /v1/conversations``: a new session, on ``metadata.assistant``, seeded with ``items``."""
    raw = await read_body(request, service.config.server.max_message_bytes, MESSAGE_LIMIT)
    body: ConversationCreate = decode_bytes(raw, ConversationCreate, empty_ok=True)
    metadata = body.metadata or {}
    others = sorted(set(metadata) - {ASSISTANT_KEY})
    if others:
        raise Unsupported(
            "metadata", f"metadata: agentd keeps only {ASSISTANT_KEY!r} (the assistant), not {', '.join(others)}"
        )
    assistant = assistant_of(service.config, metadata[ASSISTANT_KEY]) if ASSISTANT_KEY in metadata else None
    seeded = [message_of(it.role, it.content, f"items[{i}].content") for i, it in enumerate(body.items or [])]

    async def work(claim: Claim | None) -> Response:
        created = await service.create_session(
            assistant,
            session_id=claim.session if claim else None,
            resumed=claim.resumed if claim else False,
            seeded=seeded,
            opener=False,
        )
        return JSONResponse(_conversation(created))

    return await idempotent(service, request, ROUTE, raw, work)


async def retrieve(service: Service, request: Request) -> Response:
    """``GET /v1/conversations/{id}``."""
    return JSONResponse(_conversation(await _open(service, request.path_params["id"])))


async def items(service: Service, request: Request) -> Response:
    """``GET /v1/conversations/{id}/items``: ``limit`` (1–100, 20), ``order`` (``desc``, ``asc``), ``after`` (an item id)."""
    view = await _open(service, request.path_params["id"])
    query = request.query_params
    limit_text = query.get("limit", str(DEFAULT_ITEMS))
    if not is_number(limit_text) or not 1 <= int(limit_text) <= MAX_ITEMS:
        raise ParamError("limit", f"limit must be a whole number from 1 to {MAX_ITEMS}, not {limit_text!r}")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ParamError("order", f"order must be asc or desc, not {order!r}")
    listed = items_of(view.transcript, session=view.id, inputs=True)
    if order == "desc":
        listed.reverse()
    after = query.get("after")
    if after:
        ids = [item.id for item in listed]
        if after not in ids:
            raise ParamError("after", f"no item {after!r} in conversation {view.id}")
        listed = listed[ids.index(after) + 1 :]
    page = listed[: int(limit_text)]
    return JSONResponse(
        ItemList(
            data=page,
            first_id=page[0].id if page else None,
            last_id=page[-1].id if page else None,
            has_more=len(listed) > len(page),
        )
    )


async def delete(service: Service, request: Request) -> Response:
    """``DELETE /v1/conversations/{id}``: the session is closed."""
    conversation = request.path_params["id"]
    await _open(service, conversation)
    await service.close_session(conversation)
    return JSONResponse(ConversationDeleted(id=conversation))
