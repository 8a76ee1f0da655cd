"""The event vocabulary: the one definition of every event name agentd emits.

Two families share the ``component.action`` style: session events streamed to clients (SSE
``event:`` names, carried from child to supervisor in ``Event`` frames) and log events (structlog
``event`` field). Code refers to these constants, never to string literals.
"""

from __future__ import annotations

from typing import Final

# --- session events (SSE; RFC 0000 §7) ----------------------------------------------------------
TURN_STARTED: Final = "turn.started"
STEP_DONE: Final = "step.done"
TOOL_CALL: Final = "tool.call"
TOOL_RESULT: Final = "tool.result"
TRANSFER: Final = "transfer"
SWAP_PARKED: Final = "swap.parked"
SWAP_APPLIED: Final = "swap.applied"
TURN_RESTARTED: Final = "turn.restarted"
TURN_DONE: Final = "turn.done"
SESSION_FAILED: Final = "session.failed"
# A tool call waits for a human's approval (RFC 0012 §6) ...
APPROVAL_REQUESTED: Final = "approval.requested"
# ... and was decided: approved, rejected, expired or cancelled.
APPROVAL_DECIDED: Final = "approval.decided"
# Emitted when a model call begins; lets clients (and tests) know a step is in flight.
STEP_STARTED: Final = "step.started"
# Every endpoint of the session's intelligence is down: the turn waits (readiness turns 503) ...
INTEL_WAITING: Final = "intel.waiting"
# ... until a model call succeeds again.
INTEL_RECOVERED: Final = "intel.recovered"
# A step's text as the model writes it (coalesced); concatenated per (turn, run, step) it is the
# step's content (RFC 0005 §7).
DELTA: Final = "delta"
# Discard the step's deltas so far: its model call is retried or failed over after text went out.
STEP_RESET: Final = "step.reset"

SESSION_EVENTS: Final = frozenset(
    {
        TURN_STARTED,
        STEP_STARTED,
        STEP_DONE,
        TOOL_CALL,
        TOOL_RESULT,
        TRANSFER,
        SWAP_PARKED,
        SWAP_APPLIED,
        TURN_RESTARTED,
        TURN_DONE,
        SESSION_FAILED,
        INTEL_WAITING,
        INTEL_RECOVERED,
        APPROVAL_REQUESTED,
        APPROVAL_DECIDED,
        DELTA,
        STEP_RESET,
    }
)

#: Events a child sends even when nobody watches the session: the supervisor acts on them (readiness).
SUPERVISOR_EVENTS: Final = frozenset({INTEL_WAITING, INTEL_RECOVERED})

# --- span events (RFC 0011 §4): on the turn's ``invoke_agent`` span (or the span current then) ----
#: Session events that are also span events, under the same names, when tracing is on.
SPAN_EVENTS: Final = frozenset({SWAP_PARKED, SWAP_APPLIED, TURN_RESTARTED, TRANSFER, INTEL_WAITING, INTEL_RECOVERED})
SPAN_TURN_RERUN: Final = "agentd.turn.rerun"  # the turn runs again on this replica (its child was lost)
SPAN_TURN_RESUMED: Final = "agentd.turn.resumed"  # a daemon restart or a failover: the turn resumes from the store
SPAN_TOOL_REPLAYED: Final = "agentd.tool.replayed"  # the journal answered a tool call (RFC 0008 §5)
SPAN_ENDPOINT_FAILOVER: Final = "agentd.endpoint.failover"  # a model call moved to another endpoint

