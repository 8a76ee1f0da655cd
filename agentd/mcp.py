"""Tools of MCP servers, through the official ``mcp`` SDK (2.x): connections, listings, calls (RFC 0008).

A child holds one ``McpHub``. It connects to each ``[[mcp_servers]]`` entry a session needs once,
and every session of the child shares that connection: a stdio server is one process per child,
an HTTP server one client. Each connection is owned by a task of its own — the SDK's client runs
task groups inside the task that enters it, and a transport failure cancels that task; were it a
turn's task, a dying server would cancel the turn. Turns only send requests over it.

Nothing here raises into a turn. A server that is down, slow (``call_timeout``), answers
``isError``, or dies mid-call gives an error ``ToolOutcome``; a connection that broke is made
again with backoff. Secrets (``env_from``, ``headers_from``) are read from the environment the
supervisor passed (RFC 0008 §3) when a connection is made, and are never part of a message.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import math
import random
import re
import sys
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import anyio
import anyio.abc
import msgspec

from agentd import events
from agentd.causes import iter_causes
from agentd.config import McpServer
from agentd.obs import get_logger
from agentd.redact import Secrets, redact_url
from agentd.tools import ToolOutcome, ToolSpec

__all__ = [
    "McpConnection",
    "McpHub",
    "McpTool",
    "McpToolInfo",
    "McpUnavailable",
    "is_mcp_ref",
    "list_server_tools",
    "mcp_tool_name",
]

log = get_logger("mcp")

RECONNECT_START = 0.5
RECONNECT_MAX = 30.0
#: The longest tool name providers accept (OpenAI: ``^[A-Za-z0-9_-]{1,64}$``).
MAX_TOOL_NAME = 64
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


class McpUnavailable(Exception):
    """A server that cannot be reached (or configured): the message says why, without secrets."""


class McpToolInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One tool of a server's ``tools/list``: what the model is told, and whether it is read-only."""

    name: str
    description: str = ""
    input_schema: dict[str, Any] = msgspec.field(default_factory=lambda: {"type": "object", "properties": {}})
    read_only: bool = False


def mcp_tool_name(server: str, tool: str) -> str:
    """The name the model sees for ``server:tool``: ``server__tool``, fit for every provider.

    ``:`` is not allowed in provider tool names, so the separator is ``__``; other characters
    providers refuse become ``_``, and a name past 64 characters is cut and made unique by a hash.
    """
    name = _UNSAFE.sub("_", f"{server}__{tool}")
    if len(name) > MAX_TOOL_NAME:
        digest = hashlib.sha256(f"{server}:{tool}".encode()).hexdigest()[:8]
        name = f"{name[: MAX_TOOL_NAME - 9]}_{digest}"
    return name


def is_mcp_ref(ref: str, servers: Iterable[str]) -> bool:
    """Whether a tool reference names a tool of one of ``servers`` (``server:tool`` or ``server:*``)."""
    prefix, colon, _ = ref.partition(":")
    return bool(colon) and prefix in set(servers)


def describe(exc: BaseException) -> str:
    """A one-line reason for a failed connection or call, with URLs redacted.

    Exception groups (the SDK's task groups) are unwrapped to the first member that says something.
    """
    for cause in iter_causes(exc):
        if isinstance(cause, BaseExceptionGroup) or not str(cause):
            continue
        text = re.sub(r"https?://\S+", lambda m: redact_url(m.group(0)), str(cause))
        return f"{type(cause).__name__}: {text}"[:500]
    return type(exc).__name__


def _result_text(result: Any) -> str:
    """A CallToolResult's content as the text a model reads (non-text blocks are named, not inlined)."""
    import mcp_types as types

    parts: list[str] = []
    for block in result.content:
        if isinstance(block, types.TextContent):
            parts.append(block.text)
        elif isinstance(block, types.ImageContent | types.AudioContent):
            parts.append(f"[{block.type} {block.mime_type}, {len(block.data)} base64 characters]")
        elif isinstance(block, types.EmbeddedResource):
            resource = block.resource
            text = getattr(resource, "text", None)
            parts.append(text if isinstance(text, str) else f"[resource {resource.uri}]")
        elif isinstance(block, types.ResourceLink):
            parts.append(f"[resource {block.uri}]")
    if not parts and result.structured_content is not None:
        parts.append(msgspec.json.encode(result.structured_content).decode())
    return "\n".join(parts)


