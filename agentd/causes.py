"""Walking an exception's causes: the one implementation, for every "what was the OS error?" question."""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["iter_causes"]


def iter_causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then what led to it, depth first, each exception once.

    Each exception leads to its ``__cause__`` (``raise … from``), else to its ``__context__`` (the
    exception being handled when it was raised), even when ``raise … from None`` hid that context
    from tracebacks: httpcore raises its ConnectError ``from None`` while handling the OSError that
    says what went wrong, and that OSError is what callers look for. An exception group's members
    come before its own cause (anyio groups the errors of several connection attempts). A chain
    that loops back on itself ends at the repeat.
    """
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        following = current.__cause__ or current.__context__
        if following is not None:
            stack.append(following)
        if isinstance(current, BaseExceptionGroup):
            stack.extend(reversed(current.exceptions))  # popped first: members before the group's cause
