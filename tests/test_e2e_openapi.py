"""Property-based requests against every JSON route of a real daemon (RFC 0010 §5), from its own
OpenAPI document: no answer is a server error, and every documented answer keeps its schema.

Bounded in examples per operation (figures are for ``bench/``, never here); the scripted model
answers the turns. The event stream, the metrics text and reload are left out (not JSON, or not
a request to repeat at random).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error, response_schema_conformance

from agentd.api import ALL_ROUTES
from tests.daemon_harness import free_port, running_daemon, two_assistant_config, wait_until

pytestmark = pytest.mark.e2e

TOKEN = "schema-t0ken"
EXAMPLES = 12
EXCLUDED = ["/metrics", "/v1/sessions/{id}/events", "/v1/reload"]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("openapi")
    port = free_port()
    with running_daemon(
        tmp,
        two_assistant_config(tmp / "never"),
        args=["--listen", f"127.0.0.1:{port}"],
        env={"AGENTD_API_TOKEN": TOKEN},
    ):
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _up(base), "the TCP listener")
        yield base


def _up(base: str) -> bool:
    try:
        return httpx.get(base + "/v1/health").status_code == 200
    except httpx.TransportError:
        return False


def real_ids(base: str, auth: dict[str, str]) -> list[str]:
    """Ids the generated requests pick from, so that they reach real sessions, turns and models,
    not only 404s: sessions (one per route that may close one), a response, the models."""
    with httpx.Client(base_url=base, headers=auth, timeout=60) as api:
        sessions = [api.post("/v1/sessions", json={}).json()["id"] for _ in range(3)]
        response = api.post("/v1/responses", json={"model": "main", "input": "hello"}).json()["id"]
    return [*sessions, response, "main", "held"]


def aim_at_real_ids(doc: dict[str, Any], ids: list[str]) -> None:
    """Path ids drawn from ``ids`` (but where a route closes its session), ``model`` from the assistants."""
    for ops in doc["paths"].values():
        for method, op in ops.items():
            for param in op.get("parameters", []):
                if param["in"] == "path" and method != "delete":
                    param["schema"] = {"enum": ids}
    for body in ("ChatRequest", "ResponsesRequest"):
        doc["components"]["schemas"][body]["properties"]["model"] = {"enum": ["main"]}


def test_every_json_route_answers_within_its_schema(served: str) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    doc = httpx.get(served + "/v1/openapi.json", headers=auth).json()
    aim_at_real_ids(doc, real_ids(served, auth))
    schema = schemathesis.openapi.from_dict(doc).exclude(path=EXCLUDED)
    checks = [not_a_server_error, response_schema_conformance]
    tried = []
    for found in schema.get_all_operations():
        operation = found.ok()
        tried.append(operation.label)

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def answers_within_schema(case: Any) -> None:
            response = case.call(base_url=served, headers=auth, timeout=60)
            case.validate_response(response, checks=checks)

        answers_within_schema()
    assert len(tried) == len(ALL_ROUTES) - len(EXCLUDED)
