"""Run the real ``agentd run`` as a subprocess and drive it through its API, CLI and signals.

Waiting is always for an event (a socket appearing, an SSE event, a log line, a process exit)
with a generous timeout — never a sleep that decides the outcome.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 60.0


def two_assistant_config(hold: Path, *, top: str = "", supervisor: str = "") -> str:
    """The scripted squad the lifecycle and API tests share: ``main`` (free-running, clock tool, an
    opener) and ``held`` (every model call waits until ``hold`` exists)."""
    return f"""{top}
[intelligence]
provider = "scripted"
model = "echo-small"

[supervisor]
{supervisor}

[[assistants]]
name = "main"
system = "You help."
first_message = "Hello from main."
tools = ["clock"]

[[assistants]]
name = "held"
first_message_mode = "assistant-waits-for-user"
tools = ["clock"]
intelligence = {{ options = {{ hold_file = "{hold}" }} }}
"""


def wait_until(predicate: Callable[[], Any], what: str, timeout: float = TIMEOUT, interval: float = 0.02) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def agentd_env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env["AGENTD_TEST_TOOL_LOG"] = str(tmp / "tools.log")
    env["AGENTD_TEST_GATE"] = str(tmp / "tool.gate")
    env.update(extra)
    return env


#: Children see only an allowlist of the daemon's environment; test tools read AGENTD_TEST_* vars.
TEST_PASS_ENV = 'pass_env = ["AGENTD_TEST_*"]'


def passing_test_env(text: str) -> str:
    """``text`` with ``[supervisor] pass_env`` letting AGENTD_TEST_* through, unless it sets pass_env."""
    if re.search(r"^\s*pass_env\s*=", text, re.M):
        return text
    header = re.search(r"^\[supervisor\][^\n]*$", text, re.M)
    if header is None:
        return f"{text}\n[supervisor]\n{TEST_PASS_ENV}\n"
    return f"{text[: header.end()]}\n{TEST_PASS_ENV}{text[header.end() :]}"


class EventStream:
    """An SSE subscription read on a thread; events land in a queue."""

    def __init__(self, client: httpx.Client, session: str) -> None:
        self.events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self.seen: list[tuple[str, dict[str, Any]]] = []
        self._connected = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(client, session), daemon=True)
        self._thread.start()
        if not self._connected.wait(TIMEOUT):
            raise AssertionError(f"could not subscribe to events of {session}")

    def _read(self, client: httpx.Client, session: str) -> None:
        name, data = None, []
        try:
            with client.stream("GET", f"/v1/sessions/{session}/events", timeout=None) as response:
                self._connected.set()
                for line in response.iter_lines():
                    if line.startswith("event:"):
                        name = line[6:].strip()
                    elif line.startswith("data:"):
                        data.append(line[5:].strip())
                    elif not line and name:
                        self.events.put((name, json.loads("\n".join(data))))
                        name, data = None, []
        except httpx.HTTPError:
            pass
        finally:
            self._connected.set()

    def wait(
        self, name: str, where: Callable[[dict[str, Any]], bool] = lambda _: True, timeout: float = TIMEOUT
    ) -> dict[str, Any]:
        """The next event called ``name`` matching ``where`` (earlier unmatched events are kept in ``seen``)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {name} event within {timeout:g}s; seen: {[n for n, _ in self.seen]}")
            try:
                event_name, data = self.events.get(timeout=remaining)
            except queue.Empty:
                continue
            self.seen.append((event_name, data))
            if event_name == name and where(data):
                return data


