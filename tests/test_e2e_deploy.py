"""``deploy/`` against the real daemon: what the unit file and the probes count on agentd doing.

- systemd (deploy/systemd/agentd.service, ``Type=notify-reload``): the notifications on the wire,
  read from a ``NOTIFY_SOCKET`` this test binds, as systemd would.
- Kubernetes (deploy/kubernetes/deployment.yaml): the exact probe commands of the manifest, run
  against ``agentd run --listen`` with a bearer token — readiness fails while draining, liveness
  does not.
- Both, for a replica started before its database (RFC 0009 §1): systemd hears why it is not
  ready (``STATUS=``) and ``READY=1`` only once it serves; the startup and liveness probes pass
  while it waits (nothing restarts it), readiness fails until the database is there.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.daemon_harness import TIMEOUT, Daemon, free_port, running_daemon, two_assistant_config, wait_until
from tests.deploy_files import probe_command
from tests.pg_front import FrontMode, PgFront, database_name
from tests.pg_harness import PgServer

pytestmark = pytest.mark.e2e


class NotifySocket:
    """The datagram socket systemd gives a service as $NOTIFY_SOCKET; each datagram is one message."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(TIMEOUT)

    def next(self) -> dict[str, str]:
        data = self.sock.recv(4096).decode()
        return dict(line.split("=", 1) for line in data.split("\n") if line)

    def close(self) -> None:
        self.sock.close()


def monotonic_usec() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def test_agentd_notifies_systemd_as_type_notify_reload_expects(tmp_path: Path) -> None:
    notify = NotifySocket(tmp_path / "notify.sock")
    daemon = Daemon(tmp_path, two_assistant_config(tmp_path / "never"), env={"NOTIFY_SOCKET": str(notify.path)})
    try:
        daemon.start()
        assert daemon.process is not None
        ready = notify.next()
        # READY=1 once it serves (the harness has had /v1/health answer by now).
        assert ready["READY"] == "1" and ready["MAINPID"] == str(daemon.process.pid)

        before = monotonic_usec()
        daemon.signal(signal.SIGHUP)
        reloading = notify.next()
        after = monotonic_usec()
        # notify-reload ignores a RELOADING=1 without a fresh CLOCK_MONOTONIC stamp (systemd ≥ 253).
        assert reloading["RELOADING"] == "1" and before <= int(reloading["MONOTONIC_USEC"]) <= after
        done = notify.next()
        assert done["READY"] == "1" and done["STATUS"] == "generation 1"
        daemon.wait_log("config.reload")

        daemon.signal(signal.SIGTERM)
        assert notify.next() == {"STOPPING": "1"}
        assert daemon.wait_exit() == 0
    finally:
        daemon.stop()
        notify.close()


def run_probe(probe: str, port: int, token: str) -> subprocess.CompletedProcess[str]:
    """The manifest's probe, as the kubelet runs it in the container (only the port and Python differ)."""
    command = probe_command(probe, port=port, python=sys.executable)
    return subprocess.run(command, capture_output=True, text=True, env={"AGENTD_API_TOKEN": token}, timeout=30)


def test_the_manifests_probes_against_agentd_readiness_fails_while_draining(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    port, token = free_port(), "probe-token-of-the-test"
    config = two_assistant_config(hold, supervisor='stop_grace = "60s"')
    with running_daemon(
        tmp_path, config, args=["--listen", f"127.0.0.1:{port}"], env={"AGENTD_API_TOKEN": token}
    ) as daemon:
        wait_until(lambda: run_probe("startupProbe", port, token).returncode == 0, "the startup probe to pass")
        assert run_probe("livenessProbe", port, token).returncode == 0
        ready = run_probe("readinessProbe", port, token)
        assert ready.returncode == 0 and ready.stdout.startswith("200 ")
        # Without the right token a probe still gets its answer (RFC 0000 §6), never the reasons.
        anonymous = run_probe("readinessProbe", port, "not-the-token")
        assert anonymous.returncode == 0 and '"reasons"' not in anonymous.stdout

        # A turn in flight holds the drain open (up to stop_grace), as in a pod being deleted.
        session = daemon.new_session("held")
        events = daemon.events(session)
        turn_id = daemon.send(session, "work", wait=False)["turn_id"]
        events.wait("step.started", lambda d: d["turn"] == turn_id)
        daemon.signal(signal.SIGTERM)
        daemon.wait_log("supervisor.draining")

        draining = run_probe("readinessProbe", port, token)
        assert draining.returncode == 1 and draining.stdout.startswith("503 ") and "draining" in draining.stdout
        alive = run_probe("livenessProbe", port, token)
        assert alive.returncode == 0, "a draining replica is alive: liveness must not restart it"

        hold.touch()
        assert daemon.wait_exit() == 0


def test_a_replica_started_before_its_database_is_alive_but_neither_ready_nor_ready_for_systemd(
    tmp_path: Path, pg: PgServer
) -> None:
    secret = "store-password-of-the-test"
    port, token = free_port(), "probe-token-of-the-test"
    notify = NotifySocket(tmp_path / "notify.sock")
    with pg.role(secret) as role, pg.database(owner=role) as url, PgFront(pg.admin_url) as front:
        store = f'[store]\nurl = "{front.url(role, database_name(url))}"\n'  # nothing listens there yet
        env = {"NOTIFY_SOCKET": str(notify.path), "AGENTD_API_TOKEN": token, "AGENTD_STORE_PASSWORD": secret}
        daemon = Daemon(
            tmp_path,
            two_assistant_config(tmp_path / "never", top=store),
            args=["--listen", f"127.0.0.1:{port}"],
            env=env,
        )
        try:
            daemon.start()
            assert daemon.process is not None
            waiting = notify.next()
            assert set(waiting) == {"STATUS"}, waiting  # no READY=1: systemd keeps the unit activating
            location = f"postgresql://127.0.0.1:{front.port}/{database_name(url)}"
            assert waiting["STATUS"].startswith(f"waiting for the store: cannot open the store {location}: ")
            assert run_probe("startupProbe", port, token).returncode == 0
            assert run_probe("livenessProbe", port, token).returncode == 0, (
                "liveness must not restart a waiting replica"
            )
            ready = run_probe("readinessProbe", port, token)
            assert ready.returncode == 1 and ready.stdout.startswith("503 ") and "waiting for the store" in ready.stdout

            front.set(FrontMode.FORWARD)
            while "READY" not in (message := notify.next()):  # one STATUS= per failed attempt, meanwhile
                assert message["STATUS"].startswith("waiting for the store: "), message
            assert message["READY"] == "1" and message["MAINPID"] == str(daemon.process.pid)
            wait_until(lambda: run_probe("readinessProbe", port, token).returncode == 0, "readiness once serving")

            daemon.signal(signal.SIGTERM)
            assert notify.next() == {"STOPPING": "1"}
            assert daemon.wait_exit() == 0
            assert secret not in daemon.log_text()
        finally:
            daemon.stop()
            notify.close()
