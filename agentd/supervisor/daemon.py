"""``agentd run``: the supervisor process in the foreground.

Start-up: config → swap policy → state dir lock (``agentd.pid``, flock) → store (``[store]``:
SQLite in the state dir, or PostgreSQL) → restore sessions → API on ``agentd.sock`` (mode 0600)
and optionally TCP → ``READY=1``. A PostgreSQL store that cannot be opened *yet* (the server
unreachable, starting up: ``StoreUnavailable``) is waited for, tried again with backoff, while
the listeners answer with the waiting app (alive, not ready); one that cannot be opened for good
(``StoreError``) stops the start with exit 1. Signals: SIGHUP reloads (coalesced by the reload
coordinator); SIGTERM/SIGINT drain in-flight turns for ``stop_grace``, then stop children with
the kill ladder and exit 0 on a clean drain; a second one forces it. Before the store is open
SIGTERM/SIGINT stop the start at once (exit 0: nothing runs yet) and a SIGHUP waits for the
daemon to serve.
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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import IO

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel
from starlette.types import ASGIApp

from agentd import early_signals, events
from agentd.api import BearerAuth, SwitchableApp, build_app, build_waiting_app
from agentd.apitoken import TOKEN_ENV, TokenError, api_token
from agentd.config import (
    READ_TIMEOUT,
    Config,
    ConfigError,
    PolicyChoice,
    ServerSettings,
    StoreSettings,
    resolve_swap_policy,
)
from agentd.console import build_console
from agentd.environment import register_secrets
from agentd.obs import configure_logging, get_logger
from agentd.otel import tracing_unavailable
from agentd.statedir import resolve_state_dir
from agentd.store import Store, StoreError, StoreUnavailable, open_store, store_location
from agentd.supervisor.core import Supervisor
from agentd.supervisor.host import raise_fd_limit, use_pidfd_child_watcher
from agentd.supervisor.listener import TCP_BACKLOG, ApiServer, connection_cap
from agentd.supervisor.options import DaemonOptions
from agentd.supervisor.replica import ENV_REPLICA_ID, replica_id
from agentd.supervisor.running import load_daemon_config
from agentd.supervisor.systemd import notify
from agentd.validate import abort_tool_checks

__all__ = ["EXIT_CONFIG", "EXIT_RUNTIME", "STORE_RETRY_FIRST", "STORE_RETRY_MAX", "run_daemon", "store_retry_delay"]

EXIT_RUNTIME = 1
EXIT_CONFIG = 2
PID_FILE = "agentd.pid"
SOCKET_FILE = "agentd.sock"
WATCH_INTERVAL = 1.0
SERVER_EXIT_GRACE = 3.0
#: Start-up while the store cannot be opened yet: the first retry after this many seconds, each
#: next one after twice as long as the one before, up to ``STORE_RETRY_MAX``.
STORE_RETRY_FIRST = 0.5
STORE_RETRY_MAX = 10.0
#: A PostgreSQL store still opening after this many seconds has the listeners serve the waiting app.
STORE_SLOW_OPEN = 1.0

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
    sock.listen(TCP_BACKLOG)  # clients over [server] max_connections wait here, unaccepted
    sock.setblocking(False)
    return sock


def store_retry_delay(attempt: int) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (1, 2, …) to open the store.

    0.5 s doubling to 10 s: a blip costs under a second, and replicas waiting out a database
    restart try a few times a minute each, not in a storm.
    """
    doublings = min(max(attempt, 1) - 1, 32)  # bounded: 2.0 ** a large attempt count would overflow
    return min(STORE_RETRY_MAX, STORE_RETRY_FIRST * 2.0**doublings)


async def _serve_until_done(server: ApiServer, sock: socket.socket, done: anyio.Event) -> None:
    try:
        await server.serve(sockets=[sock])
    finally:
        done.set()


def _fail(message: str, code: int) -> int:
    print(f"agentd: {message}", file=sys.stderr, flush=True)
    return code


