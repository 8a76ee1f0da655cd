"""The HTTP plumbing both real providers share: one call with failover, retries and error kinds.

``HTTPProvider.complete`` runs one model call over the endpoint list (``endpoints.Endpoints``):
each attempt goes to the lowest usable endpoint not yet tried in this round; a retryable failure
(connect error, 429, 5xx, a dropped, truncated or stalled stream, a mid-stream server error) is
recorded against that endpoint and the next one is tried at once; after a failed round the call
backs off (honouring ``Retry-After``) and tries again, never past the request deadline; a round
after a backoff that finds every breaker open probes the endpoint that becomes ready first all the
same (panic mode, see ``endpoints``), so an open breaker never blocks the only endpoint that might
answer until the turn's deadline. A truncated stream is never an answer: it is retried. Everything
else — 401/403, other 4xx, a body that is not the wire format — ends the call at once with its own
IntelError kind and no failover. The wire specifics live in the subclasses (``ollama``, ``openai``).

Secrets: the API key is only ever put in the ``Authorization`` header. Every error text we produce
passes through ``_scrub`` (a server may echo the key back) and endpoints are named by
``agentd.redact.redact_url`` (no userinfo, no query string), so neither errors nor logs can carry it.
"""

from __future__ import annotations

import functools
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, ClassVar, Protocol, TypeVar

import anyio
import httpx
import msgspec
import structlog

from agentd import __version__ as _agentd_version
from agentd.causes import iter_causes
from agentd.config import Intelligence
from agentd.events import LOG_INTEL_ERROR, LOG_INTEL_FAILOVER
from agentd.intel.base import Completion, CompletionRequest, IntelError, IntelErrorKind, StreamSink
from agentd.intel.endpoints import BreakerPolicy, Endpoints, RetryPolicy, backoff_delay, parse_retry_after
from agentd.intel.pieces import TaggedSink
from agentd.intel.wire import (
    CallOptions,
    ChatResult,
    IncompleteStream,
    OptionError,
    RemoteError,
    WireError,
    call_options,
    decode_json,
)
from agentd.messages import MessageError, validate_request
from agentd.redact import redact_url

__all__ = ["HTTPProvider", "Retryable", "StreamReader"]

T = TypeVar("T")

_MAX_ERROR_BODY = 64 * 1024  # enough for any error JSON; a huge error page is not worth reading
_MAX_ERROR_TEXT = 300
_RETRYABLE_STATUS = frozenset({408, 425, 429})
_DRAIN_SECONDS = 0.5


class Retryable(Exception):
    """A failure of the endpoint, not of the request: record it and try elsewhere or later."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class StreamReader(Protocol):
    """Turns a response body, fed as it arrives, into one answer (see the provider subclasses)."""

    def feed(self, data: bytes) -> bool:
        """Take bytes; True once the stream's terminator was seen (nothing more is needed)."""
        ...

    def finish(self) -> ChatResult:
        """The body ended: the answer, or IncompleteStream/WireError/RemoteError."""
        ...


def join_url(base: str, path: str) -> str:
    """``base`` (an endpoint) with ``path`` appended, one slash between them."""
    return base.rstrip("/") + "/" + path.lstrip("/")


