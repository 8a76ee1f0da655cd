"""Regressions from a hostile review, through a real child: a tool import that calls ``sys.exit``
and provider options a provider cannot take never take a child down."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from agentd.budget import TurnStatus
from agentd.config import SwapPolicy, intelligence_map, parse_config
from agentd.protocol import Failed, Ping, Pong, SwapAck, SwapIntel, TurnDone
from tests.child_harness import REPO, running_child

FINISH = SwapPolicy.FINISH_ON_OLD


def cfg(*, tools: str = '["clock"]', options: str = "") -> str:
    return f"""
[intelligence]
provider = "scripted"
model = "m"
options = {{ {options} }}

[[assistants]]
name = "main"
first_message_mode = "assistant-waits-for-user"
tools = {tools}
"""


def swap_to(text: str, generation: int) -> SwapIntel:
    config = parse_config(text)
    return SwapIntel(
        generation=generation,
        policy=FINISH,
        intelligence=intelligence_map(config),
        limits=config.limits,
        config=config,
    )


async def alive(child: object, seq: int) -> None:
    with anyio.fail_after(10):
        await child.send(Ping(seq=seq))  # type: ignore[attr-defined]
        assert (await child.expect(Pong, lambda p: p.seq == seq)).seq == seq  # type: ignore[attr-defined]


@pytest.mark.anyio
async def test_a_reload_whose_tool_calls_sys_exit_at_import_leaves_the_child_running(tmp_path: Path) -> None:
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "sysexitmod.py").write_text("import sys\nsys.exit(0)\n")
    async with running_child(cfg(), tmp_path, PYTHONPATH=f"{REPO}:{mods}") as child:
        await child.send(swap_to(cfg(tools='["sysexitmod:f"]'), 2))
        await child.expect(SwapAck)
        await alive(child, 1)
        await child.open()
        await child.say("hello", "t1")
        done = await child.expect(TurnDone)
        assert done.record.status is TurnStatus.COMPLETED  # the assistant kept its previous tools
        assert any("child.tools_unresolved" in line and "sys.exit" in line for line in child.stderr)


@pytest.mark.anyio
async def test_a_session_whose_provider_cannot_be_built_is_refused_and_the_child_lives(tmp_path: Path) -> None:
    async with running_child(cfg(options='delay_ms = "abc"'), tmp_path) as child:
        await child.open()
        failed = await child.expect(Failed, lambda f: f.session == "s1")
        assert "cannot build the scripted provider" in failed.error and "delay_ms" in failed.error
        await alive(child, 1)


@pytest.mark.anyio
async def test_a_swap_to_options_the_provider_cannot_take_fails_the_turn_not_the_child(tmp_path: Path) -> None:
    async with running_child(cfg(), tmp_path) as child:
        await child.open()
        await child.send(swap_to(cfg(options="steps = 1.5"), 2))
        await child.expect(SwapAck)
        await alive(child, 1)
        await child.say("hello", "t1")
        done = await child.expect(TurnDone)
        assert done.record.status is TurnStatus.FAILED
        assert done.record.error is not None and "cannot build the scripted provider" in done.record.error
        await alive(child, 2)
        assert not child.of(Failed)


def test_stdlib_logging_and_uvicorn_errors_are_one_json_line_each() -> None:
    import io
    import json
    import logging

    from agentd.obs import configure_logging

    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        logging.getLogger("uvicorn.error").exception("Exception in ASGI application\n")
    finally_lines = out.getvalue()
    configure_logging("json", "info")  # back to stderr for whatever runs next in this process
    lines = finally_lines.splitlines()
    assert len(lines) == 1, lines
    record = json.loads(lines[0])
    assert record["event"] == "stdlib.log" and record["logger"] == "uvicorn.error"
    assert record["error"] == "ValueError: bad thing" and record["level"] == "error"
