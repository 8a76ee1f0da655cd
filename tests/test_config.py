"""Config schema and loading (agentd.config): defaults, durations, errors with paths, merging, policy."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Annotated

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

import agentd.config as config_module
from agentd.config import (
    MAX_CONFIG_BYTES,
    Config,
    ConfigError,
    FirstMessageMode,
    Intelligence,
    SwapPolicy,
    TransferMode,
    config_env_names,
    effective_intelligence,
    intelligence_map,
    load_config,
    parse_config,
    parse_duration,
    quickstart_config,
    quickstart_text,
    read_config_text,
    resolve_swap_policy,
)

ACCEPTED_POLICIES = ("'finish-on-old'", "'restart-turn'")


def issues_of(text: str) -> dict[str, str]:
    """Parse ``text`` expecting failure; return {path: message} for every issue."""
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    return {issue.path: issue.message for issue in info.value.issues}


# --------------------------------------------------------------------------- defaults


def test_a_file_with_only_an_assistant_gives_all_defaults() -> None:
    config = parse_config('[[assistants]]\nname = "assistant"\nsystem = "You are a helpful assistant."\n')
    assert config == Config()
    assert config.model_swap is None
    assert config.intelligence == Intelligence(provider="scripted", endpoints=(), model="echo-small", options={})
    assert config.limits.max_steps == 8
    assert config.limits.max_tokens == 0
    assert config.limits.deadline == 120.0
    assert config.limits.max_turn_restarts == 2
    assert config.supervisor.spawn_timeout == 10.0
    assert config.supervisor.ping_interval == 2.0
    assert config.supervisor.ping_timeout == 10.0
    assert config.supervisor.stop_grace == 10.0
    assert len(config.assistants) == 1
    assert config.default_assistant.name == "assistant"
    # A file with other settings and no assistants still gets the one default assistant.
    assert parse_config('model_swap = "restart-turn"').assistants == Config().assistants


@pytest.mark.parametrize("text", ["", "\n  \n", "# nothing yet\n# [[assistants]]\n"])
def test_an_empty_file_is_refused_not_taken_for_the_defaults(text: str) -> None:
    """A reload that catches a file half-written (empty) must not replace every assistant."""
    issues = issues_of(text)
    assert list(issues) == ["assistants"]
    assert "no assistants" in issues["assistants"] and "empty" in issues["assistants"]


def test_assistant_and_transfer_defaults() -> None:
    config = parse_config(
        """
[[assistants]]
name = "a"
[[assistants.transfers]]
to = "b"
[[assistants]]
name = "b"
"""
    )
    a = config.assistant("a")
    assert a.first_message_mode is FirstMessageMode.SPEAKS_FIRST
    assert a.tools == ()
    assert a.intelligence is None
    assert a.transfers[0].mode is TransferMode.ROLLING_HISTORY
    assert a.transfers[0].message == ""
    assert config.default_assistant.name == "a"
    with pytest.raises(KeyError):
        config.assistant("nobody")


def test_full_example_from_the_spec_parses() -> None:
    config = parse_config(
        """
model_swap = "restart-turn"

[intelligence]
provider = "ollama"
endpoints = ["http://127.0.0.1:11434", "https://backup.example:11434"]
model = "llama3"
api_key_env = "OPENAI_API_KEY"
options = { temperature = 0.2 }

[limits]
max_steps = 4
max_tokens = 1000
deadline = "30s"
max_turn_restarts = 1

[supervisor]
spawn_timeout = "5s"
ping_interval = "500ms"
ping_timeout = "3s"
stop_grace = "1m"

[[assistants]]
name = "triage"
system = "You route customers."
first_message = "Hi!"
first_message_mode = "assistant-waits-for-user"
tools = ["clock", "tests.tooling_examples:add"]

[[assistants.transfers]]
to = "billing"
description = "Invoices"
message = "Connecting you."
mode = "delete-history"

