"""A config validated the way the daemon will use it: one function, ``validate_config_file``, serves
``agentd check-config``, the daemon's start-up and every reload (``load_daemon_config``).

It checks, in order, and reports every issue found with its path:

1. the file and its schema and references (``agentd.config``: bounded read, every field), and
   that every variable the MCP servers name is set (``mcp_env_issues``);
2. the tools, resolved the way a child resolves them (MCP tools, ``server:tool``, are not: their
   names come from the server when a child connects; ``agentd check-config --connect`` does that). ``module:function`` references are imported
   in a fresh ``python -P -m agentd.validate`` process with the children's environment — ``-P``
   keeps the working directory off ``sys.path`` as it is for a child (RFC 0006 §9) — and within
   ``supervisor.spawn_timeout``: a tool a child cannot import by then can never start a child.
   That time runs once the check process has started: an interpreter slow to start on a loaded
   machine is retried for a child, but would refuse a config for good. (So a config can pass
   whose children then miss ``spawn_timeout`` on a slow machine: they are retried, and
   ``/v1/ready`` names the cause.)
   Importing them in the daemon itself would run a tool's import-time code in the supervisor,
   let an import that hangs hold a reload forever, and find modules cached by an earlier
   import instead of the files as they are now. Built-in tools import nothing and are resolved
   in this process;
3. that the config fits the control protocol: it is encoded in a ``Spawn`` as a child gets it.

A config that passes can be applied whole: nothing a reload does afterwards fails because of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence

import msgspec

from agentd.config import (
    Config,
    ConfigError,
    ConfigIssue,
    SupervisorSettings,
    SwapPolicy,
    effective_intelligence,
    parse_config,
    read_config_text,
)
from agentd.environment import child_environment, supervisor_only
from agentd.mcp import is_mcp_ref

__all__ = [
    "abort_tool_checks",
    "mcp_env_issues",
    "resolve_tool_lists",
    "tool_issues",
    "validate_config_file",
]

#: Left over after a timed-out check was killed: how long its output may take to arrive.
_AFTER_KILL_SECONDS = 2.0
#: How long a check process may take to start (an interpreter, on a loaded machine) before its
#: tools' imports are timed against ``spawn_timeout``.
_START_SECONDS = 30.0
#: The check's line on stdout once it has started and read the refs: the imports begin (JSON that is
#: no report line, so ``_issues_from`` passes over it).
_STARTED = b'{"started": true}\n'
#: The environment variable the daemon never passes to children (nor to the tool check).
_TOKEN_ENV = "AGENTD_API_TOKEN"

#: The tool checks running now (a reload's, on a worker thread): shutdown kills them, so a reload it
#: abandons never keeps the process alive until its check ends (RFC 0003 §5).
_checks: set[subprocess.Popen[bytes]] = set()
_checks_lock = threading.Lock()
_aborted = False


def _checks_aborted() -> bool:
    with _checks_lock:
        return _aborted


def abort_tool_checks() -> None:
    """Kill every running tool check with its process group and refuse new ones (the daemon stops)."""
    global _aborted
    with _checks_lock:
        _aborted = True
        running = list(_checks)
    for process in running:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)


def validate_config_file(
    path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None
) -> tuple[Config | None, list[ConfigIssue]]:
    """Validate the config file at ``path``: schema and references, tools, then the wire.

    Returns the config (None when any issue was found) and every issue. Tools are resolved even
    when the schema check failed, so one run shows every problem rather than one layer at a time.
    ``environ`` is the daemon's environment (default: this process's); tools are imported with the
    part of it a child gets (agentd/environment.py).
    """
    try:
        text = read_config_text(path)
    except ConfigError as exc:
        return None, list(exc.issues)
    config: Config | None
    try:
        config = parse_config(text, str(path))
        issues: list[ConfigIssue] = _option_issues(config)
        issues.extend(mcp_env_issues(config, os.environ if environ is None else environ))
        tool_lists = [list(a.tools) for a in config.assistants]
        servers = [server.name for server in config.mcp_servers]
        timeout = config.supervisor.spawn_timeout
        if config.store.password_env:  # the store's password is no tool's business (RFC 0009 §1)
            base = os.environ if environ is None else environ
            environ = {k: v for k, v in base.items() if k != config.store.password_env}
    except ConfigError as exc:
        config, issues = None, list(exc.issues)
        tool_lists, servers = _raw_tool_lists(text), _raw_server_names(text)
        timeout = SupervisorSettings().spawn_timeout
    # A ref the schema already rejected (bad syntax) is not resolved again: one error each.
    reported = {issue.path for issue in issues}
    usable = [
        [
            ref
            for k, ref in enumerate(refs)
            if f"assistants[{i}].tools[{k}]" not in reported and not is_mcp_ref(ref, servers)
        ]
        for i, refs in enumerate(tool_lists)
    ]
    # Tools are imported with exactly the environment a child would give them.
    child_env = child_environment(os.environ if environ is None else environ, config or Config())
    issues.extend(tool_issues(usable, timeout=timeout, environ=child_env))
    if config is not None and not issues:
        issues.extend(_frame_issues(config))
    return (config if not issues else None), issues


def _raw_tool_lists(text: str) -> list[list[str]]:
    """Each assistant's tool refs straight from the TOML (for a file that failed validation)."""
    try:
        raw = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError):
        return []
    assistants = raw.get("assistants")
    if not isinstance(assistants, list):
        return []
    lists: list[list[str]] = []
    for assistant in assistants:
        tools = assistant.get("tools") if isinstance(assistant, dict) else None
        lists.append([t for t in tools if isinstance(t, str)] if isinstance(tools, list) else [])
    return lists


