"""URLs fit for error messages and logs: the one place that decides what of a URL may be shown."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlsplit, urlunsplit

__all__ = ["redact_database_url", "redact_url"]


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
