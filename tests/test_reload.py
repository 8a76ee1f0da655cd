"""Reload logic without processes: the config diff, the per-session fan-out choice, and the
coordinator that serializes and coalesces reloads (RFC 0003 §4)."""

from __future__ import annotations

import anyio
import pytest

from agentd.config import parse_config
from agentd.supervisor.reload import ReloadCoordinator, changed_paths, plan_reload, sessions_to_swap

BASE = """
[intelligence]
model = "m1"
options = { temperature = 0.1 }

[[assistants]]
name = "a"

[[assistants]]
name = "b"
intelligence = { model = "b1" }
"""


def test_changed_paths_name_leaf_fields() -> None:
    old = parse_config(BASE)
    new = parse_config(BASE.replace("temperature = 0.1", "temperature = 0.5, top_k = 3").replace('"b1"', '"b2"'))
    assert changed_paths(old, new) == [
        "intelligence.options.temperature",
        "intelligence.options.top_k",
        "assistants[1].intelligence.model",
    ]
    assert changed_paths(old, old) == []


def test_a_model_change_of_the_default_reaches_assistants_that_inherit_it() -> None:
    plan = plan_reload(parse_config(BASE), parse_config(BASE.replace('model = "m1"', 'model = "m2"')))
    assert plan.changed == ["intelligence.model"]
    assert plan.intelligence_changed == ["a"]  # b overrides the model, so b is unchanged
    assert plan.intelligence["a"].model == "m2" and plan.intelligence["b"].model == "b1"


def test_prompt_changes_swap_nobody() -> None:
    plan = plan_reload(parse_config(BASE), parse_config(BASE.replace('name = "a"', 'name = "a"\nsystem = "new"')))
    assert plan.changed == ["assistants[0].system"]
    assert plan.intelligence_changed == []


def test_restart_only_fields_are_reported_and_kept() -> None:
    old = parse_config(BASE)
    new = parse_config('[server]\nlisten = "127.0.0.1:9999"\nstate_dir = "/elsewhere"\n' + BASE.replace('"m1"', '"m2"'))
    plan = plan_reload(old, new)
    assert plan.restart_required == ["server.state_dir", "server.listen"]
    assert plan.config.server == old.server
    assert plan.config.intelligence.model == "m2"
    assert "server.listen" not in plan.changed and "intelligence.model" in plan.changed


def test_sessions_to_swap_are_those_whose_current_assistant_changed() -> None:
    assert sessions_to_swap({"s1": "a", "s2": "b", "s3": "a"}, ["a"]) == ["s1", "s3"]
    assert sessions_to_swap({"s1": "a"}, []) == []


@pytest.mark.anyio
async def test_requests_during_a_reload_coalesce_into_exactly_one_more() -> None:
    started: list[int] = []
    release = anyio.Event()
    first_running = anyio.Event()

    async def reload() -> int:
        started.append(len(started) + 1)
        if len(started) == 1:
            first_running.set()
            await release.wait()
        return len(started)

    coordinator: ReloadCoordinator[int] = ReloadCoordinator(reload)
    results: list[int] = []

    async def request() -> None:
        results.append(await coordinator.request())

    async with anyio.create_task_group() as tg:
        tg.start_soon(request)
        await first_running.wait()
        for _ in range(50):  # fifty signals while the first reload runs
            tg.start_soon(request)
        await anyio.wait_all_tasks_blocked()
        release.set()
    assert started == [1, 2], "one reload running, then exactly one more for everything that piled up"
    assert sorted(results) == [1] + [2] * 50


@pytest.mark.anyio
async def test_a_request_after_a_reload_finished_gets_a_new_reload() -> None:
    count = 0

    async def reload() -> int:
        nonlocal count
        count += 1
        return count

    coordinator: ReloadCoordinator[int] = ReloadCoordinator(reload)
    assert await coordinator.request() == 1
    assert await coordinator.request() == 2


def test_the_store_is_restart_only_like_the_server() -> None:
    old = parse_config(BASE)
    new = parse_config('[store]\nurl = "postgresql://agentd@db/agentd"\nlease = "20s"\n' + BASE)
    plan = plan_reload(old, new)
    assert plan.restart_required == ["store.url", "store.lease"]
    assert plan.config.store == old.store
    assert plan.changed == []


def test_the_listener_bounds_are_restart_only_like_listen() -> None:
    old = parse_config(BASE)
    new = parse_config('[server]\nmax_connections = 8\nheader_timeout = "1s"\n' + BASE)
    plan = plan_reload(old, new)
    assert plan.restart_required == ["server.max_connections", "server.header_timeout"]
    assert plan.config.server == old.server and plan.changed == []
