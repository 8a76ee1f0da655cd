"""Signals that arrive while the ``agentd`` command starts (RFC 0000 §5), recorded, not fatal.

Importing the CLI takes a while; a SIGHUP (or SIGTERM, SIGINT) in that time would get its default
action — a SIGHUP kills the process — before the daemon's own handlers exist. ``agentd.entry``
calls ``install`` as the very first thing; it records them instead, and this module stays light
(only ``signal``). ``agentd run`` takes the
recorded signals over (``agentd.supervisor.daemon.EarlySignals``) and acts on them once it serves
(RFC 0000 §5); every other command ``release``\\ s them: default handlers back, and what arrived
delivered again. A plain ``import agentd`` installs nothing.
"""

from __future__ import annotations

import os
import signal

__all__ = ["SIGNALS", "install", "received", "release", "take"]

SIGNALS = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)
#: Signals recorded since ``install``, in arrival order.
received: list[int] = []
_installed = False


def _remember(signum: int, _frame: object) -> None:
    received.append(signum)


def install() -> None:
    """Record SIGHUP/SIGTERM/SIGINT from now on instead of acting on them."""
    global _installed
    for signum in SIGNALS:
        signal.signal(signum, _remember)
    _installed = True


def release() -> None:
    """Not the daemon: the default handlers back, and each recorded signal delivered again."""
    global _installed
    if not _installed:
        return
    _installed = False
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    pending, received[:] = list(received), []
    for signum in pending:
        os.kill(os.getpid(), signum)


def take() -> list[int]:
    """For the daemon: the signals recorded so far (its own handlers are installed by now)."""
    global _installed
    _installed = False
    pending, received[:] = list(received), []
    return pending
