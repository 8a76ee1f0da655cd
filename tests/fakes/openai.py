"""A fake OpenAI-compatible server: ``POST /v1/chat/completions`` (SSE when ``stream`` is true)
and ``GET /v1/models``. Optionally checks a bearer key."""

from __future__ import annotations

from typing import Any

from tests.fakes.render import OpenAILayout, openai_body, openai_error_event, openai_events
from tests.fakes.script import Reply, status
from tests.fakes.server import FakeServer, RecordedRequest

__all__ = ["FakeOpenAI"]

_CLASSIC_LAYOUT = OpenAILayout()  # frozen: one shared default is safe


class FakeOpenAI(FakeServer):
    """Speaks ``/v1/chat/completions``. ``layout`` picks the stream layout (classic, or Ollama's
    compat layer with a separate finish chunk); ``api_key`` makes requests without that bearer key
    fail with 401."""

    chat_path = "/v1/chat/completions"
    models_path = "/v1/models"
    default_stream = False
    stream_content_type = "text/event-stream"

    def __init__(self, *, layout: OpenAILayout = _CLASSIC_LAYOUT, api_key: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.layout = layout
        self.api_key = api_key
        if api_key is not None:
            inner = self.default

            def check_key(request: RecordedRequest) -> Any:
                if request.headers.get("authorization") != f"Bearer {api_key}":
                    return status(401, "Incorrect API key provided")
                return inner(request) if callable(inner) else inner

            self.default = check_key

    def stream_records(self, reply: Reply, request: RecordedRequest, seq: int) -> list[bytes]:
        options = request.body.get("stream_options") if isinstance(request.body, dict) else None
        include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
        return openai_events(
            reply, request.model or "unknown", layout=self.layout, include_usage=include_usage, seq=seq
        )

    def body(self, reply: Reply, request: RecordedRequest, seq: int) -> Any:
        return openai_body(reply, request.model or "unknown", layout=self.layout, seq=seq)

    def error_body(self, status: int, message: str) -> Any:
        kind = "invalid_request_error" if 400 <= status < 500 and status != 429 else "server_error"
        return {"error": {"message": message, "type": kind, "param": None, "code": None}}

    def error_record(self, message: str) -> bytes:
        return openai_error_event(message, self.layout)

    def garbage_record(self) -> bytes:
        return b"data: {this is not json\n\n"

    def models_body(self) -> Any:
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "fake"} for name in self.models]}
