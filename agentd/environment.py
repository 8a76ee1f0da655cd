"""What a child process (and the tool check that imports a child's tools) may see of the daemon's
environment (RFC 0006 §8).

A child runs third-party tool code, so it gets an allowlist, not the daemon's whole environment:
the variables a Python process and an HTTP client need (``BASE_NAMES``, ``LC_*``), the operator's
``[supervisor] pass_env`` names and patterns, and the variables the config itself names
(``api_key_env``). Everything else — the API token, cloud credentials, the store password — stays
in the supervisor (``withheld``: even a ``pass_env`` pattern cannot reach those, nor the variables
of MCP servers' ``env_from``/``headers_from``, which reach a child in its frames only).
``secret_values`` are the values no log line, tool result, answer or stored row may carry
(``agentd.redact.SECRETS``). Pure functions over a mapping, so they are tested without processes.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping

from agentd.config import Config
from agentd.redact import SECRETS

#: Always passed when set: the interpreter, locale, temp dir, CA bundle and proxy settings.
BASE_NAMES: frozenset[str] = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "PYTHONPATH",
        "VIRTUAL_ENV",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "NO_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
        "no_proxy",
    }
)
BASE_PATTERNS: tuple[str, ...] = ("LC_*",)


def named_by(config: Config) -> frozenset[str]:
    """The variables a child's own environment gets because the config names them: ``api_key_env``
    (providers read it there). MCP servers' ``env_from``/``headers_from`` are not among them: those
    reach the child in its frames only (``mcp_secrets``), never its environment, so tools cannot
    read them."""
    names = {config.intelligence.api_key_env}
    names.update(a.intelligence.api_key_env for a in config.assistants if a.intelligence is not None)
    return frozenset(name for name in names if name)


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def supervisor_only(config: Config) -> frozenset[str]:
    """Never given to a child in any way: the API token and the store's password."""
    password = config.store.password_env
    return frozenset({"AGENTD_API_TOKEN", *([password] if password else [])})


def mcp_names(config: Config) -> frozenset[str]:
    """The variables ``[[mcp_servers]]`` name (``env_from``, ``headers_from``)."""
    return frozenset(n for server in config.mcp_servers for n in (*server.env_from, *server.headers_from.values()))


def withheld(config: Config) -> frozenset[str]:
    """Never in a child's environment, whatever ``pass_env`` says: the API token, the store's
    password, and the MCP servers' secrets (those reach the child in its frames, for the MCP
    connections only, so that no tool can read them — RFC 0000 §4). A variable that is also an
    ``api_key_env`` is the exception: the provider reads that one from the environment."""
    return supervisor_only(config) | (mcp_names(config) - named_by(config))


def passed_through(environ: Mapping[str, str], config: Config) -> dict[str, str]:
    """The variables a config asks for beyond the base: ``pass_env`` matches and the names it uses.
    This is what a reload hands running children (they were started with an earlier config)."""
    named, hidden = named_by(config), withheld(config)
    patterns = config.supervisor.pass_env
    return {k: v for k, v in environ.items() if k not in hidden and (k in named or _matches(k, patterns))}


def child_environment(environ: Mapping[str, str], config: Config) -> dict[str, str]:
    """The whole environment a child process starts with under ``config``."""
    base = {k: v for k, v in environ.items() if k in BASE_NAMES or _matches(k, BASE_PATTERNS)}
    return {**base, **passed_through(environ, config)}


def mcp_secrets(environ: Mapping[str, str], config: Config) -> dict[str, str]:
    """The values of the variables ``[[mcp_servers]]`` name (``env_from``, ``headers_from``), sent in
    ``spawn``/``swap_intel.secrets`` (RFC 0008 §3); never the withheld ones."""
    hidden = supervisor_only(config)
    return {name: environ[name] for name in sorted(mcp_names(config)) if name in environ and name not in hidden}


def secret_values(environ: Mapping[str, str], config: Config) -> set[str]:
    """Every secret value ``config`` makes agentd hold, read from ``environ``: the API token, the
    store's password, the ``api_key_env`` keys, and the MCP servers' ``env``, ``env_from`` and
    ``headers_from`` values. A header value of the form ``Scheme credentials`` (``Bearer …``)
    counts its credentials too: a server may quote the token without its scheme."""
    names = supervisor_only(config) | named_by(config) | mcp_names(config)
    # Trimmed too: a value read from a file often ends in a newline that the value in use (the API
    # token, a header) does not carry, so only the trimmed form would ever appear in a text.
    held = [environ[name] for name in names if environ.get(name)]
    values = {*held, *(value.strip() for value in held)} - {""}
    values.update(value for server in config.mcp_servers for value in server.env.values())
    for server in config.mcp_servers:
        for name in server.headers_from.values():
            scheme, _, credentials = environ.get(name, "").strip().partition(" ")
            if scheme and credentials.strip():
                values.add(credentials.strip())
    return values


def register_secrets(environ: Mapping[str, str], config: Config) -> None:
    """Add ``config``'s secret values to this process's scrubber (``agentd.redact.SECRETS``)."""
    SECRETS.add(secret_values(environ, config))