def _raw_server_names(text: str) -> list[str]:
    """The ``[[mcp_servers]]`` names straight from the TOML (for a file that failed validation)."""
    try:
        raw = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError):
        return []
    servers = raw.get("mcp_servers")
    if not isinstance(servers, list):
        return []
    return [s["name"] for s in servers if isinstance(s, dict) and isinstance(s.get("name"), str)]


def _option_issues(config: Config) -> list[ConfigIssue]:
    """Provider options a provider cannot take (``agentd.intel.options``), at the table that set
    them: an assistant's own ``intelligence.options``, else the default ``[intelligence]``."""
    from agentd.intel.options import option_errors

    issues: dict[str, ConfigIssue] = {}
    for i, assistant in enumerate(config.assistants):
        effective = effective_intelligence(config, assistant.name)
        own = assistant.intelligence.options if assistant.intelligence is not None else None
        for key, message in option_errors(effective.provider, effective.options):
            where = f"assistants[{i}].intelligence" if own is not None and key in own else "intelligence"
            field = f"{where}.options.{key}"
            issues.setdefault(field, ConfigIssue(field, f"invalid {effective.provider} option: {message}"))
    return list(issues.values())


def mcp_env_issues(config: Config, environ: Mapping[str, str]) -> list[ConfigIssue]:
    """Each variable an ``[[mcp_servers]]`` entry names (``env_from``, ``headers_from``) that
    ``environ`` does not have, or that is the daemon's own secret, at its path.

    An error, not a warning, and the same at start-up, reload and ``check-config``: the daemon reads
    these from its own environment, which cannot change after it started, so a config naming a
    variable it does not have could never work until a restart — and applied, it would only show
    as a server that is "unavailable" when a turn first needs it.
    """
    own = supervisor_only(config)
    issues: list[ConfigIssue] = []
    for i, server in enumerate(config.mcp_servers):
        named = [(f"env_from[{k}]", name) for k, name in enumerate(server.env_from)]
        named += [(f"headers_from.{header}", name) for header, name in server.headers_from.items()]
        for field, name in named:
            path = f"mcp_servers[{i}].{field}"
            if name in own:
                issues.append(
                    ConfigIssue(path, f"{name} is the daemon's own secret; it is never given to an MCP server")
                )
            elif name not in environ:
                issues.append(
                    ConfigIssue(
                        path,
                        f"the environment variable {name} is not set (MCP server {server.name!r} needs it; "
                        "the daemon reads it from the environment it was started with)",
                    )
                )
    return issues


def _frame_issues(config: Config) -> list[ConfigIssue]:
    """The config as a child receives it, encoded: what could not be sent is an issue now, not a
    failed fan-out after the reload was applied. (The schema bounds every value; this is the proof.)"""
    from agentd.protocol import Spawn, encode_frames  # the protocol imports the config module

    try:
        encode_frames(Spawn(child_id="check", generation=1, policy=SwapPolicy.FINISH_ON_OLD, config=config))
    except (msgspec.EncodeError, OverflowError, TypeError, ValueError) as exc:
        return [ConfigIssue("", f"the config cannot be sent to a child: {type(exc).__name__}: {exc}")]
    return []


# --------------------------------------------------------------------------- tools


