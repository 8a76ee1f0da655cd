"""agentd.causes.iter_causes, and the error texts built on it (CLI client and providers)."""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable

import httpx
import pytest

from agentd.causes import iter_causes
from agentd.client import _caused_by, _reason
from agentd.intel.http import _errno_text


def _raise_from(exc: BaseException, cause: BaseException | None) -> BaseException:
    try:
        raise exc from cause
    except BaseException as caught:
        return caught


def test_explicit_cause_chain() -> None:
    a = ValueError("a")
    b = _raise_from(KeyError("b"), a)
    c = _raise_from(RuntimeError("c"), b)
    assert list(iter_causes(c)) == [c, b, a]


def _caught(raiser: Callable[[], object]) -> BaseException:
    try:
        raiser()
    except BaseException as caught:
        return caught
    raise AssertionError("nothing was raised")


def _while_handling(exc: BaseException, cause: BaseException | None = None, *, suppress: bool = False) -> None:
    try:
        raise ValueError("handled")
    except ValueError:
        if suppress:
            raise exc from None
        if cause is not None:
            raise exc from cause
        raise exc  # noqa: B904 - the implicit context is what is tested


def test_implicit_context_is_followed() -> None:
    outer = _caught(lambda: _while_handling(KeyError("outer")))
    assert [type(e) for e in iter_causes(outer)] == [KeyError, ValueError]


def test_a_context_hidden_by_from_none_is_still_followed_and_a_cause_wins_over_it() -> None:
    # httpcore raises its ConnectError "from None" while handling the OSError that says why.
    suppressed = _caught(lambda: _while_handling(KeyError("fresh"), suppress=True))
    assert suppressed.__suppress_context__
    assert [type(e) for e in iter_causes(suppressed)] == [KeyError, ValueError]
    explicit = OSError("explicit")
    wrapped = _caught(lambda: _while_handling(KeyError("wrapped"), explicit))
    assert isinstance(wrapped.__context__, ValueError)
    assert list(iter_causes(wrapped)) == [wrapped, explicit]


def test_a_cycle_ends_at_the_repeat() -> None:
    a, b = ValueError("a"), ValueError("b")
    a.__cause__, b.__cause__ = b, a
    assert list(iter_causes(a)) == [a, b]
    c = ValueError("c")
    c.__context__ = c
    assert list(iter_causes(c)) == [c]


def test_a_very_long_chain_does_not_recurse() -> None:
    head: BaseException = ValueError(0)
    for n in range(1, 5000):
        wrapper = ValueError(n)
        wrapper.__cause__ = head
        head = wrapper
    assert len(list(iter_causes(head))) == 5000


def test_group_members_come_before_the_groups_cause_and_each_exception_once() -> None:
    refused = ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
    timed_out = TimeoutError(errno.ETIMEDOUT, "Connection timed out")
    group = ExceptionGroup("multiple connection attempts failed", [refused, timed_out, refused])
    group.__cause__ = refused
    outer = _raise_from(OSError("All connection attempts failed"), group)
    assert list(iter_causes(outer)) == [outer, group, refused, timed_out]


def _connect_error(root: BaseException) -> httpx.ConnectError:
    # The shape httpx gives a failed connect: ConnectError from httpcore's error from anyio's OSError.
    anyio_error = _raise_from(OSError("All connection attempts failed"), root)
    core_error = _raise_from(RuntimeError("httpcore.ConnectError"), anyio_error)
    error = _raise_from(httpx.ConnectError("All connection attempts failed"), core_error)
    assert isinstance(error, httpx.ConnectError)
    return error


def test_the_os_reason_is_found_under_httpx_for_the_client_and_the_providers() -> None:
    refused = ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
    for root in (refused, ExceptionGroup("multiple connection attempts failed", [refused])):
        error = _connect_error(root)
        assert _reason(error) == "Connection refused"
        assert _errno_text(error) == "connection refused"
        assert _caused_by(error, ConnectionRefusedError)
        assert not _caused_by(error, FileNotFoundError)


def test_a_real_refused_connect_names_its_reason() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    with httpx.Client(trust_env=False) as client, pytest.raises(httpx.ConnectError) as caught:
        client.get(f"http://127.0.0.1:{port}/")
    assert _reason(caught.value) == "Connection refused"
    assert _errno_text(caught.value) == "connection refused"
    assert _caused_by(caught.value, ConnectionRefusedError)


def test_without_an_os_error_the_texts_fall_back() -> None:
    error = _connect_error(ValueError("no OS error here"))
    assert _reason(error) == "All connection attempts failed"
    assert _errno_text(error) == "ConnectError"
