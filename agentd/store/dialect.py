"""What the store's SQL looks like on each backend: the queries are written once, in one form, and rendered.

``agentd.store.operations`` writes every statement once, in a neutral form that each backend's
``Dialect`` renders (once per distinct statement: the rendering is cached):

- parameters are named, ``:name``, bound from a dict (SQLite's own named style; PostgreSQL's
  ``%(name)s``). A ``::type`` cast is PostgreSQL's and is left alone;
- ``{now}`` is the lease clock in epoch seconds (RFC 0009 §3): the database server's on
  PostgreSQL, so that replicas' clocks need not agree; this machine's on SQLite, bound as the
  parameter ``CLOCK`` (the driver reads ``time.time()`` once per call, so one call sees one time);
- ``{lock}`` ends a ``SELECT`` of a session's row that a write goes on to change: PostgreSQL
  locks the row (``FOR UPDATE``: the writes of one session queue there, and a fenced write's
  check holds until its commit); SQLite needs nothing, its one writer holds the database's lock;
- ``{skip_locked}`` ends the failover scan's ``SELECT`` of orphaned sessions (alias ``s``): on
  PostgreSQL rows another replica's scan holds are skipped, not waited for (the job-queue pattern);
- ``{true}``/``{false}``: a boolean column's values (SQLite stores 1 and 0, which its partial
  indexes name);
- ``{order}``: the column that pages sessions in creation order (SQLite's ``rowid``,
  PostgreSQL's identity column ``n``);
- ``{words(}`` … ``{)words}`` around a one-column ``SELECT … AS value … ORDER BY``: its values
  joined by single spaces, in that order (NULL or '' when there are none). For lists of
  replica ids, which have no white space (``codec.REPLICA_ID``).

What a backend has and the other has not is a statement of its own, or None: ``relaxed_commit``
(a write that need not be synced by itself, ``begin_turn(durable=False)``; on SQLite that is the
group commit's business), ``orphan_notice`` (a release that leaves a pending turn behind wakes
the other replicas' failover scans; SQLite has no other replica). ``text`` makes free text
storable (PostgreSQL refuses the NUL character).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Final, overload

__all__ = ["CLOCK", "POSTGRES", "SQLITE", "Dialect", "Rendered"]

#: The parameter that carries the lease clock where the database has none of its own (SQLite).
CLOCK: Final = "store_clock"

_PLACEHOLDER = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


class Rendered:
    """A statement as one backend runs it, and whether it needs the ``CLOCK`` parameter bound."""

    __slots__ = ("clock", "sql")

    def __init__(self, sql: str, clock: bool) -> None:
        self.sql = sql
        self.clock = clock


class Dialect:
    """How one backend spells the neutral SQL of ``agentd.store.operations`` (see the module's doc)."""

    def __init__(
        self,
        name: str,
        *,
        markers: dict[str, str],
        named: Callable[[str], str] | None,
        relaxed_commit: str | None,
        orphan_notice: str | None,
        text: Callable[[str], str],
    ) -> None:
        self.name = name
        self._markers = markers
        self._named = named
        self._cache: dict[str, Rendered] = {}
        #: The statement that lets one write's commit return before it is synced, or None.
        self.relaxed_commit = relaxed_commit
        #: The statement (neutral form: ``:channel``, ``:session``) that notifies the
        #: pending turn of a released session, or None where nobody else listens.
        self.orphan_notice = orphan_notice
        self._text = text

    def render(self, sql: str) -> Rendered:
        """``sql`` (neutral form) as this backend runs it; computed once per distinct statement."""
        rendered = self._cache.get(sql)
        if rendered is None:
            out = sql if self._named is None else self._named(sql)  # before the markers: {now} has a ::cast
            for marker, spelled in self._markers.items():
                out = out.replace(marker, spelled)
            if "{" in out:  # a marker this dialect does not know: a bug, found by the first test that runs it
                raise ValueError(f"unrendered marker in {out!r}")
            rendered = self._cache[sql] = Rendered(out, f":{CLOCK}" in out)
        return rendered

    @overload
    def text(self, value: str) -> str: ...
    @overload
    def text(self, value: None) -> None: ...
    def text(self, value: str | None) -> str | None:
        """Free text (an error, a tool's output) as this backend can store it."""
        return None if value is None else self._text(value)


def _percent_named(sql: str) -> str:
    """``:name`` → ``%(name)s`` (psycopg's named style), with any literal ``%`` doubled first."""
    return _PLACEHOLDER.sub(r"%(\1)s", sql.replace("%", "%%"))


SQLITE: Final = Dialect(
    "sqlite",
    markers={
        "{now}": f":{CLOCK}",
        "{lock}": "",
        "{skip_locked}": "",
        "{true}": "1",
        "{false}": "0",
        "{order}": "rowid",
        # SQLite keeps the order of an ORDER BY subquery under an aggregate (it is not flattened).
        "{words(}": "(SELECT group_concat(value, ' ') FROM (",
        "{)words}": "))",
    },
    named=None,  # SQLite binds :name itself
    relaxed_commit=None,
    orphan_notice=None,
    text=lambda value: value,
)

POSTGRES: Final = Dialect(
    "postgres",
    markers={
        "{now}": "extract(epoch FROM clock_timestamp())::float8",
        "{lock}": " FOR UPDATE",
        "{skip_locked}": " FOR UPDATE OF s SKIP LOCKED",
        "{true}": "TRUE",
        "{false}": "FALSE",
        "{order}": "n",
        "{words(}": "array_to_string(ARRAY(",  # ARRAY(subquery) keeps the subquery's order
        "{)words}": "), ' ')",
    },
    named=_percent_named,
    # The turn's own commit flushes the WAL, and this record with it.
    relaxed_commit="SET LOCAL synchronous_commit = off",
    orphan_notice="SELECT pg_notify(:channel, session) FROM turns WHERE session = :session AND status = 'pending'",
    # PostgreSQL refuses the NUL character in TEXT, which a model's error can hold.
    text=lambda value: value.replace("\x00", "\ufffd"),
)
