"""``agentd run``: the supervisor process in the foreground.

Start-up: config → swap policy → state dir lock (``agentd.pid``, flock) → store (``[store]``:
SQLite in the state dir, or PostgreSQL) → restore sessions → API on ``agentd.sock`` (mode 0600)
and optionally TCP → ``READY=1``. Signals: SIGHUP reloads
(coalesced by the reload coordinator); SIGTERM/SIGINT drain in-flight turns for ``stop_grace``,
then stop children with the kill ladder and exit 0 on a clean drain; a second one forces it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import resource
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import IO

import anyio
import anyio.from_thread
import anyio.lowlevel
import uvicorn

from agentd import events
from agentd.api import BearerAuth, build_app
from agentd.config import READ_TIMEOUT, Config, ConfigError, PolicyChoice, resolve_swap_policy
from agentd.obs import configure_logging, get_logger
from agentd.store import StoreError, open_store
from agentd.supervisor.core import Supervisor, load_daemon_config
from agentd.supervisor.options import DaemonOptions
from agentd.supervisor.replica import replica_id
from agentd.supervisor.systemd import notify
from agentd.validate import abort_tool_checks

__all__ = ["EXIT_CONFIG", "EXIT_RUNTIME", "run_daemon"]

EXIT_RUNTIME = 1
EXIT_CONFIG = 2
PID_FILE = "agentd.pid"
SOCKET_FILE = "agentd.sock"
WATCH_INTERVAL = 1.0
SERVER_EXIT_GRACE = 3.0

log = get_logger("supervisor")


class StateDirBusy(Exception):
    """Another live daemon owns the state dir."""


@contextlib.contextmanager
def state_dir_lock(state_dir: Path) -> Iterator[IO[str]]:
    """Hold ``agentd.pid`` locked (flock) for the daemon's life; remove it on exit."""
    path = state_dir / PID_FILE
    handle = open(path, "a+", encoding="ascii")  # noqa: SIM115 - held open for the lock's lifetime
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        handle.seek(0)
        owner = handle.read().strip() or "unknown"
        handle.close()
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise StateDirBusy(f"another agentd (pid {owner}) is running on state dir {state_dir}") from None
        raise
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield handle
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        handle.close()


def bind_unix_socket(path: Path) -> socket.socket:
    """A listening unix socket only its owner can use (mode 0600 from the first instant)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # stale: we hold the state dir lock, so no live daemon is using it
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(128)
    sock.setblocking(False)
    return sock


def bind_tcp_socket(listen: str) -> socket.socket:
    host, _, port = listen.rpartition(":")
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]") or "0.0.0.0", int(port)))
    sock.listen(128)
    sock.setblocking(False)
    return sock


class _ApiServer(uvicorn.Server):
    """uvicorn without its own signal handling: the daemon owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn releases
        return None


def _server(app: object) -> _ApiServer:
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=2)  # type: ignore[arg-type]
    return _ApiServer(config)


async def _serve_until_done(server: _ApiServer, sock: socket.socket, done: anyio.Event) -> None:
    try:
        await server.serve(sockets=[sock])
    finally:
        done.set()


def _fail(message: str, code: int) -> int:
    print(f"agentd: {message}", file=sys.stderr, flush=True)
    return code


class EarlySignals:
    """Signals that arrive while starting up, before the event loop listens: remembered, not fatal.

    A SIGHUP's default action would kill the daemon; instead it is replayed as a reload once the
    daemon serves, and a SIGTERM/SIGINT as a shutdown.
    """

    SIGNALS = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        from agentd import entry

        self.received: list[int] = []
        for signum in self.SIGNALS:
            signal.signal(signum, self._remember)
        # What arrived before this, from the launch on (the entry point's handler), comes first.
        self.received[:0] = entry.take()

    def _remember(self, signum: int, _frame: object) -> None:
        self.received.append(signum)


