"""Tools for the hostile review's tests (tests/test_e2e_review2.py): each hands back a secret the
way real code would let one slip, never as the plain value."""

from __future__ import annotations

import json
import os
from urllib.parse import quote


def leak_encoded(label: str = "") -> str:
    """An HTTP client's error quoting the URL it called (the provider key in its query string,
    percent-encoded), and a JSON body echoing the key (JSON-escaped), as careless servers do."""
    key = os.environ["REVIEW2_KEY"]
    url = f"https://api.example/v1/models?key={quote(key, safe='')}"
    body = json.dumps({"error": {"message": f"invalid key {key}"}})
    return f"Client error '401 Unauthorized' for url '{url}'\nbody: {body}"


def ancestor_environ(label: str = "") -> str:
    """The ``AGENTD_*`` lines of every ancestor process whose ``/proc/PID/environ`` can be read."""
    found: list[str] = []
    pid = os.getppid()
    while pid > 1:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                found += [v.decode(errors="replace") for v in f.read().split(b"\0") if v.startswith(b"AGENTD_API")]
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            break
    return " ".join(found) or "nothing"
