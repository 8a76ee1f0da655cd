"""The ``openai`` provider: ``/v1/chat/completions`` (SSE streaming or one JSON body) and
``/v1/models``. Serves OpenAI and the compatible servers: vLLM, llama.cpp's server, LiteLLM,
Ollama's compat layer.

Endpoints are base URLs as the OpenAI SDKs take them (``https://api.openai.com/v1``,
``http://localhost:8000/v1``); a bare server root (no path) gets ``/v1`` added. Options become
top-level request parameters (``temperature``, ``max_tokens``, ``reasoning_effort``, …) except
agentd's own ``stream``, ``read_timeout`` and ``connect_timeout``. The key comes from the env var
named by ``api_key_env`` and is sent as ``Authorization: Bearer``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar
from urllib.parse import urlsplit

from agentd.intel.base import CompletionRequest, StreamSink
from agentd.intel.http import HTTPProvider, StreamReader, join_url
from agentd.intel.wire import ChatResult, RemoteError, WireError, decode_json
from agentd.intel.wire_openai import (
    OpenAIStream,
    openai_chat_request,
    openai_error_message,
    openai_model_names,
    openai_remote_error,
    openai_response,
)
from agentd.sse import SSEParser

__all__ = ["OpenAIProvider", "SSEReader"]


def _api_base(endpoint: str) -> str:
    base = endpoint.rstrip("/")
    return base if urlsplit(base).path else base + "/v1"


class SSEReader:
    """SSE bytes → one answer (a StreamReader)."""

    def __init__(self, id_prefix: str, sink: StreamSink | None = None) -> None:
        self._events = SSEParser()
        self._stream = OpenAIStream(id_prefix=id_prefix, sink=sink)
        self._received = False
        self._any_event = False

    def feed(self, data: bytes) -> bool:
        self._received = self._received or bool(data.strip())
        for event in self._events.feed(data):
            self._take(event.event, event.data)
        return self._stream.saw_done

    def finish(self) -> ChatResult:
        # An event the body's end cut off is discarded (WHATWG): if it carried the finish or [DONE],
        # result() raises IncompleteStream, so a truncated stream fails and is never a short answer.
        self._events.finish()
        if self._received and not self._any_event and not self._events.truncated and not self._events.saw_line:
            raise WireError("the response is not an SSE stream")  # bytes came, but nothing SSE-shaped
        return self._stream.result()

    def _take(self, name: str, data: str) -> None:
        self._any_event = True
        if name == "error":  # some servers name their error events
            raise _event_error(data)
        self._stream.feed_data(data)


def _event_error(data: str) -> RemoteError:
    try:
        raw = decode_json(data, "an error event")
    except WireError:
        return RemoteError(data)
    return openai_remote_error(raw.get("error", raw) if isinstance(raw, dict) else raw)


class OpenAIProvider(HTTPProvider):
    """A model behind an OpenAI-compatible chat-completions API (see the module docstring)."""

    name: ClassVar[str] = "openai"

    def chat_url(self, endpoint: str) -> str:
        return join_url(_api_base(endpoint), "chat/completions")

    def models_url(self, endpoint: str) -> str:
        return join_url(_api_base(endpoint), "models")

    def chat_body(self, request: CompletionRequest, options: Mapping[str, Any], stream: bool) -> dict[str, Any]:
        return openai_chat_request(self.intelligence.model, request.messages, request.tools, options, stream=stream)

    def accept(self, stream: bool) -> str:
        return "text/event-stream" if stream else "application/json"

    def stream_reader(self, id_prefix: str, sink: StreamSink | None = None) -> StreamReader:
        return SSEReader(id_prefix, sink)

    def parse_body(self, raw: Any, id_prefix: str) -> ChatResult:
        return openai_response(raw, id_prefix=id_prefix)

    def parse_models(self, raw: Any) -> list[str]:
        return openai_model_names(raw)

    def error_text(self, raw: Any) -> str | None:
        if isinstance(raw, dict) and raw.get("error") is not None:
            return openai_error_message(raw["error"])
        return None
