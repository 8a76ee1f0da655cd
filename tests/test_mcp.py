"""agentd.mcp against real servers: mcp-server-time over stdio, the SDK-built fault server over HTTP.

Connections, listings and every failure the model must hear about instead of a crash: a server
that is down, slow, answers isError, dies mid-call, or refuses a missing credential; a cancelled
call; a reconnect after the server comes back.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from agentd.config import McpServer
from agentd.mcp import McpHub, McpTool, McpUnavailable, describe, is_mcp_ref, list_server_tools, mcp_tool_name
from tests.daemon_harness import free_port
from tests.mcp_servers import TIME_COMMAND, fault_server

pytestmark = pytest.mark.anyio

TIME = McpServer(name="time", command=tuple(TIME_COMMAND), connect_timeout=30.0)


def test_tool_names_fit_every_provider() -> None:
    assert mcp_tool_name("time", "get_current_time") == "time__get_current_time"
    assert mcp_tool_name("files", "read.file:v2") == "files__read_file_v2"
    long = mcp_tool_name("s", "x" * 100)
    assert len(long) == 64 and long != mcp_tool_name("s", "x" * 99)


def test_mcp_refs_are_those_naming_a_server() -> None:
    assert is_mcp_ref("time:*", ["time"]) and is_mcp_ref("time:get_current_time", ["time"])
    assert not is_mcp_ref("tests.tooling:record", ["time"]) and not is_mcp_ref("clock", ["time"])


def test_describe_unwraps_groups_and_redacts_urls() -> None:
    error = ExceptionGroup("boom", [ConnectionError("cannot reach http://u:p@host:1/mcp?token=s3cret")])
    text = describe(error)
    assert "s3cret" not in text and "u:p" not in text and "http://host:1/mcp" in text


async def test_time_server_over_stdio_lists_and_answers() -> None:
    async with anyio.create_task_group() as tg:
        hub = McpHub(tg)
        hub.configure([TIME])
        connection = hub.connection(TIME)
        await connection.settled(TIME.connect_timeout)
        assert connection.listing is not None, connection.error
        info = connection.listing["get_current_time"]
        assert info.read_only and info.input_schema["required"] == ["timezone"]
        tool = McpTool(connection, info)
        assert tool.spec.side_effect_free and tool.name == "time__get_current_time"
        outcome = await tool.invoke({"timezone": "UTC"})
        assert not outcome.is_error and '"timezone": "UTC"' in outcome.content
        bad = await tool.invoke({"timezone": "Nowhere/Atlantis"})
        assert bad.is_error and "Atlantis" in bad.content
        assert hub.connection(TIME) is connection  # shared, not a second server process
        hub.close()


async def test_http_faults_are_error_results(tmp_path: Path) -> None:
    with fault_server(tmp_path) as server:
        config = McpServer(name="faults", url=server.url, call_timeout=1.0)
        async with anyio.create_task_group() as tg:
            hub = McpHub(tg)
            hub.configure([config])
            connection = hub.connection(config)
            await connection.settled(10.0)
            assert connection.listing is not None, connection.error
            assert set(connection.listing) == {"echo", "slow", "hold", "fail", "die", "append"}
            assert not connection.listing["append"].read_only and connection.listing["echo"].read_only
            echo = await connection.call("echo", {"text": "hi"})
            assert (echo.content, echo.is_error) == ("faults:hi", False)
            slow = await connection.call("slow", {"seconds": 30})
            assert slow.is_error and "no answer within 1s (call_timeout)" in slow.content
            failed = await connection.call("fail", {})
            assert failed.is_error and "told to fail" in failed.content
            died = await connection.call("die", {})
            assert died.is_error and "faults" in died.content
            assert server.wait_dead() == 3
            down = await connection.call("echo", {"text": "anyone?"})
            assert down.is_error and "unavailable" in down.content
            server.start()  # back at the same URL: the connection is made again (with backoff)
            with anyio.fail_after(60):
                while (again := await connection.call("echo", {"text": "back"})).is_error:
                    await anyio.sleep(0.1)
            assert again.content == "faults:back" and connection.connects >= 2
            hub.close()


async def test_a_cancelled_call_is_cancelled_at_the_server(tmp_path: Path) -> None:
    with fault_server(tmp_path) as server:
        config = McpServer(name="faults", url=server.url)
        async with anyio.create_task_group() as tg:
            hub = McpHub(tg)
            connection = hub.connection(config)
            await connection.settled(10.0)
            with anyio.CancelScope() as scope:

                async def cancel_when_started() -> None:
                    await anyio.to_thread.run_sync(server.wait_line, "slow-start 30.0")
                    scope.cancel()

                tg.start_soon(cancel_when_started)
                await connection.call("slow", {"seconds": 30})
            assert scope.cancelled_caught
            await anyio.to_thread.run_sync(server.wait_line, "slow-cancelled")
            hub.close()


async def test_headers_come_from_the_environment(tmp_path: Path) -> None:
    secret = "Bearer s3cret-for-the-test"
    with fault_server(tmp_path, require_auth=secret) as server:
        config = McpServer(name="faults", url=server.url, headers_from={"Authorization": "FAULTS_AUTH"})
        tools = await list_server_tools(config, {"FAULTS_AUTH": secret})
        assert "echo" in tools
        with pytest.raises(McpUnavailable) as refused:
            await list_server_tools(config, {"FAULTS_AUTH": "Bearer wrong"})
        assert "error response" in str(refused.value) and "wrong" not in str(refused.value)  # the SDK drops the 401
        with pytest.raises(McpUnavailable, match=r"FAULTS_AUTH .* is not set"):
            await list_server_tools(config, {})


async def test_a_server_that_is_down_is_unavailable_not_a_crash() -> None:
    config = McpServer(name="nobody", url=f"http://127.0.0.1:{free_port()}/mcp", connect_timeout=5.0)
    with pytest.raises(McpUnavailable, match="ConnectError"):
        await list_server_tools(config, {})
    gone = McpServer(name="gone", command=("false",), connect_timeout=5.0)
    async with anyio.create_task_group() as tg:
        hub = McpHub(tg)
        connection = hub.connection(gone)
        await connection.settled(10.0)
        assert connection.listing is None and connection.error
        outcome = await connection.call("anything", {})
        assert outcome.is_error and "unavailable" in outcome.content
        hub.close()
