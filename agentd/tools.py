"""Tools: built-ins and ``module:function`` Python callables, their schemas, validation and calls.

A tool's JSON schema comes from its type hints; arguments are validated against them before the
call, and a bad argument, an unknown tool or an exception becomes an error *result* for the model —
never a crashed child. A tool may declare itself free of side effects with ``@side_effect_free``:
restart-turn then runs it again in a re-run instead of reusing its recorded result (RFC 0002 §5).
"""

from __future__ import annotations

import datetime as dt
import importlib
import inspect
import typing
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import anyio
import msgspec

__all__ = [
    "BUILTIN_TOOLS",
    "AnyTool",
    "Tool",
    "ToolError",
    "ToolOutcome",
    "ToolSpec",
    "resolve_tool",
    "resolve_tools",
    "side_effect_free",
]

_SIDE_EFFECT_FREE_ATTR = "__agentd_side_effect_free__"


class ToolError(Exception):
    """A tool reference that cannot be resolved (bad syntax, missing module or function)."""


class ToolSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What the model is told about a tool."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=lambda: {"type": "object", "properties": {}})
    side_effect_free: bool = False


class ToolOutcome(msgspec.Struct, frozen=True):
    """A tool's answer to the model. ``is_error`` results still continue the turn."""

    content: str
    is_error: bool = False


class AnyTool(Protocol):
    """What the turn loop needs of a tool, whatever its source (built-in, Python, MCP; RFC 0008 §1)."""

    @property
    def name(self) -> str:
        """The name the model calls it by."""

    @property
    def spec(self) -> ToolSpec:
        """What the model is told about it; ``side_effect_free`` decides replay."""

    async def invoke(self, arguments: dict[str, Any]) -> ToolOutcome:
        """Run it; every failure is an error outcome, never an exception."""


def side_effect_free(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Declare a tool free of side effects: restart-turn may run it again instead of replaying it."""
    setattr(fn, _SIDE_EFFECT_FREE_ATTR, True)
    return fn


class Tool:
    """A callable the loop can offer and invoke, with arguments checked against its signature."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None, ref: str | None = None) -> None:
        self.fn = fn
        self.name = name or fn.__name__
        self.ref = ref  # how the config names it (``require_approval`` matches on it, RFC 0012 §2)
        self._arguments_type = _arguments_struct(fn, self.name)
        schema = msgspec.json.schema(self._arguments_type)
        defs = schema.get("$defs", {})
        parameters = defs.pop(self._arguments_type.__name__, {"type": "object", "properties": {}})
        parameters.pop("title", None)
        if defs:  # nested Structs are referenced from the parameters: keep their definitions
            parameters["$defs"] = defs
        self.spec = ToolSpec(
            name=self.name,
            description=inspect.getdoc(fn) or "",
            parameters=parameters,
            side_effect_free=bool(getattr(fn, _SIDE_EFFECT_FREE_ATTR, False)),
        )

    async def invoke(self, arguments: dict[str, Any]) -> ToolOutcome:
        """Validate and call. Bad arguments and exceptions come back as error outcomes."""
        try:
            validated = msgspec.convert(arguments, self._arguments_type)
        except msgspec.ValidationError as exc:
            return ToolOutcome(f"invalid arguments for tool {self.name!r}: {exc}", is_error=True)
        kwargs = msgspec.structs.asdict(validated)
        try:
            if inspect.iscoroutinefunction(self.fn):
                result = await self.fn(**kwargs)
            else:
                result = await anyio.to_thread.run_sync(lambda: self.fn(**kwargs))
        except Exception as exc:  # a tool's failure is the model's information, not our crash
            return ToolOutcome(f"tool {self.name!r} failed: {type(exc).__name__}: {exc}", is_error=True)
        try:
            content = result if isinstance(result, str) else msgspec.json.encode(result).decode()
        except (TypeError, msgspec.EncodeError) as exc:
            return ToolOutcome(f"tool {self.name!r} returned a value that is not JSON: {exc}", is_error=True)
        return ToolOutcome(content)


def _arguments_struct(fn: Callable[..., Any], name: str) -> type[msgspec.Struct]:
    """A Struct whose fields are ``fn``'s parameters: validation and JSON schema in one place."""
    hints = typing.get_type_hints(fn, include_extras=True)
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolError(f"tool {name!r}: *args/**kwargs parameters cannot be described to a model")
        annotation = hints.get(param.name, Any)
        if param.default is inspect.Parameter.empty:
            fields.append((param.name, annotation))
        else:
            fields.append((param.name, annotation, param.default))
    return msgspec.defstruct(f"{name}_arguments", fields, kw_only=True, forbid_unknown_fields=True)


# --------------------------------------------------------------------------- built-ins


@side_effect_free
def clock(offset_hours: int = 0) -> str:
    """The current date and time (ISO 8601) at UTC plus ``offset_hours``."""
    if not -14 <= offset_hours <= 14:
        raise ValueError("offset_hours must be between -14 and 14")
    zone = dt.timezone(dt.timedelta(hours=offset_hours))
    return dt.datetime.now(zone).isoformat(timespec="seconds")


BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"clock": clock}


def resolve_tool(ref: str) -> Tool:
    """A built-in name (``clock``) or ``package.module:function`` → a Tool. Raises ToolError."""
    if ":" not in ref:
        if ref not in BUILTIN_TOOLS:
            raise ToolError(
                f"unknown built-in tool {ref!r}; built-ins: {', '.join(BUILTIN_TOOLS)}; or use 'module:function'"
            )
        return Tool(BUILTIN_TOOLS[ref], ref, ref)
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except KeyboardInterrupt:
        raise
    except SystemExit as exc:  # sys.exit() at import: it must never end the process that resolves it
        raise ToolError(f"tool {ref!r}: importing module {module_name!r} called sys.exit({exc.code!r})") from None
    except BaseException as exc:  # any exception class a module defines, even one outside Exception
        raise ToolError(f"tool {ref!r}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ToolError(f"tool {ref!r}: module {module_name!r} has no callable {attr!r}")
    return Tool(fn, attr, ref)


def resolve_tools(refs: Iterable[str]) -> dict[str, Tool]:
    """Resolve every reference; names must be unique. Raises ToolError naming the first bad one."""
    tools: dict[str, Tool] = {}
    for ref in refs:
        tool = resolve_tool(ref)
        if tool.name in tools:
            raise ToolError(f"two tools are named {tool.name!r}")
        tools[tool.name] = tool
    return tools
