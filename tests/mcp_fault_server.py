"""A streamable-HTTP MCP server for the fault tests, built on the SDK's own ``MCPServer``.

``python tests/mcp_fault_server.py --port P --tag T [--log F] [--require-auth VALUE]`` serves on
127.0.0.1:P until killed (``--stdio`` instead: over stdin/stdout, for the bench and the stdio tests;
``--noise N`` then first writes N lines that are not JSON to stdout, ``--leak-env NAME`` the value
of the variable NAME to stderr, ``--stderr-events N`` N structlog-style JSON lines to stderr). Tools: ``echo`` (read-only; answers ``T:text``), ``slow`` (read-only;
sleeps), ``hold`` (side-effecting; sleeps), ``fail`` (an ``isError`` result), ``die`` (the process exits mid-call) and ``append``
(side-effecting; appends a line to the log). With ``--require-auth``, a request whose
``Authorization`` header is not exactly VALUE is refused with 401 (``--echo-auth``: a JSON-RPC error
quoting the header it got, as careless servers do). Every call and every
cancellation is written to the log file, so a test can see what the server saw.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from typing import Any

import anyio
import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from starlette.responses import JSONResponse, PlainTextResponse

READ_ONLY = ToolAnnotations(read_only_hint=True)


def build(tag: str, log_path: str | None) -> MCPServer:
    app = MCPServer("faults")

    def log(line: str) -> None:
        if log_path:
            with open(log_path, "a", encoding="utf-8") as fh:
                fh.write(line + "\n")

    @app.tool(annotations=READ_ONLY)
    def echo(text: str) -> str:
        """Answer the text, prefixed by the server's tag."""
        log(f"echo {text}")
        return f"{tag}:{text}"

    @app.tool(annotations=READ_ONLY)
    async def slow(seconds: float) -> str:
        """Sleep, then answer."""
        log(f"slow-start {seconds}")
        try:
            await anyio.sleep(seconds)
        except BaseException:
            log("slow-cancelled")
            raise
        log("slow-end")
        return "slept"

    @app.tool()
    def fail() -> str:
        """Always fails (an isError result)."""
        log("fail")
        raise ToolError("the fault server was told to fail")

    @app.tool()
    def die() -> str:
        """The server process exits in the middle of the call."""
        log("die")
        os._exit(3)

    @app.tool()
    async def hold(seconds: float) -> str:
        """Side-effecting and slow: log its start, sleep, log its effect."""
        log(f"hold-start {seconds}")
        await anyio.sleep(seconds)
        log("hold-effect")
        return "held"

    @app.tool()
    def append(line: str) -> str:
        """Append a line to the server's log: a side effect."""
        log(f"append {line}")
        return "appended"

    return app


class RequireAuth:
    """ASGI middleware: 401 unless the Authorization header is exactly ``expected``."""

    def __init__(self, app: Any, expected: str, echo: bool = False) -> None:
        self.app, self.expected, self.echo = app, expected, echo

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            got = headers.get(b"authorization", b"").decode()
            if got != self.expected:
                if self.echo:  # a JSON-RPC error, which the SDK hands on as the reason
                    error = {"code": -32001, "message": f"unauthorized: {got!r} is not a valid credential"}
                    body = {"jsonrpc": "2.0", "id": None, "error": error}
                    await JSONResponse(body, status_code=401)(scope, receive, send)
                    return
                await PlainTextResponse("unauthorized", status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--stdio", action="store_true")
    parser.add_argument("--tag", default="faults")
    parser.add_argument("--log", default=None)
    parser.add_argument("--require-auth", default=None)
    parser.add_argument("--echo-auth", action="store_true")
    parser.add_argument("--noise", type=int, default=0)
    parser.add_argument("--leak-env", default=None)
    parser.add_argument("--stderr-events", type=int, default=0)
    parser.add_argument("--leak-pad", type=int, default=0)
    args = parser.parse_args()
    if args.stdio:
        if args.leak_env:
            pad = "x" * args.leak_pad  # --leak-pad N: N characters of padding before the value and after
            tail = f" {pad}" if pad else ""
            print(f"{pad}{args.leak_env}={os.environ.get(args.leak_env, '')}{tail}", file=sys.stderr, flush=True)
        for i in range(args.stderr_events):  # a structlog-style JSON log line, as many Python servers write
            print(json.dumps({"event": "forged.by.mcp", "level": "error", "n": i}), file=sys.stderr, flush=False)
        sys.stderr.flush()
        for i in range(args.noise):
            print(f"noise line {i}: this is not JSON", flush=False)
        sys.stdout.flush()
        build(args.tag, args.log).run()
        return
    asgi: Any = build(args.tag, args.log).streamable_http_app()
    if args.require_auth is not None:
        asgi = RequireAuth(asgi, args.require_auth, args.echo_auth)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    sock.listen()
    server = uvicorn.Server(uvicorn.Config(asgi, log_level="warning", lifespan="on"))
    print("listening", flush=True)
    anyio.run(server.serve, [sock])


if __name__ == "__main__":
    main()
