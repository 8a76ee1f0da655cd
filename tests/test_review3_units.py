"""Hostile review (wave-review3): breaks shown without processes, where that is honest; each was a
strict xfail until it was fixed, and stays as a regression test."""

from __future__ import annotations

import http.server
import json
import threading
import warnings
from typing import Any

import pytest

from agentd.approvals import check_arguments


@pytest.mark.parametrize(
    "schema",
    [
        # A schema whose definitions a tool framework dropped (pydantic-style "#/$defs/..." refs).
        {"type": "object", "properties": {"order": {"$ref": "#/$defs/Order"}}},
        # A schema that points at a document elsewhere (jsonschema fetches nothing: unresolvable).
        {"type": "object", "properties": {"order": {"$ref": "https://schemas.example.invalid/order.json"}}},
    ],
)
def test_edited_arguments_against_a_schema_with_a_dangling_ref_get_a_reason_not_an_exception(
    schema: dict[str, Any],
) -> None:
    """``Approvals.decide`` (agentd/supervisor/approvals.py) answers 400 ``bad_arguments`` with the
    reason ``check_arguments`` (agentd/approvals.py) returns; it catches ``ValidationError`` and
    ``SchemaError`` only, so a tool schema (an MCP server's ``inputSchema``, stored as the approval's
    ``parameters``) with a ``$ref`` that does not resolve makes the operator's approve-with-edits a 500."""
    problem = check_arguments({"order": {"id": 1}}, schema)
    assert isinstance(problem, str) and problem


def test_checking_edited_arguments_fetches_no_url_a_tool_schema_names() -> None:
    """``check_arguments`` runs ``jsonschema.validate`` inside ``Approvals.decide`` (async, on the
    supervisor's loop). jsonschema resolves a remote ``$ref`` by fetching it (``urllib.request.urlopen``
    without a timeout), so a tool schema — an MCP server's ``inputSchema``, stored as the approval's
    ``parameters`` — that names a URL makes the daemon request it (any host: cloud metadata, an
    internal service) and blocks every API request, child frame and lease heartbeat while it waits.
    agentd fetches no URL anywhere else (RFC 0010 §1 refuses image URLs for that reason)."""
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            body = json.dumps({"type": "object"}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/order.json"
        schema = {"type": "object", "properties": {"order": {"$ref": url}}}
        with warnings.catch_warnings():  # as the daemon runs: jsonschema's DeprecationWarning is no error there
            warnings.simplefilter("ignore", DeprecationWarning)
            check_arguments({"order": {"id": 1}}, schema)
    finally:
        server.shutdown()
        server.server_close()
    assert hits == [], f"agentd fetched {hits} while checking an approval's arguments"


@pytest.mark.parametrize("schema", [{"$ref": "#"}, {"allOf": [{"$ref": "#"}]}])
def test_edited_arguments_against_a_schema_that_refers_to_itself_get_a_reason(schema: dict[str, Any]) -> None:
    """A schema whose reference is itself recurses without end in jsonschema (RecursionError):
    a reason (400 ``bad_arguments``), not a 500."""
    problem = check_arguments({"order": {"id": 1}}, schema)
    assert isinstance(problem, str) and "refer back to themselves" in problem
