"""A fake Ollama server: ``POST /api/chat`` (NDJSON stream by default) and ``GET /api/tags``."""

from __future__ import annotations

from typing import Any

from tests.fakes.render import ollama_body, ollama_error_record, ollama_records
from tests.fakes.script import Reply
from tests.fakes.server import FakeServer, RecordedRequest

__all__ = ["FakeOllama"]


class FakeOllama(FakeServer):
    """Speaks Ollama's native API. ``with_ids=False`` acts as a server older than 0.12.10 (no
    tool-call ids)."""

    chat_path = "/api/chat"
    models_path = "/api/tags"
    default_stream = True  # Ollama streams unless told not to
    stream_content_type = "application/x-ndjson"

    def __init__(self, *, with_ids: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.with_ids = with_ids

    def stream_records(self, reply: Reply, request: RecordedRequest, seq: int) -> list[bytes]:
        lines = ollama_records(reply, request.model or "unknown", with_ids=self.with_ids, seq=seq)
        # Ollama ends every line with a newline; a blank line now and then must be tolerated.
        framed = [line + b"\n" for line in lines]
        if len(framed) > 1:
            framed.insert(1, b"\n")
        return framed

    def body(self, reply: Reply, request: RecordedRequest, seq: int) -> Any:
        return ollama_body(reply, request.model or "unknown", with_ids=self.with_ids, seq=seq)

    def error_body(self, status: int, message: str) -> Any:
        return {"error": message}

    def error_record(self, message: str) -> bytes:
        return ollama_error_record(message) + b"\n"

    def garbage_record(self) -> bytes:
        return b"<html>this is not json</html>\n"

    def models_body(self) -> Any:
        return {
            "models": [
                {"name": name, "model": name, "size": 1234, "details": {"family": "fake"}} for name in self.models
            ]
        }
