"""What every ``agentd`` command shares: flag/environment twins, output and errors, the client."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

import msgspec

from agentd.apitoken import TokenError, api_token
from agentd.client import AgentdClient
from agentd.config import (
    ConfigError,
    load_config,
)
from agentd.statedir import resolve_state_dir

# The env twin of every flag, shown in --help. Client-only twins come after the `run` ones.
ENV_TWINS: dict[str, str] = {
    "--config": "AGENTD_CONFIG",
    "--state-dir": "AGENTD_STATE_DIR",
    "--model-swap": "AGENTD_MODEL_SWAP",
    "--listen": "AGENTD_LISTEN",
    "--watch-config": "AGENTD_WATCH_CONFIG",
    "--log-format": "AGENTD_LOG_FORMAT",
    "--log-level": "AGENTD_LOG_LEVEL",
    "--url": "AGENTD_URL",
    "--session": "AGENTD_SESSION",
    "--assistant": "AGENTD_ASSISTANT",
}
DEFAULT_CONFIG_FILE = Path("agentd.toml")
LOG_FORMATS = ("json", "console", "auto")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
TRUE_WORDS = {"1", "true", "yes", "on"}
FALSE_WORDS = {"0", "false", "no", "off", ""}
# Turn statuses that are a normal end of a turn; any other status makes `send` exit 1.
OK_STATUSES = {"completed", "transferred"}
PREVIEW = 200  # characters of a tool result / thinking shown by `chat`


class UsageError(Exception):
    """A bad flag, env value or argument: exit 2."""


# --------------------------------------------------------------------------- helpers


def twin_value(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """An env twin's value; empty counts as unset, so ``AGENTD_X=`` cannot set a blank path."""
    value = (os.environ if environ is None else environ).get(name)
    return value if value else None


def err(message: str) -> None:
    print(f"agentd: {message}", file=sys.stderr, flush=True)


def out(text: str = "", stream: TextIO | None = None) -> None:
    # Flushed at once: `chat` output must interleave correctly when piped.
    print(text, file=stream or sys.stdout, flush=True)


def default_config_path(environ: Mapping[str, str] | None = None) -> Path | None:
    """``AGENTD_CONFIG``, else ``./agentd.toml`` if it exists, else None (the built-in quickstart)."""
    named = twin_value("AGENTD_CONFIG", environ)
    if named is not None:
        return Path(named)
    return DEFAULT_CONFIG_FILE if DEFAULT_CONFIG_FILE.is_file() else None


def client_state_dir(flag: str | None) -> Path:
    """Where a client looks for the daemon: the daemon's own rule (``agentd.statedir``)."""
    return resolve_state_dir(flag, os.environ, _configured_state_dir)


def _configured_state_dir() -> str | None:
    config_path = default_config_path()
    if config_path is None:
        return None
    try:
        return load_config(config_path).server.state_dir  # a bounded read: a FIFO cannot hang us
    except ConfigError:
        return None  # a broken config is `run`'s and `check-config`'s business, not ours


def make_client(args: argparse.Namespace) -> AgentdClient:
    url = args.url or twin_value("AGENTD_URL")
    token = None
    if url:  # the token is sent only over TCP: one the daemon could never match is a usage error, not a 401
        try:
            token = api_token(os.environ)
        except TokenError as exc:
            raise UsageError(str(exc)) from None
    return AgentdClient(client_state_dir(args.state_dir), url=url, token=token or "")


def parse_bool(value: str, name: str) -> bool:
    lowered = value.strip().lower()
    if lowered in TRUE_WORDS:
        return True
    if lowered in FALSE_WORDS:
        return False
    raise UsageError(f"{name}: invalid value {value!r}; accepted values: 1, true, yes, on, 0, false, no, off")


def check_listen(value: str, name: str) -> str:
    host, colon, port = value.rpartition(":")
    if not colon or not port.isdigit() or not 0 <= int(port) <= 65535 or any(c.isspace() for c in host):
        raise UsageError(f"{name}: invalid address {value!r}; expected HOST:PORT, like 127.0.0.1:8080")
    return value


def one_line(text: str, limit: int = PREVIEW) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def to_json(value: Any) -> str:
    return msgspec.json.encode(value).decode()
