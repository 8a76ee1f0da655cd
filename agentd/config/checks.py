"""Checking a parsed TOML document against the schema: field by field, so that *every* error is
reported with its field path (not just the first one msgspec would stop at), then the checks
across fields (names that must resolve, bounds that depend on each other)."""

from __future__ import annotations

import datetime as dt
import enum
import ipaddress
import math
import re
import types
import typing
from decimal import Decimal
from typing import Annotated, Any, Literal
from urllib.parse import parse_qs, urlsplit

import msgspec

from agentd.config.schema import (
    FLOAT_DIGITS,
    INT64_MAX,
    INT64_MIN,
    MAX_DURATION,
    MAX_OPTION_DEPTH,
    MAX_PRICE,
    MAX_PRICE_DECIMALS,
    TRANSFER_TOOL_PREFIX,
    Config,
    ConfigIssue,
    Intelligence,
    McpServer,
    StoreSettings,
    SupervisorSettings,
    effective_intelligence,
    parse_duration,
)

# --------------------------------------------------------------------------- field-by-field checking


def _struct_fields(cls: type) -> tuple[msgspec.structs.FieldInfo, ...]:
    return msgspec.structs.fields(cls)


def _is_struct(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, msgspec.Struct)


def accepted_values(values: list[Any]) -> str:
    return ", ".join(repr(v) for v in values)


def leaf_message(error: msgspec.ValidationError) -> str:
    # msgspec appends " - at `$...`"; we report our own path.
    return str(error).split(" - at `", 1)[0]


def error_path(error: msgspec.ValidationError) -> str:
    """The field path msgspec names (`` - at `$.a[0].b` ``) in ours (``a[0].b``); "" if none."""
    found = re.search(r"`\$\.?([^`]*)`$", str(error))  # "... - at `$.a`" or "... - at `key` in `$.a`"
    return found.group(1) if found else ""


def normalize(value: Any, annotation: Any, path: str, issues: list[ConfigIssue]) -> Any:
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
            return normalize(value, members[0], path, issues)
        return _convert_leaf(value, annotation, path, issues)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if not isinstance(value, list):
            issues.append(ConfigIssue(path, f"expected an array, got {_kind(value)}"))
            return value
        return [normalize(item, args[0], f"{path}[{i}]", issues) for i, item in enumerate(value)]
    if origin is Literal:
        if value not in args:
            issues.append(ConfigIssue(path, f"invalid value {value!r}; accepted values: {accepted_values(list(args))}"))
        return value
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        accepted = [member.value for member in annotation]
        if value not in accepted:
            issues.append(ConfigIssue(path, f"invalid value {value!r}; accepted values: {accepted_values(accepted)}"))
        return value
    duration = next(
        (meta for meta in args[1:] if isinstance(meta, msgspec.Meta) and (meta.extra or {}).get("duration")), None
    )
    if origin is Annotated and duration is not None:
        if not isinstance(value, str):
            issues.append(ConfigIssue(path, f"expected a duration string like '10s' or '250ms', got {_kind(value)}"))
            return value
        try:
            seconds = parse_duration(value)
        except ValueError as exc:
            issues.append(ConfigIssue(path, str(exc)))
            return value
        if seconds < 0 or (seconds == 0 and duration.ge is None):  # ``ge=0``: "0s" means never
            issues.append(ConfigIssue(path, f"duration must be greater than zero, got {value!r}"))
        elif seconds > MAX_DURATION:
            issues.append(ConfigIssue(path, f"duration must be at most {MAX_DURATION / 3600:g}h, got {value!r}"))
        return seconds
    if origin is Annotated and any(
        isinstance(meta, msgspec.Meta) and (meta.extra or {}).get("price") for meta in args[1:]
    ):
        return _price_value(value, path, issues)
    if origin is dict:
        if not isinstance(value, dict):
            issues.append(ConfigIssue(path, f"expected a table, got {_kind(value)}"))
            return value
        for key in value:  # keys have rules too (``headers_from``: header names), reported at the table
            try:
                msgspec.convert(key, args[0])
            except msgspec.ValidationError as exc:
                issues.append(ConfigIssue(path, f"invalid key {key!r}: {leaf_message(exc)}"))
        return {key: normalize(item, args[1], f"{path}.{key}", issues) for key, item in value.items()}
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
        out[key] = normalize(item, field.type, child, issues)
    for key, field in fields.items():
        if field.required and key not in value:
            issues.append(ConfigIssue(f"{path}.{key}" if path else key, "required key is missing"))
    return out


