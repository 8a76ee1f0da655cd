"""Idempotency keys in the store (RFC 0010 §2), on SQLite and PostgreSQL alike (the ``store`` fixture)."""

from __future__ import annotations

import anyio
import pytest

from agentd.store import Store, StoreError
from tests.store_harness import Backend

pytestmark = pytest.mark.anyio

SCOPE = "unix POST /v1/sessions"


async def claim(store: Store, key: str, owner: str = "r/1", fingerprint: str = "f1", ttl: float = 60.0) -> object:
    return await store.idempotency_claim(
        SCOPE, key, fingerprint=fingerprint, owner=owner, session="s_1", turn="t_1", ttl=ttl
    )


async def test_a_key_is_claimed_once_and_then_names_its_first_request(store: Store) -> None:
    assert await claim(store, "k") is None
    held = await claim(store, "k", owner="r/2", fingerprint="f2")
    assert held is not None
    assert (held.owner, held.fingerprint, held.session, held.turn, held.status) == ("r/1", "f1", "s_1", "t_1", None)
    # The same key in another scope is another key.
    other = await store.idempotency_claim(
        "unix POST /v1/responses", "k", fingerprint="f1", owner="r/1", session=None, turn=None, ttl=60
    )
    assert other is None


async def test_an_answer_is_kept_and_its_owner_let_go(store: Store) -> None:
    await claim(store, "k")
    await store.idempotency_answer(SCOPE, "k", status=201, answer='{"id":"s_1"}', headers={"x-a": "b"})
    held = await claim(store, "k")
    assert held is not None
    assert (held.status, held.answer, held.headers, held.owner) == (201, '{"id":"s_1"}', {"x-a": "b"}, None)
    # An answered key is never taken over: its answer is final.
    assert not await store.idempotency_take_over(SCOPE, "k", owner="r/2", previous=None)


async def test_take_over_happens_once_and_only_from_the_owner_named(store: Store) -> None:
    await claim(store, "k")
    assert not await store.idempotency_take_over(SCOPE, "k", owner="r/2", previous="r/9")
    assert await store.idempotency_take_over(SCOPE, "k", owner="r/2", previous="r/1")
    assert not await store.idempotency_take_over(SCOPE, "k", owner="r/3", previous="r/1")
    await store.idempotency_release(SCOPE, "k", owner="r/1")  # not its owner any more: nothing changes
    held = await claim(store, "k")
    assert held is not None and held.owner == "r/2"
    await store.idempotency_release(SCOPE, "k", owner="r/2")
    held = await claim(store, "k")
    assert held is not None and held.owner is None
    assert await store.idempotency_take_over(SCOPE, "k", owner="r/3", previous=None)


async def test_expired_keys_are_purged_by_the_next_claim(store: Store, backend: Backend) -> None:
    await claim(store, "old", ttl=0.05)
    await claim(store, "young", ttl=60)
    await anyio.sleep(0.2)
    assert await claim(store, "other") is None
    keys = {row[0] for row in backend.raw("SELECT key FROM idempotency")}
    assert keys == {"young", "other"}
    assert await claim(store, "old", owner="r/2") is None  # claimed anew


async def test_a_ttl_out_of_range_is_refused_naming_it(store: Store) -> None:
    with pytest.raises(StoreError, match="ttl"):
        await claim(store, "k", ttl=0)
