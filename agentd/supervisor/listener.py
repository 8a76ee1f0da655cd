"""The API's uvicorn servers, fed by agentd's own accept loop so that open connections cannot
exhaust the daemon (RFC 0000 §2 ``[server]``, §6).

uvicorn bounds neither idle nor slow clients: its ``limit_concurrency`` answers 503 once a
request's headers have arrived — a client that sends nothing is never turned away, and keeps its
file descriptor — and its ``timeout_keep_alive`` runs only after a response, not while a request's
headers trickle in. A few thousand silent TCP clients could therefore take every descriptor the
daemon has, after which the unix socket, the store and new children all fail. ``ApiServer`` is
uvicorn with its ``loop.create_server`` replaced by:

- ``AcceptLoop``, one per listening socket, which accepts a connection only while fewer than
  ``max_connections`` are open on it (``Slots``): the rest wait in the kernel's backlog, costing
  the daemon nothing, and are accepted as others close;
- ``GuardedProtocol`` around uvicorn's HTTP protocol (h11 or httptools, which still parse all of
  HTTP): a timer armed when the connection opens and again when its last response is done,
  disarmed when uvicorn has read a request's headers — the moment it calls the ASGI app. A client
  whose headers have not arrived within ``header_timeout`` is closed; so is one that reads none of
  what it is sent for as long (its writes paused: pipelined requests it never reads would
  otherwise block their response, and hold the connection, for ever);
- failed ``accept()`` calls (out of descriptors, of memory) retried after ``ACCEPT_RETRY_DELAY``
  and logged at most once per ``ACCEPT_LOG_INTERVAL`` with the count of those not logged — never
  a line per failure.

``connection_cap`` keeps the bound under half the open-files limit whatever the config says.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import resource
import socket
import time
from collections.abc import Callable, Iterator, Sequence

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from agentd import events
from agentd.obs import get_logger

__all__ = [
    "ACCEPT_LOG_INTERVAL",
    "ACCEPT_RETRY_DELAY",
    "TCP_BACKLOG",
    "AcceptLoop",
    "ApiServer",
    "GuardedProtocol",
    "RateLimitedLog",
    "Slots",
    "connection_cap",
]

log = get_logger("api")

#: Seconds before ``accept()`` is tried again after it failed for want of a resource: the
#: descriptors or memory it needs come back only as connections close, so trying at once spins.
ACCEPT_RETRY_DELAY = 0.5
#: At most one log line per listener and kind of trouble in this many seconds; the next line
#: carries how many were not logged (``suppressed``).
ACCEPT_LOG_INTERVAL = 10.0
#: The TCP listener's backlog: clients over ``max_connections`` wait here until accepted (the
#: kernel caps it at ``net.core.somaxconn``).
TCP_BACKLOG = 1024
#: ``accept()`` failures that mean the process or system is out of something: wait, then retry.
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: ``accept()`` failures that concern only the connection being accepted (accept(2): "treat as
#: EAGAIN"): the next one is accepted at once.
TRANSIENT_ERRNOS = frozenset(
    {
        errno.ECONNABORTED,
        errno.EPROTO,
        errno.ENETDOWN,
        errno.ENOPROTOOPT,
        errno.EHOSTDOWN,
        errno.ENONET,
        errno.EHOSTUNREACH,
        errno.EOPNOTSUPP,
        errno.ENETUNREACH,
        errno.EAGAIN,
        errno.EINTR,
    }
)


def connection_cap(configured: int, fd_limit: int | None = None) -> int:
    """The TCP connections the daemon may hold open: ``configured`` (``[server] max_connections``),
    but never more than half the soft open-files limit (``fd_limit``; read when None), so that the
    other half stays for children (two or more descriptors each), the store, the unix socket and
    what a turn opens. At least 1."""
    if fd_limit is None:
        fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if fd_limit == resource.RLIM_INFINITY or fd_limit < 0:
        return configured
    return max(1, min(configured, fd_limit // 2))


class RateLimitedLog:
    """One kind of log line, at most once per ``interval`` seconds: the first at once, later ones
    only once the interval has passed, each with ``suppressed``, the count of those not logged
    since the last line. A flood of failures costs a line per interval, not a line each."""

    def __init__(self, event: str, interval: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.event = event
        self.interval = ACCEPT_LOG_INTERVAL if interval is None else interval
        self._clock = clock
        self._last: float | None = None
        self.suppressed = 0

    def warning(self, **fields: object) -> bool:
        """Log the line now, or count it as suppressed. True when it was logged."""
        now = self._clock()
        if self._last is not None and now - self._last < self.interval:
            self.suppressed += 1
            return False
        log.warning(self.event, suppressed=self.suppressed, **fields)
        self._last, self.suppressed = now, 0
        return True


class Slots:
    """The connections open on one listener, and its bound (None: unbounded).

    ``take`` counts one in and returns its release (idempotent: called once whatever path the
    connection ends by); ``wait`` returns once there is room for one more.
    """

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.open = 0
        self._room = asyncio.Event()
        self._room.set()

    @property
    def full(self) -> bool:
        return self.limit is not None and self.open >= self.limit

    def take(self) -> Callable[[], None]:
        self.open += 1
        if self.full:
            self._room.clear()
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            self.open -= 1
            if not self.full:
                self._room.set()

        return release

    async def wait(self) -> None:
        await self._room.wait()


class GuardedProtocol(asyncio.Protocol):
    """uvicorn's HTTP protocol for one connection, behind a header timeout, giving its slot back
    when the connection ends.

    The protocol still does all of HTTP; this only watches when it calls the ASGI app, which it
    does as soon as a request's headers are parsed (h11 and httptools alike), by putting itself
    in as the protocol's ``app``. No request in progress and no headers for ``header_timeout``
    seconds — since the connection opened, or since its last response — closes the connection.
    """

    def __init__(
        self,
        inner: asyncio.Protocol,
        release: Callable[[], None],
        header_timeout: float | None,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        app: ASGIApp | None = getattr(inner, "app", None)
        if app is None:  # a uvicorn whose protocols changed: fail loudly, never serve without the timeout
            raise RuntimeError(f"{type(inner).__name__} has no 'app': agentd cannot see a request's headers arrive")
        self._inner = inner
        self._app = app
        inner.app = self._serve  # type: ignore[attr-defined]
        self._release = release
        self._timeout = header_timeout
        self._loop = loop
        self._transport: asyncio.BaseTransport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None  # armed while writing is paused
        self._requests = 0  # in progress: their headers are in, their app has not returned
        self._lost = False

    # -- asyncio.Protocol, passed on to uvicorn's protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._arm()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        # The client has stopped reading what it asked for: uvicorn's send now waits for a drain,
        # the app cannot return and the header timer stays off. A client that reads nothing for
        # ``header_timeout`` would otherwise hold its slot for ever (pipelined requests it never
        # reads need no token), so it is cut off — aborted: a close would wait for that drain too.
        if self._timeout is not None and self._stall is None and not self._lost:
            self._stall = self._loop.call_later(self._timeout, self._stalled)
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._unstall()
        self._inner.resume_writing()

    def _unstall(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stalled(self) -> None:
        self._stall = None
        if self._transport is not None and not self._lost:
            self._transport.abort()  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._disarm()
        self._unstall()
        self._release()
        self._inner.connection_lost(exc)

    # -- the header timeout
    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI app as this connection's protocol calls it: its headers are in."""
        self._requests += 1  # before any await: the expiry check below must see it
        self._disarm()
        try:
            await self._app(scope, receive, send)
        finally:
            self._requests -= 1
            if self._requests == 0:
                self._arm()  # the response is done: the next request's headers are due within the timeout

    def _arm(self) -> None:
        self._disarm()
        if self._timeout is not None and not self._lost:
            self._timer = self._loop.call_later(self._timeout, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        # One more turn of the loop: headers parsed in this same turn have had the app's task
        # created but not started, and must count as in.
        self._loop.call_soon(self._close_if_idle)

    def _close_if_idle(self) -> None:
        if self._requests == 0 and self._transport is not None and not self._transport.is_closing():
            self._transport.close()


class AcceptLoop:
    """Accepts connections on one listening socket while its ``Slots`` have room, and hands each to
    a new protocol; stands in for the ``asyncio.Server`` uvicorn would have made (``close``,
    ``wait_closed``)."""

    def __init__(
        self,
        sock: socket.socket,
        protocol: Callable[[Callable[[], None]], asyncio.Protocol],
        slots: Slots,
        name: str,
    ) -> None:
        self._sock = sock
        self._protocol = protocol
        self.slots = slots
        self.name = name
        self._failed = RateLimitedLog(events.LOG_API_ACCEPT_FAILED)
        self._full = RateLimitedLog(events.LOG_API_AT_CAPACITY)
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"agentd-accept-{name}")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self.slots.full:
                self._full.warning(listener=self.name, max_connections=self.slots.limit)
            await self.slots.wait()  # while full, nothing is accepted: clients wait in the backlog
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as exc:
                if self._sock.fileno() == -1:
                    return  # closed: the server is stopping
                if exc.errno in TRANSIENT_ERRNOS:
                    continue
                self._failed.warning(listener=self.name, error=f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(ACCEPT_RETRY_DELAY)
                continue
            release = self.slots.take()
            try:
                conn.setblocking(False)
                await loop.connect_accepted_socket(functools.partial(self._protocol, release), sock=conn)
            except BaseException as exc:
                release()
                conn.close()
                if not isinstance(exc, Exception):
                    raise  # cancelled: the server is stopping
                if isinstance(exc, OSError):  # the client went away while its transport was made
                    continue
                self._failed.warning(listener=self.name, error=f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Stop accepting (the socket itself is closed by its owner)."""
        self._task.cancel()

    async def wait_closed(self) -> None:
        await asyncio.wait([self._task])


class ApiServer(uvicorn.Server):
    """uvicorn serving ``app`` on the sockets given to ``serve``, each through an ``AcceptLoop``:
    at most ``max_connections`` open (None: no bound) and ``header_timeout`` seconds for a request's
    headers (None: no timeout). The daemon owns the signals, so uvicorn installs no handlers."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        name: str,
        max_connections: int | None = None,
        header_timeout: float | None = None,
        trusted_proxies: Sequence[str] = (),
    ) -> None:
        # ws="none": agentd serves no WebSocket, and an upgrade would swap the protocol out from
        # under GuardedProtocol (its slot would never come back). Forwarded headers are believed
        # from ``[server] trusted_proxies`` only: uvicorn's default (loopback, or FORWARDED_ALLOW_IPS
        # from the environment) would let any local process claim https or another client address.
        config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
            ws="none",
            proxy_headers=bool(trusted_proxies),
            forwarded_allow_ips=list(trusted_proxies),
        )
        super().__init__(config)
        self.name = name
        self.max_connections = max_connections
        self.header_timeout = header_timeout

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn releases
        return None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's start-up, with ``AcceptLoop``\\ s where it would call ``loop.create_server``."""
        if not sockets:
            raise ValueError("ApiServer serves only sockets it is given")
        await self.lifespan.startup()  # lifespan="off": nothing runs; kept for uvicorn's own bookkeeping
        config, loop = self.config, asyncio.get_running_loop()

        def protocol(release: Callable[[], None]) -> asyncio.Protocol:
            inner = config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state, _loop=loop
            )
            return GuardedProtocol(inner, release, self.header_timeout, loop)

        self.servers = [AcceptLoop(sock, protocol, Slots(self.max_connections), self.name) for sock in sockets]  # type: ignore[misc]
        self.started = True
