"""agentd.redact.redact_url: what of a URL an error message or a log line may show."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentd.client import AgentdClient
from agentd.redact import redact_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://user:pw@127.0.0.1:8400/v1", "http://127.0.0.1:8400/v1"),
        ("https://sk-token@api.example.com/v1", "https://api.example.com/v1"),
        ("https://:pw@api.example.com", "https://api.example.com"),
        ("https://api.example.com/v1?api_key=sk-123&x=1", "https://api.example.com/v1"),
        ("https://api.example.com/v1#token=abc", "https://api.example.com/v1"),
        ("http://u:p@[::1]:8000/v1?k=v", "http://[::1]:8000/v1"),
        ("http://[fe80::1]/", "http://[fe80::1]/"),
        ("http://u:p%40ss@host/", "http://host/"),  # an escaped "@" in the password
        ("http://u:p@ss@host/", "http://host/"),  # an unescaped one: the host is after the last "@"
    ],
)
def test_secrets_are_removed_and_where_is_kept(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8400", "http://localhost/path/x", "https://api.openai.com/v1", "http://h:0/"]
)
def test_a_url_without_secrets_is_unchanged(url: str) -> None:
    assert redact_url(url) == url


@pytest.mark.parametrize("url", ["http://u:s3cret@host:99999/", "http://u:s3cret@host:port/", "http://u:s3cret@[::1/"])
def test_an_unparsable_url_is_not_echoed(url: str) -> None:
    assert redact_url(url) == "<invalid URL>"


_secret = st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.~", min_size=1, max_size=12).map(lambda s: "Q" + s)


@given(_secret, _secret, _secret)
def test_no_secret_survives_in_any_place(user: str, password: str, token: str) -> None:
    redacted = redact_url(f"https://{user}:{password}@models.example:8443/v1/chat?key={token}#{token}")
    assert redacted == "https://models.example:8443/v1/chat"


def test_the_cli_client_names_its_daemon_with_it() -> None:
    with AgentdClient(url="http://user:pw@127.0.0.1:8400/?token=abc") as client:
        assert client.where == "http://127.0.0.1:8400/"
        assert "pw" not in repr(client)
        assert "abc" not in repr(client)


# --------------------------------------------------------------------------- Secrets


def test_secrets_are_replaced_wherever_they_appear_and_short_values_are_not() -> None:
    from agentd.redact import MIN_SECRET_LENGTH, REDACTED, Secrets

    secrets = Secrets(["sk-live-123456", "on", "", "x" * (MIN_SECRET_LENGTH - 1)])
    assert secrets.scrub("key sk-live-123456 is on") == f"key {REDACTED} is on"
    assert secrets.scrub("xxxxx stays") == "xxxxx stays"
    assert secrets.scrub_value({"a": ["sk-live-123456", 3, ("sk-live-123456",)]}) == {"a": [REDACTED, 3, (REDACTED,)]}


def test_a_secret_that_contains_another_is_replaced_whole() -> None:
    from agentd.redact import REDACTED, Secrets

    secrets = Secrets(["token-abc"])
    secrets.add(["Bearer token-abc-long"])
    assert secrets.scrub("got 'Bearer token-abc-long' and token-abc") == f"got '{REDACTED}' and {REDACTED}"
    assert len(secrets) == 2


def test_the_log_processor_scrubs_every_field_of_a_line() -> None:
    from agentd.redact import REDACTED, SECRETS, scrub_log_secrets

    SECRETS.add(["processor-s3cret"])
    line = scrub_log_secrets(None, "info", {"event": "x", "error": "bad processor-s3cret", "n": 1})
    assert line == {"event": "x", "error": f"bad {REDACTED}", "n": 1}


@given(st.text(min_size=6, max_size=20), st.text(max_size=30), st.text(max_size=30))
def test_no_text_around_a_secret_lets_it_through(secret: str, before: str, after: str) -> None:
    from agentd.redact import Secrets

    assert secret not in Secrets([secret]).scrub(before + secret + after)


def test_a_secret_is_scrubbed_percent_encoded_and_json_escaped_too() -> None:
    """An HTTP client's error names the URL it called (the key percent-encoded in its query); a
    server's JSON body echoes the key JSON-escaped. Neither form may pass (review2)."""
    import json
    from urllib.parse import quote, quote_plus

    from agentd.redact import Secrets

    key = 'sk-r2/Ab+cD"eF== \u00e9\udcff'  # the last: an undecodable byte from the environment
    secrets = Secrets([key])
    for text in (
        quote(key, safe="", errors="surrogateescape"),
        quote_plus(key, errors="surrogateescape"),
        json.dumps(key),
        json.dumps(key, ensure_ascii=False),
    ):
        assert (
            secrets.scrub(f"url ?key={text}&x")
            == "url ?key=" + ("[redacted]" if text[0] != '"' else '"[redacted]"') + "&x"
        )


def test_each_line_of_a_multi_line_secret_is_scrubbed_alone_too() -> None:
    """A PEM key read line by line (a child's stderr) never appears whole (review2)."""
    from agentd.redact import REDACTED, Secrets

    pem = "-----BEGIN KEY-----\nMIIEvQIBADANBgkq\r\nBKcwggSjAgEA\n-----END KEY-----\n"
    secrets = Secrets([pem])
    assert secrets.scrub("got MIIEvQIBADANBgkq") == f"got {REDACTED}"
    assert secrets.scrub("BKcwggSjAgEA") == REDACTED
    assert secrets.scrub(pem) == REDACTED