# --- log events (RFC 0000 §8, RFC 0002 §9) ------------------------------------------------------
LOG_SWAP_SENT: Final = "intel.swap.sent"
LOG_SWAP_ACKED: Final = "intel.swap.acked"  # debug: one child acknowledged
LOG_SWAP_FANOUT_ACKED: Final = "intel.swap.fanout_acked"  # every child a reload reached has acknowledged
LOG_SWAP_PARKED: Final = "intel.swap.parked"  # debug: one session parked a swap mid-turn
LOG_SWAP_PARKED_RUNNING: Final = "intel.swap.parked_running"  # one line per child: its turns in flight parked it
LOG_SWAP_APPLIED: Final = "intel.swap.applied"
LOG_SWAP_APPLIED_IDLE: Final = "intel.swap.applied_idle"  # one line per child: its idle sessions swapped at once
LOG_TURN_RESTARTED: Final = "turn.restarted"
LOG_TURN_DONE: Final = "turn.done"
LOG_TURN_DISCARDED: Final = "turn.discarded"
# A commit found its turn ended by an earlier attempt of the same commit (its answer was lost with
# the connection): the results are stored once, the turn ends as reported (RFC 0003 §3).
LOG_TURN_COMMIT_RECOVERED: Final = "turn.commit_recovered"
# A begin_turn that failed with the database had stored its turn after all (its answer was lost
# with the connection, PostgreSQL): the turn goes on as accepted (RFC 0003 §3).
LOG_TURN_BEGIN_RECOVERED: Final = "turn.begin_recovered"
LOG_SESSION_CREATE_RECOVERED: Final = "session.create_recovered"  # a create whose answer was lost had landed
LOG_TOOL_REPLAYED: Final = "tool.replayed"
LOG_CONFIG_RELOAD: Final = "config.reload"
# The reload history (GET /v1/reloads) could not be written; the reload itself stands.
LOG_CONFIG_RELOAD_UNRECORDED: Final = "config.reload_unrecorded"
# The console (agentd/console): a login refused (wrong token), a state-changing request refused
# (CSRF token or Origin), a console action done (cancel, reload, message, approve …).
LOG_CONSOLE_LOGIN_REFUSED: Final = "console.login_refused"
LOG_CONSOLE_REFUSED: Final = "console.refused"
LOG_CONSOLE_ACTION: Final = "console.action"
LOG_CONFIG_WATCH: Final = "config.watch"  # --watch-config saw the file change; a reload follows
LOG_PROTOCOL_ERROR: Final = "protocol.error"
LOG_CHILD_READY: Final = "child.ready"
LOG_CHILD_EXIT: Final = "child.exit"
LOG_CHILD_STDERR: Final = "child.stderr"
# Lines of one kind a child sent faster than the limit (its raw stderr, a library's log records):
# how many were not logged in the window that ended (RFC 0000 §8).
LOG_DROPPED: Final = "log.dropped"
LOG_CHILD_SHUTDOWN: Final = "child.shutdown"
# The pool started: the CPUs it counted, the active children it keeps, the most it spreads turns
# over, its spares and its cap (RFC 0006 §2).
LOG_POOL_STARTED: Final = "pool.started"
# The pool retires a child it no longer needs: a surplus spare, an active child empty for
# idle_unload, an empty draining or quarantine child (RFC 0006 §4).
LOG_CHILD_RETIRED: Final = "child.retired"
# A reaped child had left processes in its process group (a tool's subprocess): they were killed.
LOG_CHILD_LEFTOVERS_KILLED: Final = "child.leftovers_killed"
LOG_INTEL_ERROR: Final = "intel.error"
LOG_INTEL_FAILOVER: Final = "intel.failover"
LOG_TRANSFER: Final = "session.transfer"
LOG_SESSION_LOADED: Final = "session.loaded"  # opened on a child (from its committed transcript)
LOG_SESSION_UNLOADED: Final = "session.unloaded"  # closed on its child after idle_unload
LOG_SESSION_LEASE_LOST: Final = "session.lease_lost"  # another replica took the session over (RFC 0009 §7)
LOG_SESSION_ADOPTED: Final = "session.adopted"  # the failover scan claimed it; its pending turn re-runs here
LOG_SESSION_RELEASED: Final = "session.released"  # a stopping replica gave its lease up
LOG_SESSION_ELSEWHERE: Final = "session.elsewhere"  # a message stored here runs on the replica holding the lease
# The last subscriber of a session with a turn in flight left: its child stops streaming that turn.
LOG_SESSION_UNWATCHED: Final = "session.unwatched"
LOG_SESSION_RELAYED: Final = "session.relayed"  # a turn running here streams to another replica's subscribers now
LOG_SESSION_QUARANTINED: Final = "session.quarantined"  # its turns run on a child of its own now
LOG_STORE_WAITING: Final = "store.waiting"  # start-up: the store cannot be opened yet; tried again after retry_in
LOG_STORE_OPENED: Final = "store.opened"  # start-up: the store opened after store.waiting
LOG_SIGNAL: Final = "supervisor.signal"  # a signal and what the daemon does about it
# --- replicas (RFC 0009 §7) ---------------------------------------------------------------------
LOG_REPLICA_ID_IN_USE: Final = "replica.id_in_use"  # another live process bears this replica's id
LOG_REPLICA_RIVAL: Final = "replica.rival"  # start-up: the registry has another holder of this id; is it alive?
LOG_REPLICA_EVENTS_FENCED: Final = "replica.events_fenced"  # events of a run whose lease ran out, not relayed

