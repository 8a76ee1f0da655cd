"""Test and bench hook: a process started with this directory first on ``PYTHONPATH`` and
``AGENTD_TEST_FAKE_CPUS=N`` in its environment believes it may run on N CPUs.

It fakes the machine, not agentd: ``os.sched_getaffinity`` and ``os.cpu_count`` answer N, so the
daemon's own CPU counting (``agentd.supervisor.placement.usable_cpus``, affinity capped by a
cgroup quota) runs unchanged. A cgroup CPU quota, where there is one, still caps the count.
Python imports ``sitecustomize`` at start-up from the first ``sys.path`` entry that has one; no
production code reads the variable. Used by ``tests/test_e2e_pool.py`` and ``bench/footprint.py``
to show what a large host would start without owning one.
"""

from __future__ import annotations

import os

_FAKE = os.environ.get("AGENTD_TEST_FAKE_CPUS", "")

if _FAKE.isdigit() and int(_FAKE) > 0:
    _CPUS = int(_FAKE)

    def _affinity(pid: int, /) -> set[int]:
        return set(range(_CPUS))

    def _cpu_count() -> int:
        return _CPUS

    os.sched_getaffinity = _affinity
    os.cpu_count = _cpu_count
