"""A TCP port on 127.0.0.1 in front of the suite's PostgreSQL, behaving as the test says.

A daemon whose ``[store] url`` names this port sees, in turn, what it would see of a database that
comes up after it: ``REFUSE`` (the port is bound but not listening, so a connection is refused, as
with no server at all), ``HOLD`` (connections are accepted and never answered: a server that hangs,
a network that drops packets), ``STARTING`` (every connection gets PostgreSQL's own
``FATAL: the database system is starting up``, SQLSTATE 57P03, on the wire), and ``FORWARD``
(every connection is relayed to the real server: the database is there). A mode applies to the
connections accepted after it is set.
"""

from __future__ import annotations

import contextlib
import enum
import socket
import struct
import threading
from urllib.parse import urlsplit

from psycopg import conninfo as pg_conninfo

__all__ = ["FrontMode", "PgFront", "database_name"]

#: The 8-byte requests a client may send before its startup message (PostgreSQL protocol 3).
SSL_REQUEST = 80877103
GSSENC_REQUEST = 80877104


class FrontMode(enum.Enum):
    REFUSE = "refuse"
    HOLD = "hold"
    STARTING = "starting"
    FORWARD = "forward"


def database_name(url: str) -> str:
    """The database a ``postgresql://`` URL names."""
    return urlsplit(url).path.lstrip("/")


def _target(admin_url: str) -> tuple[int, str | tuple[str, int]]:
    """Where the real server listens, from a URL of it: a unix socket (the suite's own server) or host:port."""
    params = pg_conninfo.conninfo_to_dict(admin_url)
    host, port = str(params.get("host") or "/var/run/postgresql"), int(params.get("port") or 5432)
    if host.startswith("/"):
        return socket.AF_UNIX, f"{host}/.s.PGSQL.{port}"
    return socket.AF_INET, (host, port)


def _error_response(sqlstate: str, message: str) -> bytes:
    """A FATAL ErrorResponse message, as the server sends it during the connection."""
    fields = [(b"S", "FATAL"), (b"V", "FATAL"), (b"C", sqlstate), (b"M", message)]
    body = b"".join(code + value.encode() + b"\0" for code, value in fields) + b"\0"
    return b"E" + struct.pack("!I", len(body) + 4) + body


def _read_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the client went away")
        data += chunk
    return data


class PgFront:
    """The port: bound at once (so nothing else takes it), listening from the first mode but REFUSE."""

    def __init__(self, admin_url: str) -> None:
        self.family, self.address = _target(admin_url)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.mode = FrontMode.REFUSE
        self.accepted = 0  # connections accepted so far, whatever the mode
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None

    def url(self, user: str, database: str) -> str:
        return f"postgresql://{user}@127.0.0.1:{self.port}/{database}"

    def set(self, mode: FrontMode) -> None:
        """Behave as ``mode`` from now on (there is no going back to REFUSE once listening)."""
        self.mode = mode
        if mode is not FrontMode.REFUSE and self._thread is None:
            self.sock.listen(64)
            self.sock.settimeout(0.1)
            self._thread = threading.Thread(target=self._accept, name="pg-front", daemon=True)
            self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            with self._lock:
                self.accepted += 1
                self._open.append(conn)
            threading.Thread(target=self._handle, args=(conn, self.mode), daemon=True).start()

    def _handle(self, conn: socket.socket, mode: FrontMode) -> None:
        try:
            if mode is FrontMode.STARTING:
                self._starting_up(conn)
            elif mode is FrontMode.FORWARD:
                self._forward(conn)
            # HOLD: keep the connection open and say nothing, until close()
        except OSError:
            with contextlib.suppress(OSError):
                conn.close()

    def _starting_up(self, conn: socket.socket) -> None:
        while True:
            length, code = struct.unpack("!II", _read_exactly(conn, 8))
            if length == 8 and code in (SSL_REQUEST, GSSENC_REQUEST):
                conn.sendall(b"N")  # no TLS, no GSSAPI: the startup message follows in the clear
                continue
            _read_exactly(conn, length - 8)  # the rest of the startup message
            conn.sendall(_error_response("57P03", "the database system is starting up"))
            conn.close()
            return

    def _forward(self, conn: socket.socket) -> None:
        upstream = socket.socket(self.family, socket.SOCK_STREAM)
        upstream.connect(self.address)
        with self._lock:
            self._open.append(upstream)
        threading.Thread(target=self._pump, args=(upstream, conn), daemon=True).start()
        self._pump(conn, upstream)

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed = True
        self.sock.close()
        with self._lock:
            for conn in self._open:
                with contextlib.suppress(OSError):
                    conn.close()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> PgFront:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