[[assistants]]
name = "billing"
"""
    )
    assert config.model_swap is SwapPolicy.RESTART_TURN
    assert config.intelligence.endpoints == ("http://127.0.0.1:11434", "https://backup.example:11434")
    assert config.intelligence.options == {"temperature": 0.2}
    assert config.limits.max_tokens == 1000
    assert config.supervisor.ping_interval == 0.5
    assert config.supervisor.stop_grace == 60.0
    triage = config.assistant("triage")
    assert triage.first_message_mode is FirstMessageMode.WAITS_FOR_USER
    assert triage.tools == ("clock", "tests.tooling_examples:add")
    assert triage.transfers[0].mode is TransferMode.DELETE_HISTORY


# --------------------------------------------------------------------------- durations


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("250ms", 0.25), ("10s", 10.0), ("2m", 120.0), ("1h", 3600.0), ("1.5s", 1.5), ("0.5m", 30.0)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["10", "s", "", "10 sec", "-5s", "1d", "10S", "1e3s", "ten seconds", "5m30s"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


def test_durations_in_config_become_seconds() -> None:
    config = parse_config(
        """
[limits]
deadline = "2m"
[supervisor]
spawn_timeout = "250ms"
ping_interval = "10s"
ping_timeout = "1h"
"""
    )
    assert config.limits.deadline == 120.0
    assert config.supervisor.spawn_timeout == pytest.approx(0.25)
    assert config.supervisor.ping_interval == 10.0
    assert config.supervisor.ping_timeout == 3600.0


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ('"10"', "invalid duration"),
        ('"fast"', "invalid duration"),
        ('"0s"', "greater than zero"),
        ("10", "expected a duration string"),
        ("1.5", "expected a duration string"),
    ],
)
def test_bad_duration_in_config(value: str, fragment: str) -> None:
    issues = issues_of(f"[limits]\ndeadline = {value}\n")
    assert list(issues) == ["limits.deadline"]
    assert fragment in issues["limits.deadline"]


# --------------------------------------------------------------------------- structural errors


def test_unknown_top_level_key() -> None:
    issues = issues_of('bogus = 1\nmodel_swap = "finish-on-old"\n')
    assert list(issues) == ["bogus"]
    assert "unknown key" in issues["bogus"]
    assert "model_swap" in issues["bogus"]  # the accepted keys are listed


def test_unknown_nested_keys_carry_their_path() -> None:
    issues = issues_of(
        """
[limits]
max_step = 3
[[assistants]]
name = "a"
intelligence = { modle = "x" }
[[assistants.transfers]]
to = "b"
bogus = true
[[assistants]]
name = "b"
"""
    )
    assert set(issues) == {"limits.max_step", "assistants[0].intelligence.modle", "assistants[0].transfers[0].bogus"}
    assert all("unknown key" in message for message in issues.values())
    assert "max_steps" in issues["limits.max_step"]


def test_enum_errors_list_accepted_values() -> None:
    issues = issues_of(
        """
model_swap = "fast"
[intelligence]
provider = "anthropic"
[[assistants]]
name = "a"
first_message_mode = "shout"
[[assistants.transfers]]
to = "b"
mode = "nope"
[[assistants]]
name = "b"
"""
    )
    assert all(v in issues["model_swap"] for v in ACCEPTED_POLICIES)
    assert "'fast'" in issues["model_swap"]
    for provider in ("'scripted'", "'ollama'", "'openai'"):
        assert provider in issues["intelligence.provider"]
    for mode in FirstMessageMode:
        assert repr(mode.value) in issues["assistants[0].first_message_mode"]
    for mode in TransferMode:
        assert repr(mode.value) in issues["assistants[0].transfers[0].mode"]


def test_multiple_errors_are_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(
            """
