"""Tools (agentd.tools): resolution, schemas from type hints, argument validation, error outcomes."""

from __future__ import annotations

import datetime as dt
import json
import threading

import pytest

from agentd.tools import BUILTIN_TOOLS, Tool, ToolError, ToolOutcome, resolve_tool, resolve_tools

EX = "tests.tooling_examples"


# --------------------------------------------------------------------------- built-in clock


def test_clock_spec() -> None:
    tool = resolve_tool("clock")
    assert tool.name == "clock"
    assert tool.spec.name == "clock"
    assert "date and time" in tool.spec.description
    assert tool.spec.side_effect_free is True
    params = tool.spec.parameters
    assert params["type"] == "object"
    assert params["properties"] == {"offset_hours": {"type": "integer", "default": 0}}
    assert params.get("required", []) == []


@pytest.mark.anyio
async def test_clock_returns_iso_time_at_the_offset() -> None:
    tool = resolve_tool("clock")
    utc = await tool.invoke({})
    assert not utc.is_error
    assert dt.datetime.fromisoformat(utc.content).utcoffset() == dt.timedelta(0)
    plus_two = await tool.invoke({"offset_hours": 2})
    assert not plus_two.is_error
    assert dt.datetime.fromisoformat(plus_two.content).utcoffset() == dt.timedelta(hours=2)


@pytest.mark.anyio
async def test_clock_out_of_range_offset_is_an_error_outcome() -> None:
    outcome = await resolve_tool("clock").invoke({"offset_hours": 99})
    assert outcome.is_error
    assert "offset_hours must be between -14 and 14" in outcome.content


def test_unknown_builtin_is_a_tool_error_listing_builtins() -> None:
    with pytest.raises(ToolError) as info:
        resolve_tool("calendar")
    message = str(info.value)
    assert "'calendar'" in message
    assert all(name in message for name in BUILTIN_TOOLS)
    assert "module:function" in message


# --------------------------------------------------------------------------- module:function tools


def test_sync_tool_schema_from_type_hints() -> None:
    tool = resolve_tool(f"{EX}:add")
    assert tool.name == "add"
    assert tool.spec.description == "Add two integers."
    assert tool.spec.side_effect_free is False
    assert tool.spec.parameters == {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer", "default": 1}},
        "required": ["a"],
        "additionalProperties": False,
    }


def test_async_tool_schema_includes_enums() -> None:
    tool = resolve_tool(f"{EX}:weather")
    props = tool.spec.parameters["properties"]
    assert props["city"] == {"type": "string"}
    assert props["units"]["enum"] == ["c", "f"]
    assert tool.spec.parameters["required"] == ["city"]


def test_tool_without_parameters() -> None:
    tool = resolve_tool(f"{EX}:no_arguments")
    assert tool.spec.parameters["type"] == "object"
    assert tool.spec.parameters["properties"] == {}
    assert tool.spec.description == ""


def test_side_effect_free_decorator_is_reflected_in_spec() -> None:
    assert resolve_tool(f"{EX}:shout").spec.side_effect_free is True
    assert resolve_tool(f"{EX}:add").spec.side_effect_free is False


@pytest.mark.anyio
async def test_sync_tool_call() -> None:
    tool = resolve_tool(f"{EX}:add")
    assert await tool.invoke({"a": 2, "b": 3}) == ToolOutcome("5", is_error=False)
    assert await tool.invoke({"a": 2}) == ToolOutcome("3")


@pytest.mark.anyio
async def test_string_results_are_not_json_quoted() -> None:
    assert await resolve_tool(f"{EX}:shout").invoke({"text": "hi"}) == ToolOutcome("HI")


@pytest.mark.anyio
async def test_sync_tool_runs_off_the_event_loop_thread() -> None:
    outcome = await resolve_tool(f"{EX}:which_thread").invoke({})
    assert not outcome.is_error
    assert int(outcome.content) != threading.get_ident()


