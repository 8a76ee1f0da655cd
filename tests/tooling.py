"""Tools used by tests through ``module:function`` references (they run inside real child processes).

Each appends a line to the file named by AGENTD_TEST_TOOL_LOG, so a test can see exactly which
tool calls ran. ``held`` waits until the file named by AGENTD_TEST_GATE exists, so a test can hold
a tool call in flight for as long as it needs.
"""

from __future__ import annotations

import os
import signal
import time

from agentd.tools import side_effect_free


def _log(line: str) -> None:
    with open(os.environ["AGENTD_TEST_TOOL_LOG"], "a", encoding="utf-8") as fh:
        fh.write(line + "\n")


def record(label: str = "") -> str:
    """Record that it ran, with its label."""
    _log(f"record {label}")
    return f"recorded {label}"


def held(label: str = "") -> str:
    """Record its start, wait for the gate file, record its end."""
    _log(f"held-start {label}")
    gate = os.environ["AGENTD_TEST_GATE"]
    while not os.path.exists(gate):
        time.sleep(0.01)
    _log(f"held-end {label}")
    return f"held {label}"


@side_effect_free
def held_pure(label: str = "") -> str:
    """Like ``held`` but declared free of side effects (restart-turn runs it again)."""
    return held(label)


# Declared free of side effects so that every re-run of the turn runs it again (a side-effecting
# tool that was cut off is never run a second time, RFC 0008 §4): these two exist to crash or hang
# the child on every run, for the blame and deadline rules.
@side_effect_free
def kill_child(label: str = "") -> str:
    """Kill the child process it runs in: a tool that crashes its host, every time."""
    _log(f"kill_child {label}")
    os.kill(os.getpid(), signal.SIGKILL)
    return "unreachable"


@side_effect_free
async def block_child(label: str = "") -> str:
    """Block the child's event loop for good: a blocking sleep inside ``async def``."""
    _log(f"block_child {label}")
    time.sleep(3600)
    return "unreachable"


@side_effect_free
def env_names(label: str = "") -> str:
    """The names (never the values) of the environment variables the tool sees; also logged."""
    names = " ".join(sorted(os.environ))
    _log("env " + names)
    return names


def _fork_sleeper() -> int:
    """Fork a process that holds every fd the child has (its control channel and stderr included)
    and sleeps; its pid is logged as ``grandchild <pid>``. It does nothing else: no exec, no close."""
    pid = os.fork()
    if pid == 0:  # the grandchild: only sleep, whatever happens (never run the child's code)
        try:
            time.sleep(300)
        finally:
            os._exit(0)
    _log(f"grandchild {pid}")
    return pid


def leave_grandchild(label: str = "") -> str:
    """Fork a grandchild that outlives this call (see ``_fork_sleeper``) and return at once."""
    return f"grandchild {_fork_sleeper()}"


def hold_with_grandchild(label: str = "") -> str:
    """Fork a grandchild (see ``_fork_sleeper``), then wait for the gate file like ``held``."""
    _fork_sleeper()
    return held(label)


@side_effect_free
def loaded_modules(prefix: str = "opentelemetry") -> str:
    """The modules this child has imported whose names start with ``prefix`` (RFC 0011 §4: none
    of OpenTelemetry without it configured), as a JSON list."""
    import json
    import sys

    return json.dumps(sorted(name for name in sys.modules if name.startswith(prefix)))


def stamp(label: str = "") -> str:
    """Record that it ran, with its label and the epoch time it started (bench/approvals.py)."""
    _log(f"stamp {label} {time.time():.6f}")
    return f"stamped {label}"
