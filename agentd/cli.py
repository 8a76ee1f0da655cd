"""The ``agentd`` command: ``run | reload | status | chat | send | check-config`` (RFC 0000 §4).

``run`` starts the supervisor in the foreground; the other commands (except ``check-config``,
which works offline) talk to a running daemon through ``agentd.client``. Every flag has an
``AGENTD_*`` environment twin; a flag beats its twin. Exit codes: 0 ok, 1 runtime failure (no
daemon, rejected reload, API error, failed turn), 2 usage or config error. Errors are one line on
stderr, ``agentd: <message>``; output meant for people or scripts goes to stdout.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

import msgspec

from agentd import __version__, early_signals, events
from agentd.apitoken import TOKEN_ENV, TokenError, api_token
from agentd.client import DEFAULT_STATE_DIR, AgentdClient, ClientError, DaemonNotRunning, EventStream
from agentd.config import (
    Config,
    ConfigError,
    ConfigIssue,
    effective_intelligence,
    load_config,
    resolve_swap_policy,
)
from agentd.views import Accepted, Entry, MessageResult, ReloadResult, SessionView, StatusView

__all__ = [
    "ENV_TWINS",
    "build_parser",
    "check_config",
    "describe_event",
    "main",
    "reply_entries",
]

# The env twin of every flag, shown in --help. Client-only twins come after the `run` ones.
ENV_TWINS: dict[str, str] = {
    "--config": "AGENTD_CONFIG",
    "--state-dir": "AGENTD_STATE_DIR",
    "--model-swap": "AGENTD_MODEL_SWAP",
    "--listen": "AGENTD_LISTEN",
    "--watch-config": "AGENTD_WATCH_CONFIG",
    "--log-format": "AGENTD_LOG_FORMAT",
    "--log-level": "AGENTD_LOG_LEVEL",
    "--url": "AGENTD_URL",
    "--session": "AGENTD_SESSION",
    "--assistant": "AGENTD_ASSISTANT",
}
DEFAULT_CONFIG_FILE = Path("agentd.toml")
LOG_FORMATS = ("json", "console", "auto")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
# Turn statuses that are a normal end of a turn; any other status makes `send` exit 1.
_OK_STATUSES = {"completed", "transferred"}
_PREVIEW = 200  # characters of a tool result / thinking shown by `chat`


class UsageError(Exception):
    """A bad flag, env value or argument: exit 2."""


# --------------------------------------------------------------------------- helpers


def _env(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """An env twin's value; empty counts as unset, so ``AGENTD_X=`` cannot set a blank path."""
    value = (os.environ if environ is None else environ).get(name)
    return value if value else None


def _err(message: str) -> None:
    print(f"agentd: {message}", file=sys.stderr, flush=True)


def _out(text: str = "", stream: TextIO | None = None) -> None:
    # Flushed at once: `chat` output must interleave correctly when piped.
    print(text, file=stream or sys.stdout, flush=True)


def _default_config_path(environ: Mapping[str, str] | None = None) -> Path | None:
    """``AGENTD_CONFIG``, else ``./agentd.toml`` if it exists, else None (the built-in quickstart)."""
    named = _env("AGENTD_CONFIG", environ)
    if named is not None:
        return Path(named)
    return DEFAULT_CONFIG_FILE if DEFAULT_CONFIG_FILE.is_file() else None


def _client_state_dir(flag: str | None) -> Path:
    """Where a client looks for the daemon: the flag, AGENTD_STATE_DIR, the config's
    ``[server] state_dir`` (the daemon's own fallback), else ``./.agentd``."""
    if flag:
        return Path(flag)
    named = _env("AGENTD_STATE_DIR")
    if named is not None:
        return Path(named)
    config_path = _default_config_path()
    if config_path is not None:
        try:
            configured = load_config(config_path).server.state_dir  # a bounded read: a FIFO cannot hang us
        except ConfigError:
            configured = None  # a broken config is `run`'s and `check-config`'s business, not ours
        if configured:
            return Path(configured)
    return DEFAULT_STATE_DIR


def _make_client(args: argparse.Namespace) -> AgentdClient:
    url = args.url or _env("AGENTD_URL")
    token = None
    if url:  # the token is sent only over TCP: one the daemon could never match is a usage error, not a 401
        try:
            token = api_token(os.environ)
        except TokenError as exc:
            raise UsageError(str(exc)) from None
    return AgentdClient(_client_state_dir(args.state_dir), url=url, token=token or "")


