"""The ``agentd`` command: ``run | reload | status | chat | send | check-config`` (RFC 0000 §4).

``run`` starts the supervisor in the foreground; the other commands (except ``check-config``,
which works offline) talk to a running daemon through ``agentd.client``. Every flag has an
``AGENTD_*`` environment twin; a flag beats its twin. Exit codes: 0 ok, 1 runtime failure (no
daemon, rejected reload, API error, failed turn), 2 usage or config error. Errors are one line on
stderr, ``agentd: <message>``; output meant for people or scripts goes to stdout.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import msgspec

from agentd import __version__, early_signals
from agentd.apitoken import TOKEN_ENV, TokenError, api_token
from agentd.cli.approvals import add_commands as add_approval_commands
from agentd.cli.common import (
    ENV_TWINS,
    LOG_FORMATS,
    LOG_LEVELS,
    UsageError,
    check_listen,
    client_state_dir,
    default_config_path,
    err,
    make_client,
    out,
    parse_bool,
    to_json,
    twin_value,
)
from agentd.cli.conversation import (
    cmd_chat,
    cmd_send,
    describe_event,
    reply_entries,
)
from agentd.client import ClientError, DaemonNotRunning
from agentd.config import (
    Config,
    ConfigError,
    ConfigIssue,
    effective_intelligence,
    resolve_swap_policy,
)
from agentd.views import ReloadResult, StatusView

__all__ = [
    "ENV_TWINS",
    "build_parser",
    "check_config",
    "client_state_dir",
    "describe_event",
    "main",
    "reply_entries",
]

# --------------------------------------------------------------------------- the parser


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors as ``agentd: …`` lines (exit 2) instead of a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        err(message)
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
        description="Send one user message and print the reply (as it streams, on a terminal or with --stream). Without --session a new session is created and its id printed to stderr.",
    )
    send.add_argument("--session", metavar="S", help=f"session to talk in; default a new one {_twin('--session')}")
    send.add_argument(
        "--assistant", metavar="A", help=f"assistant for a new session (ignored with --session) {_twin('--assistant')}"
    )
    send.add_argument("--image", metavar="FILE", action="append", default=[], help="attach an image file (repeatable)")
    send.add_argument(
        "--stream",
        action="store_true",
        help="print the text as the model streams it even when stdout is not a terminal (on one it always is)",
    )
    send.add_argument(
        "text", metavar="TEXT", nargs="+", help="the message (several words are joined by spaces; '-' reads stdin)"
    )
    send.set_defaults(handler=cmd_send)

    add_approval_commands(commands, parents=[client], formatter=formatter, epilog=client_epilog)

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

    config = Path(args.config) if args.config else default_config_path(env)
    state_dir = args.state_dir or twin_value("AGENTD_STATE_DIR", env)

    listen = args.listen or twin_value("AGENTD_LISTEN", env)
    if listen is not None:
        check_listen(listen, "--listen" if args.listen else "AGENTD_LISTEN")
        try:
            token = api_token(env)
        except TokenError as exc:
            raise UsageError(str(exc)) from None
        if token is None:
            raise UsageError(f"the TCP listener ({listen}) requires a bearer token: set {TOKEN_ENV}")

    watch = args.watch_config
    if watch is None:
        raw = (env.get("AGENTD_WATCH_CONFIG") or "").strip()
        watch = parse_bool(raw, "AGENTD_WATCH_CONFIG")

    log_format = args.log_format or twin_value("AGENTD_LOG_FORMAT", env) or "auto"
    if log_format not in LOG_FORMATS:
        raise UsageError(f"AGENTD_LOG_FORMAT: invalid value {log_format!r}; accepted values: {', '.join(LOG_FORMATS)}")
    level_source = "--log-level" if args.log_level else "AGENTD_LOG_LEVEL"
    log_level = (args.log_level or twin_value("AGENTD_LOG_LEVEL", env) or "info").lower()
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
    with make_client(args) as client:
        result = client.reload()
    for line in format_reload(result):
        out(line)
    if not result.applied:
        err(f"reload rejected; the daemon keeps running generation {result.generation}")
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
    with make_client(args) as client:
        if args.json:
            out(msgspec.json.format(msgspec.json.encode(client.get_json("/v1/status")), indent=2).decode())
            return 0
        status = client.status()
    for line in format_status(status):
        out(line)
    return 0


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
    path = Path(args.file) if args.file else default_config_path()
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
        out(to_json(body))
        return 0 if not issues else 2
    for server in servers:
        listed = f"{len(server.tools)} tool(s): {', '.join(server.tools)}" if server.error is None else server.error
        out(f"mcp server {server.name}: {listed}")
    if issues or config is None:
        for issue in issues:
            out(str(issue))
        err(f"{path}: invalid config: {len(issues)} error{'s' if len(issues) != 1 else ''}")
        return 2
    summary = _summary(config)
    listed = ", ".join(f"{a['name']} ({a['provider']}/{a['model']})" for a in summary["assistants"])
    swap = summary["model_swap"] or "not set (finish-on-old unless --model-swap or AGENTD_MODEL_SWAP)"
    out(f"{path}: valid; {len(summary['assistants'])} assistant(s): {listed}; model_swap: {swap}")
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
        err(str(exc))
        return 2
    except ConfigError as exc:
        for issue in exc.issues:
            err(f"{exc.source + ': ' if exc.source else ''}{issue}")
        return 2
    except DaemonNotRunning as exc:
        # Already a complete sentence about agentd ("agentd is not running: …"): no second prefix.
        print(str(exc), file=sys.stderr, flush=True)
        return 1
    except ClientError as exc:
        err(str(exc))
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # stdout closed early (`agentd status | head -1`): not an error worth a traceback.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 — keeps the interpreter's final flush quiet
        return 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