class Daemon:
    """One ``agentd run`` process on a temp state dir."""

    def __init__(
        self,
        tmp: Path,
        config_text: str | None = None,
        *,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        state_dir: Path | None = None,
        command: str | None = "run",
    ) -> None:
        self.tmp = tmp
        self.subcommand = [command] if command else []  # None: `agentd [flags of run]`
        self.state_dir = state_dir or tmp / "state"
        self.config_path = tmp / "agentd.toml"
        if config_text is not None:
            self.write_config(config_text)
        self.args = args or []
        self.env = agentd_env(tmp, **(env or {}))
        self.log_path = tmp / f"agentd-{int(time.monotonic() * 1000)}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.client: httpx.Client | None = None

    def write_config(self, text: str) -> None:
        """Write the config file (for the start or a reload), letting the test tools' env through."""
        self.config_path.write_text(passing_test_env(text))

    @property
    def socket(self) -> Path:
        return self.state_dir / "agentd.sock"

    def command(self) -> list[str]:
        config = ["--config", str(self.config_path)] if self.config_path.exists() else []
        return [
            sys.executable,
            "-m",
            "agentd",
            *self.subcommand,
            *config,
            "--state-dir",
            str(self.state_dir),
            "--log-format",
            "json",
            *self.args,
        ]

    def start(self) -> Daemon:
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=self.env, cwd=self.tmp
        )
        return self.start_client()

    def start_client(self) -> Daemon:
        """Connect to the started process's socket and wait until it answers."""
        self.client = httpx.Client(
            transport=httpx.HTTPTransport(uds=str(self.socket)), base_url="http://agentd", timeout=TIMEOUT
        )
        wait_until(self._healthy, f"agentd to answer on {self.socket} (log: {self.log_path})")
        return self

    def _healthy(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"agentd exited with {self.process.returncode}: {self.log_text()[-3000:]}")
        if not self.socket.exists():
            return False
        try:
            return self.api("GET", "/v1/health").status_code == 200
        except httpx.TransportError:
            return False

    def api(self, method: str, path: str, body: Any = None) -> httpx.Response:
        assert self.client is not None
        return self.client.request(method, path, json=body)

    def json(self, method: str, path: str, body: Any = None, status: int | None = None) -> Any:
        response = self.api(method, path, body)
        if status is not None:
            assert response.status_code == status, f"{method} {path} → {response.status_code}: {response.text}"
        return response.json()

    def new_session(self, assistant: str | None = None) -> str:
        return self.json("POST", "/v1/sessions", {"assistant": assistant} if assistant else {}, status=201)["id"]

    def send(self, session: str, text: str, wait: bool = True) -> Any:
        return self.json(
            "POST", f"/v1/sessions/{session}/messages", {"content": text, "wait": wait}, status=200 if wait else 202
        )

    def events(self, session: str) -> EventStream:
        assert self.client is not None
        return EventStream(self.client, session)

    def session(self, session: str) -> Any:
        return self.json("GET", f"/v1/sessions/{session}", status=200)

    def turn(self, session: str, turn_id: str, *, finished: bool = True) -> Any:
        """The turn record; with ``finished``, wait until it is no longer pending."""

        def get() -> Any:
            turns = [t for t in self.session(session)["turns"] if t["id"] == turn_id]
            if turns and (not finished or turns[0]["status"] != "pending"):
                return turns[0]
            return None

        return wait_until(get, f"turn {turn_id} to end")

    def entries(self, session: str, turn_id: str) -> list[Any]:
        return [e for e in self.session(session)["transcript"] if e.get("turn") == turn_id]

    def status(self) -> Any:
        return self.json("GET", "/v1/status", status=200)

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def reload_via_signal(self) -> None:
        self.signal(signal.SIGHUP)

    def wait_exit(self, timeout: float = TIMEOUT) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    def stop(self) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.client is not None:
            self.client.close()
        if getattr(self, "_log", None) is not None:
            self._log.close()
        return self.process.returncode

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_events(self, name: str | None = None) -> list[dict[str, Any]]:
        found = []
        for line in self.log_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and (name is None or record.get("event") == name):
                found.append(record)
        return found

    def wait_log(
        self, name: str, where: Callable[[dict[str, Any]], bool] = lambda _: True, count: int = 1
    ) -> list[dict[str, Any]]:
        return wait_until(
            lambda: (m := [r for r in self.log_events(name) if where(r)]) and len(m) >= count and m,
            f"{count} log event(s) {name}",
        )

    def run_cli(
        self, *args: str, input: str | None = None, timeout: float = TIMEOUT
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "agentd", *args],
            capture_output=True,
            text=True,
            input=input,
            env={**self.env, "AGENTD_STATE_DIR": str(self.state_dir)},
            timeout=timeout,
            cwd=self.tmp,
        )


@contextmanager
def running_daemon(tmp: Path, config_text: str | None = None, **kwargs: Any) -> Iterator[Daemon]:
    daemon = Daemon(tmp, config_text, **kwargs)
    try:
        yield daemon.start()
    finally:
        daemon.stop()


def child_pids_of(pid: int) -> list[int]:
    """Live (non-zombie) direct children of ``pid``, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(stat[1]) == pid and stat[0] != "Z":
            found.append(int(entry.name))
    return found


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def zombie_children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` in the Z (zombie) state: exited but never reaped."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(stat[1]) == pid and stat[0] == "Z":
            found.append(int(entry.name))
    return found


def reaped(pid: int) -> bool:
    """True once ``pid`` has no /proc entry at all: it exited and its parent reaped it."""
    return not Path(f"/proc/{pid}").exists()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
