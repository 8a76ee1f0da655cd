"""What may be shown in error messages, logs, tool results and the store: the one place that decides.

Two tools. ``redact_url`` shows a URL without the parts that may carry secrets. ``Secrets`` knows
the secret *values* agentd holds — the API token, the store password, ``api_key_env`` keys, MCP
``env``/``env_from``/``headers_from`` values (``agentd.environment.secret_values``) — and replaces
each with ``[redacted]`` wherever it appears, as the providers always did for their key. A process
keeps one registry, ``SECRETS``: the structlog processor ``scrub_log_secrets`` applies it to every
log line (supervisor and children alike), a child applies it to every tool result before the
result is journaled, stored or returned (``agentd.child.journal``).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable, Iterator, MutableMapping
from typing import Any
from urllib.parse import parse_qsl, quote, quote_plus, urlsplit, urlunsplit

__all__ = [
    "MIN_SECRET_LENGTH",
    "REDACTED",
    "SECRETS",
    "Secrets",
    "redact_database_url",
    "redact_url",
    "scrub_log_secrets",
]

#: What a secret value is replaced with (the providers' word for it since the start).
REDACTED = "[redacted]"
#: Shorter values are not scrubbed: replacing every "1" or "on" in every log line and tool result
#: would garble them and hide nothing (a value that short is no secret worth the name).
MIN_SECRET_LENGTH = 6


def _forms(value: str) -> Iterator[str]:
    """``value`` as text may carry it: verbatim, percent-encoded (a URL an HTTP client's error
    names, a query string) and JSON-escaped (a server's JSON body echoing it)."""
    yield value
    yield json.dumps(value)[1:-1]
    yield json.dumps(value, ensure_ascii=False)[1:-1]
    # errors: a value read from the environment may hold undecodable bytes (surrogate escapes)
    yield quote(value, safe="", errors="surrogateescape")
    yield quote(value, errors="surrogateescape")
    yield quote_plus(value, safe="", errors="surrogateescape")


class Secrets:
    """A set of secret values, and ``scrub`` that replaces each wherever it appears.

    Values only ever accumulate: a reload's new secrets are added and the old ones kept, because a
    line about the old generation (a child still on it, a connection closing) may quote them yet.
    Safe to use from several threads (the standard-library log handler runs on any thread).
    """

    def __init__(self, values: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._values: frozenset[str] = frozenset()
        self._forms: frozenset[str] = frozenset()
        #: The length of the longest text ``scrub`` replaces: a text cut into pieces must keep this
        #: many characters past a cut until it is scrubbed, or a secret across it goes unseen.
        self.longest = 0
        self._pattern: re.Pattern[str] | None = None
        self.add(values)

    def add(self, values: Iterable[str]) -> None:
        """Scrub ``values`` from now on, verbatim and encoded (``_forms``), a multi-line value's
        lines each too; those shorter than ``MIN_SECRET_LENGTH`` are ignored."""
        held = list(values)
        # A multi-line value (a PEM key, a JSON credential) is also scrubbed a line at a time: what
        # is read and logged line by line (a child's stderr) never holds it whole.
        pieces = [line.strip() for value in held if "\n" in value for line in value.splitlines()]
        new = {value for value in (*held, *pieces) if len(value) >= MIN_SECRET_LENGTH}
        with self._lock:
            if new <= self._values:
                return
            self._values = self._values | new
            self._forms = self._forms | {form for value in new for form in _forms(value)}
            # Longest first: a secret that contains another is replaced whole, not in pieces.
            ordered = sorted(self._forms, key=lambda v: (-len(v), v))
            self.longest = len(ordered[0])
            self._pattern = re.compile("|".join(re.escape(value) for value in ordered))

    def __len__(self) -> int:
        """The secret values held (each is scrubbed in all its ``_forms``)."""
        return len(self._values)

    def scrub(self, text: str) -> str:
        """``text`` with every known secret replaced by ``[redacted]``."""
        pattern = self._pattern  # one read: a concurrent add swaps in a whole new pattern
        return text if pattern is None else pattern.sub(REDACTED, text)

    def scrub_value(self, value: Any) -> Any:
        """``value`` with every string in it scrubbed (dicts, lists and tuples are walked; keys too)."""
        if self._pattern is None:
            return value
        if isinstance(value, str):
            return self.scrub(value)
        if isinstance(value, dict):
            return {self.scrub_value(k): self.scrub_value(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self.scrub_value(item) for item in value)
        return value


#: This process's secrets (the supervisor registers its config's at start and at each reload, a
#: child those of its spawn and each swap_intel).
SECRETS = Secrets()


#: Fields the logging pipeline itself adds to every line (``add_log_level``, ``TimeStamper``): never
#: a secret's, and a secret that happens to equal one ("warning", an MCP ``env`` setting) must not
#: turn every line's level into ``[redacted]``.
_OWN_FIELDS = frozenset({"level", "timestamp"})


def scrub_log_secrets(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: no log line carries a value of ``SECRETS``, whatever field it is in."""
    if len(SECRETS):
        for key, value in list(event_dict.items()):
            if key not in _OWN_FIELDS:
                event_dict[key] = SECRETS.scrub_value(value)
    return event_dict


def redact_url(url: str) -> str:
    """``url`` without the parts that may carry secrets: userinfo, query string and fragment.

    Credentials are put in ``user:password@`` and tokens in ``?key=…`` often enough that neither
    is ever shown; scheme, host, port and path are kept so the message still says where. A URL
    that cannot be parsed (a bad port, a malformed IPv6 host) is not echoed at all, since the
    secret could be anywhere in it.
    """
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"  # an IPv6 literal: hostname dropped the brackets the netloc needs
        netloc = f"{host}:{parts.port}" if parts.port is not None else host
    except ValueError:
        return "<invalid URL>"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def redact_database_url(url: str) -> str:
    """A ``postgresql://`` URL fit for messages: ``redact_url``'s, keeping the ``//`` of a URL with no
    host and naming the ``host`` parameter that then says where the server is (a socket directory).

    ``postgresql://me@db:5432/agentd`` → ``postgresql://db:5432/agentd``;
    ``postgresql:///agentd?host=/run/postgresql`` → ``postgresql:///agentd (host /run/postgresql)``.
    """
    shown = redact_url(url)
    try:
        parts = urlsplit(url)
    except ValueError:
        return shown
    if parts.netloc.rpartition("@")[2]:
        return shown
    hosts = [value for key, value in parse_qsl(parts.query) if key == "host"]
    return f"{parts.scheme}://{parts.path}" + (f" (host {hosts[-1]})" if hosts else "")
