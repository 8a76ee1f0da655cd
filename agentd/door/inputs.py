"""What a door request asks, in agentd's terms: the assistant its ``model`` names, and its
messages as agentd messages (text and base64 images). Pure functions; refusals name the parameter."""

from __future__ import annotations

from collections.abc import Sequence

from agentd.config import Config
from agentd.door.errors import ParamError, Unsupported
from agentd.door.shapes import ImagePart, InputImage, InputText, OutputTextIn, Part, TextPart
from agentd.errors import NotFound
from agentd.messages import AssistantMessage, Message, SystemMessage, UserMessage

__all__ = ["Said", "assistant_of", "include_usage", "last_user", "message_of", "refuse_unserved", "said"]

DATA_URL = "data:"


class Said:
    """A message's text and images."""

    __slots__ = ("images", "text")

    def __init__(self, text: str, images: list[str]) -> None:
        self.text = text
        self.images = images


def assistant_of(config: Config, model: str) -> str:
    """The assistant ``model`` names; NotFound (``model_not_found``) listing the assistants if none."""
    names = [a.name for a in config.assistants]
    if model not in names:
        raise NotFound(
            f"no model {model!r}: agentd's models are its assistants: {', '.join(names)}", code="model_not_found"
        )
    return model


def _image(url: str | None, param: str) -> str:
    if not url or not url.startswith(DATA_URL) or ";base64," not in url:
        raise Unsupported(
            param, f"{param}: agentd fetches no image; send it as a data: URL of base64 (data:image/png;base64,…)"
        )
    return url.partition(";base64,")[2]


def said(content: str | Sequence[Part] | None, param: str) -> Said:
    """The text and images of a message's ``content`` (a string, or a list of parts)."""
    if content is None:
        return Said("", [])
    if isinstance(content, str):
        return Said(content, [])
    texts, images = [], []
    for index, part in enumerate(content):
        match part:
            case TextPart() | InputText() | OutputTextIn():
                texts.append(part.text)
            case ImagePart():
                images.append(_image(part.image_url.url, f"{param}[{index}].image_url"))
            case InputImage():
                images.append(_image(part.image_url, f"{param}[{index}].image_url"))
    return Said("\n".join(texts), images)


def message_of(role: str, content: str | Sequence[Part] | None, param: str) -> Message:
    """An earlier message of a conversation the client kept, as agentd stores it."""
    text = said(content, param)
    images = tuple(text.images) or None
    if role == "user":
        return UserMessage(content=text.text, images=images)
    if role == "assistant":
        if images:
            raise Unsupported(param, f"{param}: an assistant message carries no image")
        return AssistantMessage(content=text.text)
    return SystemMessage(content=text.text, images=images)  # system, developer


def refuse_unserved(tools: object) -> None:
    """Client-side tools are not served: agentd runs its assistants' own tools."""
    if tools:
        raise Unsupported(
            "tools",
            "tools: agentd runs its assistants' own tools (configured per assistant) and takes none from "
            "the client; send the request without tools",
        )


def include_usage(stream: bool | None, options: dict[str, object] | None) -> bool:
    """Whether a streamed chat completion ends with a ``usage`` chunk (``stream_options.include_usage``)."""
    if options is None:
        return False
    if not stream:
        raise ParamError("stream_options", "stream_options: only with stream true")
    for name, value in options.items():
        if name != "include_usage":
            raise Unsupported(f"stream_options.{name}", f"stream_options.{name}: agentd serves include_usage only")
        if not isinstance(value, bool):
            raise ParamError("stream_options.include_usage", "stream_options.include_usage: true or false")
    return bool(options.get("include_usage"))


def last_user(said_by: Sequence[tuple[str, Said]], param: str) -> Said:
    """The last message, which must be the user's and say something."""
    if not said_by or said_by[-1][0] != "user":
        raise ParamError(param, f"{param}: the last message must be the user's (it is what the assistant answers)")
    last = said_by[-1][1]
    if not last.text.strip() and not last.images:
        raise ParamError(param, f"{param}: the last user message is empty", code="empty_message")
    return last
