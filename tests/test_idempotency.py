"""What a request does with an idempotency key already held (``agentd.supervisor.idempotency.decide``)."""

from __future__ import annotations

import msgspec

from agentd.store import IdempotencyRecord
from agentd.supervisor.idempotency import Found, decide

HELD = IdempotencyRecord(
    scope="unix POST /v1/sessions",
    key="k",
    fingerprint="f",
    owner="pod-0/1a2b3c4d",
    session="s_1",
    turn="t_1",
    status=None,
    answer=None,
    headers={},
    created_at=0.0,
    expires_at=60.0,
)


def test_another_request_with_the_key_is_refused_whatever_the_key_holds() -> None:
    assert decide(HELD, "g", owner_alive=True) is Found.REUSED
    answered = msgspec.structs.replace(HELD, status=201, answer="{}", owner=None)
    assert decide(answered, "g", owner_alive=False) is Found.REUSED


def test_a_kept_answer_is_given_again() -> None:
    answered = msgspec.structs.replace(HELD, status=201, answer="{}", owner=None)
    assert decide(answered, "f", owner_alive=False) is Found.REPLAY


def test_a_key_whose_owner_lives_is_in_progress_else_taken_over() -> None:
    assert decide(HELD, "f", owner_alive=True) is Found.IN_PROGRESS
    assert decide(HELD, "f", owner_alive=False) is Found.TAKE_OVER
    released = msgspec.structs.replace(HELD, owner=None)
    assert decide(released, "f", owner_alive=False) is Found.TAKE_OVER