class _Listeners:
    """The API's listeners — ``agentd.sock`` and, with ``--listen``, TCP behind the bearer token —
    one uvicorn server each, all serving one ``SwitchableApp``.

    Bound once: when the daemon starts to wait for its store (serving the waiting app), else just
    before the supervisor starts. ``serve`` then starts the servers, or points them at a new app.
    """

    def __init__(self, state_dir: Path, listen: str | None, token: str, settings: ServerSettings | None = None) -> None:
        self.socket_path = state_dir / SOCKET_FILE
        self.listen = listen
        self.token = token
        self.settings = settings or ServerSettings()
        self.front = SwitchableApp(build_waiting_app(lambda: "starting"))
        self.bound = False
        self._servers: list[tuple[ApiServer, socket.socket]] = []
        self._served: list[anyio.Event] = []

    def bind(self) -> None:
        """Bind every listener (OSError if one cannot be); nothing is served until ``serve``. Idempotent.

        TCP gets the bounds of ``[server]``: ``max_connections`` (at most half the open-files
        limit) and ``header_timeout``. The unix socket, whose mode admits only the daemon's own
        user, gets neither: it must answer when TCP is full.
        """
        if self.bound:
            return
        self.bound = True  # from here on close() removes the socket file
        unix = ApiServer(self.front, name="unix", trusted_proxies=self.settings.trusted_proxies)
        self._servers.append((unix, bind_unix_socket(self.socket_path)))
        if self.listen:
            configured = self.settings.max_connections
            cap = connection_cap(configured)
            if cap < configured:
                fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
                log.warning(events.LOG_API_CONNECTION_CAP, configured=configured, effective=cap, fd_limit=fd_limit)
            server = ApiServer(
                BearerAuth(self.front, self.token),
                name=self.listen,
                max_connections=cap,
                header_timeout=self.settings.header_timeout,
                trusted_proxies=self.settings.trusted_proxies,
            )
            self._servers.append((server, bind_tcp_socket(self.listen)))

    def serve(self, app: ASGIApp, tg: anyio.abc.TaskGroup) -> None:
        """Serve ``app`` on every listener from now on: the servers start the first time."""
        self.front.app = app
        if self._served or not self.bound:
            return
        for server, sock in self._servers:
            done = anyio.Event()
            self._served.append(done)
            tg.start_soon(_serve_until_done, server, sock, done)

    async def stop(self) -> None:
        """Stop the servers, letting them answer the requests they hold (a waiting client whose turn
        was cut gets its 503 naming the turn) for at most ``SERVER_EXIT_GRACE``."""
        for server, _ in self._servers:
            server.should_exit = True
        with anyio.move_on_after(SERVER_EXIT_GRACE):
            for done in self._served:
                await done.wait()

    def close(self) -> None:
        """Close the sockets and remove ``agentd.sock``."""
        if self.bound:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        for _, sock in self._servers:
            sock.close()


class EarlySignals:
    """Signals that arrive while starting up, before the event loop listens: remembered, not fatal.

    A SIGHUP's default action would kill the daemon; instead it is replayed as a reload once the
    daemon serves, and a SIGTERM/SIGINT as a shutdown.
    """

    SIGNALS = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: list[int] = []
        for signum in self.SIGNALS:
            signal.signal(signum, self._remember)
        # What arrived before this, from the launch on (the entry point's handler), comes first.
        self.received[:0] = early_signals.take()

    def _remember(self, signum: int, _frame: object) -> None:
        self.received.append(signum)


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
    register_secrets(os.environ, config)  # before anything is logged about the config
    state_dir = resolve_state_dir(options.state_dir, os.environ, lambda: config.server.state_dir)
    listen = options.listen or config.server.listen
    token = ""
    if listen:
        try:  # trimmed (a Secret made from a file ends in a newline); one no client could send is refused
            token = api_token(os.environ) or ""
        except TokenError as exc:
            return _fail(str(exc), EXIT_CONFIG)
        if not token:
            return _fail(f"--listen needs a bearer token: set {TOKEN_ENV}", EXIT_CONFIG)
    try:
        replica_id()  # the supervisor's own call cannot fail after this
    except ValueError as exc:
        return _fail(str(exc), EXIT_CONFIG)
    if (missing := tracing_unavailable(os.environ)) is not None:  # else every child would refuse its spawn
        return _fail(missing, EXIT_CONFIG)
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
    api = _Listeners(state_dir, listen, token, config.server)
    opened: list[Store] = []  # the store once open: closed whatever happens next
    exit_code, ran = EXIT_RUNTIME, False
    try:
        # Signals are received from here on, also while the store opens: a SIGTERM then must stop the start.
        with anyio.open_signal_receiver(signal.SIGHUP, signal.SIGTERM, signal.SIGINT) as signals:
            async with anyio.create_task_group() as tg:
                exit_code, ran = await _run(options, config, policy, state_dir, listen, early, signals, api, opened, tg)
                await api.stop()
                tg.cancel_scope.cancel()
    finally:
        for store in opened:
            with anyio.CancelScope(shield=True):
                await store.close()
        api.close()
    if ran:
        log.info(events.LOG_SUPERVISOR_STOPPED, exit_code=exit_code)
    return exit_code


