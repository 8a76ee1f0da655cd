"""A scriptable HTTP/1.1 model server on loopback, in its own thread (usable from sync and async tests).

Written on raw asyncio streams rather than a web framework so faults can be acted out byte by
byte: a connection dropped in the middle of a chunked body, a body that ends cleanly but without
the stream terminator, a stall after the headers. Subclasses (``FakeOllama``, ``FakeOpenAI``) supply
the wire format. Every request is logged with the ``model`` it named and the server's own time
spent on it (``server_seconds``), so benchmarks can subtract the server from a client's time.
"""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Self

from tests.fakes.script import Fault, Reply

__all__ = ["FakeServer", "RecordedRequest", "refused_url"]

ScriptItem = Reply | Fault
_GATE_SECONDS = 30.0
Responder = Callable[["RecordedRequest"], ScriptItem]
_OK = Reply(content="ok")  # the default reply; frozen, so one shared instance is safe

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
}


@dataclass
class RecordedRequest:
    """One request as the fake server saw it."""

    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: Any  # decoded JSON, or None
    received_at: float  # time.perf_counter() once the request was read
    finished_at: float | None = None  # once the response was fully written (or abandoned)
    outcome: str = ""
    # time.monotonic() as each stream record was written (the clock every process of a machine shares)
    record_times: list[float] = field(default_factory=list)

    @property
    def model(self) -> str | None:
        """The ``model`` the request named."""
        return self.body.get("model") if isinstance(self.body, dict) else None

    @property
    def server_seconds(self) -> float:
        """Time the server spent on this request (0 until it finished)."""
        return (self.finished_at - self.received_at) if self.finished_at is not None else 0.0