model_swap = "fast"
unknown = 1
[limits]
max_steps = 0
max_tokens = -1
deadline = "soon"
[[assistants]]
name = "bad name"
tools = ["not a tool"]
"""
        )
    paths = [issue.path for issue in info.value.issues]
    assert set(paths) == {
        "model_swap",
        "unknown",
        "limits.max_steps",
        "limits.max_tokens",
        "limits.deadline",
        "assistants[0].name",
        "assistants[0].tools[0]",
    }
    text = str(info.value)
    assert all(path in text for path in paths)


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ('[limits]\nmax_steps = "8"\n', "limits.max_steps"),
        ("[limits]\nmax_steps = true\n", "limits.max_steps"),
        ("[limits]\nmax_turn_restarts = -1\n", "limits.max_turn_restarts"),
        ('intelligence = "scripted"\n', "intelligence"),
        ('[intelligence]\nendpoints = "http://a"\n', "intelligence.endpoints"),
        ('[intelligence]\nmodel = ""\n', "intelligence.model"),
        ('[intelligence]\napi_key_env = "not-a-name"\n', "intelligence.api_key_env"),
        ("assistants = 5\n", "assistants"),
        ("[[assistants]]\nsystem = 'no name'\n", "assistants[0].name"),
    ],
)
def test_type_errors_name_the_field(text: str, path: str) -> None:
    assert path in issues_of(text)


def test_invalid_toml() -> None:
    with pytest.raises(ConfigError, match="invalid TOML"):
        parse_config("model_swap = \n")


# --------------------------------------------------------------------------- semantic errors


def test_transfer_to_unknown_assistant() -> None:
    issues = issues_of('[[assistants]]\nname = "a"\n[[assistants.transfers]]\nto = "ghost"\n')
    assert "'ghost'" in issues["assistants[0].transfers[0].to"]


def test_transfer_to_itself() -> None:
    issues = issues_of('[[assistants]]\nname = "a"\n[[assistants.transfers]]\nto = "a"\n')
    assert "itself" in issues["assistants[0].transfers[0].to"]


def test_duplicate_assistant_names() -> None:
    issues = issues_of('[[assistants]]\nname = "a"\n[[assistants]]\nname = "b"\n[[assistants]]\nname = "a"\n')
    assert list(issues) == ["assistants[2].name"]
    assert "duplicate" in issues["assistants[2].name"]


def test_no_assistants() -> None:
    assert "assistants" in issues_of("assistants = []\n")


@pytest.mark.parametrize("provider", ["ollama", "openai"])
def test_network_provider_needs_endpoints(provider: str) -> None:
    issues = issues_of(f'[intelligence]\nprovider = "{provider}"\n')
    assert provider in issues["intelligence.endpoints"]


def test_per_assistant_provider_without_endpoints() -> None:
    issues = issues_of('[[assistants]]\nname = "a"\nintelligence = { provider = "ollama" }\n')
    assert list(issues) == ["assistants[0].intelligence.endpoints"]


def test_credentials_in_endpoint_url_are_rejected_without_echoing_them() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(
            '[intelligence]\nprovider = "openai"\nendpoints = ["http://ok:1", "https://user:hunter2@api.example"]\n'
        )
    issues = {issue.path: issue.message for issue in info.value.issues}
    assert list(issues) == ["intelligence.endpoints[1]"]
    assert "credentials" in issues["intelligence.endpoints[1]"]
    assert "hunter2" not in str(info.value)


def test_endpoint_must_be_http_url() -> None:
    issues = issues_of('[intelligence]\nprovider = "openai"\nendpoints = ["ftp://x"]\n')
    assert "intelligence.endpoints[0]" in issues


# --------------------------------------------------------------------------- intelligence merging

MERGE = """
[intelligence]
provider = "openai"
endpoints = ["http://a:1", "http://b:1"]
model = "base-model"
api_key_env = "BASE_KEY"
options = { temperature = 0.2, delay_ms = 5 }

[[assistants]]
name = "plain"

[[assistants]]
name = "bigger"
intelligence = { model = "big-model", options = { delay_ms = 50, think = true } }

