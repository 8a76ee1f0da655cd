"""The console's login and its CSRF tokens (RFC 0000 §12): pure functions over the API token.

A browser never holds the API token. Logging in with it yields a session cookie
``<issued>.<nonce>.<mac>`` whose MAC is an HMAC-SHA256 under a key derived from the token
(``ConsoleKeys``): nothing is stored, so a cookie one replica issued is good on every replica
that has the same token, a restart keeps operators logged in, and changing the token logs every
browser out. The cookie expires ``SESSION_MAX_AGE`` after login (checked here, not only by the
browser). A form's CSRF token is an HMAC of the cookie's nonce under the same key (one per login,
never the token or the cookie); the login form's own is an HMAC of a nonce in a short-lived
pre-login cookie (double submit). Tokens are compared with ``hmac.compare_digest``.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping

import msgspec

__all__ = [
    "COOKIE",
    "LOGIN_COOKIE",
    "LOGIN_MAX_AGE",
    "SESSION_MAX_AGE",
    "ConsoleKeys",
    "ConsoleLogin",
    "same_origin",
]

#: The login cookie's name, and how long a login lasts (seconds).
COOKIE = "agentd_console"
SESSION_MAX_AGE = 12 * 3600
#: The pre-login cookie (the login form's CSRF nonce) and how long the login form stays usable.
LOGIN_COOKIE = "agentd_console_login"
LOGIN_MAX_AGE = 3600
#: A cookie issued by a replica whose clock is ahead of this one's by up to this much is still good.
CLOCK_SKEW = 300

_KEY_LABEL = b"agentd console cookie key v1"


class ConsoleLogin(msgspec.Struct, frozen=True, kw_only=True):
    """A valid login: when it was made (epoch seconds) and its random nonce."""

    issued_at: int
    nonce: str


def _nonce() -> str:
    return secrets.token_urlsafe(18)


class ConsoleKeys:
    """Cookies and CSRF tokens keyed by the API token (never shown, never stored)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()
        # A key of its own, not the token: a MAC shown to the browser says nothing about the token.
        self._key = hmac.new(self._token, _KEY_LABEL, hashlib.sha256).digest()

    def _mac(self, *parts: str) -> str:
        return hmac.new(self._key, "|".join(parts).encode(), hashlib.sha256).hexdigest()

    def token_matches(self, presented: str) -> bool:
        """Whether ``presented`` is the API token (exactly, in constant time; spaces around it ignored)."""
        return hmac.compare_digest(presented.strip().encode(), self._token)

    def issue(self, now: float) -> str:
        """A new login cookie's value."""
        issued, nonce = str(int(now)), _nonce()
        return f"{issued}.{nonce}.{self._mac('session', issued, nonce)}"

    def login(self, cookie: str | None, now: float) -> ConsoleLogin | None:
        """The login ``cookie`` proves, or None: missing, malformed, forged or expired."""
        if not cookie:
            return None
        parts = cookie.split(".")
        if len(parts) != 3 or not parts[0].isascii() or not parts[0].isdigit():
            return None
        issued, nonce, mac = parts
        if not hmac.compare_digest(mac.encode(), self._mac("session", issued, nonce).encode()):
            return None
        if not -CLOCK_SKEW <= now - int(issued) <= SESSION_MAX_AGE:
            return None
        return ConsoleLogin(issued_at=int(issued), nonce=nonce)

    def csrf(self, login: ConsoleLogin) -> str:
        """The CSRF token of the forms of ``login``."""
        return self._mac("csrf", login.nonce)

    def csrf_ok(self, login: ConsoleLogin, presented: str | None) -> bool:
        """Whether a form of ``login`` carries its CSRF token."""
        return presented is not None and hmac.compare_digest(presented.encode(), self.csrf(login).encode())

    def login_nonce(self) -> str:
        """A pre-login cookie's value: the nonce the login form's CSRF token is made of."""
        return _nonce()

    def login_csrf(self, nonce: str) -> str:
        """The login form's CSRF token for the pre-login cookie ``nonce``."""
        return self._mac("login", nonce)

    def login_csrf_ok(self, nonce: str | None, presented: str | None) -> bool:
        """Whether the login form carries the CSRF token of the pre-login cookie it came with."""
        if not nonce or presented is None:
            return False
        return hmac.compare_digest(presented.encode(), self.login_csrf(nonce).encode())


def same_origin(headers: Mapping[str, str], scheme: str) -> bool:
    """Whether a state-changing request comes from the console's own pages.

    Its ``Origin`` must be this server's (scheme and ``Host``); a browser sends it with every
    POST. Without one (a client that is not a browser) the CSRF token alone decides, unless
    ``Sec-Fetch-Site`` says the request is cross-site. ``Origin: null`` (a sandboxed or opaque
    origin) is refused.
    """
    origin = headers.get("origin")
    if origin is None:
        return headers.get("sec-fetch-site", "same-origin") in {"same-origin", "none"}
    host = headers.get("host")
    return host is not None and origin == f"{scheme}://{host}"
