"""Door item ids across a transfer's rewrite of the transcript (RFC 0010 §9), and the end of a
stream whose text a transfer removed: pure, no processes."""

from __future__ import annotations

from typing import Any

import msgspec

from agentd.budget import TurnStatus, Usage
from agentd.door.chatstream import removed_by_transfer
from agentd.door.outcome import items_of, message_ids
from agentd.door.responsestream import ItemWriter, Numbered, stream_end
from agentd.door.shapes import OutputMessage, OutputText, ResponseObject
from agentd.door.stream import Ended
from agentd.views import Entry, ToolCallView, TurnView


def said(seq: int, turn: str | None, content: str, assistant: str = "front", *calls: str) -> Entry:
    views = [ToolCallView(id=c, name="transfer_to_back", arguments={}) for c in calls] or None
    return Entry(
        seq=seq, turn=turn, role="assistant", content=content, tool_calls=views, model="m", assistant=assistant
    )


def system(seq: int, turn: str | None, content: str, name: str | None) -> Entry:
    return Entry(seq=seq, turn=turn, role="system", content=content, name=name)


def user(seq: int, turn: str, content: str) -> Entry:
    return Entry(seq=seq, turn=turn, role="user", content=content)


S1 = system(0, None, "You are the front desk.", "front")
NOTE = system(1, None, "An operator's note.", None)
TURN_1 = [user(2, "t_1", "hello"), said(3, "t_1", "Hi.")]
HANDOVER = [
    user(4, "t_2", "transfer me"),
    said(5, "t_2", "Let me hand you over.", "front", "c1"),
    Entry(seq=6, turn="t_2", role="tool", content="Transferred.", tool_call_id="c1"),
]
M = "Over to back."
S2 = "You are the back office."
F2 = "Back office here."


def ids(entries: list[Entry]) -> dict[str, str]:
    """Item id by the entry's content (each content here is unique)."""
    by_seq = {e.seq: e.content for e in entries}
    return {by_seq[seq]: item for seq, item in message_ids(entries, session="s_1").items()}


def test_every_item_kept_by_a_transfer_keeps_its_id_whatever_the_mode() -> None:
    before = [S1, NOTE, *TURN_1, *HANDOVER]
    rolling = [*before, said(7, "t_2", M), system(8, "t_2", S2, "back"), said(9, "t_2", F2, "back")]
    # Swap modes: every named prompt goes, one S2 at the head; the remove mode drops TT's call and TR.
    swapped = [system(0, "t_2", S2, "back"), NOTE, *TURN_1, *HANDOVER, said(6, "t_2", M), said(7, "t_2", F2, "back")]
    removed = [
        system(0, "t_2", S2, "back"),
        NOTE,
        *TURN_1,
        user(4, "t_2", "transfer me"),
        said(5, "t_2", "Let me hand you over."),
        said(6, "t_2", M),
        said(7, "t_2", F2, "back"),
    ]
    deleted = [system(0, "t_2", S2, "back"), said(1, "t_2", F2, "back")]
    whole = ids(rolling)
    assert whole["Let me hand you over."] == "msg_t_2_a_front_0" and whole[F2] == "msg_t_2_a_back_0"
    assert whole["You are the front desk."] == "msg_s_1_s_front_0" and whole["An operator's note."] == "msg_s_1_s_0"
    for kept in (ids(before), ids(swapped), ids(removed), ids(deleted)):
        assert {content: whole[content] for content in kept} == kept


def test_a_part_of_a_turn_is_named_as_the_whole_names_it() -> None:
    entries = [user(2, "t_1", "go"), said(3, "t_1", "One."), said(4, "t_1", "Two.")]
    [shown] = items_of(entries, session="s_1", inputs=False, base=3)
    assert shown.id == "msg_t_1_a_front_1"


def _events(raw: list[bytes]) -> list[dict[str, Any]]:
    return [msgspec.json.decode(chunk.split(b"data: ", 1)[1]) for chunk in raw]


def test_a_response_stream_whose_shown_item_a_transfer_removed_completes() -> None:
    writer = ItemWriter(Numbered())
    writer.open_message("msg_t_2_a_front_0")
    writer.text("msg_t_2_a_front_0", "Let me hand")
    opener = OutputMessage(id="msg_t_2_a_back_0", role="assistant", content=[OutputText(text=F2)])
    final = ResponseObject(id="resp_t_2", created_at=0, status="completed", model="back", output=[opener], usage=None)
    sent = _events(stream_end(writer, final, transferred=True))
    assert sent[0]["type"] == "response.output_text.done" and sent[0]["text"] == "Let me hand"  # closed as sent
    assert sent[-1]["type"] == "response.completed"
    [reset] = _events(stream_end(writer, final))  # not a transfer: a reset
    assert reset["code"] == "stream_reset" and "the turn ended" in reset["message"]


def test_only_a_transfer_that_kept_nothing_its_speaker_said_removed_the_streamed_text() -> None:
    turn = TurnView(id="t_2", status=TurnStatus.TRANSFERRED, usage=Usage(1, 1), started_at="2026-01-01T00:00:00.000Z")
    deleted = Ended(turn=turn, entries=[system(0, "t_2", S2, "back"), said(1, "t_2", F2, "back")], assistant="back")
    kept = Ended(
        turn=turn, entries=[said(5, "t_2", "Let me hand you over."), said(9, "t_2", F2, "back")], assistant="back"
    )
    assert removed_by_transfer(deleted, "front")
    assert not removed_by_transfer(kept, "front")
    done = msgspec.structs.replace(turn, status=TurnStatus.COMPLETED)
    assert not removed_by_transfer(Ended(turn=done, entries=deleted.entries, assistant="back"), "front")
