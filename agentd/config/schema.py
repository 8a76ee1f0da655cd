"""The config schema: the one definition of every section, key and type (RFC 0000 §2), the
errors that name a field path, and durations. Checking a file against it is ``agentd.config.checks``;
loading one is ``agentd.config``."""

from __future__ import annotations

import enum
import re
from decimal import Decimal
from typing import Annotated, Any, Literal

import msgspec


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
# A duration where "0s" means "never" (``[limits] approval_timeout``).
SecondsOrNever = Annotated[float, msgspec.Meta(ge=0, le=MAX_DURATION, extra=_DURATION)]
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
# A ``require_approval`` entry: a ToolRef, or "*" (every tool not free of side effects).
ApprovalRef = Annotated[
    str,
    msgspec.Meta(min_length=1, pattern=r"^(\*|[A-Za-z_][A-Za-z0-9_]*|[A-Za-z0-9_][\w.-]*:(\*|[A-Za-z0-9_][\w.-]*))$"),
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
    # A pending approval of a tool call expires after this ("0s" = never; RFC 0012 §4).
    approval_timeout: SecondsOrNever = 24 * 3600.0


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
    # Tools (as named in ``tools``; "server:*"; "*" = every tool not free of side effects) whose
    # calls wait for a human's approval (RFC 0012 §2).
    require_approval: tuple[ApprovalRef, ...] = ()
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
    # How long an Idempotency-Key is remembered (RFC 0010 §2): the same key again within it gets
    # the first request's answer; expired keys are deleted.
    idempotency_ttl: Seconds = 24 * 3600.0
    # The addresses (IPs or CIDR networks; "*" is everyone) of the reverse proxies whose
    # X-Forwarded-Proto and X-Forwarded-For agentd believes: behind a TLS-terminating proxy the
    # console's origin is https and its cookies are Secure. Empty: nobody's forwarded headers.
    trusted_proxies: tuple[str, ...] = ()


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


#: A price per million tokens: a decimal, written in TOML as a number (``0.15``, read back as
#: exactly 0.15 — the shortest text of the float, never the binary value nearest to it) or a
#: string (``"0.15"``). Checked in ``agentd.config.checks``: finite, 0 or more, at most
#: ``MAX_PRICE``, at most ``MAX_PRICE_DECIMALS`` decimal places.
PerMillion = Annotated[Decimal, msgspec.Meta(extra={"price": True})]
MAX_PRICE = Decimal(1_000_000_000)
MAX_PRICE_DECIMALS = 18
#: A float literal keeps this many significant digits exactly; a longer price must be a string.
FLOAT_DIGITS = 15
#: A currency code, as the API reports it with each cost (``USD``, ``EUR``, or any unit you bill in).
Currency = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,15}$")]


class Price(_Section, frozen=True, kw_only=True):
    """What a model's tokens cost (RFC 0011 §2): a model without an entry has cost ``null``.

    Cached input tokens are priced at ``cached_input_per_mtok`` when set, else as input.
    """

    model: Annotated[str, msgspec.Meta(min_length=1)]
    currency: Currency = "USD"
    input_per_mtok: PerMillion
    output_per_mtok: PerMillion
    cached_input_per_mtok: PerMillion | None = None


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
    prices: tuple[Price, ...] = ()

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

    def price(self, model: str) -> Price | None:
        """The ``[[prices]]`` entry for ``model``, or None (its cost is unknown)."""
        return next((price for price in self.prices if price.model == model), None)


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
