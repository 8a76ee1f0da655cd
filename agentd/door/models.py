"""``/v1/models`` (RFC 0010 §1): agentd's models are its assistants (a request's ``model`` names one)."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from agentd.apicommon import JSONResponse
from agentd.door.inputs import assistant_of
from agentd.door.shapes import ModelList, ModelObject
from agentd.service import Service

__all__ = ["listed", "one"]

#: ``created`` of every model: when this process started serving (assistants have no other date).
STARTED = int(time.time())


async def listed(service: Service, _: Request) -> Response:
    """``GET /v1/models``: every assistant of the running config."""
    return JSONResponse(ModelList(data=[ModelObject(id=a.name, created=STARTED) for a in service.config.assistants]))


async def one(service: Service, request: Request) -> Response:
    """``GET /v1/models/{id}``; 404 ``model_not_found`` for a name that is no assistant's."""
    return JSONResponse(ModelObject(id=assistant_of(service.config, request.path_params["id"]), created=STARTED))