def _secret_values(server: McpServer, environ: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """The env vars for a stdio server and the headers for an HTTP one, read from ``environ``."""
    env: dict[str, str] = dict(server.env)
    headers: dict[str, str] = {}
    for name in server.env_from:
        if name not in environ:
            raise McpUnavailable(f"the environment variable {name} (mcp_servers {server.name!r} env_from) is not set")
        env[name] = environ[name]
    for header, name in server.headers_from.items():
        if name not in environ:
            raise McpUnavailable(
                f"the environment variable {name} (mcp_servers {server.name!r} headers_from.{header}) is not set"
            )
        headers[header] = environ[name]
    return env, headers


@contextlib.asynccontextmanager
async def _transport(server: McpServer, environ: Mapping[str, str], ended: anyio.Event) -> AsyncIterator[Any]:
    """The SDK transport for ``server``, its read side watched: ``ended`` is set when the server goes.

    A stdio server that exits only closes its stream; requests in flight then fail, but the client
    would not notice by itself that it must reconnect. The relay notices.
    """
    from mcp.client.stdio import StdioServerParameters, stdio_client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    env, headers = _secret_values(server, environ)
    async with contextlib.AsyncExitStack() as stack:
        if server.command is not None:
            params = StdioServerParameters(command=server.command[0], args=list(server.command[1:]), env=env)
            streams = await stack.enter_async_context(stdio_client(params, errlog=sys.stderr))
        else:
            assert server.url is not None
            http = await stack.enter_async_context(create_mcp_http_client(headers=headers))
            streams = await stack.enter_async_context(streamable_http_client(server.url, http_client=http))
        read, write = streams
        relay_send, relay_receive = anyio.create_memory_object_stream[Any](0)

        async def relay() -> None:
            try:
                async with relay_send:
                    async for item in read:
                        await relay_send.send(item)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream):
                pass
            finally:
                ended.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(relay)
            try:
                yield relay_receive, write
            finally:
                tg.cancel_scope.cancel()


def _client(server: McpServer, environ: Mapping[str, str], ended: anyio.Event) -> Any:
    from mcp import Client

    # No response cache: a listing must be the server's own after every reconnect.
    return Client(_transport(server, environ, ended), cache=None)


async def _list_tools(client: Any) -> dict[str, McpToolInfo]:
    """Every page of ``tools/list``."""
    tools: dict[str, McpToolInfo] = {}
    cursor: str | None = None
    for _ in range(1000):  # a server whose cursor never ends cannot hold a connect forever
        page = await client.list_tools(cursor=cursor)
        for tool in page.tools:
            annotations = tool.annotations
            tools[tool.name] = McpToolInfo(
                name=tool.name,
                description=tool.description or "",
                input_schema=dict(tool.input_schema),
                read_only=bool(annotations is not None and annotations.read_only_hint is True),
            )
        cursor = page.next_cursor
        if cursor is None:
            break
    return tools


async def list_server_tools(server: McpServer, environ: Mapping[str, str]) -> dict[str, McpToolInfo]:
    """Connect once, list the tools, disconnect (``agentd check-config --connect``). McpUnavailable on failure."""
    ended = anyio.Event()
    try:
        with anyio.fail_after(server.connect_timeout):
            async with _client(server, environ, ended) as client:
                return await _list_tools(client)
    except McpUnavailable:
        raise
    except TimeoutError:
        raise McpUnavailable(f"no answer within {server.connect_timeout:g}s (connect_timeout)") from None
    except Exception as exc:
        raise McpUnavailable(describe(exc)) from None


class _State(enum.Enum):
    IDLE = "idle"
    CONNECTING = "connecting"
    UP = "up"
    DOWN = "down"  # the last attempt failed; the next one waits for the backoff
    CLOSED = "closed"


