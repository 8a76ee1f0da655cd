"""``agentd.validate``: the one validation of a config file that check-config, start-up and reload share.

Tools are resolved in a real ``python -P -m agentd.validate`` process, as a child resolves them.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from agentd import validate
from agentd.validate import validate_config_file

REPO = Path(__file__).resolve().parent.parent


def environ(*paths: Path) -> dict[str, str]:
    """The environment a child gets: ours, with PYTHONPATH set to exactly ``paths`` and the repository."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (REPO, *paths))}


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_valid_config_with_module_tools_passes(tmp_path: Path) -> None:
    config = write(tmp_path / "agentd.toml", '[[assistants]]\nname = "a"\ntools = ["clock", "tests.tooling:record"]\n')
    valid, issues = validate_config_file(config, environ=environ())
    assert issues == [] and valid is not None and valid.assistants[0].tools == ("clock", "tests.tooling:record")


def test_built_in_tools_need_no_check_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_process(*args: object, **kwargs: object) -> None:
        raise AssertionError("no process for built-ins")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    config = write(tmp_path / "agentd.toml", '[[assistants]]\nname = "a"\ntools = ["clock", "nosuch"]\n')
    valid, issues = validate_config_file(config)
    assert valid is None and [i.path for i in issues] == ["assistants[0].tools"] and "nosuch" in issues[0].message


def test_schema_and_tool_errors_are_reported_together(tmp_path: Path) -> None:
    config = write(
        tmp_path / "agentd.toml",
        f'[limits]\nmax_steps = {2**64}\n[[assistants]]\nname = "a"\ntools = ["no_such_module_q:fn", "bad ref!"]\n',
    )
    valid, issues = validate_config_file(config, environ=environ())
    assert valid is None
    assert [(i.path, "no_such_module_q" in i.message) for i in issues] == [
        ("limits.max_steps", False),
        ("assistants[0].tools[1]", False),  # bad syntax: reported by the schema, not resolved again
        ("assistants[0].tools", True),
    ]


def test_a_module_only_in_the_working_directory_is_refused_as_a_child_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path / "herehelpers.py", "def ok() -> str:\n    return 'ok'\n")
    config = write(tmp_path / "agentd.toml", '[[assistants]]\nname = "a"\ntools = ["herehelpers:ok"]\n')
    monkeypatch.chdir(tmp_path)
    _, issues = validate_config_file(config, environ=environ())
    assert [i.path for i in issues] == ["assistants[0].tools"]
    assert "cannot import module 'herehelpers'" in issues[0].message
    assert validate_config_file(config, environ=environ(tmp_path))[1] == []  # on PYTHONPATH: resolved


def test_an_import_that_hangs_is_refused_within_spawn_timeout_naming_the_tool(tmp_path: Path) -> None:
    write(tmp_path / "fasttools.py", "def quick() -> str:\n    return 'q'\n")
    write(
        tmp_path / "hangtools.py",
        "import time, subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\ntime.sleep(60)\ndef slow() -> str:\n    return 's'\n",
    )
    config = write(
        tmp_path / "agentd.toml",
        '[supervisor]\nspawn_timeout = "1500ms"\n'
        '[[assistants]]\nname = "a"\ntools = ["fasttools:quick"]\n'
        '[[assistants]]\nname = "b"\ntools = ["fasttools:quick", "hangtools:slow"]\n',
    )
    started = time.monotonic()
    valid, issues = validate_config_file(config, environ=environ(tmp_path))
    assert time.monotonic() - started < 1.5 + 5.0  # the timeout, plus a check process's start-up
    assert valid is None and [i.path for i in issues] == ["assistants[1].tools"]
    assert issues[0].message == (
        "tool 'hangtools:slow': not resolved within 1.5s (supervisor.spawn_timeout); a child could not start with it"
    )


