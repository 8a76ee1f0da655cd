"""The store's schema, as versioned migrations for each backend (RFC 0009 §2).

A schema version means the same tables on both backends; each backend has one migration per
version, a tuple of SQL statements that brings a database from the previous version to it. A
store runs the missing ones when it opens, each in one transaction together with the new version
number, so a migration that fails leaves the database at the version before it. A database at a
version newer than ``SCHEMA_VERSION`` (written by a newer agentd) is refused.

Where the version is kept: SQLite ``PRAGMA user_version``; PostgreSQL the table
``agentd_schema`` (one row per migration applied, with when), read and written under an advisory
lock so that replicas starting together migrate once.

Versions:

1. sessions, entries (the transcripts, append-only) and turns; at most one pending turn per
   session, enforced by the database.
2. ``sessions_state``: the status counts and the per-assistant counts of a reload read an index,
   not the table. Sessions are paged in creation order (SQLite: the rowid; PostgreSQL: the
   identity column ``n``).
3. Leases (RFC 0009 §3): ``owner`` (the replica id, NULL when nobody holds the session),
   ``lease_expires`` (epoch seconds) and ``fence`` (the fencing token of the latest claim, 0 before
   the first), and an index to renew a replica's leases.
4. The tool journal (RFC 0008 §5): ``journal``, the side-effecting calls of pending turns — a row
   written before the call runs (``finished_at`` NULL), completed with its result when it
   returns, deleted by the transaction that ends the turn.
5. The replica registry (RFC 0009 §7): ``replicas``, one row per replica that ever ran on the
   database — its id, config generation, how many sessions it owns, and when it last beat
   (``seen_at``, epoch seconds by the store's clock). Rows of replicas that stopped beating are
   kept and ignored by readers.
6. ``turns.cancel_requested``: a cancel asked for on a replica that does not run the turn, kept
   so that the replica that runs it next — its holder, or the one that adopts it after a failover
   — ends it ``cancelled`` instead of running it (RFC 0009 §7).
7. ``watches``: the sessions each replica has event subscribers for, until when (epoch seconds
   by the store's clock), so that the replica that claims a session to run its turn knows at once
   where to relay the turn's events (RFC 0009 §7). Rows are hints: a replica that stops
   refreshing its rows is ignored once they expire, and expired rows are deleted by heartbeats.
8. ``idempotency``: the ``Idempotency-Key`` of each creating POST (RFC 0010 §2), per scope (the
   credential and the route) — the request's fingerprint, the process answering it (``owner``,
   NULL once none is), the session and turn ids chosen for it before anything was created, and
   its answer once given; until ``expires_at`` (epoch seconds by the store's clock), after which
   claims delete it. ``turns_id``: a turn is found by its id alone (the OpenAI-compatible routes
   name a response by its turn).
9. ``reloads``: the reload history (RFC 0000 §6, ``GET /v1/reloads``), one row per reload a
   replica ran — the generation it left running, when, applied or not, its errors and changed
   paths (JSON lists), how many sessions it swapped, which replica. Bounded: each insert deletes
   the rows older than the newest 1000 (``n``, the insertion order).
10. Usage and cost (RFC 0011 §2): ``turns.spend``, a committed turn's whole usage, cost and
   per-model spend (msgspec JSON; ``{}`` on turns committed before), and ``turn_spend``, one row
   per ended turn, assistant and model — its token counts and the price that applied (NULL:
   unpriced) — that ``GET /v1/usage`` sums in the database, by when the turn ended. And
   ``turns.trace``: the W3C trace context of the request that began a turn (JSON; NULL without
   one), so the replica that runs or adopts it continues the client's trace (RFC 0011 §4).
11. Approvals (RFC 0012 §4): ``approvals``, one row per tool call a human decides on (its status
    changes once, from ``pending``), and ``parked_turns``, the run of a pending turn that stopped
    for them (JSON), deleted by the transaction that ends the turn.
12. ``approvals_turn`` also holds ``status``: the transaction that ends a turn cancels the turn's
    pending approvals by session, turn and status, and with the narrower index SQLite's planner
    (which keeps no statistics) searched every pending approval of every session instead. SQLite
    drops ``turn_spend_by_session``: a page of the usage by session reads the primary key (session
    first) as fast, and every commit wrote the index.
"""

