"""A turn, from acceptance to commit: one owner, ``Turns`` (``owner.py``).

- ``owner.py``: ``Turns`` accepts a turn (stored, reserved, its lease claimed), resumes the ones a
  restart or a failover interrupted and the ones approvals let go on, cancels, closes, unloads,
  and answers the waiting client;
- ``runner.py``: ``TurnRunner`` drives a turn on the pool — delivery, re-runs after a child's
  death, the deadline — to its commit, or to its end without a result;
- ``frames.py``: ``ChildFrames``, the pool's owner: what children send about their sessions, and
  children coming and going;
- ``parking.py``: a run that stops for approvals, and how its turn goes on (RFC 0012).

The rest of the supervisor reaches a turn only through ``Turns``. See RFC 0006.
"""

from agentd.supervisor.turns.owner import ELSEWHERE_POLL, RESUME_CONCURRENCY, Turns, new_id

__all__ = ["ELSEWHERE_POLL", "RESUME_CONCURRENCY", "Turns", "new_id"]
