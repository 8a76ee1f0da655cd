"""Sample ``module:function`` tools for tests (referenced as ``tests.tooling_examples:<name>``)."""

from __future__ import annotations

import threading
from typing import Literal

import anyio
import anyio.lowlevel
import msgspec

from agentd.tools import side_effect_free

NOT_CALLABLE = 42


def add(a: int, b: int = 1) -> int:
    """Add two integers."""
    return a + b


async def weather(city: str, units: Literal["c", "f"] = "c") -> dict[str, object]:
    """Report the weather in a city."""
    await anyio.lowlevel.checkpoint()
    return {"city": city, "units": units, "temperature": 21 if units == "c" else 70}


@side_effect_free
def shout(text: str) -> str:
    """Upper-case the text."""
    return text.upper()


def explode(reason: str) -> str:
    """Always fails."""
    raise RuntimeError(reason)


async def explode_async(reason: str) -> str:
    """Always fails, asynchronously."""
    await anyio.lowlevel.checkpoint()
    raise LookupError(reason)


def which_thread() -> int:
    """The identity of the thread the tool runs on."""
    return threading.get_ident()


def no_arguments() -> str:
    return "done"


def variadic(*args: int) -> int:
    """Cannot be described to a model."""
    return sum(args)


class _Opaque:
    pass


def opaque() -> object:
    """Returns something that is not JSON."""
    return _Opaque()


class Point(msgspec.Struct):
    x: int
    y: int


def manhattan(p: Point) -> int:
    """Manhattan norm of a point."""
    return abs(p.x) + abs(p.y)
