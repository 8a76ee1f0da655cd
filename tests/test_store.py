"""The durable store (agentd.store): schema, transactions, durability, and never blocking the loop.

Every test that takes ``backend`` (or ``store``) runs against SQLite and against PostgreSQL
(tests/conftest.py, tests/store_harness.py): one suite, one set of semantics. Tests of one
backend's own files or connections say so in their names.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import msgspec
import pytest

from agentd.budget import TurnStatus, Usage
from agentd.messages import AssistantMessage, Message, SystemMessage, ToolCall, ToolResult, UserMessage
from agentd.records import Discarded, JournalEntry, StartedTurn, TurnRecord
from agentd.store import (
    CommittedTurn,
    ReloadRow,
    SqliteStore,
    Store,
    StoredEntry,
    StoreError,
    UnknownSession,
    codec,
    migrations,
)
from tests.store_harness import Backend

pytestmark = pytest.mark.anyio

IMAGE = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    """The SQLite database of the tests about SQLite's own file."""
    return tmp_path / "agentd.db"


@pytest.fixture
async def sqlite_store(db_path: Path) -> AsyncIterator[SqliteStore]:
    opened = await SqliteStore.open(db_path)
    try:
        yield opened
    finally:
        await opened.close()


def raw(db_path: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """Read the SQLite database file directly, bypassing the store."""
    conn = sqlite3.connect(db_path)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


class Loop:
    """The test's event loop, for code that runs inside a store call: in SQLite's worker thread, or
    on the loop itself (PostgreSQL's async driver). Made on the loop."""

    def __init__(self) -> None:
        self.token = anyio.lowlevel.current_token()
        self.thread = threading.get_ident()

    def run(self, fn: Any) -> None:
        """``fn()`` on the loop, waiting for it."""
        if threading.get_ident() == self.thread:
            fn()
        else:
            anyio.from_thread.run_sync(fn, token=self.token)


def reply(turn: str, text: str, *, model: str = "echo-small", assistant: str = "triage") -> AssistantMessage:
    return AssistantMessage(content=text, turn=turn, model=model, assistant=assistant)


def record(turn: str, *, status: TurnStatus = TurnStatus.COMPLETED, **fields: Any) -> TurnRecord:
    """A finished turn's record; its started_at is the child's, which the store never writes."""
    fields.setdefault("started_at", 1.0)
    fields.setdefault("ended_at", 2000.0)
    return TurnRecord(id=turn, status=status, **fields)


async def commit(
    store: Store,
    session: str,
    turn: str,
    messages: Sequence[Message] = (),
    *,
    assistant: str = "triage",
    transcript: Sequence[Message] | None = None,
    model: str | None = None,
    **fields: Any,
) -> tuple[int, ...]:
    """Commit a finished turn; the seqs of the entries it added."""
    committed = await store.commit_turn(
        session, record(turn, **fields), assistant=assistant, messages=messages, transcript=transcript, model=model
    )
    return committed.seqs


async def new_session(store: Store, session_id: str = "s1", *, created_at: float = 1000.0, **kw: Any) -> None:
    transcript = kw.pop("transcript", [SystemMessage(content="You route customers.", name="triage")])
    await store.create_session(
        session_id,
        assistant="triage",
        generation=1,
        model="echo-small",
        created_at=created_at,
        transcript=transcript,
        **kw,
    )


def every_kind(turn: str = "t0") -> list[Message]:
    """All four message kinds with every optional field set: tool calls, images, thinking, errors."""
    return [
        SystemMessage(content="You route customers.", name="triage", images=(IMAGE,)),
        UserMessage(content="What is on this picture? ✓ ünïcødé", images=(IMAGE, IMAGE), name="alice", turn=turn),
        AssistantMessage(
            content="Let me look.",
            thinking="The user wants a description; call the tools.",
            images=(IMAGE,),
            name="triage",
            tool_calls=(
                ToolCall(id="call_1", name="clock", arguments={"tz": "UTC", "nested": {"a": [1, 2.5, None, True]}}),
                ToolCall(id="call_2", name="lookup", arguments_error="arguments are not a JSON object: '[1'"),
            ),
            model="echo-small",
            assistant="triage",
            turn=turn,
        ),
        ToolResult(name="clock", content="12:00", call_id="call_1", turn=turn),
        ToolResult(name="lookup", content="error: bad arguments", call_id="call_2", is_error=True, turn=turn),
        AssistantMessage(thinking="only reasoning", model="echo-small", assistant="triage", turn=turn),
    ]


# --------------------------------------------------------------------------- schema and pragmas


async def test_schema_version_and_indexes(store: Store, backend: Backend) -> None:
    assert migrations.SCHEMA_VERSION == 12
    assert backend.schema_version() == migrations.SCHEMA_VERSION
    assert {"sessions_state", "sessions_owner", "turns_one_pending", "entries_active"} <= backend.indexes()
    assert {"owner", "lease_expires", "fence"} <= set(backend.columns("sessions"))
    assert {"session", "turn", "seq", "call", "tool", "arguments", "finished_at"} <= set(backend.columns("journal"))
    assert {"session", "replica", "until"} <= set(backend.columns("watches"))
    assert {"generation", "at", "applied", "errors", "changed", "swapped_total"} <= set(backend.columns("reloads"))


def test_both_backends_have_a_migration_for_every_version() -> None:
    versions = set(range(1, migrations.SCHEMA_VERSION + 1))
    assert set(migrations.SQLITE) == versions
    assert set(migrations.POSTGRES) == versions


async def test_sqlite_wal_mode_synchronous_full_and_foreign_keys(sqlite_store: SqliteStore, db_path: Path) -> None:
    assert raw(db_path, "PRAGMA journal_mode") == [("wal",)]  # WAL is persistent: any connection sees it
    assert raw(db_path, "PRAGMA user_version") == [(migrations.SCHEMA_VERSION,)]
    assert ("sessions_state",) in raw(db_path, "SELECT name FROM sqlite_master WHERE type = 'index'")

    def pragmas(conn: sqlite3.Connection) -> tuple[int, int]:
        return (conn.execute("PRAGMA synchronous").fetchone()[0], conn.execute("PRAGMA foreign_keys").fetchone()[0])

    assert await sqlite_store._run("pragmas", pragmas) == (2, 1)  # 2 = FULL


async def test_a_new_sqlite_database_is_private_to_its_owner(sqlite_store: SqliteStore, db_path: Path) -> None:
    await new_session(sqlite_store)  # a write creates the -wal file too
    for path in (db_path, db_path.with_name(db_path.name + "-wal")):
        assert path.stat().st_mode & 0o077 == 0, path


async def test_a_missing_state_dir_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match=r"cannot open the store .*missing.*: No such file or directory"):
        await SqliteStore.open(tmp_path / "missing" / "agentd.db")


async def test_a_database_from_a_newer_agentd_is_refused(backend: Backend) -> None:
    await (await backend.open()).close()
    backend.set_schema_version(99)
    with pytest.raises(
        StoreError, match=r"^cannot open the store .*: it has schema version 99; this agentd knows"
    ) as refused:
        await backend.open()
    assert type(refused.value) is StoreError  # not StoreUnavailable: a daemon must not wait for it


async def filled_store(db_path: Path, sessions: int = 200) -> bytes:
    """A store with enough sessions to span many pages, closed cleanly; its file's bytes."""
    store = await SqliteStore.open(db_path)
    for i in range(sessions):
        await new_session(store, f"s{i}")
    await store.close()
    assert not exists(db_path.with_name(db_path.name + "-wal"))  # a clean close checkpoints and removes it
    return read_file(db_path)


