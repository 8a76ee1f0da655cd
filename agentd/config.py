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

import datetime as dt
import enum
import math
import os
import re
import stat
import threading
import tomllib
import types
import typing
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import parse_qs, urlsplit

import msgspec

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "MAX_CONFIG_BYTES",
    "MAX_DURATION",
    "READ_TIMEOUT",
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


class SwapPolicy(enum.StrEnum):
    """What an in-flight turn does when a reload changes its model (RFC 0002 §4, §5)."""

    FINISH_ON_OLD = "finish-on-old"
    RESTART_TURN = "restart-turn"


class TransferMode(enum.StrEnum):
    """How much of the history the destination assistant sees after a transfer (RFC 0004 §3)."""

    ROLLING_HISTORY = "rolling-history"
    SWAP_SYSTEM_MESSAGE = "swap-system-message-in-history"
    SWAP_SYSTEM_MESSAGE_AND_REMOVE_TRANSFER = "swap-system-message-in-history-and-remove-transfer-tool-messages"
    DELETE_HISTORY = "delete-history"


class FirstMessageMode(enum.StrEnum):
    """What happens when an assistant takes a conversation (session start or after a transfer)."""

    SPEAKS_FIRST = "assistant-speaks-first"
    SPEAKS_FIRST_MODEL_GENERATED = "assistant-speaks-first-with-model-generated-message"
    WAITS_FOR_USER = "assistant-waits-for-user"


ProviderName = Literal["scripted", "ollama", "openai"]

#: The widest integer the wire carries both ways: msgpack frames and the JSON most servers parse.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: The longest duration any setting takes. Longer is a typo, not a setting, and every timer stays
#: finite (a duration string of 400 digits would otherwise be a float infinity).
MAX_DURATION = 7 * 24 * 3600.0
#: A config file larger than this is refused before it is read whole.
MAX_CONFIG_BYTES = 16 * 1024 * 1024
#: How long reading the config file may take (a hung network file system never answers).
READ_TIMEOUT = 5.0
#: How deeply ``options`` values may nest (tables and arrays).
MAX_OPTION_DEPTH = 32