async def _run(
    options: DaemonOptions,
    config: Config,
    policy: PolicyChoice,
    state_dir: Path,
    listen: str | None,
    early: EarlySignals,
    signals: AsyncIterator[int],
    api: _Listeners,
    opened: list[Store],
    tg: anyio.abc.TaskGroup,
) -> tuple[int, bool]:
    """Open the store (waiting for it while it cannot be opened yet), start the supervisor and serve
    until SIGTERM/SIGINT. The exit code, and whether the daemon ran (False: it failed to start)."""
    watch = options.config_path if options.watch_config else None
    mtime = _Mtime(watch) if watch is not None else None
    # The file's mtime as it was read: an edit made while the store is waited for is reloaded once serving.
    config_seen = (mtime, await mtime()) if mtime is not None else None
    deferred: list[int] = []  # SIGHUPs before the daemon serves: replayed as reloads then
    counts: list[dict[str, int]] = []  # the start's first read, made while the store is waited for

    async def first_read(store: Store) -> None:
        counts.append(await store.open_sessions_by_assistant())

    try:
        store = await _open_store(config.store, state_dir, early.received, signals, api, tg, deferred, first_read)
    except StoreError as exc:  # "cannot open the store <where>: <reason>": the operator's to fix, no traceback
        return _fail(str(exc), EXIT_RUNTIME), False
    except OSError as exc:  # a listener for the wait cannot be bound
        return _fail(f"cannot start: {exc}", EXIT_RUNTIME), False
    if store is None:  # SIGTERM/SIGINT before the store opened: nothing runs, nothing to drain
        return 0, True
    opened.append(store)
    supervisor = Supervisor(options, config, policy, store)
    # The file may have been edited while the daemon was stopped: the reload rule holds at start too.
    try:
        orphaned = await supervisor.orphaned_sessions(config, by_assistant=counts[-1] if counts else None)
    except StoreError as exc:
        return _fail(str(exc), EXIT_RUNTIME), False
    if orphaned:
        lines = "\n".join(f"  {issue}" for issue in orphaned)
        return _fail(f"invalid config ({options.config_path or 'config'}):\n{lines}", EXIT_CONFIG), False
    try:
        twin = await supervisor.find_live_twin()
    except StoreError as exc:
        return _fail(str(exc), EXIT_RUNTIME), False
    if twin is not None:
        message = (
            f"{ENV_REPLICA_ID}={supervisor.replica_name} is in use by a live replica ({twin}):"
            " give every replica an id of its own"
        )
        return _fail(message, EXIT_CONFIG), False
    try:
        api.bind()
    except OSError as exc:
        return _fail(f"cannot start: {exc}", EXIT_RUNTIME), False
    await supervisor.start(tg)
    # The console is the TCP listener's (it authorizes with a cookie keyed by the token, RFC 0000 §12).
    api.serve(build_app(supervisor, console=build_console(supervisor, api.token) if listen else None), tg)
    if watch is not None:
        tg.start_soon(_watch_config, supervisor, watch, config_seen)
    log.info(
        events.LOG_SUPERVISOR_STARTED,
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
    return await _handle_signals(signals, supervisor, tg, deferred), True


async def _open_store(
    settings: StoreSettings,
    state_dir: Path,
    early: list[int],
    signals: AsyncIterator[int],
    api: _Listeners,
    tg: anyio.abc.TaskGroup,
    deferred: list[int],
    first_read: Callable[[Store], Awaitable[None]] | None = None,
) -> Store | None:
    """The store, opened — after waiting for it as long as it cannot be opened yet (RFC 0009 §1).

    None when SIGTERM or SIGINT came first: they stop the start at once, even mid-connect. Signals
    count from the launch on (``early``, recorded before the loop listened, first); SIGHUPs go to
    ``deferred``, to reload once the daemon serves. StoreError when the store cannot be opened for
    good; OSError when a listener for the wait cannot be bound.
    """
    for signum in early:
        if not _before_serving(signum, deferred):
            return None
    outcome: list[Store | StoreError | OSError] = []
    stopped = False
    async with anyio.create_task_group() as opening:

        async def open_then_stop_listening() -> None:
            try:
                outcome.append(await _open_patiently(settings, state_dir, api, tg, first_read))
            except (StoreError, OSError) as exc:
                outcome.append(exc)
            opening.cancel_scope.cancel()

        opening.start_soon(open_then_stop_listening)
        async for signum in signals:
            if not _before_serving(signum, deferred):
                stopped = True
                opening.cancel_scope.cancel()
                break
    if stopped:
        for result in outcome:  # it opened just as the signal came
            if isinstance(result, Store):
                with anyio.CancelScope(shield=True):
                    await result.close()
        return None
    [result] = outcome
    if isinstance(result, StoreError | OSError):
        raise result
    return result


def _before_serving(signum: int, deferred: list[int]) -> bool:
    """A signal before the store is open: a SIGHUP is kept for the reload once the daemon serves
    (True: go on starting); SIGTERM or SIGINT stops the start (False)."""
    name = signal.Signals(signum).name
    if signum == signal.SIGHUP:
        deferred.append(signum)
        log.info(events.LOG_SIGNAL, signal=name, action="deferred")
        return True
    log.info(events.LOG_SIGNAL, signal=name, action="stop")
    notify("STOPPING=1")
    return False


async def _open_patiently(
    settings: StoreSettings,
    state_dir: Path,
    api: _Listeners,
    tg: anyio.abc.TaskGroup,
    first_read: Callable[[Store], Awaitable[None]] | None = None,
) -> Store:
    """``open_store``, tried again while it raises StoreUnavailable, after ``store_retry_delay``.

    ``first_read``, the start's first store call, is part of each PostgreSQL attempt: a database
    lost just after it opened is waited for too, not an exit.

    Each failed attempt is one ``store.waiting`` line and a systemd ``STATUS=``; from the first,
    the listeners serve the waiting app (``/v1/health`` 200, ``/v1/ready`` 503 with the reason).
    ``store.opened`` when it opens after waiting. StoreError (not StoreUnavailable) at once when it
    cannot be opened for good; OSError when a listener cannot be bound.
    """
    location = store_location(settings, state_dir)
    waiting_for = ["starting"]  # what the waiting app answers with: the newest failure
    began = time.monotonic()
    attempt = 0

    def serve_the_wait() -> None:
        if not api.bound:
            api.bind()
            api.serve(build_waiting_app(lambda: waiting_for[0]), tg)

    while True:
        attempt += 1
        try:
            store = await _attempt_open(settings, state_dir, location, serve_the_wait, waiting_for, first_read)
        except StoreUnavailable as exc:
            delay = store_retry_delay(attempt)
            waiting_for[0] = f"waiting for the store: {exc}"
            log.warning(events.LOG_STORE_WAITING, store=location, error=str(exc), attempt=attempt, retry_in=delay)
            notify(f"STATUS={waiting_for[0]}")
            serve_the_wait()
            await anyio.sleep(delay)
            continue
        if attempt > 1:
            waiting_for[0] = "starting: the store is open"
            waited = round(time.monotonic() - began, 3)
            log.info(events.LOG_STORE_OPENED, store=location, attempts=attempt, waited=waited)
        return store


async def _attempt_open(
    settings: StoreSettings,
    state_dir: Path,
    location: str,
    serve_the_wait: Callable[[], None],
    waiting_for: list[str],
    first_read: Callable[[Store], Awaitable[None]] | None = None,
) -> Store:
    """One ``open_store``. A PostgreSQL one still under way after ``STORE_SLOW_OPEN`` seconds — the
    server answers slowly or not at all, a migration runs or waits for another replica's — has the
    listeners serve the waiting app from then on: the probes must not wait for it (up to
    ``CONNECT_TIMEOUT`` for a silent server, the migrations' bound for a migration). OSError when a
    listener cannot be bound (the attempt is then given up)."""
    if not settings.url:  # SQLite: opened at once or refused for good; nothing is bound early
        return await open_store(settings, state_dir, os.environ)
    unbindable: list[OSError] = []
    opened: list[Store] = []
    failed: list[StoreError] = []  # raised after the task group: not wrapped in an exception group
    try:
        async with anyio.create_task_group() as attempt:

            async def serve_if_slow() -> None:
                await anyio.sleep(STORE_SLOW_OPEN)
                if waiting_for[0] == "starting":
                    waiting_for[0] = f"waiting for the store: opening {location}"
                notify(f"STATUS={waiting_for[0]}")
                try:
                    serve_the_wait()
                except OSError as exc:
                    unbindable.append(exc)
                    attempt.cancel_scope.cancel()

            attempt.start_soon(serve_if_slow)
            try:
                opened.append(await open_store(settings, state_dir, os.environ))
                if first_read is not None:
                    await first_read(opened[-1])
            except StoreError as exc:
                if opened:  # opened, then lost (or refused) at once: closed, and the attempt failed
                    with anyio.CancelScope(shield=True):
                        await opened.pop().close()
                    kind = StoreUnavailable if isinstance(exc, StoreUnavailable) else StoreError
                    exc = kind(f"cannot open the store {location}: {exc}")
                failed.append(exc)
            attempt.cancel_scope.cancel()
    except BaseException:  # cancelled (SIGTERM) just as it opened: no pool left behind
        for store in opened:
            with anyio.CancelScope(shield=True):
                await store.close()
        raise
    if unbindable:
        for store in opened:  # it opened just as the bind failed
            with anyio.CancelScope(shield=True):
                await store.close()
        raise unbindable[0]
    if failed:
        raise failed[0]
    return opened[0]


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
        log.info(events.LOG_SIGNAL, signal="SIGHUP", action="reload")
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
                log.info(events.LOG_SIGNAL, signal=signal.Signals(signum).name, action="drain")
                tg.start_soon(shutdown)
            else:
                log.warning(events.LOG_SIGNAL, signal=signal.Signals(signum).name, action="force")
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


async def _watch_config(supervisor: Supervisor, path: Path, first: tuple[_Mtime, float | None] | None = None) -> None:
    """``--watch-config``: reload when the file's mtime changes and then holds still (debounced).

    ``first``: the reader of the file's mtime and what it read when the config was loaded, so that
    an edit made while the daemon waited for its store is reloaded at once; else read now.
    """
    mtime, last = first if first is not None else (_Mtime(path), None)
    if first is None:
        last = await mtime()
    while True:
        current = await mtime()
        if current == last:
            await anyio.sleep(WATCH_INTERVAL)
            continue
        await anyio.sleep(WATCH_INTERVAL / 2)
        if await mtime() != current:
            continue
        last = current
        log.info(events.LOG_CONFIG_WATCH, path=str(path))
        await supervisor.reload()
        await anyio.sleep(WATCH_INTERVAL)


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
