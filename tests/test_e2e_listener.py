"""The TCP listener under hostile clients, and the API token as operators set it, through the real
daemon (RFC 0000 §2 ``[server]``, §4, §6).

Open connections must not exhaust the daemon: ``[server] max_connections`` bounds the TCP
connections it holds (more wait in the kernel's backlog), ``header_timeout`` closes a client whose
request headers have not arrived, and the bound stays under half the open-files limit so that
children, the store and the unix socket always have descriptors. ``AGENTD_API_TOKEN`` with a
trailing newline (a Secret made from a file) is trimmed by the daemon and the CLI alike; one of
only whitespace is refused at start. No test decides by elapsed time: each waits for an event (a
log line, an EOF, an answer) with a generous bound.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.daemon_harness import TIMEOUT, Daemon, agentd_env, free_port, wait_until

pytestmark = pytest.mark.e2e

TOKEN = "s3cret-token"


def config(server: str) -> str:
    return f"""
[server]
{server}

[intelligence]
provider = "scripted"
model = "echo-small"

[[assistants]]
name = "main"
first_message_mode = "assistant-waits-for-user"
"""


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    sock.settimeout(TIMEOUT)  # a bound on each read, never what a test decides by
    return sock


def read_to_eof(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a read returning EOF)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def health_request(*, close: bool) -> bytes:
    return b"GET /v1/health HTTP/1.1\r\nHost: agentd\r\n" + (b"Connection: close\r\n" if close else b"") + b"\r\n"


@contextmanager
def started(daemon: Daemon) -> Iterator[Daemon]:
    try:
        yield daemon.start()
    finally:
        daemon.stop()


def listening(tmp_path: Path, server: str, **kwargs: Any) -> tuple[Daemon, int]:
    port = free_port()
    env = {"AGENTD_API_TOKEN": TOKEN, **kwargs.pop("env", {})}
    return Daemon(tmp_path, config(server), args=["--listen", f"127.0.0.1:{port}"], env=env, **kwargs), port


def test_tcp_clients_over_max_connections_wait_in_the_backlog_while_the_unix_socket_answers(tmp_path: Path) -> None:
    daemon, port = listening(tmp_path, 'max_connections = 8\nheader_timeout = "1h"')
    with started(daemon):
        idle = [connect(port) for _ in range(8)]  # they send nothing, and are never timed out here
        late = connect(port)  # the ninth: queued behind them in the kernel's accept queue
        late.sendall(health_request(close=True))
        # The daemon holds the eight and stops accepting: it says so once.
        [full] = daemon.wait_log("api.at_capacity")
        assert full["max_connections"] == 8 and full["listener"] == f"127.0.0.1:{port}"
        # The unix socket answers while TCP is full, the supervisor too.
        assert daemon.api("GET", "/v1/health").status_code == 200
        assert daemon.status()["pid"] == daemon.process.pid  # type: ignore[union-attr]
        # The ninth was not accepted: its request, sent before all this, has no answer.
        readable, _, _ = select.select([late], [], [], 0)
        assert readable == [], late.recv(200)
        # One of the eight goes away: its slot is the ninth's, which is served.
        idle[0].close()
        assert read_to_eof(late).startswith(b"HTTP/1.1 200 ")
        for sock in [*idle, late]:
            sock.close()


def test_a_client_without_its_headers_is_closed_after_header_timeout_and_new_clients_are_served(
    tmp_path: Path,
) -> None:
    daemon, port = listening(tmp_path, 'max_connections = 8\nheader_timeout = "0.5s"')
    with started(daemon):
        silent = [connect(port) for _ in range(12)]  # eight held, four in the backlog
        partial = connect(port)
        partial.sendall(b"GET /v1/health HTTP/1.1\r\nHost: agentd\r\n")  # the blank line never comes
        assert daemon.api("GET", "/v1/health").status_code == 200
        # Each is closed by the daemon (a read returns EOF) without an answer: first the eight
        # it held, then those from the backlog as slots came free.
        for sock in [*silent, partial]:
            assert read_to_eof(sock) == b""
        # A kept-alive connection whose next request's headers trickle in is closed the same way
        # (uvicorn's keep-alive timer stops at the first byte of them).
        kept = connect(port)
        kept.sendall(health_request(close=False))
        answer = b""
        while b'{"status":"ok"}' not in answer:
            answer += kept.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200 ")
        kept.sendall(b"GET /v1/health HTTP/1.1\r\n")
        assert read_to_eof(kept) == b""
        # New clients are served: the slots came back.
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT) as tcp:
            assert tcp.get("/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
        for sock in [*silent, partial, kept]:
            sock.close()


#: Run ``agentd`` with its open-files limit (soft and hard) set to argv[1].
LIMITED = (
    "import os, resource, sys\n"
    "n = int(sys.argv[1])\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)


class LimitedDaemon(Daemon):
    """The daemon with a hard limit of ``FD_LIMIT`` open files (it cannot raise its soft one further)."""

    FD_LIMIT = 256

    def command(self) -> list[str]:
        return [sys.executable, "-c", LIMITED, str(self.FD_LIMIT), *super().command()[1:]]


def test_idle_tcp_clients_leave_descriptors_for_the_unix_socket_the_store_and_children(tmp_path: Path) -> None:
    """Under a 256-file limit, 300 silent TCP clients (the default max_connections is 1000): the
    daemon holds at most 128 of them, and meanwhile answers on its unix socket, runs a turn, and
    replaces a killed child."""
    port = free_port()
    daemon = LimitedDaemon(
        tmp_path,
        # The default max_connections; silent clients stay. One active child kept (not the lean
        # default of none), so a killed one is replaced whatever the load.
        config('header_timeout = "1h"') + "\n[supervisor]\nchildren = 1\n",
        args=["--listen", f"127.0.0.1:{port}"],
        env={"AGENTD_API_TOKEN": TOKEN},
    )
    with started(daemon), contextlib.ExitStack() as silent:
        [lowered] = daemon.log_events("api.connection_cap")
        assert (lowered["configured"], lowered["effective"], lowered["fd_limit"]) == (1000, 128, 256)
        for _ in range(300):
            silent.enter_context(connect(port))  # closed when the test ends, passed or not
        daemon.wait_log("api.at_capacity")
        assert daemon.api("GET", "/v1/health").status_code == 200
        session = daemon.new_session()
        assert daemon.send(session, "hello")["turn"]["status"] == "completed"
        before = {child["pid"] for child in daemon.status()["children"]}
        victim = daemon.session(session)["child"]
        assert victim in before
        os.kill(victim, signal.SIGKILL)

        def replaced() -> bool:
            pids = {child["pid"] for child in daemon.status()["children"]}
            return victim not in pids and len(pids) >= len(before) and None not in pids

        wait_until(replaced, "a replacement for the killed child")
        # Nothing ran out of descriptors: no accept() failed (asyncio's own loop logged each failure,
        # many times over, once the limit was reached).
        assert not daemon.log_events("api.accept_failed")
        assert "out of system resource" not in daemon.log_text()
        assert daemon.send(daemon.new_session(), "again")["turn"]["status"] == "completed"


# --------------------------------------------------------------------------- AGENTD_API_TOKEN


def test_an_api_token_with_a_trailing_newline_works_for_the_daemon_and_the_cli(tmp_path: Path) -> None:
    """A Kubernetes Secret made from a file: the variable ends in a newline. Daemon and CLI both
    trim it, so TCP clients get in."""
    daemon, port = listening(tmp_path, "", env={"AGENTD_API_TOKEN": f"{TOKEN}\n"})
    with started(daemon):
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT) as tcp:
            assert tcp.get("/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
            assert tcp.get("/v1/status", headers={"Authorization": f"Bearer {TOKEN}x"}).status_code == 401
        status = daemon.run_cli("status", "--json", "--url", f"http://127.0.0.1:{port}")
        assert status.returncode == 0, status.stderr
        assert TOKEN not in status.stdout + status.stderr


@pytest.mark.parametrize("token", [" ", "\n", " \t\n", "s3cret\nsecond-line"])
def test_an_api_token_no_client_could_send_is_refused_at_start_naming_the_variable(tmp_path: Path, token: str) -> None:
    state = tmp_path / "state"
    run = subprocess.run(
        [sys.executable, "-m", "agentd", "run", "--state-dir", str(state), "--listen", f"127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        env=agentd_env(tmp_path, AGENTD_API_TOKEN=token),
        cwd=tmp_path,
        timeout=TIMEOUT,
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("agentd: AGENTD_API_TOKEN "), run.stderr
    assert not (state / "agentd.sock").exists()
    # The CLI, which sends the same variable over TCP, refuses it the same way, before any request.
    cli = subprocess.run(
        [sys.executable, "-m", "agentd", "status", "--url", f"http://127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        env=agentd_env(tmp_path, AGENTD_API_TOKEN=token),
        cwd=tmp_path,
        timeout=TIMEOUT,
    )
    assert cli.returncode == 2, cli.stderr
    assert cli.stderr.startswith("agentd: AGENTD_API_TOKEN "), cli.stderr