class McpConnection:
    """One server as one child sees it: a task that connects, lists, and reconnects with backoff."""

    def __init__(self, server: McpServer, environ: Mapping[str, str]) -> None:
        self.server = server
        self._environ = dict(environ)
        self.listing: dict[str, McpToolInfo] | None = None  # the last tools/list (kept while reconnecting)
        self.error: str | None = None
        self.connects = 0
        self.users = 0  # turns holding it (a retired connection closes when none does)
        self._state = _State.IDLE
        self._changed = anyio.Event()
        self._client: Any = None
        self._ended = anyio.Event()
        self._close_requested = anyio.Event()

    @property
    def name(self) -> str:
        return self.server.name

    def start(self, tg: anyio.abc.TaskGroup) -> None:
        """Start connecting in ``tg`` unless already started."""
        if self._state is _State.IDLE:
            self._set(_State.CONNECTING)
            tg.start_soon(self._run)

    def close(self) -> None:
        """Disconnect (and stop reconnecting); calls in flight end with an error result."""
        self._close_requested.set()
        self._ended.set()
        if self._state is _State.IDLE:
            self._set(_State.CLOSED)

    async def settled(self, timeout: float) -> None:  # noqa: ASYNC109 - the connect bound is the API
        """Wait (at most ``timeout``) while a connection attempt is under way."""
        with anyio.move_on_after(timeout):
            while self._state is _State.CONNECTING:
                await self._changed.wait()

    def _set(self, state: _State) -> None:
        self._state = state
        self._changed.set()
        self._changed = anyio.Event()

    async def _run(self) -> None:
        backoff = RECONNECT_START
        while not self._close_requested.is_set():
            self._set(_State.CONNECTING)
            before = self.connects
            try:
                await self._serve_once()
            except Exception as exc:
                self.error = describe(exc)
            finally:
                self._client = None
            was_up = self.connects > before
            if self._close_requested.is_set():
                break
            log.warning(
                events.LOG_MCP_DISCONNECTED if was_up else events.LOG_MCP_CONNECT_FAILED,
                server=self.name,
                error=self.error,
            )
            if was_up:  # it worked until now: try again at once, then back off
                backoff = RECONNECT_START
                continue
            self._set(_State.DOWN)
            with anyio.move_on_after(backoff * random.uniform(0.5, 1.0)):
                await self._close_requested.wait()
            backoff = min(backoff * 2, RECONNECT_MAX)
        self._set(_State.CLOSED)

    async def _serve_once(self) -> None:
        """Connect, list, serve until the server goes or we close."""
        self._ended = ended = anyio.Event()
        if self._close_requested.is_set():
            return
        before = self.connects
        with anyio.CancelScope() as scope:
            scope.deadline = anyio.current_time() + self.server.connect_timeout
            async with _client(self.server, self._environ, ended) as client:
                self.listing = await _list_tools(client)
                scope.deadline = math.inf  # connected: the bound was for connecting only
                self._client, self.error = client, None
                self.connects += 1
                self._set(_State.UP)
                log.info(events.LOG_MCP_CONNECTED, server=self.name, tools=len(self.listing), connects=self.connects)
                await ended.wait()
                self.error = "the server closed the connection"
        if scope.cancelled_caught and self.connects == before:
            self.error = f"no answer within {self.server.connect_timeout:g}s (connect_timeout)"

    async def call(self, tool: str, arguments: dict[str, Any]) -> ToolOutcome:
        """Call ``tool``; every failure is an error outcome naming the server and the tool."""
        timeout = self.server.call_timeout
        where = f"MCP tool {tool!r} of server {self.name!r}"
        with anyio.move_on_after(timeout):
            client = self._client
            if client is None:
                await self.settled(timeout)
                client = self._client
            if client is None:
                return ToolOutcome(
                    f"{where}: the server is unavailable: {self.error or 'not connected'}", is_error=True
                )
            try:
                result = await client.call_tool(tool, arguments)
            except Exception as exc:
                if _connection_lost(exc):
                    if self._client is client:  # later calls wait for the reconnect, not this client
                        self._client = None
                        self.error = describe(exc)
                    self._ended.set()
                    return ToolOutcome(
                        f"{where}: the server went away during the call ({describe(exc)})", is_error=True
                    )
                return ToolOutcome(f"{where} failed: {describe(exc)}", is_error=True)
            return ToolOutcome(_result_text(result), is_error=bool(result.is_error))
        return ToolOutcome(f"{where}: no answer within {timeout:g}s (call_timeout)", is_error=True)


def _connection_lost(exc: BaseException) -> bool:
    from mcp.shared.exceptions import MCPError
    from mcp_types import CONNECTION_CLOSED

    if isinstance(exc, MCPError):
        return exc.code == CONNECTION_CLOSED
    return True  # anything but a protocol error answered by the server: the transport failed


class McpTool:
    """One MCP tool as the turn loop sees it: a name, a spec, and ``invoke``."""

    def __init__(self, connection: McpConnection, info: McpToolInfo) -> None:
        self.connection = connection
        self.info = info
        self.name = mcp_tool_name(connection.name, info.name)
        self.spec = ToolSpec(
            name=self.name,
            description=info.description,
            parameters=info.input_schema,
            side_effect_free=info.read_only,  # readOnlyHint: true, and only that, is free of side effects
        )

    async def invoke(self, arguments: dict[str, Any]) -> ToolOutcome:
        """Call the tool on its server (the server validates the arguments against its schema)."""
        return await self.connection.call(self.info.name, arguments)