def test_spawn_timeout_times_the_tools_imports_not_a_slow_interpreter_start(tmp_path: Path) -> None:
    """A loaded machine may take longer than ``spawn_timeout`` to start Python: that refuses no config
    (a child that starts slowly is retried; a refused config stops the daemon). The slow start is
    a ``sitecustomize`` that prints and sleeps, which every interpreter on this PYTHONPATH runs
    before ``main`` (what it prints comes before the check's own lines)."""
    write(tmp_path / "sitecustomize.py", "import time\nprint('site noise')\ntime.sleep(1.5)\n")
    write(tmp_path / "fasttools.py", "def quick() -> str:\n    return 'q'\n")
    write(tmp_path / "hangtools.py", "import time\ntime.sleep(60)\ndef slow() -> str:\n    return 's'\n")
    fast = write(
        tmp_path / "fast.toml",
        '[supervisor]\nspawn_timeout = "500ms"\n[[assistants]]\nname = "a"\ntools = ["fasttools:quick"]\n',
    )
    assert validate_config_file(fast, environ=environ(tmp_path))[1] == []
    hung = write(
        tmp_path / "hung.toml",
        '[supervisor]\nspawn_timeout = "500ms"\n[[assistants]]\nname = "a"\ntools = ["hangtools:slow"]\n',
    )
    issues = validate_config_file(hung, environ=environ(tmp_path))[1]
    assert [i.message for i in issues] == [
        "tool 'hangtools:slow': not resolved within 0.5s (supervisor.spawn_timeout); a child could not start with it"
    ]


def test_an_import_that_ends_the_process_and_noise_on_stdout_are_handled(tmp_path: Path) -> None:
    write(tmp_path / "noisytools.py", "print('hello from an import')\ndef ok() -> str:\n    return 'ok'\n")
    write(tmp_path / "exittools.py", "import os\nos._exit(3)\n")
    config = write(
        tmp_path / "agentd.toml",
        '[[assistants]]\nname = "a"\ntools = ["noisytools:ok"]\n[[assistants]]\nname = "b"\ntools = ["exittools:x"]\n',
    )
    valid, issues = validate_config_file(config, environ=environ(tmp_path))
    assert valid is None and [i.path for i in issues] == ["assistants[1].tools"]
    assert issues[0].message.startswith("tool 'exittools:x': importing it ended the process (exit status 3)")


def test_the_api_token_is_not_passed_to_the_check(tmp_path: Path) -> None:
    write(
        tmp_path / "tokentools.py",
        "import os\nassert 'AGENTD_API_TOKEN' not in os.environ\ndef ok() -> str:\n    return 'ok'\n",
    )
    config = write(tmp_path / "agentd.toml", '[[assistants]]\nname = "a"\ntools = ["tokentools:ok"]\n')
    assert validate_config_file(config, environ={**environ(tmp_path), "AGENTD_API_TOKEN": "secret"})[1] == []


def test_duplicate_tool_names_within_an_assistant_are_refused() -> None:
    assert validate.resolve_tool_lists([["clock", "clock"], ["clock"]]) == [(0, "two tools are named 'clock'")]


MCP_SECRETS = """
[[mcp_servers]]
name = "files"
command = ["files-server"]
env_from = ["FILES_TOKEN", "MISSING_TOKEN", "AGENTD_API_TOKEN"]

[[mcp_servers]]
name = "crm"
url = "http://crm/mcp"
headers_from = { Authorization = "CRM_AUTH" }

[[assistants]]
name = "a"
"""


def test_an_mcp_variable_that_is_not_set_or_is_the_daemons_own_is_an_error_at_its_path(tmp_path: Path) -> None:
    """The same check at start-up, reload and check-config: the daemon's environment cannot change."""
    path = write(tmp_path / "agentd.toml", MCP_SECRETS)
    config, issues = validate_config_file(path, environ={"FILES_TOKEN": "x"})
    assert config is None
    found = {issue.path: issue.message for issue in issues}
    assert set(found) == {
        "mcp_servers[0].env_from[1]",
        "mcp_servers[0].env_from[2]",
        "mcp_servers[1].headers_from.Authorization",
    }
    assert "MISSING_TOKEN is not set" in found["mcp_servers[0].env_from[1]"]
    assert "never given to an MCP server" in found["mcp_servers[0].env_from[2]"]
    assert "CRM_AUTH is not set" in found["mcp_servers[1].headers_from.Authorization"]
    env = {"FILES_TOKEN": "x", "MISSING_TOKEN": "", "CRM_AUTH": "y"}  # set, even empty: fine
    assert [i.path for i in validate_config_file(path, environ=env)[1]] == ["mcp_servers[0].env_from[2]"]
