"""How ``agentd run`` was asked to run: flags (already merged with their AGENTD_* env twins)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

__all__ = ["DaemonOptions"]


class DaemonOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Startup options. ``model_swap_flag`` is the ``--model-swap`` value only: AGENTD_MODEL_SWAP is
    read by the precedence rule on every reload, so the env twin is not folded in here."""

    config_path: Path | None = None  # None: the built-in quickstart config
    state_dir: Path | None = None  # None: [server] state_dir from the file, else ./.agentd
    model_swap_flag: str | None = None
    listen: str | None = None  # HOST:PORT for the optional TCP listener (bearer token required)
    watch_config: bool = False
    log_format: Literal["json", "console", "auto"] = "auto"
    log_level: str = "info"