def read_file(path: Path) -> bytes:
    return path.read_bytes()


def write_file(path: Path, data: bytes) -> None:
    path.write_bytes(data)


def exists(path: Path) -> bool:
    return path.exists()


def remove(path: Path) -> None:
    path.unlink()


def make_dir(path: Path) -> None:
    path.mkdir()


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda data: b"not a database, just text\n" * 400, "file is not a database"),
        (lambda data: data[: len(data) // 2], "database disk image is malformed"),  # truncated
        (lambda data: data[:4096], "database disk image is malformed"),  # only the header page left
        (lambda data: b"SQLite format 4\x00" + data[16:], "file is not a database"),  # a corrupt header
        (lambda data: data[:100] + b"\xff" * 3996 + data[4096:], "malformed"),  # a corrupt schema page
    ],
    ids=["not-sqlite", "truncated", "header-page-only", "corrupt-header", "corrupt-schema"],
)
async def test_a_damaged_database_is_one_clear_error_naming_the_store(db_path: Path, damage: Any, reason: str) -> None:
    write_file(db_path, damage(await filled_store(db_path)))
    with pytest.raises(StoreError) as info:
        await SqliteStore.open(db_path)
    assert str(info.value).startswith(f"cannot open the store {db_path}: ")
    assert reason in str(info.value)


async def test_an_empty_database_file_alone_is_a_new_store(db_path: Path) -> None:
    write_file(db_path, b"")  # e.g. a first start that died before its first write
    store = await SqliteStore.open(db_path)
    try:
        assert await store.list_sessions() == []
    finally:
        await store.close()


@pytest.mark.parametrize("companion", ["-wal", "-shm"])
@pytest.mark.parametrize("main_file", ["empty", "missing"])
async def test_an_empty_or_missing_database_next_to_its_log_is_refused(
    db_path: Path, companion: str, main_file: str
) -> None:
    """SQLite would open it as a new, empty store: every session would silently be gone."""
    await filled_store(db_path)
    write_file(db_path.with_name(db_path.name + companion), b"\x00" * 4096)  # left by a crash
    if main_file == "empty":
        write_file(db_path, b"")
    else:
        remove(db_path)
    with pytest.raises(StoreError) as info:
        await SqliteStore.open(db_path)
    message = str(info.value)
    assert message.startswith(f"cannot open the store {db_path}: the database file is ")
    assert f"agentd.db{companion} (4096 bytes) is next to it" in message
    assert exists(db_path) == (main_file == "empty")  # nothing was created in its place


async def test_a_directory_where_the_database_should_be_is_named(db_path: Path) -> None:
    make_dir(db_path)
    with pytest.raises(
        StoreError, match=r"cannot open the store .*agentd\.db: not a regular file \(it is a directory\)"
    ):
        await SqliteStore.open(db_path)


