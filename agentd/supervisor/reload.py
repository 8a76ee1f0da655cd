"""Reload (RFC 0003 §4): the pure config diff, and the coordinator that serializes and coalesces reloads.

``plan_reload`` says what a new config changes: the changed field paths, the restart-only paths
(kept at their old values), and which assistants' effective intelligence changed — the input of
the per-session fan-out. ``ReloadCoordinator`` runs one reload at a time; requests that arrive
while one runs are served together by exactly one more.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar

import anyio
import msgspec

from agentd.config import RESTART_ONLY_SECTIONS, Config, Intelligence, intelligence_map

__all__ = ["ReloadCoordinator", "ReloadPlan", "changed_paths", "plan_reload", "sessions_to_swap"]

T = TypeVar("T")


def changed_paths(old: Any, new: Any, path: str = "") -> list[str]:
    """Leaf field paths whose values differ (``assistants[1].intelligence.model``, ``intelligence.options.temperature``)."""
    if old == new:
        return []
    if isinstance(old, msgspec.Struct) and type(old) is type(new):
        paths: list[str] = []
        for field in msgspec.structs.fields(old):
            child = f"{path}.{field.encode_name}" if path else field.encode_name
            paths += changed_paths(getattr(old, field.name), getattr(new, field.name), child)
        return paths
    if isinstance(old, dict) and isinstance(new, dict):
        paths = []
        for key in list(old) + [k for k in new if k not in old]:
            paths += changed_paths(old.get(key), new.get(key), f"{path}.{key}")
        return paths
    if isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new):
        paths = []
        for index, (a, b) in enumerate(zip(old, new, strict=True)):
            paths += changed_paths(a, b, f"{path}[{index}]")
        return paths
    return [path]


class ReloadPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What applying ``config`` changes relative to the running config."""

    config: Config  # the config to run: the new file with restart-only sections kept as they were
    changed: list[str]
    restart_required: list[str]
    intelligence: dict[str, Intelligence]  # every assistant's effective intelligence under ``config``
    intelligence_changed: list[str]  # assistants (existing before and after) whose intelligence changed


def plan_reload(old: Config, new: Config) -> ReloadPlan:
    """Diff ``new`` against the running ``old`` config."""
    paths = changed_paths(old, new)
    restart_required = [p for p in paths if p.split(".", 1)[0].split("[", 1)[0] in RESTART_ONLY_SECTIONS]
    kept = {section: getattr(old, section) for section in RESTART_ONLY_SECTIONS}
    config = msgspec.structs.replace(new, **kept)
    old_map, new_map = intelligence_map(old), intelligence_map(config)
    changed = [name for name, intel in new_map.items() if name in old_map and old_map[name] != intel]
    return ReloadPlan(
        config=config,
        changed=[p for p in paths if p not in restart_required],
        restart_required=restart_required,
        intelligence=new_map,
        intelligence_changed=changed,
    )


def sessions_to_swap(current_assistants: Mapping[str, str], intelligence_changed: Iterable[str]) -> list[str]:
    """Sessions (id → current assistant) whose current assistant's effective intelligence changed."""
    changed = set(intelligence_changed)
    return [session for session, assistant in current_assistants.items() if assistant in changed]


class ReloadCoordinator(Generic[T]):
    """Runs reloads one at a time. A request waits for a reload that *starts after it arrived*:
    requests that pile up during one reload are all answered by exactly one more."""

    def __init__(self, reload: Callable[[], Awaitable[T]]) -> None:
        self._reload = reload
        self._lock = anyio.Lock()
        self._requested = 0
        self._covered = 0
        self._last: T | None = None

    async def request(self) -> T:
        """Ask for a reload; return the result of the reload that covered this request."""
        self._requested += 1
        ticket = self._requested
        async with self._lock:
            if self._covered >= ticket and self._last is not None:
                return self._last
            covering = self._requested
            result = await self._reload()
            self._covered, self._last = covering, result
            return result
