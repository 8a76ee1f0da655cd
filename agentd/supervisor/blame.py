"""Who is to blame for a child's crash, and what happens to the turns it was running. Pure.

A child that dies takes every turn it was running with it. Those turns re-run on another child
from the committed transcript; but a session whose turn keeps killing its child must not take
other sessions down with it, nor re-run forever. The rules (rfcs/0006-pool.md):

- Blame is per session: a crash is counted against each session that had a turn *in flight* on
  the child when it died. Sessions that were only loaded (idle) are not blamed at all.
- A session blamed for ``QUARANTINE_AFTER`` (2) crashes within ``CRASH_WINDOW`` (60 s) is
  quarantined: its turns run on a child of its own from then on, so a later crash of that child
  is nobody else's. A bystander quarantined with it is alone on its child too, so it is never
  failed for another session's crash.
- A session blamed for more than ``MAX_CRASHES`` (5) crashes within the window is ``failed``
  (kept, visible, resumable by a new message).
- A turn's deadline counts from its start across every re-run: a re-run that would start past
  the deadline is not started; the turn ends ``deadline`` without another child.
"""

from __future__ import annotations

import enum

import msgspec

__all__ = [
    "CRASH_WINDOW",
    "MAX_CRASHES",
    "QUARANTINE_AFTER",
    "Blame",
    "CrashVerdict",
    "blame",
    "quarantined",
    "rerun_allowed",
]

CRASH_WINDOW = 60.0
QUARANTINE_AFTER = 2
MAX_CRASHES = 5


class CrashVerdict(enum.StrEnum):
    """What a crash means for a session that had a turn in flight."""

    RERUN = "rerun"  # re-run its turn on another child
    QUARANTINE = "quarantine"  # re-run it on a child of its own
    FAIL = "fail"  # mark the session failed; its turn ends failed


class Blame(msgspec.Struct, frozen=True):
    """A session's recent crashes (monotonic times, oldest first) and the verdict of the newest."""

    crashes: tuple[float, ...]
    verdict: CrashVerdict


def blame(crashes: tuple[float, ...], now: float, *, window: float = CRASH_WINDOW) -> Blame:
    """Count a crash at ``now`` against a session with the recent ``crashes``; say what to do next."""
    recent = (*(t for t in crashes if now - t <= window), now)
    if len(recent) > MAX_CRASHES:
        return Blame(recent, CrashVerdict.FAIL)
    if len(recent) >= QUARANTINE_AFTER:
        return Blame(recent, CrashVerdict.QUARANTINE)
    return Blame(recent, CrashVerdict.RERUN)


def quarantined(crashes: tuple[float, ...], now: float, *, window: float = CRASH_WINDOW) -> bool:
    """Whether a session is (still) quarantined: blamed for ``QUARANTINE_AFTER`` crashes within the window.

    Quarantine lapses: once its crashes are older than the window, the session shares children again.
    """
    return sum(1 for t in crashes if now - t <= window) >= QUARANTINE_AFTER


def rerun_allowed(started_at: float, deadline: float, now: float) -> bool:
    """Whether an interrupted turn may run again: only while its deadline (from its first start) is ahead."""
    return now < started_at + deadline
