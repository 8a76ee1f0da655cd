"""The API's bearer token, ``AGENTD_API_TOKEN``: one reading of it for the daemon and its clients.

A token made from a file — a Kubernetes Secret created with ``--from-file``, ``$(cat token)``
in a unit's ``EnvironmentFile`` — often ends in a newline. No HTTP client can send that newline
(a header value cannot hold one, and clients strip the spaces around a value), so a daemon that
kept it would answer every TCP request 401 while clients failed before sending anything. Hence
surrounding whitespace is trimmed, on both sides, the same way (RFC 0000 §4). What is left must
be a token an HTTP header can carry: not empty, and printable ASCII (spaces and tabs inside are
allowed, as they travel in a header); anything else is refused, naming the variable, rather than
accepted and unusable.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["TOKEN_ENV", "TokenError", "api_token", "clean_token"]

TOKEN_ENV = "AGENTD_API_TOKEN"


class TokenError(ValueError):
    """The token is set but no HTTP client could send it: a usage error (exit 2)."""


def clean_token(value: str, source: str = TOKEN_ENV) -> str:
    """``value`` without surrounding whitespace; TokenError naming ``source`` if that leaves a
    token that cannot be sent in an ``Authorization`` header (nothing, a control character, or a
    character outside ASCII)."""
    token = value.strip()
    if not token:
        raise TokenError(f"{source} is set but holds only whitespace: set it to the bearer token")
    for index, char in enumerate(token):
        if not (" " <= char <= "~" or char == "\t"):
            raise TokenError(
                f"{source} holds {char!r} at position {index}: a bearer token must be printable ASCII "
                "(an HTTP header cannot carry that character)"
            )
    return token


def api_token(environ: Mapping[str, str]) -> str | None:
    """The token ``environ`` holds in ``AGENTD_API_TOKEN``, trimmed; None when the variable is unset
    or empty (empty counts as unset, like every ``AGENTD_*`` variable). TokenError when it is set
    but unusable (``clean_token``)."""
    value = environ.get(TOKEN_ENV)
    if not value:
        return None
    return clean_token(value)