def tool_issues(
    tool_lists: Sequence[Sequence[str]],
    *,
    timeout: float,
    environ: Mapping[str, str] | None = None,
) -> list[ConfigIssue]:
    """Resolve each assistant's tool refs (``tool_lists[i]`` for ``assistants[i]``) as a child will.

    Every failure is an issue at ``assistants[i].tools``. Only built-ins: resolved here. Any
    ``module:function``: resolved in a ``python -P`` process (see the module docstring) that is
    killed, with everything it started, after ``timeout`` seconds.
    """
    if not any(":" in ref for refs in tool_lists for ref in refs):
        return [ConfigIssue(f"assistants[{i}].tools", message) for i, message in resolve_tool_lists(tool_lists)]
    env = dict(os.environ if environ is None else environ)
    env.pop(_TOKEN_ENV, None)
    aborted = "not resolved: the daemon is shutting down"
    # The refs go in a file, not a pipe: writing them can never block on a check that does not read.
    with tempfile.TemporaryFile() as request:
        request.write(json.dumps([list(refs) for refs in tool_lists]).encode())
        request.seek(0)
        with _checks_lock:
            if _aborted:
                return _issues_from(b"", tool_lists, aborted)
            process = subprocess.Popen(
                [sys.executable, "-P", "-m", "agentd.validate"],
                stdin=request,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,  # its own process group: a timeout kills whatever a tool's import started
            )
            _checks.add(process)
    start_window = max(_START_SECONDS, timeout)
    try:
        out, err = _exchange(process, timeout, start_window)
    except _CheckStopped as stop:
        stopped = f"not resolved within {timeout:g}s (supervisor.spawn_timeout); a child could not start with it"
        if not stop.started:
            stopped = f"not resolved: the check process did not start within {start_window:g}s"
        return _issues_from(stop.out, tool_lists, stopped)
    finally:
        with _checks_lock:
            _checks.discard(process)
    if _checks_aborted():  # killed by shutdown: say so rather than "ended the process (-9)"
        return _issues_from(out, tool_lists, aborted)
    # A tool's import that exits the process (sys.exit, os._exit, a crash) would end a child's start-up
    # too — even with exit status 0 (``os._exit(0)`` cannot be caught): every ref must have been reported.
    last = err.decode("utf-8", "replace").strip().splitlines()[-1:]
    stopped = f"importing it ended the process (exit status {process.returncode})" + (f": {last[0]}" if last else "")
    return _issues_from(out, tool_lists, stopped, only_if_unreported=process.returncode == 0)


class _CheckStopped(Exception):
    """A check killed for its time: what its stdout held, and whether it had started its imports."""

    def __init__(self, out: bytes, *, started: bool) -> None:
        super().__init__("the check was stopped")
        self.out, self.started = out, started


def _has_started(out: bytes) -> bool:
    """Whether the check's ``_STARTED`` line is in ``out`` (a ``sitecustomize`` may print before it)."""
    return (b"\n" + out).find(b"\n" + _STARTED) >= 0


def _exchange(process: subprocess.Popen[bytes], timeout: float, start_window: float) -> tuple[bytes, bytes]:
    """The check's whole stdout and stderr, once it has exited.

    ``timeout`` runs from the check's ``_STARTED`` line, not from its spawn: what it bounds is the
    tools' imports. A machine under load may take a second to start an interpreter, and that is
    no fault of the config (a child that starts slowly is retried; a config refused is not). The
    start itself may take ``start_window``. When either runs out — the output still open, or the
    process not yet exited — the check's process group is killed and ``_CheckStopped`` raised.
    """
    assert process.stdout is not None and process.stderr is not None
    out_fd, err_fd = process.stdout.fileno(), process.stderr.fileno()
    chunks: dict[int, list[bytes]] = {out_fd: [], err_fd: []}
    deadline = time.monotonic() + start_window
    started = False
    try:
        with selectors.DefaultSelector() as selector:
            for fd in chunks:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map() and (left := deadline - time.monotonic()) > 0:
                for key, _ in selector.select(left):
                    data = os.read(key.fd, 65536)
                    if not data:
                        selector.unregister(key.fd)
                        continue
                    chunks[key.fd].append(data)
                    if not started and key.fd == out_fd and _has_started(b"".join(chunks[out_fd])):
                        started, deadline = True, time.monotonic() + timeout
            if not selector.get_map():  # both closed: it is exiting (unless an import keeps it alive)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=max(0.0, deadline - time.monotonic()))
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
                _drain(selector, chunks, _AFTER_KILL_SECONDS)
                with contextlib.suppress(subprocess.TimeoutExpired):  # stuck in the kernel: leave it
                    process.wait(timeout=_AFTER_KILL_SECONDS)
                raise _CheckStopped(b"".join(chunks[out_fd]), started=started)
    finally:
        process.stdout.close()
        process.stderr.close()
    return b"".join(chunks[out_fd]), b"".join(chunks[err_fd])


