"""This daemon as one replica of several on a PostgreSQL store (RFC 0009 §7): its id, its timings,
and the small decisions about leases, as pure functions.

A replica holds a session's lease while it runs one of the session's turns (from the claim before
the turn runs to the release after it ended), so the owner of a session is "the replica running
its turn now". What holds a lease is one process: the replica id and an incarnation drawn at start
(``lease_holder``), so a process restarted under the same ``AGENTD_REPLICA_ID`` (a Kubernetes pod
name survives a container restart) is a new holder — it neither renews nor skips the dead one's
leases, which expire and are adopted by the failover scan — and a second live process started
with an id in use is told apart and refused (``live_twin``). The heartbeat renews the leases every ``lease / 3``; the failover scan claims
orphaned sessions every ``lease / 2``; the registry lists replicas that beat within
``REGISTRY_AGE_LEASES`` leases.
"""

from __future__ import annotations

import enum
import os
import re
import secrets
import socket
from collections.abc import Mapping, Sequence

from agentd.store import Lease, ReplicaRow
from agentd.store.codec import REPLICA_ID_RULE, valid_replica_id

__all__ = [
    "ENV_REPLICA_ID",
    "REGISTRY_AGE_LEASES",
    "RenewVerdict",
    "heartbeat_interval",
    "judge_renewal",
    "lease_holder",
    "live_twin",
    "loaded_copy_is_current",
    "new_incarnation",
    "registry_max_age",
    "replica_id",
    "replica_name",
    "replica_views",
    "rivals",
    "scan_interval",
]

#: The environment variable that names this replica (default: ``<hostname>-<pid>-<random>``).
ENV_REPLICA_ID = "AGENTD_REPLICA_ID"
#: A replica whose last beat is older than this many leases is not listed as live.
REGISTRY_AGE_LEASES = 3


def replica_id(environ: Mapping[str, str] | None = None, *, hostname: str | None = None, pid: int | None = None) -> str:
    """This replica's id: ``AGENTD_REPLICA_ID`` when set, else ``<hostname>-<pid>-<4 random hex>``.

    The random part makes a restarted process (same host, same pid in a new container) a new
    replica, so it never inherits a dead one's leases by name. ValueError naming the variable
    when ``AGENTD_REPLICA_ID`` is not a usable id (``agentd.store.codec.REPLICA_ID``); a hostname
    is made one (other characters become ``-``).
    """
    env = os.environ if environ is None else environ
    named = env.get(ENV_REPLICA_ID, "").strip()
    if named:
        if not valid_replica_id(named):
            raise ValueError(f"{ENV_REPLICA_ID} must be {REPLICA_ID_RULE}, not {named!r}")
        return named
    host = hostname if hostname is not None else socket.gethostname()
    host = re.sub(r"[^A-Za-z0-9._:@-]", "-", host.encode("ascii", "replace").decode())[:200].lstrip("._:@-")
    return f"{host or 'agentd'}-{os.getpid() if pid is None else pid}-{secrets.token_hex(2)}"


def new_incarnation() -> str:
    """A fresh incarnation for this process: 8 random hex digits (``codec.LEASE_HOLDER``)."""
    return secrets.token_hex(4)


def lease_holder(replica: str, incarnation: str) -> str:
    """What this process is to the store (leases, registry, watches, relay): ``<replica>/<incarnation>``."""
    return f"{replica}/{incarnation}"


def replica_name(holder: str) -> str:
    """The replica id a holder bears (``pod-0`` of ``pod-0/1a2b3c4d``; an id without incarnation is its own)."""
    return holder.partition("/")[0]


def rivals(rows: Sequence[ReplicaRow], holder: str) -> dict[str, float]:
    """The other holders of this holder's replica id in the registry, with their last beat."""
    name = replica_name(holder)
    return {row.id: row.seen_at for row in rows if row.id != holder and replica_name(row.id) == name}


def live_twin(before: Mapping[str, float], after: Sequence[ReplicaRow], holder: str) -> str | None:
    """A process that bears this holder's replica id and is alive: it beat again between two reads
    of the registry (``before``: the rivals first seen, ``after``: the registry now). A dead one
    (the process this one replaces after a restart) never beats again; None when none did."""
    for rival, seen_at in rivals(after, holder).items():
        if rival not in before or seen_at > before[rival]:
            return rival
    return None


def replica_views(rows: Sequence[ReplicaRow]) -> list[ReplicaRow]:
    """The registry as operators see it: one row per replica id, its newest holder's, by id.

    A restarted replica's previous process keeps its row until it ages out; it is the same
    replica to an operator (the same pod), so only the live-est is shown.
    """
    newest: dict[str, ReplicaRow] = {}
    for row in rows:
        name = replica_name(row.id)
        if name not in newest or row.seen_at > newest[name].seen_at:
            newest[name] = ReplicaRow(id=name, generation=row.generation, sessions=row.sessions, seen_at=row.seen_at)
    return [newest[name] for name in sorted(newest)]


def heartbeat_interval(lease: float) -> float:
    """How often a replica renews its leases and beats in the registry: a third of the lease."""
    return lease / 3


def scan_interval(lease: float) -> float:
    """How often a replica looks for orphaned sessions (failover): half the lease."""
    return lease / 2


def registry_max_age(lease: float) -> float:
    """How recent a beat must be for its replica to be listed as live."""
    return lease * REGISTRY_AGE_LEASES


def loaded_copy_is_current(last_token: int | None, token: int) -> bool:
    """Whether a session this replica still has loaded on a child is current under a new lease.

    Every claim that is not an extension increments the session's fencing token by one, and a
    release keeps it. So a lease whose token is the last one this replica held, or one more, means
    no other replica held the session in between (and wrote nothing to it); anything else means
    another replica may have run turns since, and the loaded copy must be reloaded from the store.
    """
    return last_token is not None and token in (last_token, last_token + 1)


class RenewVerdict(enum.Enum):
    """What a heartbeat's ``renew`` answer means for one lease this replica held when it asked."""

    RENEWED = "renewed"  # still ours: adopt the extended lease
    CHANGED = "changed"  # released or claimed again while the renew ran: the answer says nothing of it
    LOST = "lost"  # gone while its turn runs here: another replica took the session over
    IDLE = "idle"  # gone, but no turn of it runs here: nothing to stop


def judge_renewal(asked: Lease, current: Lease | None, renewed: Lease | None, *, same_turn: bool) -> RenewVerdict:
    """Judge one lease after a renew: ``asked`` is the lease held when the renew started,
    ``current`` the one held now, ``renewed`` what the renew returned for the session (None: not
    returned), ``same_turn`` whether the turn that ran under ``asked`` still runs here."""
    if current is not asked:
        return RenewVerdict.CHANGED
    if renewed is not None and renewed.token == asked.token:
        return RenewVerdict.RENEWED
    return RenewVerdict.LOST if same_turn else RenewVerdict.IDLE
