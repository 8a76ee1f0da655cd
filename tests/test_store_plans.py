"""How SQLite runs the statements of a turn's life: by index, planned once.

SQLite keeps no statistics, so its planner picks an index from the statement alone; PostgreSQL
plans from statistics and is not covered here. Every statement a turn's ``begin_turn``,
``park_turn`` and ``commit_turn`` run (recorded from the real store, as SQLite receives them) must:

- reach each table through an index on the session (never ``SCAN`` a table, never search every
  pending approval: the statement ending a turn cancels that turn's approvals only);
- compare a status column to a literal, not a bound parameter: SQLite can use a partial index
  (``turns_one_pending``, ``WHERE status = 'pending'``) for a bound value only by re-preparing the
  statement each time it runs, which made the pending check of every ``begin_turn`` ten times
  slower.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentd.approvals import ApprovalRequest, ParkedRun
from agentd.budget import TurnStatus, Usage
from agentd.messages import AssistantMessage, UserMessage
from agentd.records import ModelSpend, TurnRecord
from agentd.store import SqliteStore, sqlite
from agentd.store.dialect import CLOCK, SQLITE
from agentd.store.sansio import Kind, Op, Query

pytestmark = pytest.mark.anyio

#: ``status`` (any table's, any alias) compared to a bound parameter.
BOUND_STATUS = re.compile(r"\bstatus\s*(=|<>|!=|IN)\s*\(?\s*:", re.IGNORECASE)
#: Where a statement's conditions start (an UPDATE's SET assigns a status: that is no comparison).
CONDITIONS = re.compile(r"\b(WHERE|ON)\b", re.IGNORECASE)


def binds_a_status(sql: str) -> bool:
    """Whether ``sql`` compares a status column to a bound parameter in its conditions."""
    found = CONDITIONS.search(sql)
    return found is not None and BOUND_STATUS.search(sql, found.start()) is not None


def recorded(op: Op[Any], seen: list[Query]) -> Op[Any]:
    """``op``, with every query it yields appended to ``seen``."""
    reply: Any = None
    while True:
        try:
            query = op.send(reply)
        except StopIteration as stop:
            return stop.value
        if query.kind is Kind.MANY:  # its parameter sets are read once: keep them for the plan
            query = query._replace(each=list(query.each))
        seen.append(query)
        reply = yield query


async def turn_statements(path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Query]:
    """Every query of a turn's begin, park and commit, on a store that holds other sessions' pending approvals."""
    store = await SqliteStore.open(path)
    try:
        for session in ("other", "s1"):
            await store.create_session(session, assistant="triage", generation=1, model="m1", created_at=1.0)
        await store.begin_turn("other", "t0", UserMessage(content="hi", turn="t0"), 2.0)
        calls = [(f"ap_{i}", ApprovalRequest(call_id=f"c{i}", tool="refund", arguments={})) for i in range(3)]
        run = ParkedRun(messages=[], calls=tuple(request.call_id for _, request in calls))
        await store.park_turn("other", "t0", run, calls, expires_at=None)
        seen: list[Query] = []
        real_drive = sqlite.drive
        monkeypatch.setattr(sqlite, "drive", lambda conn, op: real_drive(conn, recorded(op, seen)))
        await store.begin_turn("s1", "t1", UserMessage(content="ping", turn="t1"), 4.0, durable=False)
        await store.park_turn(
            "s1", "t1", run, [(f"ap_s1_{i}", request) for i, (_, request) in enumerate(calls)], expires_at=None
        )
        spent = Usage(3, 4, requests=1)
        turn = TurnRecord(
            id="t1",
            status=TurnStatus.COMPLETED,
            usage=spent,
            started_at=4.0,
            ended_at=5.0,
            by_model=(ModelSpend(assistant="triage", model="m1", usage=spent),),
        )
        await store.commit_turn("s1", turn, assistant="triage", messages=[AssistantMessage(content="pong", turn="t1")])
        return seen
    finally:
        await store.close()


def plans(path: Path, queries: list[Query]) -> Iterator[tuple[str, list[str]]]:
    """Each query's SQL (as SQLite runs it) and the steps of its plan."""
    conn = sqlite3.connect(path)
    try:
        for query in queries:
            rendered = SQLITE.render(query.sql)
            params = dict(next(iter(query.each))) if query.kind is Kind.MANY else dict(query.params)
            if rendered.clock:
                params[CLOCK] = 0.0
            yield rendered.sql, [row[-1] for row in conn.execute(f"EXPLAIN QUERY PLAN {rendered.sql}", params)]
    finally:
        conn.close()


async def test_a_turns_statements_search_by_index_and_bind_no_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "agentd.db"
    queries = await turn_statements(path, monkeypatch)
    assert len(queries) >= 15  # the pending check, the entries, the turn row, the spend, the approvals...
    assert any("approvals" in query.sql for query in queries)
    assert not [query.sql for query in queries if binds_a_status(query.sql)]
    for sql, steps in plans(path, queries):
        scans = [step for step in steps if step.startswith("SCAN") and "CONSTANT ROW" not in step]
        assert not scans, f"{sql}: {steps}"
        by_status_only = [step for step in steps if "approvals_status" in step or "approvals_expiry" in step]
        assert not by_status_only, f"{sql}: {steps}"


def test_the_status_check_finds_a_bound_status() -> None:
    assert binds_a_status("SELECT id FROM turns WHERE session = :session AND status = :pending")
    assert binds_a_status("UPDATE approvals SET reason = :r WHERE t.status <> :done")
    assert binds_a_status("SELECT 1 FROM sessions s JOIN turns t ON t.session = s.id AND t.status = :pending")
    assert not binds_a_status("SELECT id FROM turns WHERE session = :session AND status = 'pending'")
    assert not binds_a_status("UPDATE turns SET status = :status WHERE n = :n")
