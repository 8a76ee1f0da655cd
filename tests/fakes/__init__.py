"""Fake model servers on loopback that speak the real wire formats, for provider and end-to-end tests.

with FakeOllama(default=Reply(content="hi")) as server:
    server.script(status(503, retry_after="0"), Reply(content="second try"))
    ... point agentd at server.url ...
    assert server.models_served() == ["llama3", "llama3"]
"""

from tests.fakes.ollama import FakeOllama
from tests.fakes.openai import FakeOpenAI
from tests.fakes.render import OpenAILayout
from tests.fakes.script import (
    FakeCall,
    Fault,
    Reply,
    drop_mid_stream,
    malformed_chunk,
    raw,
    stall,
    status,
    stream_error,
    truncated,
)
from tests.fakes.server import FakeServer, RecordedRequest, refused_url

__all__ = [
    "FakeCall",
    "FakeOllama",
    "FakeOpenAI",
    "FakeServer",
    "Fault",
    "OpenAILayout",
    "RecordedRequest",
    "Reply",
    "drop_mid_stream",
    "malformed_chunk",
    "raw",
    "refused_url",
    "stall",
    "status",
    "stream_error",
    "truncated",
]
