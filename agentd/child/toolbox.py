"""An assistant's tools in a child: built-ins and Python tools resolved once per generation, MCP
tools resolved from their servers' listings when a turn starts (RFC 0008 §2)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agentd import events
from agentd.config import Assistant, Config, McpServer
from agentd.mcp import McpConnection, McpTool, McpToolInfo, is_mcp_ref
from agentd.obs import get_logger
from agentd.tools import AnyTool, Tool, resolve_tools

__all__ = ["Toolbox", "approval_ref", "build_toolbox"]

log = get_logger("child")


@dataclass(frozen=True)
class Toolbox:
    """What one assistant may call: ``local`` tools, and ``(server, tool or "*")`` of MCP servers."""

    local: dict[str, Tool]
    mcp: tuple[tuple[McpServer, str], ...] = ()

    @property
    def servers(self) -> list[McpServer]:
        """The MCP servers this toolbox needs, each once."""
        seen: dict[str, McpServer] = {}
        for server, _ in self.mcp:
            seen.setdefault(server.name, server)
        return list(seen.values())

    async def tools(self, connections: Sequence[McpConnection]) -> dict[str, AnyTool]:
        """Every tool for a turn that starts now. A server reached for the first time is waited for
        (at most its ``connect_timeout``); one that cannot be reached offers the tools it is known
        to have — named ones at least — whose calls then answer that the server is unavailable."""
        tools: dict[str, AnyTool] = dict(self.local)
        by_name = {connection.name: connection for connection in connections}
        for server, wanted in self.mcp:
            connection = by_name[server.name]
            if connection.listing is None:
                await connection.settled(server.connect_timeout)
            for info in _offered(connection, wanted):
                tool = McpTool(connection, info)
                if tool.name in tools:
                    log.warning(events.LOG_MCP_TOOL_NAME_TAKEN, server=server.name, tool=info.name, name=tool.name)
                    continue
                tools[tool.name] = tool
        return tools


def _offered(connection: McpConnection, wanted: str) -> list[McpToolInfo]:
    listing = connection.listing
    if listing is None:
        if wanted == "*":
            log.warning(events.LOG_MCP_TOOLS_UNAVAILABLE, server=connection.name, error=connection.error)
            return []
        # Named in the config: offered with an open schema, so the model's call reaches the server
        # (or hears why it cannot) instead of "unknown tool".
        return [McpToolInfo(name=wanted, description=f"{wanted} (MCP server {connection.name!r})")]
    if wanted == "*":
        return list(listing.values())
    if wanted not in listing:
        log.warning(events.LOG_MCP_TOOL_NOT_LISTED, server=connection.name, tool=wanted)
        return []
    return [listing[wanted]]


def build_toolbox(assistant: Assistant, config: Config) -> Toolbox:
    """Resolve an assistant's built-in and Python tools now; keep its MCP refs for its turns. Raises ToolError."""
    servers = [server.name for server in config.mcp_servers]
    local = [ref for ref in assistant.tools if not is_mcp_ref(ref, servers)]
    mcp: list[tuple[McpServer, str]] = []
    for ref in assistant.tools:
        if is_mcp_ref(ref, servers):
            name, _, tool = ref.partition(":")
            server = config.mcp_server(name)
            assert server is not None
            mcp.append((server, tool))
    return Toolbox(resolve_tools(local), tuple(mcp))


def approval_ref(tool: AnyTool) -> tuple[str | None, str | None]:
    """How ``require_approval`` names ``tool``: (its ``tools`` entry, its MCP server or None)."""
    if isinstance(tool, McpTool):
        return f"{tool.connection.name}:{tool.info.name}", tool.connection.name
    return getattr(tool, "ref", None), None
