"""A turn's text as it streams, for ``agentd chat`` and ``agentd send`` (RFC 0000 §4, §7).

``DeltaPrinter`` is pure: fed a turn's events in order, it returns the text to write. Each step's
``delta`` content is written as it comes, after a label (chat: who speaks); a ``step.reset``, a
``turn.restarted`` or a delta of a later run (the turn re-ran after its child died) ends the
line with a ``[discarded: …]`` mark, so text that was taken back is never silently run together
with what replaces it. Steps whose streamed text is exactly their ``step.done`` content are
remembered (``shown``) so the caller does not print the reply a second time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from agentd import events

__all__ = ["DeltaPrinter"]

Label = Callable[[Mapping[str, Any]], str]


class DeltaPrinter:
    """Streamed text for the terminal (see the module docstring)."""

    def __init__(self, label: Label = lambda _: "") -> None:
        self._label = label
        self.shown: list[str] = []  # contents of steps printed whole while they streamed
        self._key: tuple[int, int] | None = None  # (run, step) whose text is on the current line
        self._text = ""  # what of it was printed
        self._run = 0  # the newest run seen: deltas of older runs are void

    @property
    def mid_line(self) -> bool:
        """Whether streamed text left the cursor in the middle of a line."""
        return self._key is not None

    def feed(self, name: str, data: Mapping[str, Any]) -> str:
        """The text to write for one event of the turn ("" for most)."""
        run = data.get("run")
        if name == events.DELTA and isinstance(run, int):
            return self._delta(run, data)
        if name == events.STEP_RESET and self._key == (run, data.get("step")):
            return self._discard(str(data.get("reason") or "the model call started over"))
        if name == events.TURN_RESTARTED:
            self._run = run if isinstance(run, int) else self._run + 1
            return self._discard(f"the turn restarts on {data.get('model_to')}")
        if name == events.STEP_DONE and self._key is not None and self._key == (run, data.get("step")):
            if self._text == data.get("content"):
                self.shown.append(self._text)
            return self.break_line()
        return ""

    def break_line(self) -> str:
        """End the streamed line (before another line is printed)."""
        if self._key is None:
            return ""
        self._key, self._text = None, ""
        return "\n"

    def streamed(self, data: Mapping[str, Any]) -> bool:
        """Whether ``step.done``'s content (``data``) was already printed as it streamed."""
        content = data.get("content")
        return bool(content) and content in self.shown

    def take_shown(self, content: str) -> bool:
        """Whether ``content`` (a reply entry's) was printed as it streamed; forgets it once told."""
        if content in self.shown:
            self.shown.remove(content)
            return True
        return False

    def _delta(self, run: int, data: Mapping[str, Any]) -> str:
        out = ""
        if run > self._run:  # a re-run (its child died): what the old run printed is void
            out += self._discard(f"the turn re-runs (run {run})")
            self._run = run
        elif run < self._run:
            return ""  # a late delta of a void run
        content = data.get("content")
        if not isinstance(content, str) or not content:
            return out
        key = (run, int(data.get("step") or 0))
        if key != self._key:
            out += self.break_line() + self._label(data)
            self._key, self._text = key, ""
        self._text += content
        return out + content

    def _discard(self, reason: str) -> str:
        if self._key is None:
            return ""
        self._key, self._text = None, ""
        return f"\n  [discarded: {reason}]\n"
