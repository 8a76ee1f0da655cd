"""``agentd send`` and ``agentd chat``: a conversation from the terminal, and how a turn's events
read there (RFC 0000 §4). Text is printed as the model streams it (``agentd.cli.streaming``)."""

from __future__ import annotations

import argparse
import base64
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from agentd import events
from agentd.cli.approvals import ask_inline
from agentd.cli.common import (
    OK_STATUSES,
    UsageError,
    err,
    make_client,
    one_line,
    out,
    to_json,
    twin_value,
)
from agentd.cli.streaming import DeltaPrinter
from agentd.client import AgentdClient, ClientError, EventStream
from agentd.views import Accepted, Entry, MessageResult, SessionView

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


def write(text: str) -> None:
    """Write streamed text as it comes (no newline of our own), flushed at once."""
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


def cmd_send(args: argparse.Namespace) -> int:
    """``agentd send``: one waited message; the reply on stdout, a new session's id on stderr.

    On a terminal (or with ``--stream``) the text is printed as the model streams it; otherwise
    stdout gets the reply alone, once the turn is done, for scripts to capture.
    """
    text = _read_text(args)
    if not text.strip():
        raise UsageError("the message is empty")
    images = _read_images(args.image)
    session_id = args.session or twin_value("AGENTD_SESSION")
    with make_client(args) as client:
        if session_id is None:
            session = client.create_session(args.assistant or twin_value("AGENTD_ASSISTANT"))
            session_id = session.id
            # The bare id alone on its line, so scripts can capture it.
            out(session_id, sys.stderr)
        if getattr(args, "stream", False) or sys.stdout.isatty():
            ended = _send_streaming(client, session_id, text, images)
        else:
            result = client.send_message(session_id, text, images=images or None, wait=True)
            if isinstance(result, Accepted):  # only if the daemon ignored wait=true
                err(f"the daemon did not wait for the turn; it runs as {result.turn_id}")
                return 1
            for approval in result.approvals or []:  # the turn waits for a human (RFC 0012)
                err(
                    f"turn {result.turn.id} waits for approval {approval.id}: {approval.tool}({to_json(approval.arguments)})"
                )
            replies = reply_entries(result.messages)
            if replies:
                out(replies[-1].content)
            ended = ("awaiting_approval", None) if result.approvals else (result.turn.status, result.turn.error)
    status, error = ended
    if status == "awaiting_approval":
        err("decide with `agentd approve ID` or `agentd reject ID --reason R` (`agentd approvals` lists them)")
        return 0
    if status == "completed":
        return 0
    if status in OK_STATUSES:
        out(f"({_turn_note(status, error)})", sys.stderr)
        return 0
    err(_turn_note(status, error))
    return 1


def _send_streaming(client: AgentdClient, session_id: str, text: str, images: list[str]) -> tuple[str, str | None]:
    """Send one message and print its turn's text as it streams; (status, error) of the turn.

    The reply is printed at the end only if it did not stream whole (a provider that does not
    stream, a subscriber that came late); text taken back is marked (``DeltaPrinter``).
    """
    printer = DeltaPrinter()
    with client.events(session_id) as stream:  # subscribed before posting: nothing is missed
        answer = client.send_message(session_id, text, images=images or None, wait=False)
        if isinstance(answer, MessageResult):
            messages, status, error = answer.messages, answer.turn.status, answer.turn.error
        else:
            found = _follow_streaming(stream, answer.turn_id, printer)
            if found is None:  # the stream ended early: the session has the outcome
                turn_id = answer.turn_id
                session = client.get_session(session_id)
                record = next((t for t in session.turns if t.id == turn_id), None)
                if record is None or record.status == "pending":
                    return "pending", f"lost the event stream; turn {turn_id} is still running"
                messages = [e for e in session.transcript if e.turn == turn_id]
                status, error = record.status, record.error
            else:
                messages, status, error = found
    write(printer.break_line())
    replies = reply_entries(messages)
    if replies and not printer.take_shown(replies[-1].content):
        out(replies[-1].content)
    return status, error


def _follow_streaming(
    stream: EventStream, turn_id: str, printer: DeltaPrinter
) -> tuple[list[Entry], str, str | None] | None:
    """Print the turn's streamed text until its ``turn.done``; its (messages, status, error), or
    None when the stream ended first."""
    try:
        for name, data in stream:
            if data.get("turn") != turn_id:
                continue
            write(printer.feed(name, data))
            if name == events.APPROVAL_REQUESTED:  # it waits for a human (RFC 0012): say for what
                write(printer.break_line())
                err(
                    f"turn {turn_id} waits for approval {data.get('approval')}: {data.get('tool')}({to_json(data.get('arguments', {}))})"
                )
                return [], "awaiting_approval", None
            if name == events.TURN_DONE:
                return _turn_messages(data), str(data.get("status")), data.get("error")
    except ClientError as exc:
        if exc.code != "stream_lost":
            raise
    return None


def _turn_messages(data: Mapping[str, Any]) -> list[Entry]:
    try:
        return msgspec.convert(data.get("messages") or [], list[Entry])
    except msgspec.ValidationError as exc:
        raise ClientError(200, "bad_event", f"turn.done carries messages the client cannot read: {exc}") from None