[[assistants]]
name = "elsewhere"
intelligence = { provider = "ollama", endpoints = ["http://c:11434"] }
"""


def test_assistant_without_override_uses_default() -> None:
    config = parse_config(MERGE)
    assert effective_intelligence(config, "plain") == config.intelligence


def test_override_merged_over_default_with_options_key_wise() -> None:
    config = parse_config(MERGE)
    bigger = effective_intelligence(config, "bigger")
    assert bigger.model == "big-model"
    assert bigger.provider == "openai"
    assert bigger.endpoints == ("http://a:1", "http://b:1")
    assert bigger.api_key_env == "BASE_KEY"
    assert bigger.options == {"temperature": 0.2, "delay_ms": 50, "think": True}
    assert config.intelligence.options == {"temperature": 0.2, "delay_ms": 5}  # default untouched


def test_override_without_options_keeps_default_options() -> None:
    config = parse_config(MERGE)
    elsewhere = effective_intelligence(config, "elsewhere")
    assert elsewhere.provider == "ollama"
    assert elsewhere.endpoints == ("http://c:11434",)
    assert elsewhere.model == "base-model"
    assert elsewhere.options == {"temperature": 0.2, "delay_ms": 5}


def test_intelligence_map_covers_every_assistant() -> None:
    config = parse_config(MERGE)
    intel = intelligence_map(config)
    assert list(intel) == ["plain", "bigger", "elsewhere"]
    assert {name: i.model for name, i in intel.items()} == {
        "plain": "base-model",
        "bigger": "big-model",
        "elsewhere": "base-model",
    }
    assert intel["bigger"] == effective_intelligence(config, "bigger")


# --------------------------------------------------------------------------- quickstart and files


def test_quickstart_is_valid() -> None:
    config = quickstart_config()
    assert config == parse_config(quickstart_text())
    assert config.intelligence.provider == "scripted"
    names = [a.name for a in config.assistants]
    assert len(names) >= 1 and len(set(names)) == len(names)
    for assistant in config.assistants:
        assert effective_intelligence(config, assistant.name).provider == "scripted"


def test_load_config_from_file(tmp_path: Path) -> None:
    path = tmp_path / "agentd.toml"
    path.write_text('model_swap = "restart-turn"\n[limits]\ndeadline = "45s"\n', encoding="utf-8")
    config = load_config(path)
    assert config.model_swap is SwapPolicy.RESTART_TURN
    assert config.limits.deadline == 45.0
    assert load_config(str(path)) == config


def test_load_config_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[limits]\nmax_steps = 0\nbogus = 1\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.source == str(path)
    assert str(info.value).startswith(str(path))
    assert {i.path for i in info.value.issues} == {"limits.max_steps", "limits.bogus"}


def test_load_config_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.toml")


# --------------------------------------------------------------------------- swap policy precedence


@pytest.mark.parametrize(
    ("flag", "env", "file_value", "policy", "source"),
    [
        ("restart-turn", {"AGENTD_MODEL_SWAP": "finish-on-old"}, SwapPolicy.FINISH_ON_OLD, "restart-turn", "flag"),
        ("finish-on-old", {"AGENTD_MODEL_SWAP": "restart-turn"}, SwapPolicy.RESTART_TURN, "finish-on-old", "flag"),
        (None, {"AGENTD_MODEL_SWAP": "restart-turn"}, SwapPolicy.FINISH_ON_OLD, "restart-turn", "env"),
        (None, {"AGENTD_MODEL_SWAP": "finish-on-old"}, SwapPolicy.RESTART_TURN, "finish-on-old", "env"),
        (None, {}, SwapPolicy.RESTART_TURN, "restart-turn", "file"),
        (None, {"OTHER": "x"}, None, "finish-on-old", "default"),
    ],
)
def test_swap_policy_precedence(
    flag: str | None, env: dict[str, str], file_value: SwapPolicy | None, policy: str, source: str
) -> None:
    choice = resolve_swap_policy(flag, env, file_value)
    assert choice.policy == SwapPolicy(policy)
    assert choice.source == source


def test_swap_policy_reads_process_env_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTD_MODEL_SWAP", "restart-turn")
    assert resolve_swap_policy(None, None, None).source == "env"
    monkeypatch.delenv("AGENTD_MODEL_SWAP")
    assert resolve_swap_policy(None, None, None).source == "default"


@pytest.mark.parametrize(
    ("flag", "env", "where"),
    [
        ("fast", {}, "--model-swap"),
        ("fast", {"AGENTD_MODEL_SWAP": "restart-turn"}, "--model-swap"),
        (None, {"AGENTD_MODEL_SWAP": "restart"}, "AGENTD_MODEL_SWAP"),
    ],
)
def test_invalid_policy_values_name_accepted_values(flag: str | None, env: dict[str, str], where: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_swap_policy(flag, env, SwapPolicy.FINISH_ON_OLD)
    message = str(info.value)
    assert where in message
    assert all(value in message for value in ACCEPTED_POLICIES)


def test_error_in_inherited_default_endpoint_is_reported_once_at_its_own_path() -> None:
    issues = issues_of(
        """