from __future__ import annotations

__all__ = ["POSTGRES", "SCHEMA_VERSION", "SQLITE"]

_PRICE = "currency, input_price, output_price, cached_input_price"
_COVERED = "input_tokens, output_tokens, cached_input_tokens, reasoning_tokens, requests, unreported, ended_at"

#: The schema version this code writes.
SCHEMA_VERSION = 12

#: version -> the SQLite statements that bring a database at version-1 to it.
SQLITE: dict[int, tuple[str, ...]] = {
    1: (
        """
        CREATE TABLE sessions (
            id          TEXT PRIMARY KEY,
            assistant   TEXT NOT NULL,
            state       TEXT NOT NULL CHECK (state IN ('idle', 'running', 'failed', 'closed')),
            generation  INTEGER NOT NULL,
            model       TEXT NOT NULL,
            created_at  REAL NOT NULL,
            updated_at  REAL NOT NULL
        )
        """,
        """
        CREATE TABLE entries (
            session  TEXT NOT NULL REFERENCES sessions (id),
            seq      INTEGER NOT NULL CHECK (seq > 0),
            turn     TEXT,
            active   INTEGER NOT NULL CHECK (active IN (0, 1)),
            message  TEXT NOT NULL,
            PRIMARY KEY (session, seq)
        )
        """,
        "CREATE INDEX entries_active ON entries (session, seq) WHERE active = 1",
        """
        CREATE TABLE turns (
            n              INTEGER PRIMARY KEY,
            session        TEXT NOT NULL REFERENCES sessions (id),
            id             TEXT NOT NULL,
            status         TEXT NOT NULL,
            message_seq    INTEGER,
            models         TEXT NOT NULL DEFAULT '[]',
            steps          INTEGER NOT NULL DEFAULT 0,
            restarts       INTEGER NOT NULL DEFAULT 0,
            discarded      TEXT NOT NULL DEFAULT '[]',
            input_tokens   INTEGER NOT NULL DEFAULT 0,
            output_tokens  INTEGER NOT NULL DEFAULT 0,
            started_at     REAL NOT NULL,
            ended_at       REAL,
            error          TEXT,
            UNIQUE (session, id),
            FOREIGN KEY (session, message_seq) REFERENCES entries (session, seq)
        )
        """,
        "CREATE UNIQUE INDEX turns_one_pending ON turns (session) WHERE status = 'pending'",
    ),
    2: ("CREATE INDEX sessions_state ON sessions (state, assistant)",),
    3: (
        "ALTER TABLE sessions ADD COLUMN owner TEXT",
        "ALTER TABLE sessions ADD COLUMN lease_expires REAL",
        "ALTER TABLE sessions ADD COLUMN fence INTEGER NOT NULL DEFAULT 0",
        "CREATE INDEX sessions_owner ON sessions (owner) WHERE owner IS NOT NULL",
    ),
    4: (
        """
        CREATE TABLE journal (
            session      TEXT NOT NULL,
            turn         TEXT NOT NULL,
            seq          INTEGER NOT NULL CHECK (seq > 0),
            call         TEXT NOT NULL,
            tool         TEXT NOT NULL,
            arguments    TEXT NOT NULL,
            started_at   REAL NOT NULL,
            finished_at  REAL,
            content      TEXT,
            is_error     INTEGER NOT NULL DEFAULT 0 CHECK (is_error IN (0, 1)),
            PRIMARY KEY (session, turn, seq),
            FOREIGN KEY (session, turn) REFERENCES turns (session, id)
        )
        """,
    ),
    5: (
        """
        CREATE TABLE replicas (
            id          TEXT PRIMARY KEY,
            generation  INTEGER NOT NULL,
            sessions    INTEGER NOT NULL DEFAULT 0,
            seen_at     REAL NOT NULL
        )
        """,
    ),
    6: ("ALTER TABLE turns ADD COLUMN cancel_requested INTEGER NOT NULL DEFAULT 0",),
    7: (
        """
        CREATE TABLE watches (
            session  TEXT NOT NULL,
            replica  TEXT NOT NULL,
            until    REAL NOT NULL,
            PRIMARY KEY (session, replica)
        )
        """,
    ),
    8: (
        """
        CREATE TABLE idempotency (
            scope        TEXT NOT NULL,
            key          TEXT NOT NULL,
            fingerprint  TEXT NOT NULL,
            owner        TEXT,
            session      TEXT,
            turn         TEXT,
            status       INTEGER,
            answer       TEXT,
            headers      TEXT NOT NULL DEFAULT '{}',
            created_at   REAL NOT NULL,
            expires_at   REAL NOT NULL,
            PRIMARY KEY (scope, key)
        )
        """,
        "CREATE INDEX idempotency_expires ON idempotency (expires_at)",
        "CREATE INDEX turns_id ON turns (id)",
    ),
    9: (
        """
        CREATE TABLE reloads (
            n              INTEGER PRIMARY KEY,
            generation     INTEGER NOT NULL,
            at             REAL NOT NULL,
            applied        INTEGER NOT NULL CHECK (applied IN (0, 1)),
            errors         TEXT NOT NULL DEFAULT '[]',
            changed        TEXT NOT NULL DEFAULT '[]',
            swapped_total  INTEGER NOT NULL DEFAULT 0,
            replica        TEXT NOT NULL DEFAULT ''
        )
        """,
    ),
    10: (
        "ALTER TABLE turns ADD COLUMN spend TEXT NOT NULL DEFAULT '{}'",
        "ALTER TABLE turns ADD COLUMN trace TEXT",
        """
        CREATE TABLE turn_spend (
            session              TEXT NOT NULL,
            turn                 TEXT NOT NULL,
            assistant            TEXT NOT NULL,
            model                TEXT NOT NULL,
            ended_at             REAL NOT NULL,
            input_tokens         INTEGER NOT NULL,
            output_tokens        INTEGER NOT NULL,
            cached_input_tokens  INTEGER NOT NULL,
            reasoning_tokens     INTEGER NOT NULL,
            requests             INTEGER NOT NULL,
            unreported           INTEGER NOT NULL,
            currency             TEXT,
            input_price          TEXT,
            output_price         TEXT,
            cached_input_price   TEXT,
            PRIMARY KEY (session, turn, assistant, model)
        )
        """,
        "CREATE INDEX turn_spend_ended ON turn_spend (ended_at)",
        # SQLite sums a GROUP BY by sorting unless an index gives the order: covering indexes in
        # each grouping's order (ended_at included, for a time range) let GET /v1/usage read one
        # index in order, never the table (RFC 0011 §2; bench/usage.py has the figures).
        f"CREATE INDEX turn_spend_by_model ON turn_spend (model, {_PRICE}, {_COVERED})",
        f"CREATE INDEX turn_spend_by_assistant ON turn_spend (assistant, model, {_PRICE}, {_COVERED})",
        f"CREATE INDEX turn_spend_by_session ON turn_spend (session, model, {_PRICE}, {_COVERED})",
    ),
    11: (
        """
        CREATE TABLE approvals (
            n             INTEGER PRIMARY KEY,
            id            TEXT NOT NULL UNIQUE,
            session       TEXT NOT NULL,
            turn          TEXT NOT NULL,
            call_id       TEXT NOT NULL,
            tool          TEXT NOT NULL,
            arguments     TEXT NOT NULL,
            parameters    TEXT NOT NULL DEFAULT '{}',
            status        TEXT NOT NULL
                          CHECK (status IN ('pending', 'approved', 'rejected', 'expired', 'cancelled')),
            reason        TEXT,
            requested_at  REAL NOT NULL,
            decided_at    REAL,
            expires_at    REAL,
            FOREIGN KEY (session, turn) REFERENCES turns (session, id)
        )
        """,
        "CREATE INDEX approvals_turn ON approvals (session, turn)",
        "CREATE INDEX approvals_status ON approvals (status, n)",
        "CREATE INDEX approvals_expiry ON approvals (expires_at) WHERE status = 'pending'",
        """
        CREATE TABLE parked_turns (
            session    TEXT NOT NULL,
            turn       TEXT NOT NULL,
            run        TEXT NOT NULL,
            model      TEXT NOT NULL,
            parked_at  REAL NOT NULL,
            PRIMARY KEY (session, turn),
            FOREIGN KEY (session, turn) REFERENCES turns (session, id)
        )
        """,
    ),
    12: (
        "DROP INDEX approvals_turn",
        "CREATE INDEX approvals_turn ON approvals (session, turn, status)",
        "DROP INDEX turn_spend_by_session",
    ),
}


