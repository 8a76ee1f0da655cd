"""Where the daemon keeps its socket, pid file and store: the one rule, for the daemon and its clients.

The flag, else ``AGENTD_STATE_DIR`` (empty counts as unset), else the config's ``[server]
state_dir``, else ``./.agentd`` (RFC 0000 §2). The daemon (``agentd run``) and every client command
(``agentd status``, ``reload``, ``chat``…) resolve it through ``resolve_state_dir``, so a client
finds the daemon the config put elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

__all__ = ["DEFAULT_STATE_DIR", "STATE_DIR_ENV", "resolve_state_dir"]

DEFAULT_STATE_DIR = Path(".agentd")
STATE_DIR_ENV = "AGENTD_STATE_DIR"


def resolve_state_dir(
    flag: str | Path | None, environ: Mapping[str, str], configured: Callable[[], str | None]
) -> Path:
    """The state dir by its one rule. ``configured`` reads the config's ``[server] state_dir``; it is
    called only when neither the flag nor the environment names one (a client then reads the file)."""
    if flag:
        return Path(flag)
    named = environ.get(STATE_DIR_ENV)
    if named:
        return Path(named)
    from_config = configured()
    return Path(from_config) if from_config else DEFAULT_STATE_DIR