async def test_migration_hook_runs_each_missing_version_once(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    store = await backend.open()
    await new_session(store)
    await store.close()

    nxt = migrations.SCHEMA_VERSION + 1
    monkeypatch.setattr(migrations, "SCHEMA_VERSION", nxt)
    monkeypatch.setitem(backend.migrations, nxt, ("ALTER TABLE sessions ADD COLUMN note TEXT",))
    store = await backend.open()
    await store.close()
    store = await backend.open()  # already at the newest version: nothing runs again (it would fail: the column exists)
    loaded = await store.load_session("s1")
    await store.close()

    assert backend.schema_version() == nxt
    assert backend.columns("sessions").count("note") == 1
    assert loaded is not None
    assert loaded.id == "s1"


async def test_a_version_1_database_is_migrated_to_the_current_schema(backend: Backend) -> None:
    backend.create_schema(1)
    store = await backend.open()
    await new_session(store)
    assert (await store.session_counts())["idle"] == 1
    await store.close()
    assert backend.schema_version() == migrations.SCHEMA_VERSION


async def test_a_version_2_database_keeps_its_sessions_and_gains_leases(backend: Backend) -> None:
    """A store written before leases existed (schema 2) opens, with every session and turn, none owned."""
    backend.create_schema(2)
    assert backend.schema_version() == 2 and "fence" not in backend.columns("sessions")
    backend.raw(
        "INSERT INTO sessions (id, assistant, state, generation, model, created_at, updated_at)"
        " VALUES ('old', 'triage', 'running', 4, 'echo-small', 1.0, 2.0)"
    )
    message = codec.encode_message(UserMessage(content="from before", turn="t1"))
    backend.raw(
        "INSERT INTO entries (session, seq, turn, active, message) VALUES ('old', 1, 't1', ?, ?)", True, message
    )
    backend.raw(
        "INSERT INTO turns (session, id, status, message_seq, started_at) VALUES ('old', 't1', 'pending', 1, 3.0)"
    )

    store = await backend.open()
    try:
        assert backend.schema_version() == migrations.SCHEMA_VERSION
        loaded = await store.load_session("old")
        assert loaded is not None and (loaded.state, loaded.generation) == ("running", 4)
        assert loaded.transcript == [StoredEntry(1, UserMessage(content="from before", turn="t1"))]
        assert [(s.id, t.id) for s, t in await store.interrupted_turns()] == [("old", "t1")]
        assert await store.lease_of("old") is None
        lease = await store.claim("old", "r1", 60.0)
        assert lease is not None and lease.token == 1
    finally:
        await store.close()


async def test_a_failed_migration_leaves_the_version_unchanged(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    await (await backend.open()).close()
    current = migrations.SCHEMA_VERSION
    monkeypatch.setattr(migrations, "SCHEMA_VERSION", current + 1)
    monkeypatch.setitem(
        backend.migrations, current + 1, ("ALTER TABLE sessions ADD COLUMN note TEXT", "THIS IS NOT SQL")
    )
    with pytest.raises(StoreError, match=r"^cannot open the store .*THIS"):
        await backend.open()
    assert backend.schema_version() == current
    assert "note" not in backend.columns("sessions")


async def test_opening_again_and_again_migrates_once(backend: Backend) -> None:
    """Migrations are idempotent: every later open finds the schema current and changes nothing."""
    for _ in range(3):
        store = await backend.open()
        await store.close()
    assert backend.schema_version() == migrations.SCHEMA_VERSION
    if backend.name == "postgres":  # one row per migration applied, each once
        assert backend.raw("SELECT version FROM agentd_schema ORDER BY version") == [
            (v,) for v in range(1, migrations.SCHEMA_VERSION + 1)
        ]


# --------------------------------------------------------------------------- messages


async def test_round_trip_of_every_message_kind(backend: Backend) -> None:
    messages = every_kind()
    store = await backend.open()
    created = await store.create_session(
        "s1", assistant="triage", generation=3, model="echo-small", created_at=1000.0, transcript=messages
    )
    await store.close()

    store = await backend.open()
    loaded = await store.load_session("s1")
    await store.close()

    expected = [StoredEntry(seq, message) for seq, message in enumerate(messages, start=1)]
    assert created.transcript == expected
    assert loaded is not None
    assert loaded.transcript == expected
    assert [type(entry.message) for entry in loaded.transcript] == [type(m) for m in messages]
    # Stored as msgspec JSON of the tagged Message union, nothing else.
    stored = [json.loads(text) for (text,) in backend.raw("SELECT message FROM entries ORDER BY seq")]
    assert [row["role"] for row in stored] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert stored[2]["tool_calls"][0]["arguments"]["nested"] == {"a": [1, 2.5, None, True]}


async def test_only_messages_can_be_stored(store: Store) -> None:
    with pytest.raises(StoreError, match="session s1"):
        await store.create_session(
            "s1",
            assistant="a",
            generation=1,
            model="m",
            created_at=1.0,
            transcript=[{"role": "user"}],  # type: ignore[list-item]
        )
    await new_session(store)
    with pytest.raises(StoreError, match="session s1 turn t1"):
        await store.begin_turn("s1", "t1", AssistantMessage(content="hi"), 1.0)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- turns


async def test_begin_and_commit_a_turn(store: Store) -> None:
    await new_session(store)
    seq = await store.begin_turn("s1", "t1", UserMessage(content="hello"), started_at=1500.0)
    assert seq == 2

    running = await store.load_session("s1")
    assert running is not None
    assert running.state == "running"
    assert running.updated_at == 1500.0
    assert running.transcript[-1] == StoredEntry(2, UserMessage(content="hello", turn="t1"))
    pending = await store.pending_turn("s1")
    assert pending == StartedTurn(id="t1", message=UserMessage(content="hello", turn="t1"), started_at=1500.0)
    assert running.turns == [pending]

    appended: list[Message] = [
        AssistantMessage(
            tool_calls=(ToolCall(id="c1", name="clock"),), model="echo-small", assistant="triage", turn="t1"
        ),
        ToolResult(name="clock", content="12:00", call_id="c1", turn="t1"),
        reply("t1", "It is noon.", model="echo-large", assistant="billing"),
    ]
    discarded = (Discarded(model="echo-small", steps=1, reason="swap", usage=Usage(5, 6)),)
    seqs = await commit(
        store,
        "s1",
        "t1",
        appended,
        assistant="billing",
        models=("echo-small", "echo-large"),
        steps=2,
        restarts=1,
        discarded=discarded,
        usage=Usage(10, 20),
        ended_at=1600.0,
        error=None,
    )
    assert seqs == (3, 4, 5)

    session = await store.load_session("s1")
    assert session is not None
    assert session.state == "idle"
    assert session.assistant == "billing"
    assert session.updated_at == 1600.0
    assert [entry.seq for entry in session.transcript] == [1, 2, 3, 4, 5]
    assert [entry.message for entry in session.transcript[2:]] == appended
    assert await store.pending_turn("s1") is None
    [turn] = session.turns
    assert isinstance(turn, TurnRecord)
    assert turn.status is TurnStatus.COMPLETED
    assert turn.models == ("echo-small", "echo-large")
    assert (turn.steps, turn.restarts, turn.usage, turn.discarded) == (2, 1, Usage(10, 20), discarded)
    assert (turn.started_at, turn.ended_at, turn.error) == (1500.0, 1600.0, None)


async def test_an_ended_turn_is_read_alone_with_its_entries(store: Store) -> None:
    await new_session(store)
    await store.begin_turn("s1", "t1", UserMessage(content="hello"), started_at=1500.0)
    assert await store.ended_turn("s1", "t1") is None  # pending
    await commit(store, "s1", "t1", [reply("t1", "hi")], ended_at=1600.0)
    await store.begin_turn("s1", "t2", UserMessage(content="again"), started_at=1700.0)
    found = await store.ended_turn("s1", "t1")
    assert found is not None
    record, entries = found
    session = await store.load_session("s1")
    assert session is not None
    assert record == session.turns[0]
    assert entries == [e for e in session.transcript if e.message.turn == "t1"]
    assert [type(e.message) for e in entries] == [UserMessage, AssistantMessage]
    assert await store.ended_turn("s1", "t2") is None
    assert await store.ended_turn("s1", "nope") is None
    assert await store.ended_turn("ghost", "t1") is None


async def test_commit_returns_the_record_as_stored(store: Store, backend: Backend) -> None:
    """What commit_turn returns is what load_session gives back: begin_turn's started_at, not the child's."""
    await new_session(store)
    await store.begin_turn("s1", "t1", UserMessage(content="hello"), started_at=1500.0)
    sent = record(
        "t1",
        status=TurnStatus.LOOP_DETECTED,
        models=("echo-small",),
        steps=4,
        usage=Usage(7, 8),
        started_at=1501.25,
        ended_at=1600.0,
        error="tool 'clock' called 4 times with the same arguments",
    )
    committed = await store.commit_turn("s1", sent, assistant="triage", messages=[reply("t1", "looping")])
    assert committed == CommittedTurn(msgspec.structs.replace(sent, started_at=1500.0), (3,))
    session = await store.load_session("s1")
    assert session is not None
    assert session.turns == [committed.record]
    assert backend.raw("SELECT started_at FROM turns WHERE id = 't1'") == [(1500.0,)]


async def test_a_session_lists_ended_turns_as_records_and_the_pending_one_as_started(store: Store) -> None:
    await new_session(store)
    await store.begin_turn("s1", "t1", UserMessage(content="one"), started_at=1500.0)
    await commit(store, "s1", "t1", [reply("t1", "ok")])
    await store.begin_turn("s1", "t2", UserMessage(content="two"), started_at=1600.0)
    await store.abandon_turn("s1", "t2", status="failed", error="child crashed", ended_at=1650.0)
    await store.begin_turn("s1", "t3", None, started_at=1700.0)
    session = await store.load_session("s1")
    assert session is not None
    assert session.turns == [
        record("t1", started_at=1500.0),
        TurnRecord(id="t2", status=TurnStatus.FAILED, started_at=1600.0, ended_at=1650.0, error="child crashed"),
        StartedTurn(id="t3", message=None, started_at=1700.0),
    ]
    assert session.turn_count == 3


async def test_an_opener_turn_has_no_input_message(store: Store) -> None:
    await new_session(store)
    assert await store.begin_turn("s1", "t0", None, started_at=1000.0) is None
    pending = await store.pending_turn("s1")
    assert pending is not None
    assert pending.message is None
    assert await commit(store, "s1", "t0", [reply("t0", "Hi! How can I help?")]) == (2,)
    session = await store.load_session("s1")
    assert session is not None
    assert [type(e.message) for e in session.transcript] == [SystemMessage, AssistantMessage]
    assert session.turns == [record("t0", started_at=1000.0)]


async def test_turns_come_back_in_start_order_with_their_outcomes(store: Store) -> None:
    await new_session(store)
    for index, status in enumerate([TurnStatus.COMPLETED, TurnStatus.EXHAUSTED_STEPS, TurnStatus.FAILED]):
        turn = f"t{index}"
        await store.begin_turn("s1", turn, UserMessage(content=f"m{index}"), started_at=1000.0 + index)
        error = "boom" if status == "failed" else None
        await commit(store, "s1", turn, [reply(turn, "ok")], status=status, error=error)
    session = await store.load_session("s1")
    assert session is not None
    assert session.turns == [
        record("t0", started_at=1000.0),
        record("t1", status=TurnStatus.EXHAUSTED_STEPS, started_at=1001.0),
        record("t2", status=TurnStatus.FAILED, started_at=1002.0, error="boom"),
    ]


class EncoderFailure(RuntimeError):
    pass


@pytest.mark.parametrize("replace_history", [False, True], ids=["append", "transcript-replacement"])
async def test_commit_is_atomic(
    store: Store, backend: Backend, monkeypatch: pytest.MonkeyPatch, replace_history: bool
) -> None:
    await new_session(store)
    await store.begin_turn("s1", "t1", UserMessage(content="hello"), started_at=1500.0)
    before = backend.raw("SELECT seq, active, message FROM entries ORDER BY seq")
    messages = [reply("t1", f"part {i}") for i in range(3)]

    original = codec.encode_message
    calls = 0

    def failing(message: Message) -> str:
        nonlocal calls
        calls += 1
        if calls == 2:  # the 1st message's row (and any inactive marking) is already written
            raise EncoderFailure("disk on fire")
        return original(message)

    monkeypatch.setattr(codec, "encode_message", failing)
    transcript: list[Message] | None = None
    if replace_history:
        transcript = [SystemMessage(content="S2", name="billing"), *messages]
    with pytest.raises(EncoderFailure):
        await commit(store, "s1", "t1", messages, assistant="billing", transcript=transcript)
    assert calls == 2

    # Nothing of the turn was written: same entries (all still active), turn still pending, session unchanged.
    assert backend.raw("SELECT seq, active, message FROM entries ORDER BY seq") == before
    session = await store.load_session("s1")
    assert session is not None
    assert (session.state, session.assistant) == ("running", "triage")
    pending = await store.pending_turn("s1")
    assert pending == StartedTurn(id="t1", message=UserMessage(content="hello", turn="t1"), started_at=1500.0)

    # The same turn can still be committed once the failure is gone.
    monkeypatch.setattr(codec, "encode_message", original)
    seqs = await commit(store, "s1", "t1", messages, assistant="billing", transcript=transcript)
    assert seqs == ((3, 4, 5, 6) if replace_history else (3, 4, 5))
    assert await store.pending_turn("s1") is None


def test_a_landed_commit_is_recognised_only_by_its_own_row_and_entries() -> None:
    """``codec.landed_commit_seqs``, the decision both backends make on a commit's retry."""
    result = record("t1", ended_at=1600.0, models=("echo-small",), steps=2)
    columns = codec.ended_turn_columns(result, TurnStatus.COMPLETED)
    stored = {**columns, "n": 7, "id": "t1", "started_at": 1500.0}  # a row has more columns than a commit sets
    texts = [codec.encode_message(reply("t1", "hi")), codec.encode_message(reply("t1", "again"))]

    def row(seq: int, text: str, *, active: bool = True, is_input: bool = False) -> codec.EntryRow:
        return codec.EntryRow(seq, active, text, is_input)

    written = [row(3, texts[0]), row(4, texts[1])]
    landed = codec.landed_commit_seqs
    assert landed(stored, columns, written, texts) == (3, 4)
    assert landed(stored, columns, [*written, row(5, "next", is_input=True)], texts) == (3, 4)  # a later turn's input
    assert landed(stored, columns, [], []) == ()
    assert landed(stored, columns, [row(3, "next", is_input=True)], []) == ()

    for name, value in (("status", "exhausted_steps"), ("ended_at", 1601.0), ("steps", 3), ("error", "boom")):
        assert landed({**stored, name: value}, columns, written, texts) is None, name
    assert landed(stored, columns, [row(3, texts[0]), row(4, "other")], texts) is None
    assert landed(stored, columns, [row(3, texts[0]), row(4, texts[1], active=False)], texts) is None  # rewritten since
    assert landed(stored, columns, [row(3, texts[0]), row(4, texts[1], is_input=True)], texts) is None
    assert landed(stored, columns, written[:1], texts) is None  # fewer entries than the commit writes
    assert landed(stored, columns, [*written, row(5, "more")], texts) is None  # the commit that landed wrote more
    assert landed(stored, columns, [row(3, "more")], []) is None
    assert landed(stored, columns, [row(3, texts[0]), row(5, texts[1])], texts) is None  # not consecutive


def raw_state(backend: Backend) -> tuple[list[tuple[Any, ...]], ...]:
    """Every row of the store's tables, to show that a call wrote nothing."""
    return tuple(
        backend.raw(f"SELECT * FROM {table} ORDER BY {order}")
        for table, order in (("entries", "seq"), ("turns", "n"), ("sessions", "id"), ("journal", "seq"))
    )


@pytest.mark.parametrize(
    ("opener", "rewrite", "expected_seqs"),
    [(False, False, (5, 6)), (False, True, (5, 6, 7, 8)), (True, False, (4, 5)), (True, True, (4, 5, 6, 7))],
    ids=["append", "transcript-replacement", "opener", "opener-transcript-replacement"],
)
async def test_a_commit_that_landed_is_recognised_on_retry_and_stored_once(
    store: Store, backend: Backend, opener: bool, rewrite: bool, expected_seqs: tuple[int, ...]
) -> None:
    """The retry of a commit whose answer was lost (RFC 0003 §3) gets what the first attempt got."""
    await new_session(store)
    await store.begin_turn("s1", "t0", UserMessage(content="earlier"), started_at=1400.0)
    await commit(store, "s1", "t0", [reply("t0", "before")])
    await store.begin_turn("s1", "t1", None if opener else UserMessage(content="hello"), started_at=1500.0)
    result = record("t1", ended_at=1600.0, models=("echo-small",), steps=2, usage=Usage(7, 3))
    messages: list[Message] = [reply("t1", "hi"), reply("t1", "again")]
    transcript: list[Message] | None = None
    if rewrite:
        transcript = [SystemMessage(content="You handle invoices.", name="billing"), UserMessage(content="earlier")]
        transcript += messages
    arguments: dict[str, Any] = {"assistant": "triage", "messages": messages, "transcript": transcript}
    first = await store.commit_turn("s1", result, **arguments)
    assert first == CommittedTurn(msgspec.structs.replace(result, started_at=1500.0), expected_seqs)
    before = raw_state(backend)

    again = await store.commit_turn("s1", result, **arguments)

    assert again == first
    assert raw_state(backend) == before  # nothing written twice
    session = await store.load_session("s1")
    assert session is not None
    assert [e.message for e in session.transcript if e.seq in again.seqs] == (transcript or messages)
    assert [getattr(e.message, "content", None) for e in session.transcript].count("again") == 1


async def test_a_retried_commit_is_recognised_after_another_replica_stored_the_next_message(
    store: Store, backend: Backend
) -> None:
    """A message another replica stored meanwhile (``begin_turn`` is not fenced) does not hide the commit."""
    await new_session(store)
    await store.begin_turn("s1", "t1", UserMessage(content="hello"), started_at=1500.0)
    result = record("t1", ended_at=1600.0)
    first = await store.commit_turn("s1", result, assistant="triage", messages=[reply("t1", "hi")])
    assert await store.begin_turn("s1", "t2", UserMessage(content="next"), started_at=1700.0) == 4
    before = raw_state(backend)
    assert await store.commit_turn("s1", result, assistant="triage", messages=[reply("t1", "hi")]) == first
    assert raw_state(backend) == before


async def test_a_commit_of_other_results_for_an_ended_turn_is_refused_and_writes_nothing(
    store: Store, backend: Backend
) -> None:
    await new_session(store)
    await store.begin_turn("s1", "t1", UserMessage(content="hello"), started_at=1500.0)
    result = record("t1", ended_at=1600.0)
    messages = [reply("t1", "hi"), reply("t1", "again")]
    assert (await store.commit_turn("s1", result, assistant="triage", messages=messages)).seqs == (3, 4)
    before = raw_state(backend)

    refused = r"^cannot commit session s1 turn t1: the turn is not pending \(status completed\)$"
    others: list[tuple[TurnRecord, list[Message], list[Message] | None]] = [
        (record("t1", ended_at=1601.0), messages, None),  # another record
        (record("t1", ended_at=1600.0, status=TurnStatus.EXHAUSTED_STEPS), messages, None),
        (record("t1", ended_at=1600.0, error="boom"), messages, None),
        (result, [reply("t1", "hi"), reply("t1", "other")], None),  # other entries
        (result, messages[:1], None),  # fewer
        (result, [*messages, reply("t1", "more")], None),  # more
        (result, [], None),
        (result, messages, [reply("t1", "x")]),  # a rewrite where there was none
    ]
    for other, other_messages, transcript in others:
        with pytest.raises(StoreError, match=refused):
            await store.commit_turn("s1", other, assistant="triage", messages=other_messages, transcript=transcript)
    assert raw_state(backend) == before


async def test_a_commit_for_a_turn_that_ended_without_results_is_refused(store: Store, backend: Backend) -> None:
    await new_session(store)
    await store.begin_turn("s1", "t1", UserMessage(content="hello"), started_at=1500.0)
    await store.abandon_turn("s1", "t1", status="cancelled", error="cancelled by the operator", ended_at=1550.0)
    before = raw_state(backend)
    with pytest.raises(StoreError, match=r"not pending \(status cancelled\)$"):
        await store.commit_turn("s1", record("t1", ended_at=1600.0), assistant="triage", messages=[reply("t1", "hi")])
    # Not even one whose record says what the abandon wrote: the abandon wrote none of its entries.
    with pytest.raises(StoreError, match=r"not pending \(status cancelled\)$"):
        await store.commit_turn(
            "s1",
            record("t1", status=TurnStatus.CANCELLED, ended_at=1550.0, error="cancelled by the operator"),
            assistant="triage",
            messages=[reply("t1", "hi")],
        )
    assert raw_state(backend) == before


async def test_transcript_replacement_keeps_old_entries_inactive_and_seqs_increasing(
    store: Store, backend: Backend
) -> None:
    await new_session(store)
    await store.begin_turn("s1", "t1", UserMessage(content="bill me"), started_at=1500.0)
    await commit(store, "s1", "t1", [reply("t1", "one moment")])
    await store.begin_turn("s1", "t2", UserMessage(content="transfer me to billing"), started_at=1600.0)
    old = await store.load_session("s1")
    assert old is not None
    assert [e.seq for e in old.transcript] == [1, 2, 3, 4]

    new_transcript: list[Message] = [
        SystemMessage(content="You handle invoices.", name="billing"),
        UserMessage(content="bill me", turn="t1"),
        UserMessage(content="transfer me to billing", turn="t2"),
        AssistantMessage(content="Billing here.", model="echo-large", assistant="billing", turn="t2"),
    ]
    seqs = await commit(
        store,
        "s1",
        "t2",
        [new_transcript[-1]],
        status=TurnStatus.TRANSFERRED,
        assistant="billing",
        transcript=new_transcript,
    )
    assert seqs == (5, 6, 7, 8)

    session = await store.load_session("s1")
    assert session is not None
    assert session.assistant == "billing"
    assert [e.seq for e in session.transcript] == [5, 6, 7, 8]
    assert [e.message for e in session.transcript] == new_transcript
    assert session.turns[1] == record("t2", status=TurnStatus.TRANSFERRED, started_at=1600.0)
    # The turn's input is still reachable although its entry is no longer active.
    [(message,)] = backend.raw(
        "SELECT e.message FROM turns t JOIN entries e ON (e.session, e.seq) = (t.session,"
        " t.message_seq) WHERE t.id = 't2' AND NOT e.active",
    )
    assert json.loads(message)["content"] == "transfer me to billing"
    # Old entries are all still in the file, inactive.
    assert backend.raw("SELECT seq, active FROM entries ORDER BY seq") == [
        (1, 0),
        (2, 0),
        (3, 0),
        (4, 0),
        (5, 1),
        (6, 1),
        (7, 1),
        (8, 1),
    ]
    assert [
        json.loads(m)["content"] for (m,) in backend.raw("SELECT message FROM entries WHERE NOT active ORDER BY seq")
    ] == ["You route customers.", "bill me", "one moment", "transfer me to billing"]

    # Appending after a replacement continues the sequence.
    assert await store.begin_turn("s1", "t3", UserMessage(content="thanks"), started_at=1700.0) == 9
    assert await commit(store, "s1", "t3", [reply("t3", "bye", assistant="billing")], assistant="billing") == (10,)
    session = await store.load_session("s1")
    assert session is not None
    assert [e.seq for e in session.transcript] == [5, 6, 7, 8, 9, 10]


async def test_abandon_keeps_the_user_message_and_frees_the_session(store: Store) -> None:
    await new_session(store)
    await store.begin_turn("s1", "t1", UserMessage(content="hello"), started_at=1500.0)
    await store.abandon_turn("s1", "t1", status="cancelled", error="cancelled by the operator", ended_at=1550.0)
    session = await store.load_session("s1")
    assert session is not None
    assert session.state == "idle"
    assert session.transcript[-1].message == UserMessage(content="hello", turn="t1")
    assert session.turns == [
        TurnRecord(
            id="t1", status=TurnStatus.CANCELLED, started_at=1500.0, ended_at=1550.0, error="cancelled by the operator"
        )
    ]
    assert await store.pending_turn("s1") is None
    with pytest.raises(StoreError, match=r"session s1 turn t1.*not pending"):
        await commit(store, "s1", "t1", [reply("t1", "late")])
    assert await store.begin_turn("s1", "t2", UserMessage(content="again"), started_at=1600.0) == 3


async def test_abandon_keeps_a_closed_or_failed_state(store: Store) -> None:
    for session_id, state in (("s1", "closed"), ("s2", "failed")):
        await new_session(store, session_id)
        await store.begin_turn(session_id, "t1", UserMessage(content="hello"), started_at=1500.0)
        await store.update_session(session_id, state=state)  # type: ignore[arg-type]
        await store.abandon_turn(session_id, "t1", status="failed", error="child crashed", ended_at=1550.0)
        session = await store.load_session(session_id)
        assert session is not None
        assert session.state == state


async def test_a_commit_after_close_keeps_the_session_closed(store: Store) -> None:
    await new_session(store)
    await store.begin_turn("s1", "t1", UserMessage(content="hello"), started_at=1500.0)
    await store.update_session("s1", state="closed")
    await commit(store, "s1", "t1", [reply("t1", "hi")], status=TurnStatus.CANCELLED)
    session = await store.load_session("s1")
    assert session is not None
    assert session.state == "closed"
    assert session.turns == [record("t1", status=TurnStatus.CANCELLED, started_at=1500.0)]


# --------------------------------------------------------------------------- sessions


async def test_update_session_sets_only_the_given_fields(store: Store) -> None:
    await new_session(store)
    await store.update_session("s1", generation=4, model="echo-large")
    session = await store.load_session("s1")
    assert session is not None
    assert (session.state, session.generation, session.model, session.assistant) == ("idle", 4, "echo-large", "triage")
    assert session.updated_at > session.created_at
    await store.update_session("s1", state="failed", assistant="billing")
    session = await store.load_session("s1")
    assert session is not None
    assert (session.state, session.generation, session.model, session.assistant) == (
        "failed",
        4,
        "echo-large",
        "billing",
    )
    with pytest.raises(StoreError, match="unknown state 'sleeping'"):
        await store.update_session("s1", state="sleeping")  # type: ignore[arg-type]


async def test_a_failed_session_resumes_with_a_new_message(store: Store) -> None:
    await new_session(store)
    await store.update_session("s1", state="failed")
    await store.begin_turn("s1", "t1", UserMessage(content="still there?"), started_at=1500.0)
    session = await store.load_session("s1")
    assert session is not None
    assert session.state == "running"


async def test_sessions_are_rows_paged_counted_and_read_without_their_transcript(store: Store) -> None:
    await new_session(store, "old", created_at=1.0)
    await new_session(store, "mid", created_at=2.0, transcript=[SystemMessage(content="s")])
    await new_session(store, "new", created_at=3.0)
    await store.begin_turn("mid", "t1", UserMessage(content="hi"), started_at=5.0)
    await store.update_session("old", state="closed")
    await store.update_session("new", state="failed")

    summaries = await store.list_sessions()
    assert [(s.id, s.state) for s in summaries] == [("old", "closed"), ("mid", "running"), ("new", "failed")]
    assert all(s.transcript == [] and s.turns == [] for s in summaries)
    assert [s.turn_count for s in summaries] == [0, 1, 0]
    first = await store.list_sessions(limit=2)
    assert [s.id for s in first] == ["old", "mid"]
    assert [s.id for s in await store.list_sessions(limit=2, after=first[-1].id)] == ["new"]
    with pytest.raises(UnknownSession, match="no session 'nope'"):
        await store.list_sessions(after="nope")

    assert await store.session_counts() == {"closed": 1, "failed": 1, "idle": 0, "running": 1}
    assert await store.open_sessions_by_assistant() == {"triage": 2}
    summary = await store.session_summary("mid")
    assert summary is not None and summary.state == "running" and summary.transcript == []
    assert await store.session_summary("nope") is None
    # A pending turn's own input is left out of the transcript it re-runs over.
    assert await store.transcript("mid") == [SystemMessage(content="s"), UserMessage(content="hi", turn="t1")]
    assert await store.transcript("mid", exclude_turn="t1") == [SystemMessage(content="s")]

    interrupted = await store.interrupted_turns()
    assert [(s.id, t.id) for s, t in interrupted] == [("mid", "t1")]  # closed sessions are not resumed
    assert interrupted[0][1] == StartedTurn(id="t1", message=UserMessage(content="hi", turn="t1"), started_at=5.0)
    assert await store.load_session("nope") is None


async def test_reopen_restores_everything_including_a_pending_turn(backend: Backend) -> None:
    store = await backend.open()
    await new_session(store, transcript=every_kind("t0"))
    await store.begin_turn("s1", "t1", UserMessage(content="first"), started_at=1500.0)
    await commit(store, "s1", "t1", [reply("t1", "answer")], usage=Usage(3, 4), models=("echo-small",))
    await store.begin_turn("s1", "t2", UserMessage(content="second", images=(IMAGE,)), started_at=1700.0)
    await new_session(store, "gone")
    await store.update_session("gone", state="closed")
    before = await store.load_session("s1")
    await store.close()

    store = await backend.open()
    try:
        after = await store.load_session("s1")
        assert after == before
        assert after is not None
        assert after.state == "running"
        pending = await store.pending_turn("s1")
        assert pending is not None
        second = UserMessage(content="second", images=(IMAGE,), turn="t2")
        assert pending == StartedTurn(id="t2", message=second, started_at=1700.0)
        assert after.turns[-1] == pending
        assert pending.message is not None
        assert after.transcript[-1] == StoredEntry(9, pending.message)
        assert [s.id for s, _ in await store.interrupted_turns()] == ["s1"]
        # The restored pending turn can be committed, and it still blocks a second one.
        with pytest.raises(StoreError, match="turn t2 is still pending"):
            await store.begin_turn("s1", "t3", UserMessage(content="third"), started_at=1800.0)
        assert await commit(store, "s1", "t2", [reply("t2", "re-run answer")]) == (10,)
    finally:
        await store.close()


# --------------------------------------------------------------------------- errors


async def test_errors_name_the_session_and_turn(store: Store) -> None:
    with pytest.raises(UnknownSession, match=r"session ghost turn t1: the session is unknown"):
        await store.begin_turn("ghost", "t1", UserMessage(content="hi"), started_at=1.0)
    with pytest.raises(UnknownSession, match=r"session ghost turn t1: the session is unknown"):
        await commit(store, "ghost", "t1")
    with pytest.raises(UnknownSession, match=r"session ghost turn t1: the session is unknown"):
        await store.abandon_turn("ghost", "t1", status="cancelled", error=None, ended_at=1.0)
    with pytest.raises(UnknownSession, match=r"session ghost is unknown"):
        await store.update_session("ghost", state="idle")
    with pytest.raises(UnknownSession, match=r"session ghost is unknown"):
        await store.pending_turn("ghost")

    await new_session(store)
    with pytest.raises(StoreError, match=r"session s1 already exists"):
        await new_session(store)
    with pytest.raises(StoreError, match=r"session s1 turn t9: no such turn"):
        await commit(store, "s1", "t9")
    with pytest.raises(StoreError, match=r"session s1 turn t9: no such turn"):
        await store.abandon_turn("s1", "t9", status="cancelled", error=None, ended_at=1.0)

    await store.begin_turn("s1", "t1", UserMessage(content="hi"), started_at=1.0)
    with pytest.raises(StoreError, match=r"session s1 turn t2: turn t1 is still pending"):
        await store.begin_turn("s1", "t2", UserMessage(content="again"), started_at=2.0)
    with pytest.raises(StoreError, match=r"session s1 turn t1: unknown status 'pending'"):
        await store.abandon_turn("s1", "t1", status="pending", error=None, ended_at=3.0)
    with pytest.raises(StoreError, match=r"session s1 turn t1: unknown status 'pending'"):
        await store.commit_turn("s1", record("t1", status="pending"), assistant="triage")  # type: ignore[arg-type]
    await commit(store, "s1", "t1", [reply("t1", "ok")])
    with pytest.raises(StoreError, match=r"session s1 turn t1: the session already has a turn with this id"):
        await store.begin_turn("s1", "t1", UserMessage(content="reuse"), started_at=4.0)
    with pytest.raises(StoreError, match=r"session s1 turn t1.*not pending \(status completed\)"):
        await store.abandon_turn("s1", "t1", status="cancelled", error=None, ended_at=5.0)

    await store.update_session("s1", state="closed")
    with pytest.raises(StoreError, match=r"session s1 turn t5: the session is closed"):
        await store.begin_turn("s1", "t5", UserMessage(content="hello?"), started_at=6.0)
    # None of the refused calls left anything behind.
    session = await store.load_session("s1")
    assert session is not None
    assert [t.id for t in session.turns] == ["t1"]
    assert [e.seq for e in session.transcript] == [1, 2, 3]


async def test_calls_on_a_closed_store_are_refused(backend: Backend) -> None:
    store = await backend.open()
    await store.close()
    await store.close()  # idempotent
    with pytest.raises(StoreError, match="store is closed"):
        await store.load_session("s1")


# --------------------------------------------------------------------------- concurrency and the event loop


async def test_many_concurrent_sessions_are_all_durable(backend: Backend) -> None:
    store = await backend.open()

    async def converse(index: int) -> None:
        session_id = f"s{index:02d}"
        await new_session(store, session_id, created_at=float(index))
        for turn_index in range(2):
            turn = f"t{turn_index}"
            await store.begin_turn(
                session_id, turn, UserMessage(content=f"{session_id} says {turn}"), started_at=float(index)
            )
            answers = [reply(turn, f"{session_id} answer {turn} part {p}") for p in range(3)]
            await commit(store, session_id, turn, answers)

    async with anyio.create_task_group() as tg:
        for index in range(50):
            tg.start_soon(converse, index)
    await store.close()

    store = await backend.open()
    try:
        assert len(await store.list_sessions()) == 50
        for index in range(50):
            session_id = f"s{index:02d}"
            session = await store.load_session(session_id)
            assert session is not None
            assert session.state == "idle"
            assert [e.seq for e in session.transcript] == list(range(1, 10))
            contents = [getattr(e.message, "content", None) for e in session.transcript[1:]]
            assert contents == [
                f"{session_id} says t0",
                *(f"{session_id} answer t0 part {p}" for p in range(3)),
                f"{session_id} says t1",
                *(f"{session_id} answer t1 part {p}" for p in range(3)),
            ]
            assert session.turns == [record(t, started_at=float(index)) for t in ("t0", "t1")]
    finally:
        await store.close()


async def test_a_sqlite_store_call_does_not_block_the_event_loop(
    sqlite_store: SqliteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a big commit is inside its transaction, other tasks keep running on the loop.

    The commit's worker pauses inside the transaction until a task on the event loop has ticked
    several times. If the store ran on the loop thread, the blocked loop could never tick: the
    commit would resume only after its deadlock guard, and the order would differ.
    """
    await new_session(sqlite_store)
    await sqlite_store.begin_turn("s1", "t1", UserMessage(content="write a lot"), started_at=1.0)
    messages = [reply("t1", f"chunk {i} " + "x" * 2000) for i in range(500)]

    original = codec.encode_message
    in_transaction = anyio.Event()
    release = threading.Event()
    log: list[str] = []
    loop = Loop()
    worker_threads: set[int] = set()

    def pausing(message: Message) -> str:
        worker_threads.add(threading.get_ident())
        if message is messages[0]:
            loop.run(in_transaction.set)
            released = release.wait(timeout=60)  # a deadlock guard only; the loop releases it
            log.append("worker resumed" if released else "worker never released")
        return original(message)

    monkeypatch.setattr(codec, "encode_message", pausing)

    async def ticker() -> None:
        await in_transaction.wait()
        for index in range(5):
            log.append(f"tick {index}")
            await anyio.lowlevel.checkpoint()
        release.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        seqs = await commit(sqlite_store, "s1", "t1", messages)
        log.append("commit returned")

    assert log == [*(f"tick {i}" for i in range(5)), "worker resumed", "commit returned"]
    assert loop.thread not in worker_threads
    assert seqs == tuple(range(3, 503))


async def test_sqlite_writes_that_arrive_during_a_batch_are_written_together_next(
    sqlite_store: SqliteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group commit: while one write's transaction runs, five more arrive; they go in one batch
    after it (two transactions in all), and every caller is answered."""
    for index in range(6):
        await new_session(sqlite_store, f"s{index}")
    first = UserMessage(content="first")
    original = codec.encode_message
    in_transaction, release = anyio.Event(), threading.Event()
    loop = Loop()

    def pausing(message: Message) -> str:
        if message.content == "first":  # type: ignore[union-attr]  # every message here is a UserMessage
            loop.run(in_transaction.set)
            release.wait(timeout=60)  # a deadlock guard only; the test releases it
        return original(message)

    monkeypatch.setattr(codec, "encode_message", pausing)
    transactions: list[str] = []
    conn = sqlite_store._conn
    assert conn is not None
    conn.set_trace_callback(lambda sql: transactions.append(sql) if sql.startswith("BEGIN IMMEDIATE") else None)
    seqs: dict[str, int | None] = {}

    async def begin(session: str, message: UserMessage) -> None:
        seqs[session] = await sqlite_store.begin_turn(session, "t1", message, started_at=1.0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(begin, "s0", first)
        await in_transaction.wait()
        for index in range(1, 6):
            tg.start_soon(begin, f"s{index}", UserMessage(content="later"))
        for _ in range(5):
            await anyio.lowlevel.checkpoint()  # every later write is queued
        release.set()
    conn.set_trace_callback(None)
    assert len(transactions) == 2
    assert seqs == {f"s{index}": 2 for index in range(6)}


async def test_a_cancelled_caller_does_not_tear_a_commit(
    store: Store, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelling the task awaiting a commit while it runs: the transaction still completes whole."""
    await new_session(store)
    await store.begin_turn("s1", "t1", UserMessage(content="hello"), started_at=1.0)
    messages = [reply("t1", f"part {i}") for i in range(5)]
    original = codec.encode_message
    scope = anyio.CancelScope()
    loop = Loop()

    def cancelling(message: Message) -> str:
        if message is messages[0]:
            loop.run(scope.cancel)
        return original(message)

    monkeypatch.setattr(codec, "encode_message", cancelling)
    with scope:
        await commit(store, "s1", "t1", messages)
        await anyio.lowlevel.checkpoint()  # the cancellation is delivered here at the latest
        pytest.fail("the cancellation was not delivered")
    assert scope.cancel_called
    assert scope.cancelled_caught
    # As soon as the cancelled caller has control back, the commit is whole in the file.
    assert backend.raw("SELECT COUNT(*) FROM entries WHERE turn = 't1'") == [(6,)]
    assert backend.raw("SELECT status FROM turns WHERE id = 't1'") == [("completed",)]

    session = await store.load_session("s1")
    assert session is not None
    assert [e.message for e in session.transcript[2:]] == messages
    assert session.turns == [record("t1", started_at=1.0)]
    assert await store.pending_turn("s1") is None


async def test_stored_structs_are_frozen(store: Store) -> None:
    await new_session(store)
    session = await store.load_session("s1")
    assert session is not None
    with pytest.raises(AttributeError):
        session.state = "closed"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        session.transcript[0].seq = 5  # type: ignore[misc]
    await store.begin_turn("s1", "t1", UserMessage(content="hello"), started_at=1.0)
    await commit(store, "s1", "t1")
    reloaded = await store.load_session("s1")
    assert reloaded is not None
    with pytest.raises(AttributeError):
        reloaded.turns[0].id = "t2"  # type: ignore[misc]


def test_the_store_imports_neither_the_protocol_nor_the_api_views_nor_the_postgres_driver() -> None:
    """The store keeps domain records (agentd.records), so it must not pull in the wire or the HTTP layer;
    and the embedded default must not need the optional PostgreSQL driver."""
    modules = ("agentd.protocol", "agentd.views", "psycopg", "psycopg_pool", "agentd.store.postgres")
    code = f"import sys, agentd.store; print(sorted(m for m in {modules!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


async def test_a_transfer_commit_sets_the_new_model_in_the_same_transaction(store: Store) -> None:
    await new_session(store)
    await store.begin_turn("s1", "t1", UserMessage(content="transfer me"), started_at=1.0)
    await commit(store, "s1", "t1", [reply("t1", "bye")], assistant="billing", model="echo-large")
    loaded = await store.load_session("s1")
    assert loaded is not None
    assert (loaded.assistant, loaded.model, loaded.turn_count) == ("billing", "echo-large", 1)
    await store.begin_turn("s1", "t2", UserMessage(content="again"), started_at=2.0)
    await commit(store, "s1", "t2", [reply("t2", "ok")], assistant="billing")
    assert (await store.load_session("s1")).model == "echo-large"  # type: ignore[union-attr]


async def test_concurrent_writes_share_a_transaction_and_a_failing_one_leaves_the_others(store: Store) -> None:
    await new_session(store, "s1")
    await new_session(store, "s2")

    results: dict[str, object] = {}

    async def begin(session: str, turn: str) -> None:
        try:
            results[turn] = await store.begin_turn(session, turn, UserMessage(content=turn), started_at=1.0)
        except StoreError as exc:
            results[turn] = exc

    async with anyio.create_task_group() as tg:
        tg.start_soon(begin, "s1", "t1")
        tg.start_soon(begin, "s2", "t2")
        tg.start_soon(begin, "s1", "t3")  # refused: s1 already has a pending turn
        tg.start_soon(begin, "nope", "t4")  # refused: no such session
    assert isinstance(results["t3"], StoreError) and "still pending" in str(results["t3"])
    assert isinstance(results["t4"], StoreError) and "unknown" in str(results["t4"])
    assert isinstance(results["t1"], int) and isinstance(results["t2"], int)
    assert (await store.pending_turn("s1")) is not None and (await store.pending_turn("s2")) is not None
    assert await store.transcript("s1") == [
        SystemMessage(content="You route customers.", name="triage"),
        UserMessage(content="t1", turn="t1"),
    ]


# --------------------------------------------------------------------------- the tool journal


def journal_entry(seq: int, tool: str = "refund", **arguments: Any) -> JournalEntry:
    return JournalEntry(seq=seq, call=f"call_{seq}", tool=tool, arguments=arguments or {"order": seq})


async def test_journal_holds_started_and_finished_calls_in_order(store: Store) -> None:
    await new_session(store)
    await store.begin_turn("s1", "t1", UserMessage(content="refund it"), 1001.0)
    await store.journal_start("s1", "t1", journal_entry(1, nested={"a": [1, 2.5, None]}))
    await store.journal_start("s1", "t1", journal_entry(2))
    await store.journal_finish("s1", "t1", 1, content="refunded ✓", is_error=True)
    first, second = await store.journal_entries("s1", "t1")
    assert first == JournalEntry(
        seq=1, call="call_1", tool="refund", arguments={"nested": {"a": [1, 2.5, None]}},
        finished=True, content="refunded ✓", is_error=True,
    )  # fmt: skip
    assert second == journal_entry(2) and not second.finished
    assert await store.journal_entries("s1", "other") == []


async def test_journal_refuses_what_would_break_at_most_once(store: Store) -> None:
    await new_session(store)
    with pytest.raises(StoreError, match="no such turn"):
        await store.journal_start("s1", "t1", journal_entry(1))
    await store.begin_turn("s1", "t1", UserMessage(content="go"), 1001.0)
    await store.journal_start("s1", "t1", journal_entry(1))
    with pytest.raises(StoreError, match="journaled already"):
        await store.journal_start("s1", "t1", journal_entry(1))
    with pytest.raises(StoreError, match="no such call is waiting"):
        await store.journal_finish("s1", "t1", 2, content="", is_error=False)
    await store.journal_finish("s1", "t1", 1, content="done", is_error=False)
    with pytest.raises(StoreError, match="no such call is waiting"):  # a result is written once
        await store.journal_finish("s1", "t1", 1, content="again", is_error=False)
    assert [e.content for e in await store.journal_entries("s1", "t1")] == ["done"]


@pytest.mark.parametrize("ending", ["commit", "abandon"])
async def test_journal_is_pruned_by_the_transaction_that_ends_the_turn(store: Store, ending: str) -> None:
    await new_session(store)
    await store.begin_turn("s1", "t1", UserMessage(content="go"), 1001.0)
    await store.journal_start("s1", "t1", journal_entry(1))
    await store.journal_finish("s1", "t1", 1, content="done", is_error=False)
    if ending == "commit":
        await commit(store, "s1", "t1", [reply("t1", "done")])
    else:
        await store.abandon_turn("s1", "t1", status="cancelled", error="closed", ended_at=1002.0)
    assert await store.journal_entries("s1", "t1") == []
    with pytest.raises(StoreError, match="not pending"):  # a late write for an ended turn is refused
        await store.journal_start("s1", "t1", journal_entry(2))


async def test_a_failed_commit_keeps_the_journal(store: Store, db_path: Path) -> None:
    await new_session(store)
    await store.begin_turn("s1", "t1", UserMessage(content="go"), 1001.0)
    await store.journal_start("s1", "t1", journal_entry(1))
    with pytest.raises(StoreError):  # not a transcript message: the whole commit is undone
        await commit(store, "s1", "t1", ["not a message"])  # type: ignore[list-item]
    assert len(await store.journal_entries("s1", "t1")) == 1


async def test_journal_survives_reopening(db_path: Path) -> None:
    first = await SqliteStore.open(db_path)
    await new_session(first)
    await first.begin_turn("s1", "t1", UserMessage(content="go"), 1001.0)
    await first.journal_start("s1", "t1", journal_entry(1))
    await first.close()
    again = await SqliteStore.open(db_path)
    try:
        assert await again.journal_entries("s1", "t1") == [journal_entry(1)]
    finally:
        await again.close()


async def test_a_sqlite_file_that_claims_a_schema_without_its_tables_is_refused(db_path: Path) -> None:
    conn = sqlite3.connect(db_path)
    conn.execute(f"PRAGMA user_version = {migrations.SCHEMA_VERSION}")
    conn.execute("CREATE TABLE other (x)")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match=r"cannot open the store .*: it says schema version \d+ but has no table"):
        await SqliteStore.open(db_path)


async def test_a_cancel_request_is_kept_on_the_pending_turn_only(store: Store) -> None:
    await new_session(store)
    await store.begin_turn("s1", "t1", UserMessage(content="go"), 1001.0)
    started = await store.pending_turn("s1")
    assert started is not None and started.cancel_requested is False
    assert await store.request_cancel("s1", "t1") is True
    started = await store.pending_turn("s1")
    assert started is not None and started.cancel_requested is True
    [(_, interrupted)] = await store.interrupted_turns()
    assert interrupted.cancel_requested is True
    await store.abandon_turn("s1", "t1", status="cancelled", error="cancelled", ended_at=1002.0)
    assert await store.request_cancel("s1", "t1") is False  # not pending any more


# --------------------------------------------------------------------------- filters and the reload history


async def test_sessions_are_filtered_by_state_and_assistant_and_paged_within_the_filter(store: Store) -> None:
    for index, assistant in enumerate(["triage", "billing", "triage", "triage"]):
        await store.create_session(
            f"s{index}", assistant=assistant, generation=1, model="m", created_at=float(index), transcript=[]
        )
    await store.begin_turn("s2", "t1", UserMessage(content="hi"), started_at=5.0)
    await store.update_session("s3", state="failed")

    assert [s.id for s in await store.list_sessions(assistant="triage")] == ["s0", "s2", "s3"]
    assert [s.id for s in await store.list_sessions(state="running")] == ["s2"]
    assert [s.id for s in await store.list_sessions(state="idle")] == ["s0", "s1"]
    assert [s.id for s in await store.list_sessions(state="idle", assistant="triage")] == ["s0"]
    assert [s.id for s in await store.list_sessions(assistant="triage", limit=1, after="s0")] == ["s2"]
    assert await store.list_sessions(assistant="nobody") == []
    with pytest.raises(StoreError, match="unknown state 'asleep'"):
        await store.list_sessions(state="asleep")


async def test_the_reload_history_is_newest_first_and_bounded(store: Store, backend: Backend) -> None:
    assert await store.reloads(10) == []
    applied = ReloadRow(
        generation=2, at=10.5, applied=True, changed=("assistants[0].intelligence.model",), swapped_total=3, replica="a"
    )
    refused = ReloadRow(generation=2, at=11.0, applied=False, errors=(("limits.max_steps", "must be > 0"),))
    await store.record_reload(applied, keep=3)
    await store.record_reload(refused, keep=3)
    assert await store.reloads(10) == [refused, applied]
    assert await store.reloads(1) == [refused]
    for generation in range(3, 7):
        await store.record_reload(ReloadRow(generation=generation, at=20.0 + generation, applied=True), keep=3)
    assert [r.generation for r in await store.reloads(10)] == [6, 5, 4]
    assert backend.raw("SELECT COUNT(*) FROM reloads") == [(3,)]
    with pytest.raises(StoreError, match="keep must be at least 1"):
        await store.record_reload(applied, keep=0)