def _parse_bool(value: str, name: str) -> bool:
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise UsageError(f"{name}: invalid value {value!r}; accepted values: 1, true, yes, on, 0, false, no, off")


def _check_listen(value: str, name: str) -> str:
    host, colon, port = value.rpartition(":")
    if not colon or not port.isdigit() or not 0 <= int(port) <= 65535 or any(c.isspace() for c in host):
        raise UsageError(f"{name}: invalid address {value!r}; expected HOST:PORT, like 127.0.0.1:8080")
    return value


def _one_line(text: str, limit: int = _PREVIEW) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _json(value: Any) -> str:
    return msgspec.json.encode(value).decode()


# --------------------------------------------------------------------------- the parser


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors as ``agentd: …`` lines (exit 2) instead of a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        _err(message)
        raise SystemExit(2)


def _twin(flag: str) -> str:
    return f"[env: {ENV_TWINS[flag]}]"


def build_parser() -> argparse.ArgumentParser:
    """The ``agentd`` argument parser with every subcommand of RFC 0000 §4."""
    formatter = argparse.RawDescriptionHelpFormatter
    parser = _Parser(
        prog="agentd",
        usage="agentd [flags of run]\n       agentd COMMAND [flags]",
        description=(
            "Run LLM agent conversations and hot-swap the model under them.\n\n"
            "With no COMMAND, agentd runs the daemon: `agentd --model-swap restart-turn` is\n"
            "`agentd run --model-swap restart-turn`."
        ),
        formatter_class=formatter,
        epilog="Run `agentd COMMAND --help` for a command's flags and their AGENTD_* environment twins.",
    )
    parser.add_argument("--version", action="version", version=f"agentd {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser, prog="agentd")

    run = commands.add_parser(
        "run",
        help="run the supervisor in the foreground until SIGTERM/SIGINT",
        description="Run the supervisor in the foreground until SIGTERM/SIGINT. SIGHUP reloads the config.",
        formatter_class=formatter,
        epilog=(
            "Every flag has an environment twin; a flag beats its twin:\n"
            + "".join(f"  {ENV_TWINS[f]:<22} {f}\n" for f in list(ENV_TWINS)[:7])
            + f"  {TOKEN_ENV:<22} bearer token the --listen TCP listener requires"
        ),
    )
    run.add_argument(
        "--config",
        metavar="F",
        help=f"config file; default ./agentd.toml if it exists, else the built-in quickstart {_twin('--config')}",
    )
    run.add_argument(
        "--state-dir",
        metavar="D",
        help=f"directory for the socket, pid file and store; default the config's [server] state_dir, else ./.agentd {_twin('--state-dir')}",
    )
    run.add_argument(
        "--model-swap",
        metavar="P",
        help=f"swap policy: finish-on-old or restart-turn; default the config's model_swap, else finish-on-old {_twin('--model-swap')}",
    )
    run.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help=f"also serve the API over TCP; requests need 'Authorization: Bearer ${TOKEN_ENV}' {_twin('--listen')}",
    )
    run.add_argument(
        "--watch-config",
        action="store_true",
        default=None,
        help=f"reload when the config file changes {_twin('--watch-config')} (1/true/yes/on)",
    )
    run.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        metavar="json|console",
        help=f"log lines as JSON or for people; default console on a TTY, else json {_twin('--log-format')}",
    )
    run.add_argument(
        "--log-level", metavar="L", help=f"one of {', '.join(LOG_LEVELS)}; default info {_twin('--log-level')}"
    )
    run.set_defaults(handler=cmd_run)

    # Flags shared by every command that talks to a running daemon.
    client = _Parser(add_help=False)
    client.add_argument(
        "--state-dir",
        metavar="D",
        help=f"the daemon's state dir (its socket is D/agentd.sock); default ./.agentd {_twin('--state-dir')}",
    )
    client.add_argument(
        "--url",
        metavar="URL",
        help=f"reach the daemon over TCP instead (e.g. http://127.0.0.1:8080), sending ${TOKEN_ENV} as a bearer token {_twin('--url')}",
    )
    client_epilog = f"Environment: AGENTD_STATE_DIR, AGENTD_URL, {TOKEN_ENV} (bearer token, used with --url)."

    reload = commands.add_parser(
        "reload",
        parents=[client],
        formatter_class=formatter,
        epilog=client_epilog,
        help="reload the running daemon's config; exit 1 if rejected",
        description="Reload the running daemon's config and print the result; exit 1 if it was rejected.",
    )
    reload.set_defaults(handler=cmd_reload)

    status = commands.add_parser(
        "status",
        parents=[client],
        formatter_class=formatter,
        epilog=client_epilog,
        help="generation, effective swap policy and its source, children, sessions",
        description="Show the generation, the effective swap policy and its source, children and sessions.",
    )
    status.add_argument("--json", action="store_true", help="print the daemon's raw JSON")
    status.set_defaults(handler=cmd_status)

    chat = commands.add_parser(
        "chat",
        parents=[client],
        formatter_class=formatter,
        epilog=client_epilog + " Ctrl-D ends the chat; Ctrl-C cancels a running turn.",
        help="interactive conversation; shows tool calls, transfers, swaps as they happen",
        description="Talk to an assistant line by line, seeing tool calls, transfers and swaps as they happen.",
    )
    chat.add_argument(
        "--assistant",
        metavar="A",
        help=f"assistant for a new session; default the config's first {_twin('--assistant')}",
    )
    chat.add_argument(
        "--session", metavar="S", help=f"resume this session instead of creating one {_twin('--session')}"
    )
    chat.set_defaults(handler=cmd_chat)

    send = commands.add_parser(
        "send",
        parents=[client],
        formatter_class=formatter,
        epilog=client_epilog,
        help="one user message; prints the reply",
        description="Send one user message and print the reply. Without --session a new session is created and its id printed to stderr.",
    )
    send.add_argument("--session", metavar="S", help=f"session to talk in; default a new one {_twin('--session')}")
    send.add_argument(
        "--assistant", metavar="A", help=f"assistant for a new session (ignored with --session) {_twin('--assistant')}"
    )
    send.add_argument("--image", metavar="FILE", action="append", default=[], help="attach an image file (repeatable)")
    send.add_argument(
        "text", metavar="TEXT", nargs="+", help="the message (several words are joined by spaces; '-' reads stdin)"
    )
    send.set_defaults(handler=cmd_send)

    check = commands.add_parser(
        "check-config",
        formatter_class=formatter,
        help="validate a config file; exit 0, or 2 with every error",
        description="Validate a config file (schema, references, tools); exit 0, or 2 printing every error as `path: message`.",
    )
    check.add_argument(
        "file", metavar="F", nargs="?", help="the config file; default AGENTD_CONFIG, else ./agentd.toml"
    )
    check.add_argument("--json", action="store_true", help='print {"valid": ..., "errors": [{"path", "message"}]}')
    check.add_argument(
        "--connect",
        action="store_true",
        help="also start (or reach) each [[mcp_servers]] entry and list its tools, so a bad server is caught before a reload",
    )
    check.set_defaults(handler=cmd_check_config)
    return parser


