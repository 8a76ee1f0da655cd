"""What a child sees of the daemon's environment (agentd/environment.py, RFC 0006 §9)."""

from __future__ import annotations

import pytest

from agentd.config import ConfigError, parse_config
from agentd.environment import child_environment, mcp_secrets, named_by, passed_through, secret_values

DAEMON_ENV = {
    "PATH": "/usr/bin",
    "HOME": "/home/agentd",
    "LC_ALL": "C.UTF-8",
    "PYTHONPATH": "/opt/tools",
    "HTTPS_PROXY": "http://proxy:3128",
    "AGENTD_API_TOKEN": "api-token",
    "AWS_SECRET_ACCESS_KEY": "cloud",
    "OPENAI_KEY": "sk-openai",
    "BILLING_KEY": "sk-billing",
    "OTEL_EXPORTER": "otlp",
    "OTEL_SERVICE_NAME": "agentd",
    "TOOL_DB_URL": "postgres://tools",
}

CONFIG = """
[intelligence]
provider = "openai"
endpoints = ["http://llm:8000/v1"]
model = "m"
api_key_env = "OPENAI_KEY"

[supervisor]
pass_env = ["OTEL_*", "TOOL_DB_URL", "NOT_SET"]

[[assistants]]
name = "main"

[[assistants]]
name = "billing"
intelligence = { api_key_env = "BILLING_KEY" }
"""


def test_a_child_gets_the_base_set_the_named_keys_and_pass_env_only() -> None:
    env = child_environment(DAEMON_ENV, parse_config(CONFIG))
    assert env == {
        "PATH": "/usr/bin",
        "HOME": "/home/agentd",
        "LC_ALL": "C.UTF-8",
        "PYTHONPATH": "/opt/tools",
        "HTTPS_PROXY": "http://proxy:3128",
        "OPENAI_KEY": "sk-openai",
        "BILLING_KEY": "sk-billing",
        "OTEL_EXPORTER": "otlp",
        "OTEL_SERVICE_NAME": "agentd",
        "TOOL_DB_URL": "postgres://tools",
    }


def test_the_default_config_passes_no_secret() -> None:
    env = child_environment(DAEMON_ENV, parse_config('[[assistants]]\nname = "a"\n'))
    assert set(env) == {"PATH", "HOME", "LC_ALL", "PYTHONPATH", "HTTPS_PROXY"}


def test_a_reload_hands_over_what_the_config_asks_for_beyond_the_base() -> None:
    passed = passed_through(DAEMON_ENV, parse_config(CONFIG))
    assert set(passed) == {"OPENAI_KEY", "BILLING_KEY", "OTEL_EXPORTER", "OTEL_SERVICE_NAME", "TOOL_DB_URL"}
    assert named_by(parse_config(CONFIG)) == {"OPENAI_KEY", "BILLING_KEY"}


