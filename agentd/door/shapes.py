"""The door's bodies (RFC 0010): OpenAI's request and response shapes, as far as agentd serves them.

Request bodies reject unknown fields, so a parameter agentd does not serve is a 400 naming it
rather than silently ignored. Response bodies carry the fields the official SDKs read.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = [
    "ChatChoice",
    "ChatChunk",
    "ChatCompletion",
    "ChatMessage",
    "ChatRequest",
    "ChatUsage",
    "ChunkChoice",
    "ChunkDelta",
    "ConversationCreate",
    "ConversationDeleted",
    "ConversationObject",
    "ConversationRef",
    "DoorError",
    "DoorErrorBody",
    "ImagePart",
    "ImageURL",
    "IncompleteDetails",
    "InputImage",
    "InputItem",
    "InputText",
    "ItemList",
    "McpApprovalRequest",
    "McpCall",
    "ModelList",
    "ModelObject",
    "OutputMessage",
    "OutputText",
    "Part",
    "ResponseError",
    "ResponseInputItem",
    "ResponseObject",
    "ResponseUsage",
    "ResponsesRequest",
    "StreamErrorBody",
    "TextPart",
]


class _Request(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class _Body(msgspec.Struct, kw_only=True):
    pass


# --------------------------------------------------------------------------- content parts (requests)


class TextPart(_Request, kw_only=True, tag="text", tag_field="type"):
    text: str


class ImageURL(_Request, kw_only=True):
    url: str  # a data: URL of a base64 image (agentd fetches nothing)
    detail: str | None = None


class ImagePart(_Request, kw_only=True, tag="image_url", tag_field="type"):
    image_url: ImageURL


class InputText(_Request, kw_only=True, tag="input_text", tag_field="type"):
    text: str


class InputImage(_Request, kw_only=True, tag="input_image", tag_field="type"):
    image_url: str | None = None  # a data: URL
    detail: str | None = None


class OutputTextIn(_Request, kw_only=True, tag="output_text", tag_field="type"):
    """An assistant's earlier text, as a client sends its history back."""

    text: str
    annotations: list[Any] = []


Part = TextPart | ImagePart | InputText | InputImage | OutputTextIn


# --------------------------------------------------------------------------- chat completions


class ChatMessage(_Request, kw_only=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Part] | None = None
    name: str | None = None


class ChatRequest(_Request, kw_only=True):
    model: str
    messages: list[ChatMessage]
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class ChatAnswer(_Body, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None


class ChatChoice(_Body, kw_only=True):
    index: int = 0
    message: ChatAnswer
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class ChatUsage(_Body, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(_Body, kw_only=True):
    id: str  # chatcmpl-<turn id>
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: ChatUsage
    system_fingerprint: str | None = None


class ChunkDelta(_Body, kw_only=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(_Body, kw_only=True):
    index: int = 0
    delta: ChunkDelta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class ChatChunk(_Body, kw_only=True):
    """A ``chat.completion.chunk`` of a streamed chat completion (RFC 0010 §7)."""

    id: str  # chatcmpl-<turn id>
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: ChatUsage | None = None
    system_fingerprint: str | None = None


class StreamErrorBody(_Body, kw_only=True):
    """How a streamed chat completion ends when it cannot go on (RFC 0010 §7): the SDK raises it."""

    error: DoorError


# --------------------------------------------------------------------------- responses


class InputItem(_Request, kw_only=True):
    """A message of a Responses ``input`` list or a conversation's ``items``."""

    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Part]


class ResponseInputItem(_Request, kw_only=True):
    """An item of a Responses ``input`` list: a message (``type`` ``message``, the default:
    ``role`` and ``content``), or a decision on an approval the previous response asked for
    (``type`` ``mcp_approval_response``: ``approval_request_id``, ``approve``, ``reason``)."""

    type: Literal["message", "mcp_approval_response"] = "message"
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: str | list[Part] | None = None
    id: str | None = None
    approval_request_id: str | None = None
    approve: bool | None = None
    reason: str | None = None


class ConversationRef(_Request, kw_only=True):
    id: str


class ResponsesRequest(_Request, kw_only=True):
    model: str
    input: str | list[ResponseInputItem]
    previous_response_id: str | None = None
    conversation: str | ConversationRef | None = None
    instructions: str | None = None
    stream: bool | None = None
    metadata: dict[str, str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class OutputText(_Body, kw_only=True, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = []


class InputTextOut(_Body, kw_only=True, tag="input_text", tag_field="type"):
    text: str


class OutputMessage(_Body, kw_only=True, tag="message", tag_field="type"):
    id: str
    role: Literal["assistant", "user", "system"]
    status: Literal["completed", "incomplete", "in_progress"] = "completed"
    content: list[OutputText | InputTextOut]


class McpCall(_Body, kw_only=True, tag="mcp_call", tag_field="type"):
    """A tool agentd ran during the turn (its MCP server's label, or ``agentd`` for a built-in)."""

    id: str
    server_label: str
    name: str
    arguments: str  # JSON text
    output: str | None = None
    error: str | None = None


class McpApprovalRequest(_Body, kw_only=True, tag="mcp_approval_request", tag_field="type"):
    """A tool call that waits for a human's decision (RFC 0012): ``id`` is the approval's id."""

    id: str
    server_label: str
    name: str
    arguments: str  # JSON text


Item = OutputMessage | McpCall | McpApprovalRequest


class ResponseUsage(_Body, kw_only=True):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int] = msgspec.field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens_details: dict[str, int] = msgspec.field(default_factory=lambda: {"reasoning_tokens": 0})


class IncompleteDetails(_Body, kw_only=True):
    reason: str


class ResponseError(_Body, kw_only=True):
    code: str
    message: str


class ResponseConversation(_Body, kw_only=True):
    id: str


class ResponseObject(_Body, kw_only=True):
    id: str  # resp_<turn id>
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "failed", "cancelled", "in_progress"]
    model: str
    output: list[Item]
    usage: ResponseUsage | None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    conversation: ResponseConversation | None = None
    previous_response_id: str | None = None
    instructions: str | None = None
    metadata: dict[str, str] = {}
    parallel_tool_calls: bool = False
    tool_choice: str = "auto"
    tools: list[Any] = []
    temperature: float | None = None
    top_p: float | None = None


# --------------------------------------------------------------------------- conversations


class ConversationCreate(_Request, kw_only=True):
    metadata: dict[str, str] | None = None
    items: list[InputItem] | None = None


class ConversationObject(_Body, kw_only=True):
    id: str  # the session's id
    object: Literal["conversation"] = "conversation"
    created_at: int
    metadata: dict[str, str] = {}


class ConversationDeleted(_Body, kw_only=True):
    id: str
    object: Literal["conversation.deleted"] = "conversation.deleted"
    deleted: bool = True


class ItemList(_Body, kw_only=True):
    object: Literal["list"] = "list"
    data: list[Item]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


# --------------------------------------------------------------------------- models


class ModelObject(_Body, kw_only=True):
    id: str  # an assistant's name
    object: Literal["model"] = "model"
    created: int
    owned_by: Literal["agentd"] = "agentd"


class ModelList(_Body, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelObject]


# --------------------------------------------------------------------------- errors


class DoorError(_Body, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class DoorErrorBody(_Body, kw_only=True):
    error: DoorError