class HTTPProvider:
    """Base of the HTTP providers: endpoint health, the HTTP client, retries and error kinds.

    Subclasses set ``name`` and implement ``chat_url``, ``models_url``, ``chat_body``,
    ``stream_reader``, ``parse_body``, ``parse_models`` and ``error_text``. ``clock``/``sleep``
    and the policies are injectable so tests can drive breaker cooldowns without waiting.
    """

    name: ClassVar[str] = "http"

    def __init__(
        self,
        intelligence: Intelligence,
        *,
        breaker: BreakerPolicy | None = None,
        retry: RetryPolicy | None = None,
        clock: Callable[[], float] = anyio.current_time,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        rng: random.Random | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.intelligence = intelligence
        self.failing = False  # the latest attempt found no endpoint reachable (see Provider.failing)
        self.endpoints = Endpoints(intelligence.endpoints, breaker)  # config guarantees at least one
        self.retry = retry or RetryPolicy()
        self._clock = clock
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._api_key = os.environ.get(intelligence.api_key_env) if intelligence.api_key_env else None
        self._client = httpx.AsyncClient(transport=transport, follow_redirects=False)

    def __repr__(self) -> str:  # the key stays out of reprs
        return f"{type(self).__name__}(model={self.intelligence.model!r}, endpoints={len(self.endpoints.urls)})"

    # ----------------------------------------------------------------------- wire specifics

    def chat_url(self, endpoint: str) -> str:
        raise NotImplementedError

    def models_url(self, endpoint: str) -> str:
        raise NotImplementedError

    def chat_body(self, request: CompletionRequest, options: Mapping[str, Any], stream: bool) -> dict[str, Any]:
        raise NotImplementedError

    def stream_reader(self, id_prefix: str, sink: StreamSink | None = None) -> StreamReader:
        raise NotImplementedError

    def parse_body(self, raw: Any, id_prefix: str) -> ChatResult:
        raise NotImplementedError

    def parse_models(self, raw: Any) -> list[str]:
        raise NotImplementedError

    def error_text(self, raw: Any) -> str | None:
        """The message in an error body (decoded JSON), or None when it has none."""
        raise NotImplementedError

    def accept(self, stream: bool) -> str:
        return "application/json"

    # ----------------------------------------------------------------------- the Provider protocol

    async def complete(self, request: CompletionRequest) -> Completion:
        """One model call with failover and retries (see the module docstring). Raises IntelError."""
        try:
            validate_request(request.messages)
        except MessageError as exc:
            raise IntelError(IntelErrorKind.REQUEST, str(exc)) from None
        options = {**self.intelligence.options, **request.options}
        try:
            call = call_options(options)
        except OptionError as exc:
            raise IntelError(IntelErrorKind.REQUEST, str(exc)) from None
        self._require_key()
        body = msgspec.json.encode(self.chat_body(request, options, call.stream))
        # Generated tool-call ids depend on the history's length: stable for the same history,
        # unique across the steps of one transcript.
        id_prefix = f"call_{len(request.messages)}_"
        sink, attempts = request.sink, 0

        async def attempt(endpoint: str) -> ChatResult:
            nonlocal attempts
            if sink is not None and attempts:
                # Pieces of the failed attempt went out: the answer starts again (RFC 0005 §7).
                sink.reset("the model call is retried after a failure")
            attempts += 1
            return await self._chat_attempt(endpoint, body, call, id_prefix, TaggedSink(sink) if sink else None)

        result = await self._with_failover(attempt, request.deadline, "chat")
        return Completion(message=result.message, usage=result.usage, model=self.intelligence.model)

    async def models(self, deadline: float | None = None) -> list[str]:
        """The model names the endpoints offer (``/api/tags`` or ``/v1/models``), with failover."""
        self._require_key()

        async def attempt(endpoint: str) -> list[str]:
            timeout = httpx.Timeout(30.0, connect=5.0)
            response = await self._send("GET", self.models_url(endpoint), None, timeout, stream=False)
            return self._checked(lambda: self.parse_models(decode_json(response.content, "the model list")))

        return await self._with_failover(attempt, deadline, "models")

    async def aclose(self) -> None:
        """Close the HTTP client and its connections."""
        await self._client.aclose()

    # ----------------------------------------------------------------------- one attempt

    def _require_key(self) -> None:
        env = self.intelligence.api_key_env
        if env and not self._api_key:
            raise IntelError(IntelErrorKind.AUTH, f"the environment variable {env} (api_key_env) is not set")

    def _headers(self, stream: bool) -> dict[str, str]:
        headers = {"Accept": self.accept(stream), "User-Agent": f"agentd/{_agentd_version}"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        return headers

    async def _chat_attempt(
        self, endpoint: str, body: bytes, call: CallOptions, id_prefix: str, sink: TaggedSink | None
    ) -> ChatResult:
        timeout = httpx.Timeout(call.read_timeout, connect=call.connect_timeout)
        url = self.chat_url(endpoint)
        if not call.stream:
            response = await self._send("POST", url, body, timeout, stream=False)
            return self._checked(lambda: self.parse_body(decode_json(response.content, "the response body"), id_prefix))
        request = self._client.build_request(
            "POST",
            url,
            content=body,
            headers={**self._headers(True), "Content-Type": "application/json"},
            timeout=timeout,
        )
        with self._transport_errors(timeout):
            response = await self._client.send(request, stream=True)
            try:
                await self._raise_for_status(response)
                if response.headers.get("content-type", "").startswith("application/json"):
                    # A server (or proxy) that does not stream answered with one body: read it as one.
                    content = await response.aread()
                    return self._checked(lambda: self.parse_body(decode_json(content, "the response body"), id_prefix))
                reader = self.stream_reader(id_prefix, sink)
                chunks = response.aiter_bytes()
                async for data in chunks:
                    if self._checked(functools.partial(reader.feed, data)):
                        await _drain(chunks)
                        break
                result = self._checked(reader.finish)
                if sink is not None:
                    sink.finish()  # the answer is whole: what the think-tag split held back goes out
                return result
            finally:
                with anyio.CancelScope(shield=True):  # release the connection even when cancelled
                    await response.aclose()

    async def _send(
        self,
        method: str,
        url: str,
        body: bytes | None,
        timeout: httpx.Timeout,  # noqa: ASYNC109 - httpx's per-phase timeouts, not a deadline for this coroutine
        *,
        stream: bool,
    ) -> httpx.Response:
        headers = self._headers(stream)
        if body is not None:
            headers["Content-Type"] = "application/json"
        with self._transport_errors(timeout):
            response = await self._client.request(method, url, content=body, headers=headers, timeout=timeout)
        await self._raise_for_status(response)
        return response

    def _transport_errors(self, timeout: httpx.Timeout) -> _TransportErrors:
        return _TransportErrors(timeout)

    def _checked(self, parse: Callable[[], T]) -> T:
        """Run a parse step, mapping wire-level failures to their kinds."""
        try:
            return parse()
        except IncompleteStream as exc:
            raise Retryable(str(exc)) from None
        except WireError as exc:
            raise IntelError(IntelErrorKind.MALFORMED, self._scrub(str(exc))) from None
        except RemoteError as exc:
            text = f"the server reported an error mid-response: {self._scrub(str(exc))[:_MAX_ERROR_TEXT]}"
            if exc.request_error:
                raise IntelError(IntelErrorKind.REQUEST, text) from None
            raise Retryable(text) from None

    async def _raise_for_status(self, response: httpx.Response) -> None:
        status = response.status_code
        if 200 <= status < 300:
            return
        raw = bytearray()
        try:
            async for data in response.aiter_bytes():
                raw += data
                if len(raw) >= _MAX_ERROR_BODY:
                    break
        except httpx.HTTPError:
            pass  # the status says enough
        detail = self._error_detail(bytes(raw))
        text = f"HTTP {status}" + (f": {detail}" if detail else "")
        if status in (401, 403):
            raise IntelError(IntelErrorKind.AUTH, text)
        if status in _RETRYABLE_STATUS or status >= 500:
            raise Retryable(text, parse_retry_after(response.headers.get("retry-after"), time.time()))
        raise IntelError(IntelErrorKind.REQUEST, text)

    def _error_detail(self, raw: bytes) -> str:
        try:
            message = self.error_text(msgspec.json.decode(raw))
        except (msgspec.DecodeError, WireError):
            message = None
        if message is None:
            message = raw.decode("utf-8", "replace").strip()
        return self._scrub(" ".join(message.split()))[:_MAX_ERROR_TEXT]

    def _scrub(self, text: str) -> str:
        """Remove the API key from text a server sent (some servers echo it in auth errors)."""
        if self._api_key and self._api_key in text:
            text = text.replace(self._api_key, "[redacted]")
        return text

    # ----------------------------------------------------------------------- failover

    async def _with_failover(self, attempt: Callable[[str], Awaitable[T]], deadline: float | None, what: str) -> T:
        """Run ``attempt`` on endpoints per the breaker and retry policy (see the module docstring)."""
        last_error = "no endpoint was usable (all circuit breakers open)"
        failed_on: int | None = None
        for round_index in range(self.retry.rounds):
            tried: set[int] = set()
            # Panic mode (agentd.intel.endpoints): once the call has backed off, a round that finds
            # every breaker open still probes the endpoint that becomes ready first — one probe per
            # round — instead of waiting out a cooldown that can outlast the turn's deadline.
            while (index := self.endpoints.pick(self._clock(), tried, panic=round_index > 0 and not tried)) is not None:
                tried.add(index)
                if failed_on is not None and failed_on != index:
                    self._log_failover(failed_on, index, last_error)
                try:
                    result = await self._attempt_within_deadline(index, attempt, deadline, what)
                    self.failing = False
                    return result
                except Retryable as failure:
                    self.failing = True
                    self.endpoints.failed(index, self._clock(), failure.retry_after)
                    last_error = str(failure)
                    failed_on = index
                    self._log_error(index, IntelErrorKind.UNAVAILABLE, last_error, what, retrying=True)
            if round_index + 1 < self.retry.rounds:
                await self._pause(round_index, deadline, last_error)
        raise self._unavailable(last_error)

    async def _attempt_within_deadline(
        self, index: int, attempt: Callable[[str], Awaitable[T]], deadline: float | None, what: str
    ) -> T:
        endpoint = self.endpoints.urls[index]
        remaining = None if deadline is None else deadline - self._clock()
        if remaining is not None and remaining <= 0:
            self.endpoints.released(index)
            raise self._unavailable("the request deadline passed")
        verdict = False
        try:
            with anyio.move_on_after(remaining) as scope:
                result = await attempt(endpoint)
                verdict = True
                self.endpoints.succeeded(index)
                return result
        except Retryable:
            verdict = True
            raise
        except IntelError as exc:
            # The endpoint answered (auth, request or format error): it is up, but we do not fail over.
            verdict = True
            self.endpoints.succeeded(index)
            self._log_error(index, exc.kind, str(exc), what, retrying=False)
            raise
        finally:
            if not verdict and not scope.cancelled_caught:
                self.endpoints.released(index)  # cancelled by our caller: no verdict on the endpoint
        # Out of time. An endpoint that cannot answer within the deadline is failing us, whatever
        # its read timeout says (a stall longer than the deadline is caught only here); one slow
        # answer does not open its breaker, three in a row do.
        message = f"the request deadline passed while waiting for {redact_url(endpoint)}"
        self.endpoints.failed(index, self._clock())
        self._log_error(index, IntelErrorKind.UNAVAILABLE, message, what, retrying=False)
        raise self._unavailable(message)

    async def _pause(self, round_index: int, deadline: float | None, last_error: str) -> None:
        """Back off between rounds, and longer if ``Retry-After`` holds every endpoint.

        Breaker cooldowns do not lengthen the pause: the next round may probe in panic mode.
        """
        now = self._clock()
        wait = backoff_delay(round_index, self.retry, self._rng)
        ready = self.endpoints.next_ready_at(panic=True)
        if ready is not None:
            wait = max(wait, ready - now)
        if wait > self.retry.max_wait or (deadline is not None and now + wait >= deadline):
            raise self._unavailable(last_error)
        await self._sleep(wait)

    def _unavailable(self, last_error: str) -> IntelError:
        error = IntelError(
            IntelErrorKind.UNAVAILABLE, f"{self.name}: no endpoint could serve the call; last error: {last_error}"
        )
        structlog.get_logger().warning(
            LOG_INTEL_ERROR, provider=self.name, model=self.intelligence.model, kind=str(error.kind), error=str(error)
        )
        return error

    def _log_error(self, index: int, kind: IntelErrorKind, message: str, what: str, *, retrying: bool) -> None:
        # Looked up per event (not at import) so a later structlog configuration always applies.
        structlog.get_logger().warning(
            LOG_INTEL_ERROR,
            provider=self.name,
            model=self.intelligence.model,
            endpoint=redact_url(self.endpoints.urls[index]),
            call=what,
            kind=str(kind),
            error=message,
            retrying=retrying,
            breaker=str(self.endpoints.state(index)),
        )

    def _log_failover(self, from_index: int, to_index: int, reason: str) -> None:
        structlog.get_logger().warning(
            LOG_INTEL_FAILOVER,
            provider=self.name,
            model=self.intelligence.model,
            from_endpoint=redact_url(self.endpoints.urls[from_index]),
            to_endpoint=redact_url(self.endpoints.urls[to_index]),
            reason=reason,
        )


async def _drain(chunks: AsyncIterator[bytes]) -> None:
    """After the stream's terminator, read the body's end so the connection can be reused, but
    never wait long for it: the answer is already whole."""
    with anyio.move_on_after(_DRAIN_SECONDS):
        try:
            async for _ in chunks:
                pass
        except httpx.HTTPError:
            pass


class _TransportErrors:
    """Maps httpx transport failures to Retryable with a message that names no URL or secret."""

    def __init__(self, timeout: httpx.Timeout) -> None:
        self._timeout = timeout

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is None or not isinstance(exc, httpx.HTTPError):
            return None
        raise Retryable(self._describe(exc)) from None

    def _describe(self, exc: httpx.HTTPError) -> str:
        # httpx messages can embed the request URL; say what happened in our own words instead.
        if isinstance(exc, httpx.ConnectTimeout):
            return f"connect timed out after {self._timeout.connect:g}s"
        if isinstance(exc, httpx.ConnectError):
            return f"cannot connect: {_errno_text(exc)}"
        if isinstance(exc, httpx.ReadTimeout):
            return f"no data from the server for {self._timeout.read:g}s (read timeout)"
        if isinstance(exc, httpx.TimeoutException):
            return f"timed out ({type(exc).__name__})"
        if isinstance(exc, httpx.RemoteProtocolError):
            return "the server closed the connection before the response was complete"
        if isinstance(exc, httpx.NetworkError):
            return f"the connection failed: {type(exc).__name__}"
        return f"HTTP transport error: {type(exc).__name__}"


def _errno_text(exc: httpx.HTTPError) -> str:
    """'connection refused' and the like, from the OSError under an httpx error."""
    for cause in iter_causes(exc):
        if isinstance(cause, OSError) and (cause.errno or cause.strerror):
            return (os.strerror(cause.errno) if cause.errno else str(cause.strerror)).lower()
    return type(exc).__name__