def _price_value(value: Any, path: str, issues: list[ConfigIssue]) -> Any:
    """A price per million tokens: a number or a decimal string → its exact Decimal.

    A TOML float is read back by its shortest text (0.15 is 0.15); one with more significant
    digits than a float keeps could not be, so it must be written as a string.
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        issues.append(
            ConfigIssue(path, f"expected a price (a number or a decimal string like '0.15'), got {_kind(value)}")
        )
        return value
    if isinstance(value, float) and math.isfinite(value):
        digits = Decimal(repr(value)).as_tuple().digits
        if len(digits) > FLOAT_DIGITS:
            issues.append(
                ConfigIssue(path, f"{value!r} has more digits than a TOML number keeps exactly; write it as a string")
            )
            return value
    try:
        price = Decimal(repr(value) if isinstance(value, float) else value)
    except ArithmeticError:
        issues.append(ConfigIssue(path, f"invalid price {value!r}: expected a decimal number like '0.15'"))
        return value
    if not price.is_finite() or price < 0 or price > MAX_PRICE:
        issues.append(ConfigIssue(path, f"a price must be a finite number from 0 to {MAX_PRICE}, got {value!r}"))
    elif -int(price.as_tuple().exponent) > MAX_PRICE_DECIMALS:
        issues.append(ConfigIssue(path, f"a price may have at most {MAX_PRICE_DECIMALS} decimal places, got {value!r}"))
    return str(price)


def _prices_issues(config: Config) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    seen: set[str] = set()
    for i, price in enumerate(config.prices):
        if price.model in seen:
            issues.append(ConfigIssue(f"prices[{i}].model", f"duplicate price for model {price.model!r}"))
        seen.add(price.model)
    return issues


def _convert_leaf(value: Any, annotation: Any, path: str, issues: list[ConfigIssue]) -> Any:
    try:
        msgspec.convert(value, annotation)
    except msgspec.ValidationError as exc:
        issues.append(ConfigIssue(path, leaf_message(exc)))
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


def _trusted_proxies_issues(proxies: tuple[str, ...]) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    for i, proxy in enumerate(proxies):
        if proxy == "*":
            continue
        try:
            ipaddress.ip_network(proxy, strict=False)
        except ValueError:
            issues.append(
                ConfigIssue(
                    f"server.trusted_proxies[{i}]",
                    f'must be an IP address, a CIDR network (10.0.0.0/8) or "*", got {proxy!r}',
                )
            )
    return issues


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


def semantic_issues(config: Config) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = _listen_issues(config.server.listen) + _store_issues(config.store)
    issues.extend(_trusted_proxies_issues(config.server.trusted_proxies))
    issues.extend(_supervisor_issues(config.supervisor))
    issues.extend(_mcp_server_issues(config.mcp_servers))
    issues.extend(_prices_issues(config))
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
        issues.extend(_approval_issues(assistant.require_approval, assistant.tools, f"assistants[{i}]"))
        # Report a problem where it is written: an inherited default is reported once, at its own path.
        override = assistant.intelligence
        own = f"assistants[{i}].intelligence"
        urls_at = own if override is not None and override.endpoints is not None else "intelligence"
        missing_at = (
            own if override is not None and (override.provider or override.endpoints is not None) else "intelligence"
        )
        issues.extend(_intelligence_issues(effective_intelligence(config, assistant.name), missing_at, urls_at))
    return _dedupe(issues)


def _approval_issues(required: tuple[str, ...], tools: tuple[str, ...], where: str) -> list[ConfigIssue]:
    """``require_approval`` names only the assistant's own tools: an entry of ``tools``, a tool of a
    server whose ``server:*`` is there, or "*" (RFC 0012 §2)."""
    issues = []
    offered = set(tools)
    for k, name in enumerate(required):
        server, _, _ = name.partition(":")
        if name == "*" or name in offered or (":" in name and f"{server}:*" in offered):
            continue
        listed = ", ".join(tools) or "none"
        issues.append(
            ConfigIssue(
                f"{where}.require_approval[{k}]",
                f"{name!r} is not among the assistant's tools (tools: {listed})",
            )
        )
    return issues


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