def describe_event(name: str, data: Mapping[str, Any], *, streamed: bool = False) -> str | None:
    """The line ``agentd chat`` prints for a session event, or None for events it does not show.

    The final step's content is left out: it is the reply, printed once the turn is done; so is a
    step's content that was printed as it streamed (``streamed``).
    """
    match name:
        case events.TOOL_CALL:
            return f"  -> tool {data.get('name')}({to_json(data.get('arguments', {}))})"
        case events.TOOL_RESULT:
            flags = "".join(f" [{flag}]" for flag in ("is_error", "replayed") if data.get(flag))
            flags = flags.replace("is_error", "error")
            return f"  <- {data.get('name')}{flags}: {one_line(str(data.get('content', '')))}"
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
                lines.append(f"  [thinking] {one_line(str(data['thinking']))}")
            if data.get("tool_calls") and data.get("content") and not streamed:
                lines.append(f"  [step {data.get('step')}, {data.get('model')}] {data['content']}")
            return "\n".join(lines) or None
        case events.SESSION_FAILED:
            return f"  [session failed] {data.get('error')}"
        case events.APPROVAL_DECIDED:
            why = f": {data.get('reason')}" if data.get("reason") else ""
            return f"  [approval {data.get('approval')} {data.get('status')}{why}]"
    return None


def _ask(prompt: str) -> str | None:
    """One answer from the user (a terminal prompt, or the next line of piped stdin)."""
    if sys.stdin.isatty():
        try:
            return input(prompt)
        except EOFError:
            return None
    out(prompt.rstrip())
    line = sys.stdin.readline()
    return line or None


def _print_reply(messages: Sequence[Entry], assistant: str, printer: DeltaPrinter | None = None) -> None:
    for entry in reply_entries(messages):
        if printer is None or not printer.take_shown(entry.content):  # not printed as it streamed
            out(f"{_speaker(entry, assistant)}: {entry.content}")


def _print_turn_end(status: str | None, models: Sequence[str], restarts: int, error: str | None) -> None:
    if len(models) > 1 or restarts:
        out(f"  [turn used {', '.join(models)}; {restarts} restart(s)]")
    if status and status != "completed":
        out(f"  [{_turn_note(status, error)}]")


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
                out("  [cancel requested]")
                return
            except ClientError as exc:
                if exc.code != "stream_lost":
                    raise
                finished = False
        if not finished:
            self._recover(answer.turn_id)

    def _follow(self, stream: EventStream, turn_id: str) -> bool:
        """Print events until this turn is done; False if the stream ended first."""
        printer = DeltaPrinter(lambda d: f"{self.assistant} ({d.get('model')}): ")
        for name, data in stream:
            if data.get("turn") not in (None, turn_id):
                continue  # another turn's event (there is one turn at a time, so a stray)
            if name == events.TRANSFER and data.get("to"):
                self.assistant = str(data["to"])
            write(printer.feed(name, data))
            line = describe_event(name, data, streamed=name == events.STEP_DONE and printer.streamed(data))
            if line:
                write(printer.break_line())
                out(line)
            if name == events.APPROVAL_REQUESTED:  # asked inline; the turn goes on once decided
                ask_inline(self.client, data, _ask)
            if name == events.SESSION_FAILED:
                write(printer.break_line())
                return True
            if name == events.TURN_DONE and data.get("turn") == turn_id:
                write(printer.break_line())
                _print_reply(_turn_messages(data), self.assistant, printer)
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
            err(f"lost the event stream; turn {turn_id} is still running (see `agentd status`)")
            return
        self.assistant = session.assistant
        _print_reply([e for e in session.transcript if e.turn == turn_id], self.assistant)
        _print_turn_end(turn.status, turn.models, turn.restarts, turn.error)


def _read_line(interactive: bool) -> str | None:
    if interactive:
        try:
            return input("you> ")
        except EOFError:
            out()
            return None
    line = sys.stdin.readline()
    return line if line else None


def cmd_chat(args: argparse.Namespace) -> int:
    """``agentd chat``: an interactive conversation until EOF (Ctrl-D)."""
    session_id = args.session or twin_value("AGENTD_SESSION")
    with make_client(args) as client:
        if session_id is None:
            session = client.create_session(args.assistant or twin_value("AGENTD_ASSISTANT"))
            out(f"session {session.id} (assistant {session.assistant}, model {session.model})", sys.stderr)
            opener = [e for e in session.transcript if e.role == "assistant" and e.content]
        else:
            session = client.get_session(session_id)
            out(
                f"resumed session {session.id} (assistant {session.assistant}, model {session.model}, {len(session.turns)} turns)",
                sys.stderr,
            )
            opener = [e for e in session.transcript if e.role == "assistant" and e.content][-1:]
        for entry in opener:
            out(f"{_speaker(entry, session.assistant)}: {entry.content}")
        chat = _Chat(client, session)
        interactive = sys.stdin.isatty()
        while True:
            try:
                line = _read_line(interactive)
            except KeyboardInterrupt:
                out()
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
                err(str(exc))  # e.g. 409 turn already running: the conversation goes on