_DURATION = {"duration": True}
Seconds = Annotated[float, msgspec.Meta(gt=0, le=MAX_DURATION, extra=_DURATION)]
# Assistant names become tool names ("transfer_to_<name>"), which providers limit to [A-Za-z0-9_-]{1,64}.
TRANSFER_TOOL_PREFIX = "transfer_to_"
Name = Annotated[
    str, msgspec.Meta(min_length=1, max_length=64 - len(TRANSFER_TOOL_PREFIX), pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
]
EnvVarName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
# A name, or a prefix ending in ``*`` ("OTEL_*"): what ``[supervisor] pass_env`` lets through to children.
EnvVarPattern = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*\*?$")]
# A built-in (``clock``), a Python callable (``package.module:function``), or a tool of an MCP server
# (``server:tool``, ``server:*``). The last two share a syntax: a prefix that names an
# ``[[mcp_servers]]`` entry is a server (RFC 0008 §2). MCP tool names may hold ``-`` and ``.``.
ToolRef = Annotated[
    str, msgspec.Meta(min_length=1, pattern=r"^([A-Za-z_][A-Za-z0-9_]*|[A-Za-z0-9_][\w.-]*:(\*|[A-Za-z0-9_][\w.-]*))$")
]
# HTTP header names (RFC 9110 tokens, the usual subset).
HeaderName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")]


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base for config sections: immutable, unknown keys rejected."""


class Intelligence(_Section, frozen=True):
    """Which model serves an assistant and how to reach it."""

    provider: ProviderName = "scripted"
    endpoints: tuple[str, ...] = ()
    model: Annotated[str, msgspec.Meta(min_length=1)] = "echo-small"
    api_key_env: EnvVarName | None = None
    options: dict[str, Any] = {}


class IntelligenceOverride(_Section, frozen=True):
    """Per-assistant intelligence: every set field replaces the default's; ``options`` merge key-wise."""

    provider: ProviderName | None = None
    endpoints: tuple[str, ...] | None = None
    model: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    api_key_env: EnvVarName | None = None
    options: dict[str, Any] | None = None


class Limits(_Section, frozen=True):
    """The per-turn budget (RFC 0007 §4) and the restart-turn bound (RFC 0002 §5)."""

    # Upper bounds keep every value far inside the wire's 64 bits and reject typos.
    max_steps: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 8
    max_tokens: Annotated[int, msgspec.Meta(ge=0, le=1_000_000_000_000)] = 0  # 0 = no token budget
    deadline: Seconds = 120.0
    max_turn_restarts: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 2


class SupervisorSettings(_Section, frozen=True):
    """Child supervision timings (RFC 0003 §2, §5) and the pool of children (RFC 0006 §2)."""

    spawn_timeout: Seconds = 10.0
    ping_interval: Seconds = 2.0
    ping_timeout: Seconds = 10.0
    stop_grace: Seconds = 10.0
    # Active children kept with no load, and the most concurrent turns are spread over; 0 = keep
    # none (the spares only) and spread over up to the CPU count, at least 2 (RFC 0006 §2).
    children: Annotated[int, msgspec.Meta(ge=0, le=4096)] = 0
    # 1 = a process per loaded session, for operators who want isolation.
    sessions_per_child: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 1000
    max_children: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 64
    spare_children: Annotated[int, msgspec.Meta(ge=0, le=4096)] = 1
    idle_unload: Seconds = 600.0
    # Daemon environment variables children (and so tools) see beyond the base set (RFC 0006 §8).
    pass_env: tuple[EnvVarPattern, ...] = ()


class McpServer(_Section, frozen=True):
    """An MCP server whose tools assistants may name (``server:tool``, ``server:*``), RFC 0008 §3.

    Exactly one of ``command`` (stdio: the server is started by each child that needs it) and
    ``url`` (streamable HTTP). Secrets never live in the file: ``env_from`` names daemon env vars
    passed through to a stdio server, ``headers_from`` maps HTTP headers to env var names.
    """

    name: Name
    command: tuple[Annotated[str, msgspec.Meta(min_length=1)], ...] | None = None
    url: str | None = None
    env: dict[EnvVarName, str] = {}
    env_from: tuple[EnvVarName, ...] = ()
    headers_from: dict[HeaderName, EnvVarName] = {}
    call_timeout: Seconds = 60.0
    # How long connecting (start, handshake, tools/list) may take before the server counts as down.
    connect_timeout: Seconds = 10.0


class Transfer(_Section, frozen=True):
    """A destination the assistant may hand the conversation to."""

    to: Name
    description: str = ""
    message: str = ""
    mode: TransferMode = TransferMode.ROLLING_HISTORY


class Assistant(_Section, frozen=True):
    """A named persona: system prompt, tools, transfer destinations, opener, optional intelligence."""

    name: Name
    system: str = ""
    first_message: str = ""
    first_message_mode: FirstMessageMode = FirstMessageMode.SPEAKS_FIRST
    tools: tuple[ToolRef, ...] = ()
    intelligence: IntelligenceOverride | None = None
    transfers: tuple[Transfer, ...] = ()


DEFAULT_ASSISTANT = Assistant(name="assistant", system="You are a helpful assistant.")


class ServerSettings(_Section, frozen=True):
    """Where the daemon lives. Restart-only: a reload reports a change here and keeps the old value.

    ``--state-dir``/``AGENTD_STATE_DIR`` and ``--listen``/``AGENTD_LISTEN`` take precedence.
    """

    state_dir: str | None = None
    listen: Annotated[str, msgspec.Meta(pattern=r"^[^\s:]*:\d{1,5}$")] | None = None
    # The largest request body (a user message with its images) the API accepts; larger → 413,
    # refused before anything is stored. Well under the 16 MiB frame, so an Input is one frame.
    max_message_bytes: Annotated[int, msgspec.Meta(ge=1024, le=8 * 1024 * 1024)] = 4 * 1024 * 1024
    # Concurrent TCP connections; more wait in the kernel's backlog, unaccepted, so idle clients
    # cannot spend the file descriptors children, the store and the unix socket need. At most half
    # the open-files limit is used, whatever this says (agentd.supervisor.listener).
    max_connections: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 1000
    # A TCP client that has not sent its request headers by then is closed (also between the
    # requests of a kept-alive connection): a slow or silent client cannot hold a slot for ever.
    header_timeout: Seconds = 10.0


class StoreSettings(_Section, frozen=True):
    """Where sessions are stored (RFC 0009 §1). Restart-only, like ``[server]``.

    ``url`` empty is SQLite in the state dir; a ``postgresql://`` URL is a PostgreSQL database,
    whose password is read from the env var named by ``password_env`` (never from the file: a
    password in the URL is refused). ``lease`` is how long a replica owns a session without
    renewing (PostgreSQL; RFC 0009 §3).
    """

    url: str = ""
    password_env: EnvVarName | None = "AGENTD_STORE_PASSWORD"
    lease: Seconds = 10.0


RESTART_ONLY_SECTIONS = ("server", "store")


class Config(_Section, frozen=True):
    """The whole config file. The first assistant is the default for new sessions."""

    model_swap: SwapPolicy | None = None
    server: ServerSettings = ServerSettings()
    store: StoreSettings = StoreSettings()
    intelligence: Intelligence = Intelligence()
    limits: Limits = Limits()
    supervisor: SupervisorSettings = SupervisorSettings()
    mcp_servers: tuple[McpServer, ...] = ()
    assistants: tuple[Assistant, ...] = (DEFAULT_ASSISTANT,)

    def assistant(self, name: str) -> Assistant:
        """The assistant called ``name``; KeyError when there is none."""
        for assistant in self.assistants:
            if assistant.name == name:
                return assistant
        raise KeyError(name)

    @property
    def default_assistant(self) -> Assistant:
        return self.assistants[0]

    def mcp_server(self, name: str) -> McpServer | None:
        """The ``[[mcp_servers]]`` entry called ``name``, or None."""
        return next((server for server in self.mcp_servers if server.name == name), None)


class ConfigIssue(msgspec.Struct, frozen=True):
    """One problem with a config: where (a field path like ``assistants[1].transfers[0].mode``) and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ConfigError(Exception):
    """A config (file, flag or env value) that cannot be used; carries every issue found."""

    def __init__(self, issues: list[ConfigIssue], source: str = "") -> None:
        self.issues = issues
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(where + "; ".join(str(issue) for issue in issues))


# --------------------------------------------------------------------------- durations

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """``"250ms"`` → 0.25, ``"10s"`` → 10.0, ``"2m"`` → 120.0, ``"1h"`` → 3600.0 (seconds)."""
    match = _DURATION_RE.match(text)
    if match is None:
        raise ValueError(
            f"invalid duration {text!r}: expected a number and a unit (ms, s, m, h), like '250ms' or '10s'"
        )
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


# --------------------------------------------------------------------------- field-by-field checking


def _struct_fields(cls: type) -> tuple[msgspec.structs.FieldInfo, ...]:
    return msgspec.structs.fields(cls)


def _is_struct(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, msgspec.Struct)


def _accepted(values: list[Any]) -> str:
    return ", ".join(repr(v) for v in values)


def _leaf_message(error: msgspec.ValidationError) -> str:
    # msgspec appends " - at `$...`"; we report our own path.
    return str(error).split(" - at `", 1)[0]


def _error_path(error: msgspec.ValidationError) -> str:
    """The field path msgspec names (`` - at `$.a[0].b` ``) in ours (``a[0].b``); "" if none."""
    found = re.search(r"`\$\.?([^`]*)`$", str(error))  # "... - at `$.a`" or "... - at `key` in `$.a`"
    return found.group(1) if found else ""


def _normalize(value: Any, annotation: Any, path: str, issues: list[ConfigIssue]) -> Any:
    """Check ``value`` against ``annotation``; return it with durations converted, recording issues."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)

    if _is_struct(annotation):
        return _normalize_struct(value, annotation, path, issues)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        members = [a for a in args if a is not type(None)]
        if len(members) == 1:
            return _normalize(value, members[0], path, issues)
        return _convert_leaf(value, annotation, path, issues)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if not isinstance(value, list):
            issues.append(ConfigIssue(path, f"expected an array, got {_kind(value)}"))
            return value
        return [_normalize(item, args[0], f"{path}[{i}]", issues) for i, item in enumerate(value)]
    if origin is Literal:
        if value not in args:
            issues.append(ConfigIssue(path, f"invalid value {value!r}; accepted values: {_accepted(list(args))}"))
        return value
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        accepted = [member.value for member in annotation]
        if value not in accepted:
            issues.append(ConfigIssue(path, f"invalid value {value!r}; accepted values: {_accepted(accepted)}"))
        return value
    if origin is Annotated and any(
        isinstance(meta, msgspec.Meta) and (meta.extra or {}).get("duration") for meta in args[1:]
    ):
        if not isinstance(value, str):
            issues.append(ConfigIssue(path, f"expected a duration string like '10s' or '250ms', got {_kind(value)}"))
            return value
        try:
            seconds = parse_duration(value)
        except ValueError as exc:
            issues.append(ConfigIssue(path, str(exc)))
            return value
        if seconds <= 0:
            issues.append(ConfigIssue(path, f"duration must be greater than zero, got {value!r}"))
        elif seconds > MAX_DURATION:
            issues.append(ConfigIssue(path, f"duration must be at most {MAX_DURATION / 3600:g}h, got {value!r}"))
        return seconds
    if origin is dict:
        if not isinstance(value, dict):
            issues.append(ConfigIssue(path, f"expected a table, got {_kind(value)}"))
            return value
        for key in value:  # keys have rules too (``headers_from``: header names), reported at the table
            try:
                msgspec.convert(key, args[0])
            except msgspec.ValidationError as exc:
                issues.append(ConfigIssue(path, f"invalid key {key!r}: {_leaf_message(exc)}"))
        return {key: _normalize(item, args[1], f"{path}.{key}", issues) for key, item in value.items()}
    if annotation is Any:
        _check_wire_value(value, path, issues, depth=1)
        return value
    return _convert_leaf(value, annotation, path, issues)


def _check_wire_value(value: Any, path: str, issues: list[ConfigIssue], depth: int) -> None:
    """A free-form value (an ``options`` entry) must survive a msgpack frame and a server's JSON unchanged.

    msgpack refuses integers outside [-2**63, 2**64) only when the frame is encoded — too late,
    after a reload has been applied — and JSON has no infinities, NaN or dates (msgspec writes
    ``null`` or a string in their place). So they are refused here, at their path.
    """
    if depth > MAX_OPTION_DEPTH:
        issues.append(ConfigIssue(path, f"nested more than {MAX_OPTION_DEPTH} levels deep"))
    elif isinstance(value, bool | str):
        pass
    elif isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            issues.append(ConfigIssue(path, f"integer {value} does not fit in 64 bits (-2**63 to 2**63-1)"))
    elif isinstance(value, float):
        if not math.isfinite(value):
            issues.append(ConfigIssue(path, f"{value} is not a finite number (JSON has no inf or nan)"))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_wire_value(item, f"{path}[{i}]", issues, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_wire_value(item, f"{path}.{key}", issues, depth + 1)
    elif isinstance(value, dt.date | dt.time):  # datetime is a date
        issues.append(ConfigIssue(path, "a TOML date or time cannot be sent to a model server; write it as a string"))
    else:  # not reachable from TOML; kept so a new value type is refused rather than sent
        issues.append(ConfigIssue(path, f"unsupported value of type {type(value).__name__}"))


def _normalize_struct(value: Any, cls: type, path: str, issues: list[ConfigIssue]) -> Any:
    if not isinstance(value, dict):
        issues.append(ConfigIssue(path, f"expected a table, got {_kind(value)}"))
        return value
    fields = {f.encode_name: f for f in _struct_fields(cls)}
    out: dict[str, Any] = {}
    for key, item in value.items():
        child = f"{path}.{key}" if path else key
        field = fields.get(key)
        if field is None:
            issues.append(ConfigIssue(child, f"unknown key; accepted keys: {', '.join(fields)}"))
            continue
        out[key] = _normalize(item, field.type, child, issues)
    for key, field in fields.items():
        if field.required and key not in value:
            issues.append(ConfigIssue(f"{path}.{key}" if path else key, "required key is missing"))
    return out


def _convert_leaf(value: Any, annotation: Any, path: str, issues: list[ConfigIssue]) -> Any:
    try:
        msgspec.convert(value, annotation)
    except msgspec.ValidationError as exc:
        issues.append(ConfigIssue(path, _leaf_message(exc)))
    return value


def _kind(value: Any) -> str:
    return {
        dict: "a table",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a float",
    }.get(type(value), type(value).__name__)


def _listen_issues(listen: str | None) -> list[ConfigIssue]:
    # The pattern allows five digits; a port above 65535 would only fail when the socket is bound.
    if listen is not None and int(listen.rpartition(":")[2]) > 65535:
        return [ConfigIssue("server.listen", f"port must be at most 65535, got {listen!r}")]
    return []


# --------------------------------------------------------------------------- semantic checks


#: The shortest ``[store] lease``: a replica must be able to renew it well within that time.
MIN_LEASE = 1.0
#: Schemes of a PostgreSQL ``[store] url`` (libpq takes both).
POSTGRES_SCHEMES = ("postgresql", "postgres")


def store_url_problem(url: str) -> str | None:
    """Why ``url`` is not a usable ``[store] url`` (None when it is). Never echoes the URL: it may hold a password.

    Empty is SQLite in the state dir. Otherwise a ``postgresql://`` (or ``postgres://``) URL, as
    libpq reads it, without a password in it: in the user part or as a ``password`` parameter.
    """
    if not url:
        return None
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number or out of range
    except ValueError:  # its text can quote a part of the URL, which may be a mistyped password
        return "not a valid URL (its host or port cannot be read)"
    if parts.scheme not in POSTGRES_SCHEMES:
        return 'expected "" (SQLite in the state dir) or a postgresql:// URL'
    if parts.password is not None or "password" in {key.lower() for key in parse_qs(parts.query)}:
        return "a password in the URL is not allowed; put it in the env var named by store.password_env"
    return None


#: The shortest supervisor timer: a shorter ping interval would spin a core pinging children, and
#: a shorter timeout or spawn could never be met.
MIN_SUPERVISOR_TIMER = 0.01
_SUPERVISOR_TIMERS = ("spawn_timeout", "ping_interval", "ping_timeout")


def _supervisor_issues(supervisor: SupervisorSettings) -> list[ConfigIssue]:
    return [
        ConfigIssue(
            f"supervisor.{key}",
            f"must be at least {MIN_SUPERVISOR_TIMER * 1000:g}ms, got {getattr(supervisor, key) * 1000:g}ms",
        )
        for key in _SUPERVISOR_TIMERS
        if getattr(supervisor, key) < MIN_SUPERVISOR_TIMER
    ]


def _store_issues(store: StoreSettings) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    problem = store_url_problem(store.url)
    if problem is not None:
        issues.append(ConfigIssue("store.url", problem))
    if store.lease < MIN_LEASE:
        issues.append(
            ConfigIssue(
                "store.lease", f"a lease must be at least {MIN_LEASE:g}s (replicas renew it), got {store.lease:g}s"
            )
        )
    return issues


def _semantic_issues(config: Config) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = _listen_issues(config.server.listen) + _store_issues(config.store)
    issues.extend(_supervisor_issues(config.supervisor))
    issues.extend(_mcp_server_issues(config.mcp_servers))
    names = [a.name for a in config.assistants]
    if not config.assistants:
        issues.append(ConfigIssue("assistants", "at least one assistant is required"))
    seen: set[str] = set()
    for i, assistant in enumerate(config.assistants):
        if assistant.name in seen:
            issues.append(ConfigIssue(f"assistants[{i}].name", f"duplicate assistant name {assistant.name!r}"))
        seen.add(assistant.name)
        destinations: set[str] = set()
        for j, transfer in enumerate(assistant.transfers):
            where = f"assistants[{i}].transfers[{j}].to"
            if transfer.to not in names:
                issues.append(ConfigIssue(where, f"no assistant named {transfer.to!r}; assistants: {', '.join(names)}"))
            elif transfer.to == assistant.name:
                issues.append(ConfigIssue(where, "an assistant cannot transfer to itself"))
            elif transfer.to in destinations:
                issues.append(ConfigIssue(where, f"duplicate transfer destination {transfer.to!r}"))
            destinations.add(transfer.to)
        for k, tool in enumerate(assistant.tools):
            where = f"assistants[{i}].tools[{k}]"
            prefix, _, rest = tool.partition(":")
            if rest.startswith(TRANSFER_TOOL_PREFIX):
                issues.append(
                    ConfigIssue(where, f"tool names starting with {TRANSFER_TOOL_PREFIX!r} are reserved for transfers")
                )
            elif config.mcp_server(prefix) is None and (rest == "*" or not _is_module_path(prefix)):
                servers = ", ".join(s.name for s in config.mcp_servers) or "none"
                issues.append(ConfigIssue(where, f"no MCP server named {prefix!r} ([[mcp_servers]]: {servers})"))
        # Report a problem where it is written: an inherited default is reported once, at its own path.
        override = assistant.intelligence
        own = f"assistants[{i}].intelligence"
        urls_at = own if override is not None and override.endpoints is not None else "intelligence"
        missing_at = (
            own if override is not None and (override.provider or override.endpoints is not None) else "intelligence"
        )
        issues.extend(_intelligence_issues(effective_intelligence(config, assistant.name), missing_at, urls_at))
    return _dedupe(issues)


def _is_module_path(text: str) -> bool:
    return all(part.isidentifier() for part in text.split("."))


def _mcp_server_issues(servers: tuple[McpServer, ...]) -> list[ConfigIssue]:
    """One transport per server, the options of that transport only, unique names, URLs without secrets."""
    issues: list[ConfigIssue] = []
    seen: set[str] = set()
    for i, server in enumerate(servers):
        where = f"mcp_servers[{i}]"
        if server.name in seen:
            issues.append(ConfigIssue(f"{where}.name", f"duplicate MCP server name {server.name!r}"))
        seen.add(server.name)
        if (server.command is None) == (server.url is None):
            issues.append(ConfigIssue(where, "set exactly one of command (stdio) and url (streamable HTTP)"))
        if server.command is not None and not server.command:
            issues.append(ConfigIssue(f"{where}.command", "the command is empty"))
        if server.url is not None:
            if not re.match(r"^https?://[^\s/]+", server.url):
                issues.append(ConfigIssue(f"{where}.url", "expected an http:// or https:// URL"))
            elif re.match(r"^https?://[^/\s]*@", server.url) or "?" in server.url:
                # Credentials and tokens in a URL end up in logs; they belong in headers_from.
                issues.append(
                    ConfigIssue(
                        f"{where}.url", "credentials or a query string in the URL are not allowed; use headers_from"
                    )
                )
            for key in ("env", "env_from"):
                if getattr(server, key):
                    issues.append(ConfigIssue(f"{where}.{key}", "only a stdio server (command) takes an environment"))
        if server.command is not None and server.headers_from:
            issues.append(ConfigIssue(f"{where}.headers_from", "only an HTTP server (url) takes headers"))
    return issues


def _intelligence_issues(intel: Intelligence, missing_at: str, where: str) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    if intel.provider != "scripted" and not intel.endpoints:
        issues.append(
            ConfigIssue(f"{missing_at}.endpoints", f"provider {intel.provider!r} needs at least one endpoint URL")
        )
    for k, url in enumerate(intel.endpoints):
        if not re.match(r"^https?://[^\s/]+", url):
            issues.append(ConfigIssue(f"{where}.endpoints[{k}]", "expected an http:// or https:// URL"))
        elif re.match(r"^https?://[^/\s]*@", url):
            # Credentials in a URL would end up in logs; keys belong in the env var named by api_key_env.
            issues.append(
                ConfigIssue(f"{where}.endpoints[{k}]", "credentials in endpoint URLs are not allowed; use api_key_env")
            )
    return issues


def _dedupe(issues: list[ConfigIssue]) -> list[ConfigIssue]:
    return list(dict.fromkeys(issues))


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
    normalized = _normalize(raw, Config, "", issues)
    if issues:
        raise ConfigError(issues, source)
    try:
        config = msgspec.convert(normalized, Config)
    except msgspec.ValidationError as exc:  # a case the field walk missed; still name it, at its path
        raise ConfigError([ConfigIssue(_error_path(exc), _leaf_message(exc))], source) from None
    semantic = _semantic_issues(config)
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


def effective_intelligence(config: Config, assistant_name: str) -> Intelligence:
    """The assistant's intelligence: its override merged over the default (options merged key-wise)."""
    base = config.intelligence
    override = config.assistant(assistant_name).intelligence
    if override is None:
        return base
    changes: dict[str, Any] = {}
    for field in ("provider", "endpoints", "model", "api_key_env"):
        value = getattr(override, field)
        if value is not None:
            changes[field] = value
    if override.options is not None:
        changes["options"] = {**base.options, **override.options}
    return msgspec.structs.replace(base, **changes)


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
        accepted = _accepted([p.value for p in SwapPolicy])
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
