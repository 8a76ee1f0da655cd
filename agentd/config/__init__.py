"""The config schema (the one definition of it), loading, validation and model-swap precedence.

The TOML file is checked field by field against the msgspec Structs below so that *every* error is
reported with its field path, not just the first one msgspec would stop at. Durations are written
as strings (``"250ms"``, ``"10s"``, ``"2m"``) and held as float seconds.

A config that parses is whole: every value fits the control protocol's msgpack frames and the model
servers' JSON (integers are bounded, durations at most ``MAX_DURATION``, ``options`` hold only
JSON-like values in 64 bits), so applying it cannot fail half-way because a child or a server
cannot be sent what it holds. A file is read with a bound (``read_config_text``): a FIFO, a device
or a hung file system gives an error naming the path, never a reload or a shutdown that hangs.
"""

from __future__ import annotations

import os
import stat
import threading
import tomllib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Literal

import msgspec

from agentd.config.checks import (
    accepted_values,
    error_path,
    leaf_message,
    normalize,
    semantic_issues,
)
from agentd.config.schema import (
    INT64_MAX,
    INT64_MIN,
    MAX_CONFIG_BYTES,
    MAX_DURATION,
    READ_TIMEOUT,
    RESTART_ONLY_SECTIONS,
    TRANSFER_TOOL_PREFIX,
    Assistant,
    Config,
    ConfigError,
    ConfigIssue,
    FirstMessageMode,
    Intelligence,
    IntelligenceOverride,
    Limits,
    McpServer,
    Price,
    ProviderName,
    ServerSettings,
    StoreSettings,
    SupervisorSettings,
    SwapPolicy,
    Transfer,
    TransferMode,
    effective_intelligence,
    parse_duration,
)

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "MAX_CONFIG_BYTES",
    "MAX_DURATION",
    "READ_TIMEOUT",
    "RESTART_ONLY_SECTIONS",
    "TRANSFER_TOOL_PREFIX",
    "Assistant",
    "Config",
    "ConfigError",
    "ConfigIssue",
    "FirstMessageMode",
    "Intelligence",
    "IntelligenceOverride",
    "Limits",
    "McpServer",
    "PolicyChoice",
    "Price",
    "ProviderName",
    "ServerSettings",
    "StoreSettings",
    "SupervisorSettings",
    "SwapPolicy",
    "Transfer",
    "TransferMode",
    "config_env_names",
    "effective_intelligence",
    "intelligence_map",
    "load_config",
    "parse_config",
    "parse_duration",
    "quickstart_config",
    "quickstart_text",
    "read_config_text",
    "resolve_swap_policy",
    "store_url_problem",
]

# --------------------------------------------------------------------------- public API