def _drain(selector: selectors.BaseSelector, chunks: dict[int, list[bytes]], seconds: float) -> None:
    """What a killed check wrote before it died, for at most ``seconds`` (a hung file system)."""
    deadline = time.monotonic() + seconds
    while selector.get_map() and (left := deadline - time.monotonic()) > 0:
        for key, _ in selector.select(left):
            data = os.read(key.fd, 65536)
            if data:
                chunks[key.fd].append(data)
            else:
                selector.unregister(key.fd)


def _issues_from(
    out: bytes, tool_lists: Sequence[Sequence[str]], stopped: str | None, *, only_if_unreported: bool = False
) -> list[ConfigIssue]:
    """The check's report (one JSON line per ref resolved) → issues. When the check was ``stopped``
    (timed out, or its process ended), the first ref without a line is the one it stopped at; with
    ``only_if_unreported`` (it exited 0), that is an issue only if some ref has no line."""
    issues: list[ConfigIssue] = []
    seen: set[tuple[int, int]] = set()
    for line in out.decode("utf-8", "replace").splitlines():
        try:
            record = json.loads(line)
            i, k, error = int(record["assistant"]), int(record["tool"]), record["error"]
        except (ValueError, KeyError, TypeError):
            continue  # not ours (a tool's import wrote to stdout is redirected, but be safe)
        seen.add((i, k))
        if error:
            issues.append(ConfigIssue(f"assistants[{i}].tools", str(error)))
    if stopped is not None:
        pending = [(i, k) for i, refs in enumerate(tool_lists) for k in range(len(refs) + 1) if (i, k) not in seen]
        if only_if_unreported and not pending:
            return issues
        i, k = pending[0] if pending else (0, 0)
        what = f"tool {tool_lists[i][k]!r}" if i < len(tool_lists) and k < len(tool_lists[i]) else "the tools"
        issues.append(ConfigIssue(f"assistants[{i}].tools", f"{what}: {stopped}"))
    return issues


def resolve_tool_lists(
    tool_lists: Sequence[Sequence[str]], report: Callable[[int, int, str | None], None] | None = None
) -> list[tuple[int, str]]:
    """Resolve every ref in this process; ``(assistant index, message)`` for every failure.

    ``report(i, k, error)`` is called as each ref is resolved (``k == len(refs)`` for the check
    that the assistant's tool names are unique), so a caller that is cut off knows how far it got.
    """
    from agentd.tools import ToolError, resolve_tool, resolve_tools

    failures: list[tuple[int, str]] = []
    for i, refs in enumerate(tool_lists):
        before = len(failures)
        for k, ref in enumerate(refs):
            error: str | None = None
            try:
                resolve_tool(ref)
            except ToolError as exc:
                error = str(exc)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # e.g. a signature that cannot be described; never SystemExit out
                error = f"tool {ref!r}: {type(exc).__name__}: {exc}"
            if error is not None:
                failures.append((i, error))
            if report is not None:
                report(i, k, error)
        error = None
        if len(failures) == before:
            try:
                resolve_tools(refs)  # the set as a whole: two tools with one name
            except ToolError as exc:
                error = str(exc)
                failures.append((i, error))
        if report is not None:
            report(i, len(refs), error)
    return failures


def main() -> int:
    """``python -P -m agentd.validate``: tool ref lists (JSON) on stdin, one JSON line per ref on stdout.

    Whatever a tool's import writes to stdout goes to stderr instead: stdout is the report.
    """
    report_fd = os.dup(1)
    os.dup2(2, 1)
    import agentd.tools  # noqa: F401  (agentd's own imports are start-up, not the tools' time)

    tool_lists = json.loads(sys.stdin.buffer.read())
    with open(report_fd, "w", encoding="utf-8") as report:
        report.write(_STARTED.decode())
        report.flush()

        def line(i: int, k: int, error: str | None) -> None:
            report.write(json.dumps({"assistant": i, "tool": k, "error": error}) + "\n")
            report.flush()  # a check cut off by its timeout still tells how far it got

        resolve_tool_lists(tool_lists, line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