@pytest.mark.anyio
async def test_async_tool_call_result_is_json() -> None:
    outcome = await resolve_tool(f"{EX}:weather").invoke({"city": "Oslo", "units": "f"})
    assert not outcome.is_error
    assert json.loads(outcome.content) == {"city": "Oslo", "units": "f", "temperature": 70}


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        ({"a": "two"}, "Expected `int`, got `str`"),
        ({"a": 1, "c": 2}, "unknown field `c`"),
        ({"b": 2}, "missing required field `a`"),
        ({"a": 1.5}, "Expected `int`"),
    ],
    ids=["bad-type", "unknown-arg", "missing-arg", "float-for-int"],
)
async def test_bad_arguments_are_error_outcomes(arguments: dict[str, object], fragment: str) -> None:
    outcome = await resolve_tool(f"{EX}:add").invoke(arguments)
    assert outcome.is_error
    assert "invalid arguments for tool 'add'" in outcome.content
    assert fragment in outcome.content


@pytest.mark.anyio
async def test_enum_argument_is_validated() -> None:
    outcome = await resolve_tool(f"{EX}:weather").invoke({"city": "Oslo", "units": "k"})
    assert outcome.is_error


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("ref", "kind"),
    [("explode", "RuntimeError"), ("explode_async", "LookupError")],
    ids=["sync", "async"],
)
async def test_exception_becomes_error_outcome_with_the_message(ref: str, kind: str) -> None:
    outcome = await resolve_tool(f"{EX}:{ref}").invoke({"reason": "disk on fire"})
    assert outcome.is_error
    assert kind in outcome.content
    assert "disk on fire" in outcome.content
    assert f"'{ref}'" in outcome.content


@pytest.mark.anyio
async def test_unencodable_result_is_an_error_outcome() -> None:
    outcome = await resolve_tool(f"{EX}:opaque").invoke({})
    assert outcome.is_error
    assert "opaque" in outcome.content


def test_struct_parameter_schema_has_no_dangling_refs() -> None:
    params = resolve_tool(f"{EX}:manhattan").spec.parameters
    ref = params["properties"]["p"].get("$ref")
    if ref is not None:
        assert ref.startswith("#/$defs/")
        assert ref.removeprefix("#/$defs/") in params.get("$defs", {})


@pytest.mark.anyio
async def test_struct_parameter_is_validated_and_converted() -> None:
    tool = resolve_tool(f"{EX}:manhattan")
    assert await tool.invoke({"p": {"x": 3, "y": -4}}) == ToolOutcome("7")
    assert (await tool.invoke({"p": {"x": 3}})).is_error


# --------------------------------------------------------------------------- resolution errors


@pytest.mark.parametrize(
    ("ref", "fragments"),
    [
        ("no_such_module_xyz:fn", ["cannot import module 'no_such_module_xyz'"]),
        (f"{EX}:nope", [f"module '{EX}' has no callable 'nope'"]),
        (f"{EX}:NOT_CALLABLE", ["no callable 'NOT_CALLABLE'"]),
        (f"{EX}:variadic", ["*args/**kwargs"]),
    ],
)
def test_bad_references_are_tool_errors(ref: str, fragments: list[str]) -> None:
    with pytest.raises(ToolError) as info:
        resolve_tool(ref)
    assert all(fragment in str(info.value) for fragment in fragments)


def test_resolve_tools_maps_names() -> None:
    tools = resolve_tools(["clock", f"{EX}:add", f"{EX}:weather"])
    assert list(tools) == ["clock", "add", "weather"]
    assert all(isinstance(tool, Tool) and tool.name == name for name, tool in tools.items())


def test_resolve_tools_rejects_duplicate_names() -> None:
    with pytest.raises(ToolError, match="two tools are named 'add'"):
        resolve_tools([f"{EX}:add", f"{EX}:add"])


def test_resolve_tools_names_the_bad_reference() -> None:
    with pytest.raises(ToolError, match="calendar"):
        resolve_tools(["clock", "calendar"])