# --------------------------------------------------------------------------- run


def run_options(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Any:
    """``agentd run``'s flags merged with their env twins into DaemonOptions (UsageError/ConfigError if bad)."""
    from agentd.supervisor.options import DaemonOptions

    env = os.environ if environ is None else environ
    # Fail early, naming the accepted values. Only the flag goes into the options: the daemon
    # re-reads AGENTD_MODEL_SWAP itself on every reload (RFC 0002 §7), but a bad value there is
    # just as fatal, so it is checked here too.
    resolve_swap_policy(args.model_swap, env)

    config = Path(args.config) if args.config else _default_config_path(env)
    state_dir = args.state_dir or _env("AGENTD_STATE_DIR", env)

    listen = args.listen or _env("AGENTD_LISTEN", env)
    if listen is not None:
        _check_listen(listen, "--listen" if args.listen else "AGENTD_LISTEN")
        try:
            token = api_token(env)
        except TokenError as exc:
            raise UsageError(str(exc)) from None
        if token is None:
            raise UsageError(f"the TCP listener ({listen}) requires a bearer token: set {TOKEN_ENV}")

    watch = args.watch_config
    if watch is None:
        raw = (env.get("AGENTD_WATCH_CONFIG") or "").strip()
        watch = _parse_bool(raw, "AGENTD_WATCH_CONFIG")

    log_format = args.log_format or _env("AGENTD_LOG_FORMAT", env) or "auto"
    if log_format not in LOG_FORMATS:
        raise UsageError(f"AGENTD_LOG_FORMAT: invalid value {log_format!r}; accepted values: {', '.join(LOG_FORMATS)}")
    level_source = "--log-level" if args.log_level else "AGENTD_LOG_LEVEL"
    log_level = (args.log_level or _env("AGENTD_LOG_LEVEL", env) or "info").lower()
    if log_level not in LOG_LEVELS:
        raise UsageError(f"{level_source}: invalid value {log_level!r}; accepted values: {', '.join(LOG_LEVELS)}")

    return DaemonOptions(
        # Absolute, so a reload reads the same file whatever the daemon's working directory becomes.
        config_path=config.absolute() if config is not None else None,
        state_dir=Path(state_dir) if state_dir else None,
        model_swap_flag=args.model_swap or None,
        listen=listen,
        watch_config=watch,
        log_format=log_format,  # type: ignore[arg-type]  # checked against LOG_FORMATS above
        log_level=log_level,
    )


def cmd_run(args: argparse.Namespace) -> int:
    """``agentd run``: the supervisor in the foreground; its exit code is ours."""
    options = run_options(args)
    # Imported here: `agentd status` and friends must not pay for (or depend on) the daemon's imports.
    from agentd.supervisor.daemon import run_daemon

    return run_daemon(options)


# --------------------------------------------------------------------------- reload / status


def format_reload(result: ReloadResult) -> list[str]:
    """``agentd reload``'s report, one line each; errors as ``path: message``."""
    lines: list[str] = []
    if result.applied:
        lines.append(f"reload applied: generation {result.generation}")
    else:
        count = len(result.errors)
        lines.append(f"reload rejected: generation {result.generation} kept; {count} error{'s' if count != 1 else ''}")
    lines.append(f"changed: {', '.join(result.changed) if result.changed else 'nothing'}")
    if result.restart_required:
        lines.append(f"restart required (old values kept until then): {', '.join(result.restart_required)}")
    swapped = result.swapped_sessions
    total = max(result.swapped_total, len(swapped))
    listed = f" ({', '.join(swapped)}{', …' if total > len(swapped) else ''})" if swapped else ""
    lines.append(f"swapped sessions: {total}{listed}")
    lines.extend(str(error) for error in result.errors)
    return lines


def cmd_reload(args: argparse.Namespace) -> int:
    """``agentd reload``: exit 0 when applied, 1 when rejected."""
    with _make_client(args) as client:
        result = client.reload()
    for line in format_reload(result):
        _out(line)
    if not result.applied:
        _err(f"reload rejected; the daemon keeps running generation {result.generation}")
        return 1
    return 0


def format_status(status: StatusView) -> list[str]:
    """``agentd status``'s table."""
    lines = [
        f"agentd {status.version}  pid {status.pid}  generation {status.generation}"
        + ("  (draining)" if status.draining else ""),
        f"model swap:  {status.model_swap.policy} (from {status.model_swap.source})",
        f"config:      {status.config_path or 'built-in quickstart'}",
        f"sessions:    {status.sessions.open} open, {status.sessions.loaded} loaded, "
        f"{status.sessions.running} running, {status.sessions.failed} failed",
    ]
    if not status.children:
        lines.append("children:    none")
        return lines
    lines.append("children:")
    header = ("PID", "STATE", "GEN", "RESTARTS", "IN FLIGHT", "SESSIONS")
    rows = [
        (
            str(c.pid) if c.pid is not None else "-",
            c.state,
            str(c.generation),
            str(c.restarts),
            str(c.in_flight),
            str(c.sessions),
        )
        for c in status.children
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        lines.append(
            "  " + "  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
        )
    return lines


def cmd_status(args: argparse.Namespace) -> int:
    """``agentd status``: a table, or the daemon's JSON with ``--json``."""
    with _make_client(args) as client:
        if args.json:
            _out(msgspec.json.format(msgspec.json.encode(client.get_json("/v1/status")), indent=2).decode())
            return 0
        status = client.status()
    for line in format_status(status):
        _out(line)
    return 0


# --------------------------------------------------------------------------- send / chat


def reply_entries(messages: Sequence[Entry]) -> list[Entry]:
    """The reply of a turn: assistant entries with content after its last tool-calling one.

    Content that came with tool calls is a step's commentary, not the answer; after a transfer
    the reply is the old assistant's message and the new one's opener.
    """
    last_call = max((i for i, e in enumerate(messages) if e.role == "assistant" and e.tool_calls), default=-1)
    return [e for e in messages[last_call + 1 :] if e.role == "assistant" and e.content]


def _speaker(entry: Entry, fallback: str) -> str:
    who = entry.assistant or fallback
    return f"{who} ({entry.model})" if entry.model else who


def _turn_note(status: str, error: str | None) -> str:
    return f"turn {status}" + (f": {error}" if error else "")


def _read_text(args: argparse.Namespace) -> str:
    if args.text == ["-"]:
        return sys.stdin.read()
    return " ".join(args.text)


def _read_images(paths: Sequence[str]) -> list[str]:
    images: list[str] = []
    for path in paths:
        try:
            images.append(base64.b64encode(Path(path).read_bytes()).decode("ascii"))
        except OSError as exc:
            raise UsageError(f"--image {path}: {exc.strerror or exc}") from None
    return images


def cmd_send(args: argparse.Namespace) -> int:
    """``agentd send``: one waited message; the reply on stdout, a new session's id on stderr."""
    text = _read_text(args)
    if not text.strip():
        raise UsageError("the message is empty")
    images = _read_images(args.image)
    session_id = args.session or _env("AGENTD_SESSION")
    with _make_client(args) as client:
        if session_id is None:
            session = client.create_session(args.assistant or _env("AGENTD_ASSISTANT"))
            session_id = session.id
            # The bare id alone on its line, so scripts can capture it.
            _out(session_id, sys.stderr)
        result = client.send_message(session_id, text, images=images or None, wait=True)
    if isinstance(result, Accepted):  # only if the daemon ignored wait=true
        _err(f"the daemon did not wait for the turn; it runs as {result.turn_id}")
        return 1
    replies = reply_entries(result.messages)
    if replies:
        _out(replies[-1].content)
    turn = result.turn
    if turn.status == "completed":
        return 0
    if turn.status in _OK_STATUSES:
        _out(f"({_turn_note(turn.status, turn.error)})", sys.stderr)
        return 0
    _err(_turn_note(turn.status, turn.error))
    return 1


def describe_event(name: str, data: Mapping[str, Any]) -> str | None:
    """The line ``agentd chat`` prints for a session event, or None for events it does not show.

    The final step's content is left out: it is the reply, printed once the turn is done.
    """
    match name:
        case events.TOOL_CALL:
            return f"  -> tool {data.get('name')}({_json(data.get('arguments', {}))})"
        case events.TOOL_RESULT:
            flags = "".join(f" [{flag}]" for flag in ("is_error", "replayed") if data.get(flag))
            flags = flags.replace("is_error", "error")
            return f"  <- {data.get('name')}{flags}: {_one_line(str(data.get('content', '')))}"
        case events.SWAP_PARKED:
            return (
                f"  [swap parked] {data.get('model_from')} -> {data.get('model_to')} "
                f"(generation {data.get('generation')}, policy {data.get('policy')})"
            )
        case events.SWAP_APPLIED:
            return (
                f"  [swap applied] {data.get('model_from')} -> {data.get('model_to')} "
                f"(generation {data.get('generation')}, {data.get('kind')}, policy {data.get('policy')})"
            )
        case events.TURN_RESTARTED:
            return (
                f"  [turn restarted] {data.get('model_from')} -> {data.get('model_to')} "
                f"(restart {data.get('restarts')}, {data.get('discarded_steps')} step(s) discarded)"
            )
        case events.TRANSFER:
            return f"  [transfer] {data.get('from')} -> {data.get('to')} ({data.get('mode')})"
        case events.STEP_DONE:
            lines: list[str] = []
            if data.get("thinking"):
                lines.append(f"  [thinking] {_one_line(str(data['thinking']))}")
            if data.get("tool_calls") and data.get("content"):
                lines.append(f"  [step {data.get('step')}, {data.get('model')}] {data['content']}")
            return "\n".join(lines) or None
        case events.SESSION_FAILED:
            return f"  [session failed] {data.get('error')}"
    return None


def _print_reply(messages: Sequence[Entry], assistant: str) -> None:
    for entry in reply_entries(messages):
        _out(f"{_speaker(entry, assistant)}: {entry.content}")


def _print_turn_end(status: str | None, models: Sequence[str], restarts: int, error: str | None) -> None:
    if len(models) > 1 or restarts:
        _out(f"  [turn used {', '.join(models)}; {restarts} restart(s)]")
    if status and status != "completed":
        _out(f"  [{_turn_note(status, error)}]")


class _Chat:
    """One interactive session: read a line, start its turn, show its events, print the reply."""

    def __init__(self, client: AgentdClient, session: SessionView) -> None:
        self.client = client
        self.session = session
        self.assistant = session.assistant

    def turn(self, text: str) -> None:
        """Run one user message through to the end of its turn."""
        # Subscribe before posting: a turn's first events can come before the POST is answered.
        with self.client.events(self.session.id) as stream:
            answer = self.client.send_message(self.session.id, text, wait=False)
            if isinstance(answer, MessageResult):  # a daemon that ran it synchronously anyway
                _print_reply(answer.messages, self.assistant)
                turn = answer.turn
                _print_turn_end(turn.status, turn.models, turn.restarts, turn.error)
                return
            try:
                finished = self._follow(stream, answer.turn_id)
            except KeyboardInterrupt:
                self.client.cancel(self.session.id)
                _out("  [cancel requested]")
                return
            except ClientError as exc:
                if exc.code != "stream_lost":
                    raise
                finished = False
        if not finished:
            self._recover(answer.turn_id)

    def _follow(self, stream: EventStream, turn_id: str) -> bool:
        """Print events until this turn is done; False if the stream ended first."""
        for name, data in stream:
            if data.get("turn") not in (None, turn_id):
                continue  # another turn's event (there is one turn at a time, so a stray)
            if name == events.TRANSFER and data.get("to"):
                self.assistant = str(data["to"])
            line = describe_event(name, data)
            if line:
                _out(line)
            if name == events.SESSION_FAILED:
                return True
            if name == events.TURN_DONE and data.get("turn") == turn_id:
                try:
                    messages = msgspec.convert(data.get("messages") or [], list[Entry])
                except msgspec.ValidationError as exc:
                    raise ClientError(
                        200, "bad_event", f"turn.done carries messages the client cannot read: {exc}"
                    ) from None
                _print_reply(messages, self.assistant)
                _print_turn_end(
                    data.get("status"),
                    list(data.get("models") or []),
                    int(data.get("restarts") or 0),
                    data.get("error"),
                )
                return True
        return False

    def _recover(self, turn_id: str) -> None:
        """The event stream ended early: show the turn's outcome from the session itself."""
        session = self.client.get_session(self.session.id)
        turn = next((t for t in session.turns if t.id == turn_id), None)
        if turn is None or turn.status == "pending":
            _err(f"lost the event stream; turn {turn_id} is still running (see `agentd status`)")
            return
        self.assistant = session.assistant
        _print_reply([e for e in session.transcript if e.turn == turn_id], self.assistant)
        _print_turn_end(turn.status, turn.models, turn.restarts, turn.error)


def _read_line(interactive: bool) -> str | None:
    if interactive:
        try:
            return input("you> ")
        except EOFError:
            _out()
            return None
    line = sys.stdin.readline()
    return line if line else None


def cmd_chat(args: argparse.Namespace) -> int:
    """``agentd chat``: an interactive conversation until EOF (Ctrl-D)."""
    session_id = args.session or _env("AGENTD_SESSION")
    with _make_client(args) as client:
        if session_id is None:
            session = client.create_session(args.assistant or _env("AGENTD_ASSISTANT"))
            _out(f"session {session.id} (assistant {session.assistant}, model {session.model})", sys.stderr)
            opener = [e for e in session.transcript if e.role == "assistant" and e.content]
        else:
            session = client.get_session(session_id)
            _out(
                f"resumed session {session.id} (assistant {session.assistant}, model {session.model}, {len(session.turns)} turns)",
                sys.stderr,
            )
            opener = [e for e in session.transcript if e.role == "assistant" and e.content][-1:]
        for entry in opener:
            _out(f"{_speaker(entry, session.assistant)}: {entry.content}")
        chat = _Chat(client, session)
        interactive = sys.stdin.isatty()
        while True:
            try:
                line = _read_line(interactive)
            except KeyboardInterrupt:
                _out()
                return 130
            if line is None:
                return 0
            text = line.strip()
            if not text:
                continue
            if text in ("/quit", "/exit"):
                return 0
            try:
                chat.turn(text)
            except ClientError as exc:
                _err(str(exc))  # e.g. 409 turn already running: the conversation goes on


# --------------------------------------------------------------------------- check-config


def check_config(path: str | os.PathLike[str]) -> tuple[Config | None, list[ConfigIssue]]:
    """Validate a config file exactly as the daemon does at start-up and on reload
    (``agentd.validate.validate_config_file``: schema and references, tools as a child resolves
    them, the wire). Returns the config (None when it is invalid) and every issue found."""
    from agentd.validate import validate_config_file

    return validate_config_file(path)


def _connect_servers(config: Config) -> tuple[list[Any], list[ConfigIssue]]:
    """``--connect``: every MCP server reached with this environment (less the API token), its tools listed."""
    import anyio

    from agentd.mcp import check_servers

    environ = {k: v for k, v in os.environ.items() if k != "AGENTD_API_TOKEN"}
    return anyio.run(check_servers, config, environ)


def _summary(config: Config) -> dict[str, Any]:
    assistants = []
    for assistant in config.assistants:
        intel = effective_intelligence(config, assistant.name)
        assistants.append({"name": assistant.name, "provider": intel.provider, "model": intel.model})
    return {"assistants": assistants, "model_swap": config.model_swap.value if config.model_swap else None}


def cmd_check_config(args: argparse.Namespace) -> int:
    """``agentd check-config F``: exit 0 when valid, 2 printing every error."""
    path = Path(args.file) if args.file else _default_config_path()
    if path is None:
        raise UsageError("no config file given (and no AGENTD_CONFIG, and no ./agentd.toml)")
    config, issues = check_config(path)
    servers: list[Any] = []
    if args.connect and config is not None and config.mcp_servers:
        servers, connect_issues = _connect_servers(config)
        issues = [*issues, *connect_issues]
    if args.json:
        body: dict[str, Any] = {"valid": not issues, "errors": msgspec.to_builtins(issues)}
        if args.connect:
            body["mcp_servers"] = msgspec.to_builtins(servers)
        if config is not None and not issues:
            body.update(_summary(config))
        _out(_json(body))
        return 0 if not issues else 2
    for server in servers:
        listed = f"{len(server.tools)} tool(s): {', '.join(server.tools)}" if server.error is None else server.error
        _out(f"mcp server {server.name}: {listed}")
    if issues or config is None:
        for issue in issues:
            _out(str(issue))
        _err(f"{path}: invalid config: {len(issues)} error{'s' if len(issues) != 1 else ''}")
        return 2
    summary = _summary(config)
    listed = ", ".join(f"{a['name']} ({a['provider']}/{a['model']})" for a in summary["assistants"])
    swap = summary["model_swap"] or "not set (finish-on-old unless --model-swap or AGENTD_MODEL_SWAP)"
    _out(f"{path}: valid; {len(summary['assistants'])} assistant(s): {listed}; model_swap: {swap}")
    return 0


# --------------------------------------------------------------------------- main


_TOP_LEVEL_FLAGS = frozenset({"-h", "--help", "--version"})


def with_default_command(argv: list[str]) -> list[str]:
    """``agentd [flags of run]`` means ``agentd run [flags]``: the original usage keeps working.

    Only a leading flag that the top-level parser does not know selects ``run``; a command name,
    ``--help`` and ``--version`` are left alone.
    """
    if not argv or (argv[0].startswith("-") and argv[0].split("=", 1)[0] not in _TOP_LEVEL_FLAGS):
        return ["run", *argv]
    return argv


def main(argv: list[str] | None = None) -> int:
    """The ``agentd`` command. Returns the exit code (0 ok, 1 runtime failure, 2 usage/config error)."""
    parser = build_parser()
    argv = with_default_command(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors: keep main() returning a code
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is not cmd_run:  # only the daemon keeps the signals recorded at launch (agentd/early_signals.py)
        early_signals.release()
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return handler(args)
    except UsageError as exc:
        _err(str(exc))
        return 2
    except ConfigError as exc:
        for issue in exc.issues:
            _err(f"{exc.source + ': ' if exc.source else ''}{issue}")
        return 2
    except DaemonNotRunning as exc:
        # Already a complete sentence about agentd ("agentd is not running: …"): no second prefix.
        print(str(exc), file=sys.stderr, flush=True)
        return 1
    except ClientError as exc:
        _err(str(exc))
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # stdout closed early (`agentd status | head -1`): not an error worth a traceback.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 — keeps the interpreter's final flush quiet
        return 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