def parse_config(text: str, source: str = "<config>") -> Config:
    """Parse and validate TOML text; raise ConfigError with every issue found.

    Text that defines nothing (empty, or only comments) is an error, not the defaults: a file
    caught half-written by a reload must not replace every assistant with the default one. Only
    an absent config file means the built-in quickstart (``quickstart_config``).
    """
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([ConfigIssue("", f"invalid TOML: {exc}")], source) from None
    except RecursionError:  # tomllib recurses per nesting level
        raise ConfigError([ConfigIssue("", "invalid TOML: arrays or tables nested too deeply")], source) from None
    if not raw:
        raise ConfigError(
            [
                ConfigIssue(
                    "assistants",
                    "the config defines no assistants (the file is empty or only comments); "
                    "add at least one [[assistants]] table",
                )
            ],
            source,
        )
    issues: list[ConfigIssue] = []
    normalized = normalize(raw, Config, "", issues)
    if issues:
        raise ConfigError(issues, source)
    try:
        config = msgspec.convert(normalized, Config)
    except msgspec.ValidationError as exc:  # a case the field walk missed; still name it, at its path
        raise ConfigError([ConfigIssue(error_path(exc), leaf_message(exc))], source) from None
    semantic = semantic_issues(config)
    if semantic:
        raise ConfigError(semantic, source)
    return config


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read (``read_config_text``) and validate a config file; raise ConfigError naming the file."""
    return parse_config(read_config_text(path), str(path))


def read_config_text(path: str | os.PathLike[str], timeout: float = READ_TIMEOUT) -> str:
    """The text of a config file, read with bounds; ConfigError otherwise, whose message names the
    file (a reload's result carries the message alone).

    Refused: anything but a regular file (a FIFO would block the reader until some writer
    appeared), more than ``MAX_CONFIG_BYTES``, text that is not UTF-8, and a read that has not
    finished within ``timeout`` seconds (a hung network file system). The read runs on a daemon
    thread: when it hangs, only that thread waits, and it cannot keep the process from exiting.
    """
    outcome: list[bytes | ConfigIssue] = []
    done = threading.Event()

    def read() -> None:
        try:
            outcome.append(_read_regular_file(Path(path)))
        except Exception as exc:  # never leave the caller waiting out the timeout for a bug
            outcome.append(ConfigIssue("", f"cannot read config file {path}: {type(exc).__name__}: {exc}"))
        finally:
            done.set()

    threading.Thread(target=read, name="agentd-config-read", daemon=True).start()
    done.wait(timeout)
    if not outcome:
        raise ConfigError(
            [ConfigIssue("", f"cannot read config file {path}: no answer within {timeout:g}s (a hung file system?)")],
            str(path),
        )
    data = outcome[0]
    if isinstance(data, ConfigIssue):
        raise ConfigError([data], str(path))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [ConfigIssue("", f"config file {path} is not UTF-8 text: byte {exc.start}: {exc.reason}")], str(path)
        ) from None


def _read_regular_file(path: Path) -> bytes | ConfigIssue:
    """The file's bytes, or the issue that stops them being read. Runs on the reader thread."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (it changes nothing for a regular file).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        return ConfigIssue("", f"cannot read config file {path}: {exc.strerror or exc}")
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            return ConfigIssue("", f"cannot read config file {path}: not a regular file (it is {_file_kind(mode)})")
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, 1 << 16):
            size += len(chunk)
            if size > MAX_CONFIG_BYTES:
                return ConfigIssue("", f"config file {path} is larger than {MAX_CONFIG_BYTES // (1024 * 1024)} MiB")
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as exc:
        return ConfigIssue("", f"cannot read config file {path}: {exc.strerror or exc}")
    finally:
        os.close(fd)


def _file_kind(mode: int) -> str:
    kinds = [
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ]
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def quickstart_text() -> str:
    """The built-in quickstart config (scripted model, no network) shipped inside the package."""
    return resources.files("agentd").joinpath("quickstart.toml").read_text(encoding="utf-8")


def quickstart_config() -> Config:
    return parse_config(quickstart_text(), "<built-in quickstart>")


def config_env_names(config: Config) -> list[str]:
    """Every environment variable the config names (``api_key_env``, ``env_from``, ``headers_from``).

    What a child's environment must hold for the config to work: secrets are read from these,
    in the child, when they are used (RFC 0008 §3).
    """
    names = [config.intelligence.api_key_env]
    names += [a.intelligence.api_key_env for a in config.assistants if a.intelligence is not None]
    for server in config.mcp_servers:
        names += [*server.env_from, *server.headers_from.values()]
    return sorted({name for name in names if name})


def intelligence_map(config: Config) -> dict[str, Intelligence]:
    """Effective intelligence of every assistant, keyed by assistant name."""
    return {a.name: effective_intelligence(config, a.name) for a in config.assistants}


PolicySource = Literal["flag", "env", "file", "default"]


class PolicyChoice(msgspec.Struct, frozen=True):
    """The effective swap policy and where it came from."""

    policy: SwapPolicy
    source: PolicySource


def _policy_value(value: str, where: str) -> SwapPolicy:
    try:
        return SwapPolicy(value)
    except ValueError:
        accepted = accepted_values([p.value for p in SwapPolicy])
        raise ConfigError([ConfigIssue(where, f"invalid value {value!r}; accepted values: {accepted}")]) from None


def resolve_swap_policy(
    flag: str | None, environ: Mapping[str, str] | None = None, file_value: SwapPolicy | None = None
) -> PolicyChoice:
    """Apply the precedence ``--model-swap`` > ``AGENTD_MODEL_SWAP`` > file ``model_swap`` > finish-on-old."""
    env = os.environ if environ is None else environ
    if flag:
        return PolicyChoice(_policy_value(flag, "--model-swap"), "flag")
    if env.get("AGENTD_MODEL_SWAP"):
        return PolicyChoice(_policy_value(env["AGENTD_MODEL_SWAP"], "AGENTD_MODEL_SWAP"), "env")
    if file_value is not None:
        return PolicyChoice(file_value, "file")
    return PolicyChoice(SwapPolicy.FINISH_ON_OLD, "default")
