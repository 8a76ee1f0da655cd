"""A fault-injecting proxy in front of the test PostgreSQL: it loses a connection while ``COMMIT`` is in flight.

The store connects to the proxy's unix socket (a socket directory of its own, as libpq names
sockets: ``<dir>/.s.PGSQL.<port>``); the proxy opens a connection to the real server for each
one and forwards bytes both ways. Over a unix socket libpq asks for neither SSL nor GSS
encryption, so both directions are the plain PostgreSQL protocol, which the proxy reads message
by message: a frontend message is a type byte and a 4-byte length (the startup message has no
type byte), and so is every backend message.

Armed (``arm``), it cuts the first transaction that sent a given statement (or each one, until
``disarm``), at its ``COMMIT`` (psycopg sends ``BEGIN`` and ``COMMIT`` as simple ``Query``
messages; a statement is seen in its ``Query``, its ``Parse``, or the ``Bind`` of a statement
prepared earlier):

- ``Cut.AFTER_REPLY``: the ``COMMIT`` is forwarded and the server's whole reply (up to its
  ``ReadyForQuery``) is awaited — so the transaction has committed — then both sockets are closed
  without forwarding it. The client sees the connection lost with ``COMMIT`` in flight: the
  commit landed and it cannot know.
- ``Cut.BEFORE_COMMIT``: both sockets are closed instead of forwarding the ``COMMIT``: the server
  rolls the transaction back.

``cut`` is set once it happened. Nothing here depends on timing: the proxy acts on the messages
themselves. The connection to the server uses asyncio's streams (``_Upstream`` says why); an
upstream on TCP (``AGENTD_TEST_PG_URL``) gets the same plain-text protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import shutil
import struct
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlencode

import anyio
import anyio.abc
import anyio.from_thread
from psycopg import conninfo

__all__ = ["TURN_COMMIT", "Cut", "PgProxy", "proxy_in_thread", "serving"]

#: The statement only ``commit_turn`` sends (it sets a turn's results), as psycopg sends it.
TURN_COMMIT = "UPDATE turns SET status = $1, models = $2"
#: Protocol codes of untyped frontend messages that ask for encryption (the proxy forwards plain text only).
_ENCRYPTION_REQUESTS = (80877103, 80877104)  # SSLRequest, GSSENCRequest
_CANCEL_REQUEST = 80877102
_SOCKET_PORT = 5432  # only a part of the socket's name


class Cut(enum.Enum):
    """Where an armed proxy loses the connection of the transaction it watches for."""

    AFTER_REPLY = "after_reply"  # the COMMIT landed; its reply is never forwarded
    BEFORE_COMMIT = "before_commit"  # the COMMIT never reaches the server


class PgProxy:
    """The proxy for the server ``upstream_url`` names (a URL or conninfo string libpq reads)."""

    def __init__(self, upstream_url: str) -> None:
        self._upstream = conninfo.conninfo_to_dict(upstream_url)
        # Short: a unix socket's path is limited to about 100 bytes.
        self.directory = Path(tempfile.mkdtemp(prefix="agentd-pgproxy-"))
        self.socket_path = self.directory / f".s.PGSQL.{_SOCKET_PORT}"
        self._armed: tuple[str, Cut, bool] | None = None
        self._scope: anyio.CancelScope | None = None
        #: Set once an armed proxy cut a connection (thread-safe: e2e tests wait for it from their thread).
        self.cut = threading.Event()

    def url(self, database_url: str) -> str:
        """``database_url`` (same database, user and options) through the proxy, as a ``postgresql://`` URL."""
        params = {k: str(v) for k, v in conninfo.conninfo_to_dict(database_url).items()}
        database = params.pop("dbname", "postgres")
        params.update(host=str(self.directory), port=str(_SOCKET_PORT))
        return f"postgresql:///{database}?{urlencode(params)}"

    def arm(self, statement: str = TURN_COMMIT, cut: Cut = Cut.AFTER_REPLY, *, every: bool = False) -> None:
        """Cut the connection of the next transaction that sends ``statement`` (a substring), at its
        ``COMMIT``, as ``cut`` says: once, or with ``every`` each such transaction until ``disarm``.
        ``cut`` is cleared."""
        self.cut.clear()
        self._armed = (statement, cut, every)

    def disarm(self) -> None:
        """Cut nothing more."""
        self._armed = None

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Accept connections until ``stop``; ``task_status.started()`` once the socket listens."""
        listener = await anyio.create_unix_listener(self.socket_path)
        with anyio.CancelScope() as self._scope:
            async with listener:
                task_status.started()
                await listener.serve(self._handle)

    def stop(self) -> None:
        """Stop accepting and close every connection (on the proxy's event loop)."""
        if self._scope is not None:
            self._scope.cancel()

    def remove(self) -> None:
        """Remove the socket's directory."""
        shutil.rmtree(self.directory, ignore_errors=True)

    # ------------------------------------------------------------------ one connection

    async def _connect_upstream(self) -> _Upstream:
        host = str(self._upstream.get("host") or "/var/run/postgresql").split(",")[0]
        port = int(str(self._upstream.get("port") or 5432).split(",")[0])
        if host.startswith("/"):
            reader, writer = await asyncio.open_unix_connection(f"{host}/.s.PGSQL.{port}")
        else:
            reader, writer = await asyncio.open_connection(host, port)
        return _Upstream(reader, writer)

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        try:
            server = await self._connect_upstream()
        except OSError:
            await client.aclose()
            return
        link = _Link(client, server)
        async with client, server, anyio.create_task_group() as tg:
            link.scope = tg.cancel_scope
            tg.start_soon(self._frontend, link)
            tg.start_soon(self._backend, link)

    async def _frontend(self, link: _Link) -> None:
        """Client → server, message by message, watching for the transaction to cut."""
        buffer = bytearray()
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            while True:
                buffer += await link.client.receive()
                while (message := _take(buffer, typed=link.started)) is not None:
                    if not link.started:
                        link.started = _startup(message)
                    elif self._cuts_here(link, message):
                        return
                    await link.server.send(message)
        link.scope.cancel()  # one side ended: the connection ends

    async def _backend(self, link: _Link) -> None:
        """Server → client; while a COMMIT's reply is held, nothing is forwarded until it is complete."""
        buffer = bytearray()
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            while True:
                buffer += await link.server.receive()
                while (message := _take(buffer, typed=True)) is not None:
                    if not link.holding:
                        await link.client.send(message)
                    elif message[:1] == b"Z":  # ReadyForQuery: the COMMIT is done on the server
                        self._lose(link)
                        return
        link.scope.cancel()

    def _cuts_here(self, link: _Link, message: bytes) -> bool:
        """Track the transaction's statements; at the COMMIT of the armed one, cut as armed.

        True when the message must not be forwarded (the connection is being lost).
        """
        kind, body = message[:1], message[5:]
        if kind == b"Q":
            query = _cstrings(body)[0]
            verb = query.strip().rstrip(";").upper()
            if verb == "BEGIN" or verb.startswith("BEGIN "):
                link.transaction = []
            elif verb == "COMMIT" and self._armed is not None:
                statement, cut, every = self._armed
                if any(statement in sent for sent in link.transaction):
                    if not every:
                        self._armed = None
                    if cut is Cut.BEFORE_COMMIT:
                        self._lose(link)
                        return True
                    link.holding = True  # before the COMMIT is sent: none of its reply gets through
            link.transaction.append(query)
        elif kind == b"P":  # Parse: a (possibly named) prepared statement
            name, query = _cstrings(body)[:2]
            link.prepared[name] = query
            link.transaction.append(query)
        elif kind == b"B":  # Bind: runs a statement prepared earlier, maybe in another transaction
            link.transaction.append(link.prepared.get(_cstrings(body)[1], ""))
        return False

    def _lose(self, link: _Link) -> None:
        """Close both sockets at once, forwarding nothing more."""
        self.cut.set()
        link.scope.cancel()


class _Upstream:
    """The connection to the server, on asyncio's streams (transports).

    Not anyio's unix socket stream: with that one, a test that failed after using the proxy left
    the next test's connections through it hanging (about one time in four), which asyncio's
    transports never did in dozens of runs.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer

    async def receive(self) -> bytes:
        """The next bytes from the server; EndOfStream once it closed the connection."""
        data = await self._reader.read(65536)
        if not data:
            raise anyio.EndOfStream
        return data

    async def send(self, data: bytes) -> None:
        """Send ``data`` to the server."""
        self._writer.write(data)
        await self._writer.drain()

    async def aclose(self) -> None:
        """Close the connection (without waiting for the server)."""
        self._writer.close()

    async def __aenter__(self) -> _Upstream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class _Link:
    """One proxied connection and what the proxy knows about it."""

    def __init__(self, client: anyio.abc.SocketStream, server: _Upstream) -> None:
        self.client, self.server = client, server
        self.scope = anyio.CancelScope()
        self.started = False  # the startup message has been forwarded: every later message is typed
        self.holding = False  # a cut COMMIT's reply is being swallowed
        self.transaction: list[str] = []  # the statements since the last BEGIN
        self.prepared: dict[str, str] = {}  # prepared statement name → its query


def _take(buffer: bytearray, *, typed: bool) -> bytes | None:
    """The first complete message in ``buffer`` (removed from it), or None if it is not all there yet."""
    header = 5 if typed else 4
    if len(buffer) < header:
        return None
    (length,) = struct.unpack_from("!I", buffer, header - 4)
    end = header - 4 + length
    if len(buffer) < end:
        return None
    message = bytes(buffer[:end])
    del buffer[:end]
    return message


def _startup(message: bytes) -> bool:
    """Whether the untyped ``message`` started the session (so typed messages follow)."""
    code: int = struct.unpack_from("!I", message, 4)[0]
    if code in _ENCRYPTION_REQUESTS:
        raise RuntimeError("pg_proxy forwards plain text only: connect through its unix socket")
    return code != _CANCEL_REQUEST


def _cstrings(body: bytes) -> list[str]:
    """The NUL-terminated strings a message body starts with (and the rest, undecoded, dropped)."""
    return [part.decode(errors="replace") for part in body.split(b"\0")]


@contextlib.asynccontextmanager
async def serving(upstream_url: str) -> AsyncIterator[PgProxy]:
    """A proxy serving on the caller's event loop (async tests), stopped and removed afterwards."""
    proxy = PgProxy(upstream_url)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(proxy.serve)
            try:
                yield proxy
            finally:
                proxy.stop()
    finally:
        proxy.remove()


@contextlib.contextmanager
def proxy_in_thread(upstream_url: str) -> Iterator[PgProxy]:
    """A proxy serving on an event loop of its own in a thread (e2e tests, which are not async)."""
    proxy = PgProxy(upstream_url)
    try:
        with anyio.from_thread.start_blocking_portal() as portal:
            portal.start_task(proxy.serve)  # returns once the socket listens
            try:
                yield proxy
            finally:
                portal.call(proxy.stop)
    finally:
        proxy.remove()