def refused_url() -> str:
    """A loopback URL where nothing listens (connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@dataclass
class _Stats:
    connections: int = 0
    disconnects: int = 0


class FakeServer:
    """Base fake: routing, the request log, the script, and fault acting."""

    chat_path = "/chat"
    models_path = "/models"
    default_stream = False
    stream_content_type = "application/octet-stream"

    def __init__(
        self,
        *,
        default: ScriptItem | Responder = _OK,
        models: tuple[str, ...] = ("fake-model",),
        split_writes: bool = True,
    ) -> None:
        self.default = default
        self.models = models
        self.split_writes = split_writes  # write each record in two pieces: lines split across reads
        self.requests: list[RecordedRequest] = []
        self.stalled = threading.Event()  # set when a stall fault starts
        self.stats = _Stats()
        self._script: collections.deque[ScriptItem | Responder] = collections.deque()
        self._changed = threading.Condition()
        self._started = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._seq = 0
        self._gates: set[threading.Event] = set()
        self.port = 0

    # ----------------------------------------------------------------------- control (any thread)

    @property
    def url(self) -> str:
        """The server root, e.g. ``http://127.0.0.1:41234``."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        """Start listening (returns once the port is bound)."""
        self._thread = threading.Thread(target=self._run, name=type(self).__name__, daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("fake server did not start")
        return self

    def stop(self) -> None:
        """Stop listening and drop every open connection (ends stalls and opens held gates)."""
        for gate in list(self._gates):
            gate.set()
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def script(self, *items: ScriptItem | Responder) -> None:
        """Queue answers for the next chat requests, one each, in order."""
        self._script.extend(items)

    @property
    def chat_requests(self) -> list[RecordedRequest]:
        """The chat requests received so far."""
        return [r for r in self.requests if r.path == self.chat_path]

    def models_served(self) -> list[str | None]:
        """The ``model`` named by each chat request, in order."""
        return [r.model for r in self.chat_requests]

    def wait_for_received(self, count: int, timeout: float = 10.0) -> bool:
        """Block until ``count`` chat requests have arrived (answered or not); False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: len(self.chat_requests) >= count, timeout)

    def wait_for_requests(self, count: int, timeout: float = 10.0) -> bool:
        """Block until ``count`` chat requests have finished (True) or ``timeout`` passed (False)."""
        with self._changed:
            return self._changed.wait_for(
                lambda: sum(1 for r in self.chat_requests if r.finished_at is not None) >= count, timeout
            )

    # ----------------------------------------------------------------------- wire format (subclasses)

    def stream_records(self, reply: Reply, request: RecordedRequest, seq: int) -> list[bytes]:
        """A streamed reply as framed records (each ends with its own delimiter)."""
        raise NotImplementedError

    def body(self, reply: Reply, request: RecordedRequest, seq: int) -> Any:
        """A non-stream reply body (JSON value)."""
        raise NotImplementedError

    def error_body(self, status: int, message: str) -> Any:
        """The wire's error body for an HTTP error status."""
        raise NotImplementedError

    def error_record(self, message: str) -> bytes:
        """The wire's mid-stream error record (framed)."""
        raise NotImplementedError

    def garbage_record(self) -> bytes:
        """A framed record that is not valid JSON."""
        raise NotImplementedError

    def models_body(self) -> Any:
        raise NotImplementedError

    # ----------------------------------------------------------------------- the server thread

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        server = await asyncio.start_server(self._connection, "127.0.0.1", self.port)
        self.port = server.sockets[0].getsockname()[1]
        self._started.set()
        await self._stopping.wait()
        server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        await asyncio.sleep(0)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        self.stats.connections += 1
        try:
            while True:
                request = await self._read_request(reader)
                if request is None:
                    break
                keep_alive = await self._respond(request, reader, writer)
                request.finished_at = request.finished_at or time.perf_counter()
                with self._changed:
                    self._changed.notify_all()
                if not keep_alive or request.headers.get("connection", "").lower() == "close":
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.stats.disconnects += 1
            self._writers.discard(writer)
            writer.transport.abort()

    async def _read_request(self, reader: asyncio.StreamReader) -> RecordedRequest | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        raw = await reader.readexactly(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        request = RecordedRequest(method, target.split("?", 1)[0], headers, body, time.perf_counter())
        with self._changed:
            self.requests.append(request)
            self._changed.notify_all()
        return request

    async def _respond(
        self, request: RecordedRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        if request.method == "GET" and request.path == self.models_path:
            await self._send_json(writer, 200, self.models_body())
            request.outcome = "models"
            return True
        if request.method != "POST" or request.path != self.chat_path:
            await self._send_json(writer, 404, self.error_body(404, f"no route {request.method} {request.path}"))
            request.outcome = "404"
            return True
        item = self._script.popleft() if self._script else self.default
        if callable(item):
            item = item(request)
        self._seq += 1
        stream = request.body.get("stream", self.default_stream) if isinstance(request.body, dict) else False
        if isinstance(item, Reply):
            request.outcome = "reply"
            if item.gate is not None:
                self._gates.add(item.gate)
                await asyncio.get_running_loop().run_in_executor(None, item.gate.wait, _GATE_SECONDS)
            if stream:
                return await self._send_stream(writer, self.stream_records(item, request, self._seq), item, request)
            await self._send_json(writer, 200, self.body(item, request, self._seq))
            return True
        request.outcome = item.kind
        return await self._act(item, request, reader, writer, stream)

    async def _act(
        self,
        fault: Fault,
        request: RecordedRequest,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        stream: bool,
    ) -> bool:
        if fault.kind == "status":
            message = fault.message
            if fault.echo_auth:
                message += f" (you sent: {request.headers.get('authorization', '')})"
            await self._send_json(writer, fault.status, self.error_body(fault.status, message), fault.headers)
            return True
        if fault.kind == "raw":
            await self._send_bytes(writer, fault.status, fault.body or b"", fault.headers)
            return True
        records = self.stream_records(fault.reply, request, self._seq)
        if not stream:
            return await self._act_whole(fault, request, reader, writer, records)
        head, tail = records[: fault.after], records[fault.after :]
        await self._start_chunked(writer)
        for record in head:
            await self._chunk(writer, record)
        await self._hold(fault.reply.midway)  # the fault strikes once the test has seen the head
        if fault.kind == "drop":
            return False  # close without the terminating chunk
        if fault.kind == "truncate":
            await self._end_chunked(writer)
            return True
        if fault.kind == "malformed":
            for record in [self.garbage_record(), *tail]:
                await self._chunk(writer, record)
            await self._end_chunked(writer)
            return True
        if fault.kind == "stream_error":
            await self._chunk(writer, self.error_record(fault.message))
            await self._end_chunked(writer)
            return True
        await self._stall(reader)
        return False

    async def _act_whole(
        self,
        fault: Fault,
        request: RecordedRequest,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        records: list[bytes],
    ) -> bool:
        """Faults on a non-stream request: the same failures, on one JSON body."""
        body = json.dumps(self.body(fault.reply, request, self._seq)).encode()
        if fault.kind in ("drop", "truncate"):
            writer.write(self._head(200, {"Content-Type": "application/json", "Content-Length": str(len(body))}))
            writer.write(body[: len(body) // 2])
            await writer.drain()
            return False
        if fault.kind == "malformed":
            await self._send_bytes(writer, 200, b"{this is not json", (("Content-Type", "application/json"),))
            return True
        if fault.kind == "stream_error":
            await self._send_json(writer, 200, self.error_body(500, fault.message))
            return True
        writer.write(self._head(200, {"Content-Type": "application/json", "Content-Length": str(len(body))}))
        await writer.drain()
        await self._stall(reader)
        return False

    async def _stall(self, reader: asyncio.StreamReader) -> None:
        """Send nothing more until the client disconnects or the server stops."""
        self.stalled.set()
        assert self._stopping is not None
        waiters = [asyncio.ensure_future(reader.read(1)), asyncio.ensure_future(self._stopping.wait())]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for waiter in waiters:
            waiter.cancel()

    # ----------------------------------------------------------------------- HTTP framing

    @staticmethod
    def _head(status: int, headers: dict[str, str]) -> bytes:
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def _send_json(
        self, writer: asyncio.StreamWriter, status: int, value: Any, extra: tuple[tuple[str, str], ...] = ()
    ) -> None:
        await self._send_bytes(
            writer, status, json.dumps(value).encode(), (("Content-Type", "application/json"), *extra)
        )

    async def _send_bytes(
        self, writer: asyncio.StreamWriter, status: int, body: bytes, headers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        all_headers = {"Content-Length": str(len(body)), **dict(headers)}
        writer.write(self._head(status, all_headers) + body)
        await writer.drain()

    async def _start_chunked(self, writer: asyncio.StreamWriter) -> None:
        writer.write(self._head(200, {"Content-Type": self.stream_content_type, "Transfer-Encoding": "chunked"}))
        await writer.drain()

    async def _chunk(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        pieces = [data[: len(data) // 2], data[len(data) // 2 :]] if self.split_writes and len(data) > 1 else [data]
        for piece in pieces:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            if self.split_writes:
                await asyncio.sleep(0)  # let the piece go out on its own

    async def _end_chunked(self, writer: asyncio.StreamWriter) -> None:
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def _send_stream(
        self, writer: asyncio.StreamWriter, records: list[bytes], reply: Reply, request: RecordedRequest
    ) -> bool:
        await self._start_chunked(writer)
        for n, record in enumerate(records):
            if reply.midway is not None and n == reply.midway_after:
                await self._hold(reply.midway)
            if reply.pace_ms and n:
                await asyncio.sleep(reply.pace_ms / 1000)
            request.record_times.append(time.monotonic())
            await self._chunk(writer, record)
        await self._end_chunked(writer)
        return True

    async def _hold(self, gate: threading.Event | None) -> None:
        """Wait (at most ``_GATE_SECONDS``) until the test sets ``gate``; None: no wait."""
        if gate is not None:
            self._gates.add(gate)
            await asyncio.get_running_loop().run_in_executor(None, gate.wait, _GATE_SECONDS)
