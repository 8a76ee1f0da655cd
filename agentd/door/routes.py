"""The door's handlers by the names ``agentd.api``'s route table gives them (``DOOR_ROUTES``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from agentd.door import chat, conversations, models, responses
from agentd.door.errors import door_route
from agentd.service import Service

__all__ = ["HANDLERS", "door_handlers"]

Handler = Callable[[Service, Request], Awaitable[Response]]

#: Route name -> handler.
HANDLERS: dict[str, Handler] = {
    "list_models": models.listed,
    "get_model": models.one,
    "chat_completion": chat.create,
    "create_response": responses.create,
    "get_response": responses.retrieve,
    "cancel_response": responses.cancel,
    "create_conversation": conversations.create,
    "get_conversation": conversations.retrieve,
    "list_conversation_items": conversations.items,
    "delete_conversation": conversations.delete,
}


def door_handlers(service: Service) -> dict[str, Callable[[Request], Awaitable[Response]]]:
    """Every door handler bound to ``service``, answering errors in the door's shape."""

    def bound(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def route(request: Request) -> Response:
            return await handler(service, request)

        return door_route(route)

    return {name: bound(handler) for name, handler in HANDLERS.items()}
