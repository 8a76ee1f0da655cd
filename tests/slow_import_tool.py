"""A tool module whose import blocks until the file named by AGENTD_TEST_IMPORT_GATE exists.

Children resolve their tools before sending Ready, so this holds a child in its start-up for as
long as a test needs: the way to exercise ``spawn_timeout`` deterministically.
"""

from __future__ import annotations

import os
import time

_GATE = os.environ.get("AGENTD_TEST_IMPORT_GATE", "")
while _GATE and not os.path.exists(_GATE):
    time.sleep(0.01)


def ping(label: str = "") -> str:
    """Answer pong."""
    return f"pong {label}"