@pytest.mark.parametrize("pattern", ["*", "OTEL_*_X", "A B", "", "1ABC", "OTEL*X"])
def test_pass_env_accepts_names_and_trailing_star_prefixes_only(pattern: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_config(f'[supervisor]\npass_env = ["{pattern}"]\n[[assistants]]\nname = "a"\n')
    assert "supervisor.pass_env" in str(error.value)


def test_the_frame_that_carries_the_values_shows_only_their_names() -> None:
    from agentd.config import Intelligence, SwapPolicy
    from agentd.protocol import ChildEnv, SwapIntel

    frame = SwapIntel(
        generation=2,
        policy=SwapPolicy.FINISH_ON_OLD,
        intelligence={"a": Intelligence()},
        env=ChildEnv(values={"OPENAI_KEY": "sk-secret-value"}),
    )
    assert "OPENAI_KEY" in repr(frame) and "sk-secret-value" not in repr(frame)


def test_the_api_token_and_the_store_password_are_withheld_whatever_pass_env_says() -> None:
    config = parse_config(
        '[store]\npassword_env = "PGPASS_VAR"\n[supervisor]\npass_env = ["AGENTD_*", "PGPASS_*"]\n'
        '[[assistants]]\nname = "a"\n'
    )
    env = child_environment({**DAEMON_ENV, "PGPASS_VAR": "db-secret", "AGENTD_LOG_FORMAT": "json"}, config)
    assert "AGENTD_API_TOKEN" not in env and "PGPASS_VAR" not in env
    assert env["AGENTD_LOG_FORMAT"] == "json"


def test_a_config_that_names_the_api_token_as_a_key_still_does_not_pass_it() -> None:
    config = parse_config('[intelligence]\napi_key_env = "AGENTD_API_TOKEN"\n[[assistants]]\nname = "a"\n')
    assert "AGENTD_API_TOKEN" not in child_environment(DAEMON_ENV, config)
    assert "AGENTD_API_TOKEN" not in passed_through(DAEMON_ENV, config)


MCP_CONFIG = """
[intelligence]
api_key_env = "OPENAI_KEY"

[supervisor]
pass_env = ["MCP_*", "OPENAI_KEY", "SHARED_KEY", "AGENTD_API_TOKEN"]

[[mcp_servers]]
name = "files"
command = ["files-server"]
env = { MODE = "read-only-mode" }
env_from = ["MCP_FILES_TOKEN", "SHARED_KEY"]

[[mcp_servers]]
name = "crm"
url = "http://crm/mcp"
headers_from = { Authorization = "MCP_CRM_AUTH" }

[[assistants]]
name = "a"
intelligence = { api_key_env = "SHARED_KEY" }
"""

MCP_ENV = {
    **DAEMON_ENV,
    "MCP_FILES_TOKEN": "files-token-1",
    "MCP_CRM_AUTH": "Bearer crm-token-2",
    "MCP_OTHER": "plain",
    "SHARED_KEY": "shared-key-3",
}


def test_pass_env_cannot_hand_an_mcp_secret_to_a_child() -> None:
    """MCP secrets reach a child in its frames only; a variable that is also an api_key_env is the
    provider's, so it stays in the environment (RFC 0000 §4)."""
    config = parse_config(MCP_CONFIG)
    env = child_environment(MCP_ENV, config)
    assert "MCP_FILES_TOKEN" not in env and "MCP_CRM_AUTH" not in env and "AGENTD_API_TOKEN" not in env
    assert env["MCP_OTHER"] == "plain" and env["SHARED_KEY"] == "shared-key-3"
    assert "MCP_FILES_TOKEN" not in passed_through(MCP_ENV, config)
    assert mcp_secrets(MCP_ENV, config) == {
        "MCP_CRM_AUTH": "Bearer crm-token-2",
        "MCP_FILES_TOKEN": "files-token-1",
        "SHARED_KEY": "shared-key-3",
    }


def test_secret_values_are_every_value_the_config_makes_agentd_hold() -> None:
    config = parse_config(MCP_CONFIG)
    values = secret_values({**MCP_ENV, "AGENTD_STORE_PASSWORD": "db-password"}, config)
    assert values == {
        "api-token",  # AGENTD_API_TOKEN
        "db-password",
        "sk-openai",
        "shared-key-3",
        "files-token-1",
        "Bearer crm-token-2",
        "crm-token-2",  # the credentials of a "Scheme credentials" header, on their own
        "read-only-mode",  # an MCP server's env
    }


def test_a_secret_read_from_a_file_is_scrubbed_as_it_is_used_without_its_newline() -> None:
    """AGENTD_API_TOKEN from a Kubernetes Secret made from a file ends in a newline; the daemon uses
    it trimmed, so the trimmed value is what a text could carry."""
    values = secret_values({"AGENTD_API_TOKEN": "api-token-from-file\n"}, parse_config(MCP_CONFIG))
    assert {"api-token-from-file", "api-token-from-file\n"} <= values
