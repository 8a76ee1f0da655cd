"""What the daemon sets up in its own process before it serves: the open-files limit and the way
asyncio watches child processes."""

from __future__ import annotations

import os
import resource
import sys

from agentd import events
from agentd.obs import get_logger

__all__ = ["raise_fd_limit", "use_pidfd_child_watcher"]

log = get_logger("supervisor")


def raise_fd_limit() -> None:
    """Raise the soft limit on open files to the hard one: each child costs the supervisor two fds,
    each API connection one, and systemd's default soft limit (1024) is far below what a pool and
    thousands of clients need."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ValueError, OSError) as exc:
        log.warning(events.LOG_SUPERVISOR_FD_LIMIT, soft=soft, hard=hard, error=str(exc))


def use_pidfd_child_watcher() -> None:
    """Watch children through pidfds, not a thread per child.

    Python 3.11's default asyncio child watcher starts a thread for every child process; from 3.12
    on, asyncio picks a pidfd watcher by itself where the kernel has pidfds (and the watcher API
    is deprecated), so this only acts on 3.11.
    """
    if sys.version_info >= (3, 12) or not hasattr(os, "pidfd_open"):
        return
    import asyncio

    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:  # an old kernel: keep the default
        return
    watcher = asyncio.PidfdChildWatcher()
    watcher.attach_loop(asyncio.get_running_loop())
    asyncio.get_event_loop_policy().set_child_watcher(watcher)
