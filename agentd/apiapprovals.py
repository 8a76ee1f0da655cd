"""The handlers of ``/v1/approvals`` (RFC 0012 §6), served from ``agentd.api``'s route table."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from agentd.apicommon import JSONResponse, decode
from agentd.service import Service
from agentd.views import Decide

__all__ = ["approval_handlers"]

Handler = Callable[[Request], Awaitable[Response]]


def approval_handlers(supervisor: Service, page_limit: Callable[[Request], int]) -> dict[str, Handler]:
    """``list_approvals``, ``get_approval`` and ``decide_approval`` over ``supervisor``;
    ``page_limit`` reads a listing's ``?limit=`` as every listing does."""

    async def list_approvals(request: Request) -> Response:
        query = request.query_params
        page = await supervisor.list_approvals(
            status=query.get("status") or None,
            session=query.get("session") or None,
            limit=page_limit(request),
            after=query.get("after") or None,
        )
        return JSONResponse(page)

    async def get_approval(request: Request) -> Response:
        return JSONResponse(await supervisor.get_approval(request.path_params["id"]))

    async def decide_approval(request: Request) -> Response:
        body = await decode(request, Decide)
        decided = await supervisor.decide_approval(
            request.path_params["id"], body.decision, body.reason, body.arguments
        )
        return JSONResponse(decided)

    return {"list_approvals": list_approvals, "get_approval": get_approval, "decide_approval": decide_approval}