# --- log events named where they are logged (RFC 0000 §8) -------------------------------------
LOG_API_INTERNAL_ERROR: Final = "api.internal_error"
# An idempotency key's answer, or its release, could not be written (RFC 0010 §2): the next
# request with the key takes it over once this process no longer answers it.
LOG_API_KEY_NOT_KEPT: Final = "api.idempotency_key_not_kept"
LOG_CHILD_FAILED: Final = "child.failed"
LOG_CHILD_FRAME_FOR_UNKNOWN_SESSION: Final = "child.frame_for_unknown_session"
LOG_CHILD_PARENT_GONE: Final = "child.parent_gone"
LOG_CHILD_SPAWN_FAILED: Final = "child.spawn_failed"
LOG_CHILD_START_FAILED: Final = "child.start_failed"
LOG_CHILD_TOOLS_UNRESOLVED: Final = "child.tools_unresolved"
LOG_CHILD_UNRESPONSIVE: Final = "child.unresponsive"
# An in-process child runtime (tests: agentd.supervisor.inprocess) raised: its "process" exits 1.
LOG_CHILD_RUNTIME_CRASHED: Final = "child.runtime_crashed"
LOG_MCP_CONNECTED: Final = "mcp.connected"
LOG_MCP_DISCONNECTED: Final = "mcp.disconnected"
LOG_MCP_TOOL_NAME_TAKEN: Final = "mcp.tool_name_taken"
LOG_MCP_TOOL_NOT_LISTED: Final = "mcp.tool_not_listed"
LOG_MCP_TOOLS_UNAVAILABLE: Final = "mcp.tools_unavailable"
LOG_REPLICA_BEAT_FAILED: Final = "replica.beat_failed"
LOG_REPLICA_CATCH_UP_FAILED: Final = "replica.catch_up_failed"
LOG_REPLICA_EVENTS_MISSED: Final = "replica.events_missed"
LOG_REPLICA_LISTEN_GAP: Final = "replica.listen_gap"
LOG_REPLICA_NOTIFICATION_FAILED: Final = "replica.notification_failed"
LOG_REPLICA_RELAY_DROPPED: Final = "replica.relay_dropped"
LOG_REPLICA_RELAY_FAILED: Final = "replica.relay_failed"
LOG_REPLICA_RENEW_FAILED: Final = "replica.renew_failed"
LOG_REPLICA_SCAN_FAILED: Final = "replica.scan_failed"
LOG_SESSION_ADOPT_FAILED: Final = "session.adopt_failed"
LOG_SESSION_CLAIM_FAILED: Final = "session.claim_failed"
LOG_SESSION_CLOSED: Final = "session.closed"
LOG_SESSION_CREATE_UNKNOWN: Final = "session.create_unknown"
LOG_SESSION_CREATED: Final = "session.created"
LOG_SESSION_FAILED: Final = "session.failed"
LOG_SESSION_RELEASE_FAILED: Final = "session.release_failed"
LOG_SESSION_STORE_FAILED: Final = "session.store_failed"
LOG_SUPERVISOR_DRAINING: Final = "supervisor.draining"
LOG_SUPERVISOR_RESTORED: Final = "supervisor.restored"
LOG_SUPERVISOR_RESUME_FAILED: Final = "supervisor.resume_failed"
LOG_SUPERVISOR_STORE_FAILED: Final = "supervisor.store_failed"
LOG_TOOL_JOURNAL_FAILED: Final = "tool.journal_failed"
LOG_TOOL_JOURNAL_REFUSED: Final = "tool.journal_refused"
LOG_TURN_ABANDON_FAILED: Final = "turn.abandon_failed"
LOG_TURN_BEGIN_UNKNOWN: Final = "turn.begin_unknown"
LOG_TURN_COMMIT_FAILED: Final = "turn.commit_failed"
LOG_TURN_COMMIT_REFUSED: Final = "turn.commit_refused"
LOG_TURN_CRASHED: Final = "turn.crashed"
LOG_TURN_INTERNAL_ERROR: Final = "turn.internal_error"
LOG_TURN_RERUN: Final = "turn.rerun"
LOG_TURN_UNEXPECTED: Final = "turn.unexpected"
# Approvals (RFC 0012): a run stopped for approvals (child, debug); the supervisor stored them;
# one was decided (approved, rejected, expired, cancelled); a turn whose approvals are all
# decided goes on; storing or resuming failed; a restart-turn swap discarded a waiting run.
LOG_TURN_PARKED: Final = "turn.parked"
LOG_APPROVAL_REQUESTED: Final = "approval.requested"
LOG_APPROVAL_DECIDED: Final = "approval.decided"
LOG_APPROVAL_RESUMED: Final = "approval.resumed"
LOG_APPROVAL_FAILED: Final = "approval.failed"
LOG_APPROVAL_DISCARDED: Final = "approval.discarded"

# The API's listeners (RFC 0000 §6): accept() failed (out of descriptors, of memory) — one line per
# interval with the count not logged; every TCP slot is taken, clients wait in the backlog (same);
# [server] max_connections was lowered to half the open-files limit at start.
LOG_API_ACCEPT_FAILED: Final = "api.accept_failed"
LOG_API_AT_CAPACITY: Final = "api.at_capacity"
LOG_API_CONNECTION_CAP: Final = "api.connection_cap"
LOG_STORE_DRIVER: Final = "store.driver"
LOG_STORE_LISTEN_FAILED: Final = "store.listen_failed"
LOG_STORE_NOTIFY_FAILED: Final = "store.notify_failed"
LOG_MCP_CONNECT_FAILED: Final = "mcp.connect_failed"

# --- log events named where they are logged (RFC 0000 §8) -------------------------------------
LOG_SUPERVISOR_FD_LIMIT: Final = "supervisor.fd_limit"
LOG_SUPERVISOR_STARTED: Final = "supervisor.started"
LOG_SUPERVISOR_STOPPED: Final = "supervisor.stopped"
