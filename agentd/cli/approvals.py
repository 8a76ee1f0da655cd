"""``agentd approvals``, ``agentd approve``, ``agentd reject`` (RFC 0012 §6), and how ``agentd chat``
asks about a tool call inline."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from agentd.cli.common import UsageError, make_client, one_line, out, to_json
from agentd.client import AgentdClient, ClientError
from agentd.views import ApprovalView

__all__ = ["add_commands", "ask_inline", "format_approvals"]


def add_commands(commands: Any, *, parents: list[argparse.ArgumentParser], formatter: Any, epilog: str) -> None:
    """Register the three commands on ``agentd``'s subcommands."""
    listing = commands.add_parser(
        "approvals",
        parents=parents,
        formatter_class=formatter,
        epilog=epilog,
        help="tool calls waiting for a human's approval",
        description="List the tool calls waiting for approval (all approvals with --all).",
    )
    listing.add_argument("--json", action="store_true", help="print the daemon's raw JSON")
    listing.add_argument("--all", action="store_true", help="every approval, decided ones too")
    listing.add_argument("--session", metavar="S", help="only this session's")
    listing.set_defaults(handler=cmd_approvals)

    approve = commands.add_parser(
        "approve",
        parents=parents,
        formatter_class=formatter,
        epilog=epilog,
        help="approve a waiting tool call (it runs once)",
        description="Approve a waiting tool call; it runs once, with --arguments instead of its own if given.",
    )
    approve.add_argument("id", metavar="ID", help="the approval's id (ap_…)")
    approve.add_argument("--reason", metavar="R", help="why (kept with the approval)")
    approve.add_argument(
        "--arguments", metavar="JSON", help="edited arguments, a JSON object the tool's schema accepts"
    )
    approve.set_defaults(handler=cmd_approve)

    reject = commands.add_parser(
        "reject",
        parents=parents,
        formatter_class=formatter,
        epilog=epilog,
        help="reject a waiting tool call (the model is told why)",
        description="Reject a waiting tool call; the model gets an error result naming the reason.",
    )
    reject.add_argument("id", metavar="ID", help="the approval's id (ap_…)")
    reject.add_argument("--reason", metavar="R", required=True, help="why (the model is told)")
    reject.set_defaults(handler=cmd_reject)


def format_approvals(approvals: Sequence[ApprovalView]) -> list[str]:
    """``agentd approvals``'s table."""
    if not approvals:
        return ["no approvals"]
    header = ("ID", "STATUS", "SESSION", "TURN", "TOOL", "ARGUMENTS")
    rows = [(a.id, a.status, a.session, a.turn, a.tool, one_line(to_json(a.arguments))) for a in approvals]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
        for row in [header, *rows]
    ]


def cmd_approvals(args: argparse.Namespace) -> int:
    with make_client(args) as client:
        approvals = client.list_approvals(status=None if args.all else "pending", session=args.session)
    if args.json:
        out(msgspec.json.format(msgspec.json.encode(approvals), indent=2).decode())
        return 0
    for line in format_approvals(approvals):
        out(line)
    return 0


def _arguments(text: str | None) -> Any:
    if text is None:
        return None
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise UsageError(f"--arguments is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise UsageError("--arguments must be a JSON object")
    return value


def _decided(approval: ApprovalView) -> int:
    out(f"{approval.id} {approval.status}" + (f": {approval.reason}" if approval.reason else ""))
    return 0


def cmd_approve(args: argparse.Namespace) -> int:
    arguments = _arguments(args.arguments)
    with make_client(args) as client:
        return _decided(client.decide(args.id, "approve", reason=args.reason, arguments=arguments))


def cmd_reject(args: argparse.Namespace) -> int:
    with make_client(args) as client:
        return _decided(client.decide(args.id, "reject", reason=args.reason))


def ask_inline(client: AgentdClient, data: dict[str, Any], read: Callable[[str], str | None]) -> None:
    """``agentd chat``: an ``approval.requested`` event asks the user, then decides (y = approve,
    anything else rejects, naming what was typed). Decided elsewhere first: said so."""
    approval = str(data.get("approval"))
    prompt = f"  [approval] run {data.get('tool')}({to_json(data.get('arguments', {}))})? [y/N/reason] "
    answer = (read(prompt) or "").strip()
    try:
        if answer.lower() in ("y", "yes"):
            client.decide(approval, "approve")
        else:
            client.decide(approval, "reject", reason=answer or "rejected in agentd chat")
    except ClientError as exc:
        if exc.code != "already_decided":
            raise
        out(f"  [approval {approval} was decided elsewhere]", sys.stderr)
