"""Real MCP servers for tests: the fault server (``tests/mcp_fault_server.py``, HTTP) in a subprocess,
and ``mcp-server-time`` (from PyPI, stdio) as a config entry."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.daemon_harness import TIMEOUT, free_port, wait_until

HERE = Path(__file__).resolve().parent
TIME_COMMAND = [sys.executable, "-m", "mcp_server_time", "--local-timezone", "UTC"]


def stdio_fault_command(*extra: str) -> list[str]:
    """The fault server over stdio (started by each child that needs it), with ``extra`` flags."""
    return [sys.executable, str(HERE / "mcp_fault_server.py"), "--stdio", *extra]


class FaultServer:
    """One fault server process on a fixed loopback port (so a restart comes back at the same URL)."""

    def __init__(
        self, tmp: Path, *, tag: str = "faults", require_auth: str | None = None, echo_auth: bool = False
    ) -> None:
        self.port = free_port()
        self.tag = tag
        self.log_path = tmp / f"mcp-{tag}-{self.port}.log"
        self.require_auth = require_auth
        self.echo_auth = echo_auth
        self.process: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def start(self) -> FaultServer:
        self._release()
        command = [sys.executable, str(HERE / "mcp_fault_server.py"), "--port", str(self.port), "--tag", self.tag]
        command += ["--log", str(self.log_path)]
        if self.require_auth is not None:
            command += ["--require-auth", self.require_auth]
        if self.echo_auth:
            command.append("--echo-auth")
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()  # printed once the socket listens
        assert line.strip() == "listening", f"fault server did not start: {line!r}"
        return self

    def wait_dead(self) -> int:
        assert self.process is not None
        return self.process.wait(TIMEOUT)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(TIMEOUT)
        self._release()

    def _release(self) -> None:
        """Close the pipe of a process that is gone (a restart replaces it)."""
        if self.process is not None and self.process.poll() is not None and self.process.stdout is not None:
            self.process.stdout.close()

    def lines(self) -> list[str]:
        return self.log_path.read_text().splitlines() if self.log_path.exists() else []

    def wait_line(self, line: str) -> None:
        wait_until(lambda: line in self.lines(), f"the fault server to log {line!r}")


@contextmanager
def fault_server(tmp: Path, **kwargs: Any) -> Iterator[FaultServer]:
    server = FaultServer(tmp, **kwargs)
    try:
        yield server.start()
    finally:
        server.stop()


def toml_list(items: list[str]) -> str:
    """A TOML array of strings."""
    return "[" + ", ".join(f'"{item}"' for item in items) + "]"