def raise_fd_limit() -> None:
    """Raise the soft limit on open files to the hard one: each child costs the supervisor two fds,
    each API connection one, and systemd's default soft limit (1024) is far below what a pool and
    thousands of clients need."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ValueError, OSError) as exc:
        log.warning("supervisor.fd_limit", soft=soft, hard=hard, error=str(exc))


def use_pidfd_child_watcher() -> None:
    """Watch children through pidfds, not a thread per child.

    Python 3.11's default asyncio child watcher starts a thread for every child process; from 3.12
    on, asyncio picks a pidfd watcher by itself where the kernel has pidfds (and the watcher API
    is deprecated), so this only acts on 3.11.
    """
    if sys.version_info >= (3, 12) or not hasattr(os, "pidfd_open"):
        return
    import asyncio

    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:  # an old kernel: keep the default
        return
    watcher = asyncio.PidfdChildWatcher()
    watcher.attach_loop(asyncio.get_running_loop())
    asyncio.get_event_loop_policy().set_child_watcher(watcher)


def run_daemon(options: DaemonOptions) -> int:
    """Run the supervisor until SIGTERM/SIGINT; return the exit code (0 clean, 1 runtime, 2 config)."""
    early = EarlySignals()
    configure_logging(options.log_format, options.log_level)
    try:
        config = load_daemon_config(options.config_path)
        policy = resolve_swap_policy(options.model_swap_flag, os.environ, config.model_swap)
    except ConfigError as exc:
        where = exc.source or "config"
        lines = "\n".join(f"  {issue}" for issue in exc.issues)
        return _fail(f"invalid config ({where}):\n{lines}", EXIT_CONFIG)
    state_dir = options.state_dir or Path(os.environ.get("AGENTD_STATE_DIR") or config.server.state_dir or ".agentd")
    listen = options.listen or config.server.listen
    token = os.environ.get("AGENTD_API_TOKEN", "")
    if listen and not token:
        return _fail("--listen needs a bearer token: set AGENTD_API_TOKEN", EXIT_CONFIG)
    try:
        replica_id()  # the supervisor's own call cannot fail after this
    except ValueError as exc:
        return _fail(str(exc), EXIT_CONFIG)
    raise_fd_limit()
    try:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with state_dir_lock(state_dir):
            return anyio.run(_serve, options, config, policy, state_dir, listen, token, early)
    except StateDirBusy as exc:
        return _fail(str(exc), EXIT_RUNTIME)
    except OSError as exc:
        return _fail(f"cannot start: {exc}", EXIT_RUNTIME)


async def _serve(
    options: DaemonOptions,
    config: Config,
    policy: PolicyChoice,
    state_dir: Path,
    listen: str | None,
    token: str,
    early: EarlySignals,
) -> int:
    use_pidfd_child_watcher()
    try:
        store = await open_store(config.store, state_dir, os.environ)
    except StoreError as exc:  # "cannot open the store <where>: <reason>": the operator's to fix, no traceback
        return _fail(str(exc), EXIT_RUNTIME)
    supervisor = Supervisor(options, config, policy, store)
    # The file may have been edited while the daemon was stopped: the reload rule holds at start too.
    try:
        orphaned = await supervisor.orphaned_sessions(config)
    except StoreError as exc:
        await store.close()
        return _fail(str(exc), EXIT_RUNTIME)
    if orphaned:
        await store.close()
        lines = "\n".join(f"  {issue}" for issue in orphaned)
        return _fail(f"invalid config ({options.config_path or 'config'}):\n{lines}", EXIT_CONFIG)
    socket_path = state_dir / SOCKET_FILE
    unix_sock = bind_unix_socket(socket_path)
    servers: list[tuple[_ApiServer, socket.socket]] = [(_server(build_app(supervisor)), unix_sock)]
    if listen:
        servers.append((_server(BearerAuth(build_app(supervisor), token)), bind_tcp_socket(listen)))
    exit_code = 0
    try:
        with anyio.open_signal_receiver(signal.SIGHUP, signal.SIGTERM, signal.SIGINT) as signals:
            async with anyio.create_task_group() as tg:
                await supervisor.start(tg)
                served = [anyio.Event() for _ in servers]
                for (server, sock), done in zip(servers, served, strict=True):
                    tg.start_soon(_serve_until_done, server, sock, done)
                if options.watch_config and options.config_path is not None:
                    tg.start_soon(_watch_config, supervisor, options.config_path)
                log.info(
                    "supervisor.started",
                    pid=os.getpid(),
                    state_dir=str(state_dir),
                    store=store.location,
                    generation=supervisor.generation,
                    model_swap=policy.policy.value,
                    model_swap_source=policy.source,
                    listen=listen,
                    config=str(options.config_path) if options.config_path else "<built-in quickstart>",
                )
                notify("READY=1", f"STATUS=generation {supervisor.generation}", f"MAINPID={os.getpid()}")
                exit_code = await _handle_signals(signals, supervisor, tg, early.received)
                for server, _ in servers:
                    server.should_exit = True
                # Let the servers answer the requests they hold (a waiting client whose turn was cut
                # gets its 503 naming the turn) before everything is cancelled.
                with anyio.move_on_after(SERVER_EXIT_GRACE):
                    for done in served:
                        await done.wait()
                tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await store.close()
        with contextlib.suppress(FileNotFoundError):
            socket_path.unlink()
        for _, sock in servers:
            sock.close()
    log.info("supervisor.stopped", exit_code=exit_code)
    return exit_code


async def _handle_signals(
    signals: AsyncIterator[int], supervisor: Supervisor, tg: anyio.abc.TaskGroup, early: list[int]
) -> int:
    """Serve signals (those received during start-up first) until shutdown completes; return the exit code."""
    shutdown_done = anyio.Event()
    result = {"code": 0}

    async def shutdown() -> None:
        notify("STOPPING=1")
        abort_tool_checks()  # a reload's tool check must not hold the exit (the reload is rejected)
        clean = await supervisor.drain(supervisor.config.supervisor.stop_grace)
        await supervisor.stop()
        result["code"] = 0 if clean else EXIT_RUNTIME
        shutdown_done.set()

    async def reload() -> None:
        notify("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")
        log.info("supervisor.signal", signal="SIGHUP", action="reload")
        outcome = await supervisor.reload()
        notify("READY=1", f"STATUS=generation {outcome.generation}")

    async def replayed_then_live() -> AsyncIterator[int]:
        for signum in early:
            yield signum
        async for signum in signals:
            yield signum

    async def receive() -> None:
        shutting_down = False
        async for signum in replayed_then_live():
            if signum == signal.SIGHUP:
                if not shutting_down:
                    tg.start_soon(reload)
            elif not shutting_down:
                shutting_down = True
                log.info("supervisor.signal", signal=signal.Signals(signum).name, action="drain")
                tg.start_soon(shutdown)
            else:
                log.warning("supervisor.signal", signal=signal.Signals(signum).name, action="force")
                abort_tool_checks()
                supervisor.draining = True
                await supervisor.stop()
                result["code"] = EXIT_RUNTIME
                shutdown_done.set()
                return

    async with anyio.create_task_group() as inner:
        inner.start_soon(receive)
        await shutdown_done.wait()
        inner.cancel_scope.cancel()
    return result["code"]


async def _watch_config(supervisor: Supervisor, path: Path) -> None:
    """``--watch-config``: reload when the file's mtime changes and then holds still (debounced)."""
    mtime = _Mtime(path)
    last = await mtime()
    while True:
        await anyio.sleep(WATCH_INTERVAL)
        current = await mtime()
        if current == last:
            continue
        await anyio.sleep(WATCH_INTERVAL / 2)
        if await mtime() != current:
            continue
        last = current
        log.info(events.LOG_CONFIG_WATCH, path=str(path))
        await supervisor.reload()


class _Mtime:
    """A file's mtime, read off the event loop; None when it is missing, unreadable, or gives no
    answer within ``READ_TIMEOUT``.

    ``stat`` runs on a daemon thread: on a hung file system it never returns, and it must block
    neither the event loop (which serves the API and SIGTERM) nor the process's exit. At most one
    ``stat`` is in flight: while one hangs, later reads wait for it rather than start another.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._answered: anyio.Event | None = None
        self._result: list[float | None] = []

    async def __call__(self) -> float | None:
        if self._answered is None:
            self._answered, self._result = anyio.Event(), []
            threading.Thread(
                target=self._stat,
                args=(self._answered, self._result, anyio.lowlevel.current_token()),
                name="agentd-config-watch",
                daemon=True,
            ).start()
        answered, result = self._answered, self._result
        with anyio.move_on_after(READ_TIMEOUT):
            await answered.wait()
        if not answered.is_set():
            return None
        self._answered = None
        return result[0]

    def _stat(self, answered: anyio.Event, result: list[float | None], token: anyio.lowlevel.EventLoopToken) -> None:
        try:
            result.append(self.path.stat().st_mtime)
        except OSError:
            result.append(None)
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is waiting any more
            anyio.from_thread.run_sync(answered.set, token=token)