#: version -> the PostgreSQL statements that bring a database at version-1 to it.
POSTGRES: dict[int, tuple[str, ...]] = {
    1: (
        """
        CREATE TABLE sessions (
            id          TEXT PRIMARY KEY,
            n           BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
            assistant   TEXT NOT NULL,
            state       TEXT NOT NULL CHECK (state IN ('idle', 'running', 'failed', 'closed')),
            generation  BIGINT NOT NULL,
            model       TEXT NOT NULL,
            created_at  DOUBLE PRECISION NOT NULL,
            updated_at  DOUBLE PRECISION NOT NULL
        )
        """,
        """
        CREATE TABLE entries (
            session  TEXT NOT NULL REFERENCES sessions (id),
            seq      BIGINT NOT NULL CHECK (seq > 0),
            turn     TEXT,
            active   BOOLEAN NOT NULL,
            message  TEXT NOT NULL,
            PRIMARY KEY (session, seq)
        )
        """,
        "CREATE INDEX entries_active ON entries (session, seq) WHERE active",
        """
        CREATE TABLE turns (
            n              BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            session        TEXT NOT NULL REFERENCES sessions (id),
            id             TEXT NOT NULL,
            status         TEXT NOT NULL,
            message_seq    BIGINT,
            models         TEXT NOT NULL DEFAULT '[]',
            steps          BIGINT NOT NULL DEFAULT 0,
            restarts       BIGINT NOT NULL DEFAULT 0,
            discarded      TEXT NOT NULL DEFAULT '[]',
            input_tokens   BIGINT NOT NULL DEFAULT 0,
            output_tokens  BIGINT NOT NULL DEFAULT 0,
            started_at     DOUBLE PRECISION NOT NULL,
            ended_at       DOUBLE PRECISION,
            error          TEXT,
            UNIQUE (session, id),
            FOREIGN KEY (session, message_seq) REFERENCES entries (session, seq)
        )
        """,
        "CREATE UNIQUE INDEX turns_one_pending ON turns (session) WHERE status = 'pending'",
    ),
    2: ("CREATE INDEX sessions_state ON sessions (state, assistant)",),
    3: (
        "ALTER TABLE sessions ADD COLUMN owner TEXT",
        "ALTER TABLE sessions ADD COLUMN lease_expires DOUBLE PRECISION",
        "ALTER TABLE sessions ADD COLUMN fence BIGINT NOT NULL DEFAULT 0",
        "CREATE INDEX sessions_owner ON sessions (owner) WHERE owner IS NOT NULL",
    ),
    4: (
        """
        CREATE TABLE journal (
            session      TEXT NOT NULL,
            turn         TEXT NOT NULL,
            seq          BIGINT NOT NULL CHECK (seq > 0),
            call         TEXT NOT NULL,
            tool         TEXT NOT NULL,
            arguments    TEXT NOT NULL,
            started_at   DOUBLE PRECISION NOT NULL,
            finished_at  DOUBLE PRECISION,
            content      TEXT,
            is_error     BOOLEAN NOT NULL DEFAULT FALSE,
            PRIMARY KEY (session, turn, seq),
            FOREIGN KEY (session, turn) REFERENCES turns (session, id)
        )
        """,
    ),
    5: (
        """
        CREATE TABLE replicas (
            id          TEXT PRIMARY KEY,
            generation  BIGINT NOT NULL,
            sessions    BIGINT NOT NULL DEFAULT 0,
            seen_at     DOUBLE PRECISION NOT NULL
        )
        """,
    ),
    6: ("ALTER TABLE turns ADD COLUMN cancel_requested BOOLEAN NOT NULL DEFAULT FALSE",),
    7: (
        """
        CREATE TABLE watches (
            session  TEXT NOT NULL,
            replica  TEXT NOT NULL,
            until    DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (session, replica)
        )
        """,
    ),
    8: (
        """
        CREATE TABLE idempotency (
            scope        TEXT NOT NULL,
            key          TEXT NOT NULL,
            fingerprint  TEXT NOT NULL,
            owner        TEXT,
            session      TEXT,
            turn         TEXT,
            status       BIGINT,
            answer       TEXT,
            headers      TEXT NOT NULL DEFAULT '{}',
            created_at   DOUBLE PRECISION NOT NULL,
            expires_at   DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (scope, key)
        )
        """,
        "CREATE INDEX idempotency_expires ON idempotency (expires_at)",
        "CREATE INDEX turns_id ON turns (id)",
    ),
    9: (
        """
        CREATE TABLE reloads (
            n              BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            generation     BIGINT NOT NULL,
            at             DOUBLE PRECISION NOT NULL,
            applied        BOOLEAN NOT NULL,
            errors         TEXT NOT NULL DEFAULT '[]',
            changed        TEXT NOT NULL DEFAULT '[]',
            swapped_total  BIGINT NOT NULL DEFAULT 0,
            replica        TEXT NOT NULL DEFAULT ''
        )
        """,
    ),
    10: (
        "ALTER TABLE turns ADD COLUMN spend TEXT NOT NULL DEFAULT '{}'",
        "ALTER TABLE turns ADD COLUMN trace TEXT",
        """
        CREATE TABLE turn_spend (
            session              TEXT NOT NULL,
            turn                 TEXT NOT NULL,
            assistant            TEXT NOT NULL,
            model                TEXT NOT NULL,
            ended_at             DOUBLE PRECISION NOT NULL,
            input_tokens         BIGINT NOT NULL,
            output_tokens        BIGINT NOT NULL,
            cached_input_tokens  BIGINT NOT NULL,
            reasoning_tokens     BIGINT NOT NULL,
            requests             BIGINT NOT NULL,
            unreported           BIGINT NOT NULL,
            currency             TEXT,
            input_price          TEXT,
            output_price         TEXT,
            cached_input_price   TEXT,
            PRIMARY KEY (session, turn, assistant, model)
        )
        """,
        "CREATE INDEX turn_spend_ended ON turn_spend (ended_at)",
    ),
    11: (
        """
        CREATE TABLE approvals (
            n             BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            id            TEXT NOT NULL UNIQUE,
            session       TEXT NOT NULL,
            turn          TEXT NOT NULL,
            call_id       TEXT NOT NULL,
            tool          TEXT NOT NULL,
            arguments     TEXT NOT NULL,
            parameters    TEXT NOT NULL DEFAULT '{}',
            status        TEXT NOT NULL
                          CHECK (status IN ('pending', 'approved', 'rejected', 'expired', 'cancelled')),
            reason        TEXT,
            requested_at  DOUBLE PRECISION NOT NULL,
            decided_at    DOUBLE PRECISION,
            expires_at    DOUBLE PRECISION,
            FOREIGN KEY (session, turn) REFERENCES turns (session, id)
        )
        """,
        "CREATE INDEX approvals_turn ON approvals (session, turn)",
        "CREATE INDEX approvals_status ON approvals (status, n)",
        "CREATE INDEX approvals_expiry ON approvals (expires_at) WHERE status = 'pending'",
        """
        CREATE TABLE parked_turns (
            session    TEXT NOT NULL,
            turn       TEXT NOT NULL,
            run        TEXT NOT NULL,
            model      TEXT NOT NULL,
            parked_at  DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (session, turn),
            FOREIGN KEY (session, turn) REFERENCES turns (session, id)
        )
        """,
    ),
    12: (
        "DROP INDEX approvals_turn",
        "CREATE INDEX approvals_turn ON approvals (session, turn, status)",
    ),
}