class McpHub:
    """A child's MCP connections, shared by its sessions, keyed by each server's whole config.

    A reload that changes a server makes a new connection for turns that start afterwards; the old
    one closes when no turn holds it any more (``hold``).
    """

    def __init__(self, tg: anyio.abc.TaskGroup, environ: Mapping[str, str] | None = None) -> None:
        self._tg = tg
        self._environ: dict[str, str] = dict(environ or {})
        self._connections: dict[bytes, McpConnection] = {}
        self._current: set[bytes] = set()

    def configure(self, servers: Sequence[McpServer], environ: Mapping[str, str] | None = None) -> None:
        """Adopt a generation's servers: connections no longer in it close once unused."""
        if environ is not None:
            self._environ = dict(environ)
        self._current = {self._key(server) for server in servers}
        for key, connection in list(self._connections.items()):
            if key not in self._current and connection.users == 0:
                del self._connections[key]
                connection.close()

    def _key(self, server: McpServer) -> bytes:
        # The secrets' values are part of a connection's identity too (a rotated token reconnects).
        env: dict[str, str] = {}
        headers: dict[str, str] = {}
        with contextlib.suppress(McpUnavailable):
            env, headers = _secret_values(server, self._environ)
        digest = hashlib.sha256(msgspec.json.encode([env, headers])).hexdigest()
        return msgspec.json.encode(server) + digest.encode()

    def connection(self, server: McpServer) -> McpConnection:
        """The connection for ``server`` (started on first use)."""
        key = self._key(server)
        connection = self._connections.get(key)
        if connection is None:
            connection = self._connections[key] = McpConnection(server, self._environ)
        connection.start(self._tg)
        return connection

    def warm(self, servers: Iterable[McpServer]) -> None:
        """Start connecting to ``servers`` now (a session was opened that will need them)."""
        for server in servers:
            self.connection(server)

    @contextlib.asynccontextmanager
    async def hold(self, servers: Iterable[McpServer]) -> AsyncIterator[list[McpConnection]]:
        """The connections for ``servers``, held for the duration (a turn): none closes under it."""
        held = [self.connection(server) for server in servers]
        for connection in held:
            connection.users += 1
        try:
            yield held
        finally:
            for connection in held:
                connection.users -= 1
            self.configure_retired()

    def configure_retired(self) -> None:
        """Close retired connections nobody holds."""
        for key, connection in list(self._connections.items()):
            if key not in self._current and connection.users == 0:
                del self._connections[key]
                connection.close()

    def close(self) -> None:
        """Close every connection (the child is stopping)."""
        for connection in self._connections.values():
            connection.close()
        self._connections.clear()


class ServerCheck(msgspec.Struct, frozen=True, kw_only=True):
    """What ``agentd check-config --connect`` found for one server: its tools, or why it failed."""

    name: str
    tools: list[str] = []
    error: str | None = None


async def check_servers(config: Any, environ: Mapping[str, str]) -> tuple[list[ServerCheck], list[Any]]:
    """Connect to every ``[[mcp_servers]]`` entry at once and list its tools; the issues found.

    An issue for each server that cannot be reached (at ``mcp_servers[i]``), for each
    ``server:tool`` an assistant names that its server does not list, and for two tools of one
    assistant that the model would see under one name (at ``assistants[i].tools[k]``).
    """
    from agentd.config import ConfigIssue
    from agentd.environment import secret_values

    listings: dict[str, dict[str, McpToolInfo] | str] = {}
    secrets = Secrets(secret_values(environ, config))  # a server may quote its credential in an error

    async def one(server: McpServer) -> None:
        try:
            listings[server.name] = await list_server_tools(server, environ)
        except McpUnavailable as exc:
            listings[server.name] = secrets.scrub(str(exc))

    async with anyio.create_task_group() as tg:
        for server in config.mcp_servers:
            tg.start_soon(one, server)
    checks: list[ServerCheck] = []
    issues: list[ConfigIssue] = []
    for i, server in enumerate(config.mcp_servers):
        listing = listings[server.name]
        if isinstance(listing, str):
            checks.append(ServerCheck(name=server.name, error=listing))
            issues.append(ConfigIssue(f"mcp_servers[{i}]", f"cannot connect to MCP server {server.name!r}: {listing}"))
        else:
            checks.append(ServerCheck(name=server.name, tools=sorted(listing)))
    servers = [server.name for server in config.mcp_servers]
    for i, assistant in enumerate(config.assistants):
        seen: dict[str, str] = {}
        for k, ref in enumerate(assistant.tools):
            names = [ref.rpartition(":")[2] or ref]
            if is_mcp_ref(ref, servers):
                server_name, _, tool = ref.partition(":")
                listing = listings[server_name]
                if isinstance(listing, str):
                    continue
                if tool != "*" and tool not in listing:
                    have = ", ".join(sorted(listing)) or "none"
                    issues.append(
                        ConfigIssue(
                            f"assistants[{i}].tools[{k}]",
                            f"MCP server {server_name!r} has no tool {tool!r}; it has: {have}",
                        )
                    )
                    continue
                names = [mcp_tool_name(server_name, t) for t in (sorted(listing) if tool == "*" else [tool])]
            for name in names:
                if name in seen and seen[name] != ref:
                    issues.append(
                        ConfigIssue(f"assistants[{i}].tools[{k}]", f"the model would see two tools named {name!r}")
                    )
                seen.setdefault(name, ref)
    return checks, issues
