"""A tool module whose import blocks in a child until the file named by AGENTD_TEST_IMPORT_GATE exists.

Children resolve their tools before sending Ready, so this holds a child in its start-up for as
long as a test needs: the way to exercise ``spawn_timeout`` deterministically. Only a child is
held: the daemon's config check (``python -P -m agentd.validate``, at start-up and on reload)
imports it at once, as it would import any healthy tool module.
"""

from __future__ import annotations

import os
import sys
import time

_GATE = os.environ.get("AGENTD_TEST_IMPORT_GATE", "")
_MAIN = getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", "") or ""
while _GATE and _MAIN.startswith("agentd.child") and not os.path.exists(_GATE):
    time.sleep(0.01)


def ping(label: str = "") -> str:
    """Answer pong."""
    return f"pong {label}"