[intelligence]
provider = "openai"
endpoints = ["https://user:pw@api.example"]
[[assistants]]
name = "a"
[[assistants]]
name = "b"
intelligence = { model = "big" }
"""
    )
    assert list(issues) == ["intelligence.endpoints[0]"]


# --------------------------------------------------------------------------- whole: everything fits the wire

ONE = '\n[[assistants]]\nname = "a"\n'


@pytest.mark.parametrize(
    ("text", "path"),
    [
        (f"[limits]\nmax_steps = {2**64}", "limits.max_steps"),  # the report of the issue: it passed before
        (f"[limits]\nmax_steps = {2**63 - 1}", "limits.max_steps"),
        ("[limits]\nmax_steps = 100001", "limits.max_steps"),
        (f"[limits]\nmax_tokens = {2**63}", "limits.max_tokens"),
        (f"[limits]\nmax_turn_restarts = {2**64}", "limits.max_turn_restarts"),
        (f"[supervisor]\nchildren = {2**64}", "supervisor.children"),
        ('[limits]\ndeadline = "169h"', "limits.deadline"),
        (f'[limits]\ndeadline = "{"9" * 400}h"', "limits.deadline"),  # a float infinity, once parsed
        ('[supervisor]\nidle_unload = "100000000000000000000s"', "supervisor.idle_unload"),
        ('[server]\nlisten = "127.0.0.1:65536"', "server.listen"),
    ],
)
def test_every_number_has_bounds_inside_the_wire(text: str, path: str) -> None:
    issues = issues_of(text + ONE)
    assert list(issues) == [path], issues


def test_the_bounds_still_take_large_sensible_values() -> None:
    config = parse_config(
        '[limits]\nmax_steps = 100000\nmax_tokens = 1000000000000\ndeadline = "168h"\nmax_turn_restarts = 1000\n'
        '[server]\nlisten = "127.0.0.1:65535"\n' + ONE
    )
    assert config.limits.max_steps == 100_000 and config.limits.deadline == 7 * 24 * 3600.0


@pytest.mark.parametrize(
    ("options", "path", "words"),
    [
        (f"x = {2**64}", "intelligence.options.x", "64 bits"),
        (f"x = {2**63}", "intelligence.options.x", "64 bits"),
        (f"x = {-(2**63) - 1}", "intelligence.options.x", "64 bits"),
        (f"deep = {{ list = [1, {{ n = {2**64} }}] }}", "intelligence.options.deep.list[1].n", "64 bits"),
        ("t = inf", "intelligence.options.t", "finite"),
        ("t = nan", "intelligence.options.t", "finite"),
        ("when = 1979-05-27T07:32:00Z", "intelligence.options.when", "date"),
        ("day = 1979-05-27", "intelligence.options.day", "date"),
        ("at = 07:32:00", "intelligence.options.at", "time"),
        ("n = " + "[" * 40 + "]" * 40, "intelligence.options.n" + "[0]" * 32, "nested"),
    ],
)
def test_options_hold_only_values_a_frame_and_a_server_can_carry(options: str, path: str, words: str) -> None:
    issues = issues_of(f"[intelligence]\noptions = {{ {options} }}\n" + ONE)
    assert list(issues) == [path], issues
    assert words in issues[path]


def test_an_assistants_options_are_checked_at_their_own_path() -> None:
    issues = issues_of(f'[[assistants]]\nname = "a"\nintelligence = {{ options = {{ seed = {2**64} }} }}\n')
    assert list(issues) == ["assistants[0].intelligence.options.seed"]


def test_options_keep_every_json_like_value() -> None:
    config = parse_config(
        '[intelligence]\noptions = { t = 0.5, n = -9223372036854775808, m = 9223372036854775807, s = "x", '
        'b = true, l = [1, 2.5, ["a"]], nested = { k = { v = 1 } } }\n' + ONE
    )
    assert config.intelligence.options["n"] == -(2**63) and config.intelligence.options["nested"] == {"k": {"v": 1}}


@given(st.one_of(st.integers(), st.floats()))
def test_any_number_an_accepted_config_holds_encodes_in_a_frame(number: int | float) -> None:
    from agentd.protocol import Spawn, decode_payload, encode_frame

    text = f"[intelligence]\noptions = {{ x = {_toml_number(number)} }}\n" + ONE
    try:
        config = parse_config(text)
    except ConfigError:
        return
    frame = Spawn(child_id="c", generation=1, policy=SwapPolicy.FINISH_ON_OLD, config=config)
    assert decode_payload(encode_frame(frame)[4:]) == frame


def _toml_number(number: int | float) -> str:
    if isinstance(number, float) and number != number:
        return "nan"
    if isinstance(number, float) and number in (float("inf"), float("-inf")):
        return "inf" if number > 0 else "-inf"
    return repr(number)


def test_nesting_too_deep_for_the_toml_parser_is_a_config_error() -> None:
    issues = issues_of("x = " + "[" * 5000 + "]" * 5000)
    assert "nested too deeply" in issues[""]


# --------------------------------------------------------------------------- reading the file, bounded


def test_a_fifo_is_refused_at_once_naming_the_path(tmp_path: Path) -> None:
    fifo = tmp_path / "agentd.toml"
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        load_config(fifo)  # without a writer, reading a FIFO would wait forever
    assert time.monotonic() - started < 2.0
    assert str(info.value).endswith(f"cannot read config file {fifo}: not a regular file (it is a FIFO)")


def test_a_directory_and_a_missing_file_are_refused_naming_the_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read config file .*: not a regular file \(it is a directory\)"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match=r"cannot read config file .*nope\.toml: No such file or directory"):
        load_config(tmp_path / "nope.toml")


def test_a_file_too_large_is_refused_before_it_is_read_whole(tmp_path: Path) -> None:
    big = tmp_path / "big.toml"
    with big.open("wb") as handle:
        handle.truncate(MAX_CONFIG_BYTES + 1)
    with pytest.raises(ConfigError, match="is larger than 16 MiB"):
        load_config(big)


def test_a_read_that_hangs_times_out_on_a_thread_that_cannot_hold_up_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hung file system never answers: stood in for by a read that blocks until released."""
    release = threading.Event()
    readers: list[threading.Thread] = []

    def hung(path: Path) -> bytes:
        readers.append(threading.current_thread())
        release.wait(30)
        return b""

    monkeypatch.setattr(config_module, "_read_regular_file", hung)
    started = time.monotonic()
    try:
        with pytest.raises(ConfigError, match=r"cannot read config file .*: no answer within 0\.2s"):
            read_config_text(tmp_path / "agentd.toml", timeout=0.2)
        assert time.monotonic() - started < 2.0
        assert readers and readers[0].daemon  # the interpreter does not wait for it at exit
    finally:
        release.set()


