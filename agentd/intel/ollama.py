"""The ``ollama`` provider: Ollama's native ``/api/chat`` (NDJSON streaming) and ``/api/tags``.

Endpoints are server roots (``http://localhost:11434``); a trailing ``/api`` is accepted too.
Options go into the request's ``options`` except ``think``, ``format`` and ``keep_alive`` (top
level) and agentd's own ``stream``, ``read_timeout`` and ``connect_timeout``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from agentd.intel.base import CompletionRequest, StreamSink
from agentd.intel.http import HTTPProvider, StreamReader, join_url
from agentd.intel.streams import NDJSONSplitter
from agentd.intel.wire import ChatResult, IncompleteStream, WireError
from agentd.intel.wire_ollama import (
    OllamaStream,
    ollama_chat_request,
    ollama_error_message,
    ollama_model_names,
    ollama_response,
)

__all__ = ["NDJSONReader", "OllamaProvider"]


def _api_root(endpoint: str) -> str:
    root = endpoint.rstrip("/")
    return root if root.endswith("/api") else root + "/api"


class NDJSONReader:
    """NDJSON bytes → one answer (a StreamReader)."""

    def __init__(self, id_prefix: str, sink: StreamSink | None = None) -> None:
        self._lines = NDJSONSplitter()
        self._stream = OllamaStream(id_prefix=id_prefix, sink=sink)

    def feed(self, data: bytes) -> bool:
        for line in self._lines.feed(data):
            self._stream.feed_line(line)
        return self._stream.done

    def finish(self) -> ChatResult:
        rest = self._lines.finish()
        if rest and not self._stream.done:
            try:
                self._stream.feed_line(rest)  # a last line without its newline may still be whole
            except WireError:
                if rest.startswith(b"{"):  # JSON cut short: a broken stream, worth a retry
                    raise IncompleteStream("the Ollama stream was cut off mid-line") from None
                raise  # not NDJSON at all (an HTML error page, say)
        return self._stream.result()


class OllamaProvider(HTTPProvider):
    """A model served by Ollama's native API (see the module docstring)."""

    name: ClassVar[str] = "ollama"

    def chat_url(self, endpoint: str) -> str:
        return join_url(_api_root(endpoint), "chat")

    def models_url(self, endpoint: str) -> str:
        return join_url(_api_root(endpoint), "tags")

    def chat_body(self, request: CompletionRequest, options: Mapping[str, Any], stream: bool) -> dict[str, Any]:
        return ollama_chat_request(self.intelligence.model, request.messages, request.tools, options, stream=stream)

    def accept(self, stream: bool) -> str:
        return "application/x-ndjson" if stream else "application/json"

    def stream_reader(self, id_prefix: str, sink: StreamSink | None = None) -> StreamReader:
        return NDJSONReader(id_prefix, sink)

    def parse_body(self, raw: Any, id_prefix: str) -> ChatResult:
        return ollama_response(raw, id_prefix=id_prefix)

    def parse_models(self, raw: Any) -> list[str]:
        return ollama_model_names(raw)

    def error_text(self, raw: Any) -> str | None:
        if isinstance(raw, dict) and raw.get("error") is not None:
            return ollama_error_message(raw["error"])
        return None