# --------------------------------------------------------------------------- [store]


def test_store_defaults_are_sqlite_in_the_state_dir() -> None:
    config = parse_config('[[assistants]]\nname = "a"\n')
    assert (config.store.url, config.store.password_env, config.store.lease) == ("", "AGENTD_STORE_PASSWORD", 10.0)


def test_a_postgres_store_url_and_its_settings_parse() -> None:
    config = parse_config(
        '[store]\nurl = "postgresql://agentd@db.internal:5432/agentd"\npassword_env = "PGPASS_AGENTD"\nlease = "30s"\n'
        '[[assistants]]\nname = "a"\n'
    )
    assert config.store.url == "postgresql://agentd@db.internal:5432/agentd"
    assert (config.store.password_env, config.store.lease) == ("PGPASS_AGENTD", 30.0)
    unix = parse_config('[store]\nurl = "postgres:///agentd?host=/run/postgresql"\n[[assistants]]\nname = "a"\n')
    assert unix.store.url.startswith("postgres:///")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("postgresql://agentd:hunter2@db/agentd", "a password in the URL is not allowed"),
        ("postgresql://agentd@db/agentd?sslmode=require&password=hunter2", "a password in the URL is not allowed"),
        ("mysql://agentd@db/agentd", 'expected "" (SQLite in the state dir) or a postgresql:// URL'),
        ("/var/lib/agentd/agentd.db", 'expected "" (SQLite in the state dir) or a postgresql:// URL'),
        ("postgresql://agentd@db:hunter2/agentd", "not a valid URL (its host or port cannot be read)"),
    ],
)
def test_a_store_url_that_cannot_be_used_is_refused_without_echoing_it(url: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(f'[store]\nurl = "{url}"\n[[assistants]]\nname = "a"\n')
    issues = {issue.path: issue.message for issue in info.value.issues}
    assert list(issues) == ["store.url"]
    assert message in issues["store.url"]
    assert "hunter2" not in str(info.value)


def test_store_lease_is_a_duration_of_at_least_a_second() -> None:
    assert issues_of('[store]\nlease = "500ms"\n')["store.lease"] == (
        "a lease must be at least 1s (replicas renew it), got 0.5s"
    )
    assert "expected a duration string" in issues_of("[store]\nlease = 10\n")["store.lease"]
    assert "unknown key" in issues_of('[store]\nhost = "db"\n')["store.host"]
    assert "store.password_env" in issues_of('[store]\npassword_env = "not a name"\n')


# --------------------------------------------------------------------------- [[mcp_servers]] (RFC 0008 §3)

MCP = """
[intelligence]
api_key_env = "OPENAI_KEY"

[[mcp_servers]]
name = "time"
command = ["python", "-m", "mcp_server_time", "--local-timezone", "UTC"]
env = { TZ = "UTC" }
env_from = ["TIME_TOKEN"]
call_timeout = "30s"

[[mcp_servers]]
name = "crm"
url = "https://crm.example/mcp"
headers_from = { Authorization = "CRM_AUTH", "X-Tenant" = "CRM_TENANT" }

[[assistants]]
name = "main"
tools = ["clock", "time:*", "crm:find-customer", "tests.tooling_examples:add"]
"""


def test_mcp_servers_parse_with_their_defaults() -> None:
    config = parse_config(MCP)
    time, crm = config.mcp_servers
    assert time.command == ("python", "-m", "mcp_server_time", "--local-timezone", "UTC")
    assert (time.env, time.env_from, time.call_timeout, time.connect_timeout) == (
        {"TZ": "UTC"},
        ("TIME_TOKEN",),
        30.0,
        10.0,
    )
    assert crm.url == "https://crm.example/mcp" and crm.call_timeout == 60.0
    assert crm.headers_from == {"Authorization": "CRM_AUTH", "X-Tenant": "CRM_TENANT"}
    assert config.mcp_server("crm") is crm and config.mcp_server("nope") is None
    assert config_env_names(config) == ["CRM_AUTH", "CRM_TENANT", "OPENAI_KEY", "TIME_TOKEN"]


@pytest.mark.parametrize(
    ("server", "path", "message"),
    [
        ('name = "x"', "mcp_servers[0]", "exactly one of command"),
        ('name = "x"\ncommand = ["a"]\nurl = "http://h/mcp"', "mcp_servers[0]", "exactly one of command"),
        ('name = "x"\ncommand = []', "mcp_servers[0].command", "empty"),
        ('name = "x"\nurl = "ftp://h"', "mcp_servers[0].url", "http:// or https://"),
        ('name = "x"\nurl = "http://u:p@h/mcp"', "mcp_servers[0].url", "use headers_from"),
        ('name = "x"\nurl = "http://h/mcp?token=1"', "mcp_servers[0].url", "use headers_from"),
        ('name = "x"\nurl = "http://h/mcp"\nenv_from = ["A"]', "mcp_servers[0].env_from", "only a stdio server"),
        ('name = "x"\ncommand = ["a"]\nheaders_from = { A = "B" }', "mcp_servers[0].headers_from", "only an HTTP"),
        ('name = "x"\ncommand = ["a"]\nenv_from = ["not a name"]', "mcp_servers[0].env_from[0]", ""),
        ('name = "x"\ncommand = ["a"]\ncall_timeout = "soon"', "mcp_servers[0].call_timeout", "invalid duration"),
        ('name = "x:y"\ncommand = ["a"]', "mcp_servers[0].name", ""),
        (
            'name = "x"\nurl = "http://h/mcp"\nheaders_from = { "Bad Header" = "B" }',
            "mcp_servers[0].headers_from",
            "'Bad Header'",
        ),
        ('name = "x"\nurl = "http://h/mcp"\nheaders_from = { A = "not a name" }', "mcp_servers[0].headers_from.A", ""),
    ],
)
def test_mcp_server_errors_name_the_field(server: str, path: str, message: str) -> None:
    issues = issues_of(f"[[mcp_servers]]\n{server}\n")
    assert path in issues, issues
    assert message in issues[path]


def test_tool_refs_must_name_a_defined_server() -> None:
    issues = issues_of(
        '[[mcp_servers]]\nname = "time"\ncommand = ["a"]\n[[assistants]]\nname = "a"\ntools = ["tiem:*", "t-1:x"]\n'
    )
    assert "no MCP server named 'tiem'" in issues["assistants[0].tools[0]"]
    assert "no MCP server named 't-1'" in issues["assistants[0].tools[1]"]


def test_duplicate_mcp_server_names_are_refused() -> None:
    issues = issues_of(
        '[[mcp_servers]]\nname = "a"\ncommand = ["x"]\n[[mcp_servers]]\nname = "a"\nurl = "http://h/mcp"\n'
    )
    assert "duplicate MCP server name" in issues["mcp_servers[1].name"]


class _Inner(msgspec.Struct):
    table: dict[Annotated[str, msgspec.Meta(pattern="^a$")], int] = {}
    items: list[int] = []


def test_a_schema_error_the_field_walk_missed_is_still_reported_at_msgspecs_path() -> None:
    from agentd.config.checks import error_path as _error_path

    for value, path in [({"table": {"x": 1}}, "table"), ({"items": [1, "x"]}, "items[1]"), (3, "")]:
        with pytest.raises(msgspec.ValidationError) as error:
            msgspec.convert(value, _Inner)
        assert _error_path(error.value) == path


# --------------------------------------------------------------------------- [server] connection bounds


def test_server_connection_bounds_default_and_parse() -> None:
    assert (Config().server.max_connections, Config().server.header_timeout) == (1000, 10.0)
    config = parse_config('[server]\nmax_connections = 8\nheader_timeout = "500ms"\n')
    assert (config.server.max_connections, config.server.header_timeout) == (8, 0.5)


@pytest.mark.parametrize(
    ("text", "path", "fragment"),
    [
        ("[server]\nmax_connections = 0\n", "server.max_connections", ">= 1"),
        ('[server]\nmax_connections = "1000"\n', "server.max_connections", "int"),
        ("[server]\nmax_connections = 1000001\n", "server.max_connections", "<= 1000000"),
        ("[server]\nheader_timeout = 10\n", "server.header_timeout", "expected a duration string"),
        ('[server]\nheader_timeout = "0s"\n', "server.header_timeout", "greater than zero"),
        ('[server]\nheader_timeout = "soon"\n', "server.header_timeout", "invalid duration"),
    ],
)
def test_server_connection_bounds_are_validated_with_their_path(text: str, path: str, fragment: str) -> None:
    issues = issues_of(text)
    assert list(issues) == [path]
    assert fragment in issues[path]


# --------------------------------------------------------------------------- [server] trusted_proxies


def test_trusted_proxies_default_to_nobody_and_take_addresses_and_networks() -> None:
    assert Config().server.trusted_proxies == ()
    config = parse_config('[server]\ntrusted_proxies = ["127.0.0.1", "10.0.0.0/8", "fd00::/8", "*"]\n')
    assert config.server.trusted_proxies == ("127.0.0.1", "10.0.0.0/8", "fd00::/8", "*")


@pytest.mark.parametrize(
    ("text", "path", "fragment"),
    [
        ('[server]\ntrusted_proxies = ["127.0.0.1", "ingress.local"]\n', "server.trusted_proxies[1]", "CIDR"),
        ('[server]\ntrusted_proxies = ["10.0.0.0/33"]\n', "server.trusted_proxies[0]", "'10.0.0.0/33'"),
        ('[server]\ntrusted_proxies = "127.0.0.1"\n', "server.trusted_proxies", "array"),
    ],
)
def test_trusted_proxies_are_validated_with_their_path(text: str, path: str, fragment: str) -> None:
    issues = issues_of(text)
    assert list(issues) == [path]
    assert fragment in issues[path]
