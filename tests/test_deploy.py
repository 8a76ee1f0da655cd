"""``deploy/``: the Kubernetes manifests and the systemd unit, checked without a cluster or a systemd.

The manifests are validated against the Kubernetes API schemas (kubernetes-validate, offline;
deploy/kubernetes/README.md says why) and then for what no schema can see: that the pieces refer
to each other correctly, that the shutdown timing covers agentd's own bounds, that secrets come
only from the documented Secrets, and that the config they mount is one agentd accepts. The unit
file is checked against what agentd tells systemd (agentd/supervisor/systemd.py, RFC 0000 §5).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import anyio
import kubernetes_validate
import pytest

from agentd.config import Config, SupervisorSettings, parse_config, parse_duration
from agentd.supervisor import daemon
from agentd.supervisor.child import KILL_AFTER_TERM, SHUTDOWN_SEND_TIMEOUT, ChildProcess
from agentd.supervisor.daemon import EXIT_CONFIG, SERVER_EXIT_GRACE
from agentd.validate import validate_config_file
from tests.deploy_files import (
    K8S,
    SYSTEMD,
    container,
    documented_secrets,
    flag,
    generated_config_maps,
    kustomization,
    manifests,
    merged,
    one,
    pod_spec,
    probe_command,
    read_unit,
    timespan_seconds,
    value,
    values,
)

#: The Kubernetes versions the manifests are written for: 1.30 is the first where the preStop
#: `sleep` action is on by default; 1.37 the newest schema the pinned kubernetes-validate bundles.
KUBERNETES_VERSIONS = ("1.30", "1.37")

#: What agentd itself may take after stop_grace before it exits (RFC 0003 §2 item 5, §5): the
#: children's kill ladder with grace 0 — the Shutdown frame's send, the wait before SIGTERM, the wait
#: before SIGKILL — then the API servers' bounded exit. REAP_AFTER_GRACE is a literal in
#: ChildProcess.stop, checked below so that a change there shows up here.
REAP_AFTER_GRACE = 0.5
SHUTDOWN_TAIL = SHUTDOWN_SEND_TIMEOUT + REAP_AFTER_GRACE + KILL_AFTER_TERM + SERVER_EXIT_GRACE

#: Left over after the sum, for what agentd does not bound by a constant: closing the store (the
#: PostgreSQL pool) and, with replicas, releasing the leases.
SHUTDOWN_MARGIN = 5.0

CONFIG_FILE = K8S / "agentd.toml"
#: Names that hold secrets: such a variable must come from a Secret, never from a literal.
SECRET_NAME = re.compile(r"TOKEN|PASSWORD|PASSWD|SECRET|CREDENTIAL|API_KEY|_KEY$")


def test_the_shutdown_tail_is_the_one_childprocess_stop_implements() -> None:
    assert f"move_on_after(grace + {REAP_AFTER_GRACE})" in inspect.getsource(ChildProcess.stop), (
        "ChildProcess.stop waits another time before SIGTERM: update REAP_AFTER_GRACE, and the "
        "shutdown arithmetic in deploy/kubernetes/deployment.yaml, its README and deploy/systemd"
    )


# --------------------------------------------------------------------------- the schema


def test_the_kustomization_lists_every_manifest_and_the_config() -> None:
    kust = kustomization()
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == on_disk, "every manifest in deploy/kubernetes is applied, and only those"
    (generator,) = kust["configMapGenerator"]
    assert generator["files"] == ["agentd.toml"]
    # A hashed name would turn every config change into a rollout instead of a hot reload.
    assert generator["options"]["disableNameSuffixHash"] is True
    assert kust["namespace"] == one("Namespace")["metadata"]["name"]
    image_names = {i["name"] for i in kust["images"]}
    assert container()["image"].rpartition(":")[0] in image_names, "kustomization.yaml sets the Deployment's image"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_matches_the_kubernetes_schema(version: str) -> None:
    kinds = []
    for manifest in manifests():
        name = f"{manifest['kind']}/{manifest['metadata']['name']}"
        try:
            kubernetes_validate.validate(manifest, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{name} is not valid Kubernetes {version}: {where}: {exc.message}")
        kinds.append(manifest["kind"])
    assert sorted(kinds) == ["ConfigMap", "Deployment", "Namespace", "PodDisruptionBudget", "Service"]


def test_the_schema_check_rejects_what_it_should() -> None:
    """The validator is not a no-op: an unknown field (strict) and a wrong type are refused."""
    typo = one("Deployment")
    typo["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinessProbes"):
        kubernetes_validate.validate(typo, KUBERNETES_VERSIONS[0], strict=True)
    wrong = one("Deployment")
    wrong["spec"]["replicas"] = "3"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, KUBERNETES_VERSIONS[0], strict=True)


# --------------------------------------------------------------------------- cross-references


def pod_labels() -> dict[str, str]:
    labels: dict[str, str] = one("Deployment")["spec"]["template"]["metadata"]["labels"]
    return labels


def selects_the_pods(selector: dict[str, str]) -> bool:
    return bool(selector) and selector.items() <= pod_labels().items()


def test_the_service_the_budget_and_the_spread_select_the_deployments_pods() -> None:
    deployment = one("Deployment")
    assert selects_the_pods(deployment["spec"]["selector"]["matchLabels"])
    assert selects_the_pods(one("Service")["spec"]["selector"])
    assert selects_the_pods(one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"])
    for spread in pod_spec()["topologySpreadConstraints"]:
        assert selects_the_pods(spread["labelSelector"]["matchLabels"])


def test_replicas_rollout_and_disruption_budget() -> None:
    spec = one("Deployment")["spec"]
    assert spec["replicas"] == 3
    # A rollout adds a pod before it removes one: never fewer than `replicas` ready.
    assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    budget = one("PodDisruptionBudget")["spec"]
    # One of the two, never both (the API server refuses both); maxUnavailable: pdb.yaml says why.
    assert budget["maxUnavailable"] == 1 and "minAvailable" not in budget


def test_the_listen_port_the_container_port_the_service_and_the_probes_agree() -> None:
    agentd = container()
    host, _, port = flag(agentd["command"], "--listen").rpartition(":")
    assert host == "0.0.0.0", "the Service reaches the pod on its IP, not on loopback"
    (http,) = [p for p in agentd["ports"] if p["name"] == "http"]
    assert http["containerPort"] == int(port)
    (service_port,) = one("Service")["spec"]["ports"]
    assert service_port["targetPort"] in ("http", int(port))
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert probe_command(probe)[-2] == port, f"{probe} asks the port agentd listens on"


def test_the_command_runs_agentd_with_the_mounted_config_and_watches_it() -> None:
    agentd = container()
    command = agentd["command"]
    assert command[:2] == ["agentd", "run"]
    assert "--watch-config" in command
    assert flag(command, "--log-format") == "json"
    config = Path(flag(command, "--config"))
    (mount,) = [m for m in agentd["volumeMounts"] if m["name"] == "config"]
    # A directory mount: the kubelet updates it by swapping ..data; a subPath mount never updates.
    assert "subPath" not in mount and "subPathExpr" not in mount
    assert Path(mount["mountPath"]) == config.parent and mount["readOnly"] is True
    (volume,) = [v for v in pod_spec()["volumes"] if v["name"] == "config"]
    (generated,) = generated_config_maps()
    assert volume["configMap"]["name"] == generated["metadata"]["name"]
    assert "items" not in volume["configMap"], "every key of the ConfigMap is a file in the directory"
    assert config.name in generated["data"]


def test_probes_ask_health_and_ready_and_read_the_token_from_the_environment() -> None:
    paths = {probe: probe_command(probe)[-1] for probe in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert paths == {"startupProbe": "/v1/health", "livenessProbe": "/v1/health", "readinessProbe": "/v1/ready"}
    scripts = {tuple(probe_command(probe)[:-2]) for probe in paths}
    assert len(scripts) == 1, "the three probes run the same script"
    (script,) = scripts
    assert script[:4] == ("python3", "-I", "-S", "-c")
    assert 'os.environ["AGENTD_API_TOKEN"]' in script[4]
    assert all("httpGet" not in container()[probe] for probe in paths)


class _FakeAgentd(BaseHTTPRequestHandler):
    """Answers like agentd's TCP listener: 401 without the token, /v1/ready draining."""

    token = "token-of-the-test"
    seen: list[str | None] = []  # noqa: RUF012 - one class per server, reset by the fixture

    def do_GET(self) -> None:
        type(self).seen.append(self.headers.get("Authorization"))
        if self.headers.get("Authorization") != f"Bearer {self.token}":
            status, body = 401, {"error": {"code": "unauthorized"}}
        elif self.path == "/v1/health":
            status, body = 200, {"status": "ok"}
        else:
            status, body = 503, {"ready": False, "reasons": ["draining"]}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def fake_agentd() -> Iterator[int]:
    _FakeAgentd.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeAgentd)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def run_probe(probe: str, port: int, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = probe_command(probe, port=port, python=sys.executable)
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=30)


def test_the_probe_script_sends_the_token_and_passes_only_on_200(fake_agentd: int) -> None:
    env = {"PATH": os.environ["PATH"], "AGENTD_API_TOKEN": _FakeAgentd.token}
    health = run_probe("livenessProbe", fake_agentd, env)
    assert health.returncode == 0 and health.stdout.startswith("200 ")
    ready = run_probe("readinessProbe", fake_agentd, env)
    assert ready.returncode == 1 and "503" in ready.stdout and "draining" in ready.stdout
    wrong = run_probe("livenessProbe", fake_agentd, {**env, "AGENTD_API_TOKEN": "another"})
    assert wrong.returncode == 1 and wrong.stdout.startswith("401 ")
    assert _FakeAgentd.seen == [f"Bearer {_FakeAgentd.token}"] * 2 + ["Bearer another"]
    unset = run_probe("livenessProbe", fake_agentd, {"PATH": os.environ["PATH"]})
    assert unset.returncode == 1 and len(_FakeAgentd.seen) == 3, "no token, no request: the probe fails"


def test_termination_grace_covers_prestop_the_drain_and_agentds_shutdown_bounds() -> None:
    spec = pod_spec()
    pre_stop = container()["lifecycle"]["preStop"]["sleep"]["seconds"]
    stop_grace = mounted_config().supervisor.stop_grace
    needed = pre_stop + stop_grace + SHUTDOWN_TAIL + SHUTDOWN_MARGIN
    assert spec["terminationGracePeriodSeconds"] >= needed, (
        f"terminationGracePeriodSeconds {spec['terminationGracePeriodSeconds']} < preStop {pre_stop} + "
        f"stop_grace {stop_grace:g} + shutdown {SHUTDOWN_TAIL:g} + margin {SHUTDOWN_MARGIN:g}"
    )
    # preStop gives the endpoints time to drop the pod before agentd turns requests away.
    assert pre_stop >= 3


def env_entries() -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container()["env"]}


def test_secrets_come_only_from_the_documented_secrets() -> None:
    documented = documented_secrets()
    used: dict[str, set[str]] = {}
    for name, entry in env_entries().items():
        ref = entry.get("valueFrom", {}).get("secretKeyRef")
        if SECRET_NAME.search(name):
            assert ref is not None and "value" not in entry, f"{name} must come from a Secret"
        if ref is not None:
            used.setdefault(ref["name"], set()).add(ref["key"])
    for volume in pod_spec()["volumes"]:
        if "secret" in volume:
            keys = {item["key"] for item in volume["secret"]["items"]}
            used.setdefault(volume["secret"]["secretName"], set()).update(keys)
    assert used, "the Deployment takes its secrets from Secrets"
    for secret, keys in used.items():
        assert keys <= documented.get(secret, set()), (
            f"Secret {secret} keys {sorted(keys - documented.get(secret, set()))} are not documented "
            f"in deploy/kubernetes/README.md (a `kubectl create secret generic {secret} --from-file=KEY=…`)"
        )
    assert documented == used, "every documented Secret key is used (the README is not stale)"


def test_no_token_or_password_is_written_in_deploy() -> None:
    for path in sorted(K8S.parent.rglob("*")):
        if not path.is_file():
            continue
        text = path.read_text()
        assert not re.search(r"Bearer [A-Za-z0-9._~+/-]{8,}", text), f"{path}: a bearer token"
        for url in re.findall(r"postgres(?:ql)?://[^\s\"']+", text):
            parts = urlsplit(url)
            assert parts.password is None and "password" not in parse_qs(parts.query), f"{path}: {url}"


# --------------------------------------------------------------------------- the mounted config


STORE_IS_KNOWN = "store" in Config.__struct_fields__


def without_table(text: str, name: str) -> str:
    """``text`` without the TOML table ``[name]`` (and its sub-tables)."""
    kept, skipping = [], False
    for line in text.splitlines(keepends=True):
        header = re.match(r"\s*\[\[?\s*([A-Za-z0-9_.-]+)\s*\]\]?", line)
        if header:
            skipping = header.group(1) == name or header.group(1).startswith(f"{name}.")
        if not skipping:
            kept.append(line)
    return "".join(kept)


def mounted_config() -> Config:
    """The config every replica reads, parsed as agentd parses it (without [store] where unknown)."""
    text = CONFIG_FILE.read_text()
    if not STORE_IS_KNOWN:
        text = without_table(text, "store")
    return parse_config(text, str(CONFIG_FILE))


def test_the_config_passes_check_config(tmp_path: Path) -> None:
    """The same validation as `agentd check-config` (and every start and reload): RFC 0000 §2."""
    _, issues = validate_config_file(CONFIG_FILE)
    if STORE_IS_KNOWN:
        assert issues == []
        return
    # `[store]` (PostgreSQL, leases) is planned and not in this agentd's schema yet (RFC 0000 §11),
    # so the file is refused for that key and that key alone. The rest is validated without the
    # table. Once the store lands, STORE_IS_KNOWN is true and the whole file is checked above.
    assert [(i.path, i.message.partition(";")[0]) for i in issues] == [("store", "unknown key")]
    text = CONFIG_FILE.read_text()
    stripped = without_table(text, "store")
    assert tomllib.loads(stripped) == {k: v for k, v in tomllib.loads(text).items() if k != "store"}
    (tmp_path / "agentd.toml").write_text(stripped)
    config, issues = validate_config_file(tmp_path / "agentd.toml")
    assert issues == [] and config is not None


def test_the_store_is_postgresql_over_verified_tls_without_a_password() -> None:
    store = tomllib.loads(CONFIG_FILE.read_text())["store"]
    assert set(store) == {"url", "password_env", "lease"}
    parts = urlsplit(store["url"])
    assert parts.scheme == "postgresql" and parts.password is None and parts.hostname
    query = parse_qs(parts.query)
    # verify-full: encrypted, and the server must prove it is that host. `require` would accept anyone.
    assert query["sslmode"] == ["verify-full"]
    (root_cert,) = query["sslrootcert"]
    mounts = {m["name"]: m for m in container()["volumeMounts"]}
    (ca,) = [
        v
        for v in pod_spec()["volumes"]
        if "secret" in v and Path(root_cert).parent == Path(mounts[v["name"]]["mountPath"])
    ]
    assert [item["path"] for item in ca["secret"]["items"]] == [Path(root_cert).name]
    assert parse_duration(store["lease"]) >= 1.0
    # Until the store lands its schema cannot check these: the password's variable is a Secret's.
    assert env_entries()[store["password_env"]]["valueFrom"]["secretKeyRef"]


def test_every_variable_the_config_names_is_given_to_the_pod() -> None:
    config = mounted_config()
    named = {config.intelligence.api_key_env} | {
        a.intelligence.api_key_env for a in config.assistants if a.intelligence is not None
    }
    named.discard(None)
    # pass_env names (not `PREFIX*` patterns, which may match nothing) are variables someone must set.
    named |= {n for n in config.supervisor.pass_env if not n.endswith("*")}
    missing = {n for n in named if n is not None and n not in env_entries()}
    assert not missing, f"agentd.toml names variables the Deployment does not set: {sorted(missing)}"


def test_the_state_dir_is_the_same_emptydir_everywhere() -> None:
    config = mounted_config()
    mounts = {m["mountPath"]: m["name"] for m in container()["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    assert config.server.state_dir == env_entries()["AGENTD_STATE_DIR"]["value"]
    assert "emptyDir" in volumes[mounts[config.server.state_dir]], "the state dir is writable and the pod's own"
    assert "emptyDir" in volumes[mounts["/tmp"]], "a read-only root needs a writable /tmp"
    # The listen address is the Deployment's flag; one in [server] would be overridden silently.
    assert config.server.listen is None


def test_the_pool_is_sized_for_the_pod_not_the_node() -> None:
    config = mounted_config()
    limits = container()["resources"]["limits"]
    # children = 0 means os.cpu_count(): the node's CPUs, not the pod's limit.
    assert 1 <= config.supervisor.children <= cpu_quantity(limits["cpu"])
    assert config.supervisor.max_children >= config.supervisor.children


# --------------------------------------------------------------------------- pod security


def cpu_quantity(text: str | int) -> float:
    text = str(text)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def memory_quantity(text: str) -> float:
    factors = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 1e3, "M": 1e6, "G": 1e9}
    for suffix, factor in factors.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def test_the_pod_meets_the_restricted_pod_security_standard() -> None:
    assert one("Namespace")["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    spec = pod_spec()
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    assert spec["automountServiceAccountToken"] is False
    # Service links would inject AGENTD_* variables (AGENTD_PORT, …) into agentd's env-twin namespace.
    assert spec["enableServiceLinks"] is False
    for volume in spec["volumes"]:
        assert set(volume) - {"name"} <= {"configMap", "secret", "emptyDir"}, volume
    security = container()["securityContext"]
    assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"]} and not security.get("privileged")


def test_resources_are_requested_and_bounded() -> None:
    resources = container()["resources"]
    requests, limits = resources["requests"], resources["limits"]
    assert cpu_quantity(requests["cpu"]) <= cpu_quantity(limits["cpu"])
    assert memory_quantity(requests["memory"]) <= memory_quantity(limits["memory"])


# --------------------------------------------------------------------------- --watch-config and the ConfigMap


class _Reloads:
    def __init__(self) -> None:
        self.count = 0
        self.changed = anyio.Event()

    async def reload(self) -> None:
        self.count += 1
        self.changed.set()


@pytest.mark.anyio
async def test_watch_config_follows_a_configmap_update(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kubelet's update of a ConfigMap volume, as its atomic writer does it, reaches --watch-config.

    The volume holds a timestamped directory with the files, ``..data`` → that directory, and
    ``agentd.toml`` → ``..data/agentd.toml``. An update writes a new timestamped directory, points a
    new symlink at it, renames it over ``..data`` (one atomic step) and removes the old directory.
    The path agentd watches never changes; only what it resolves to does.
    """
    monkeypatch.setattr(daemon, "WATCH_INTERVAL", 0.05)
    polls: list[float | None] = []

    class CountingMtime(daemon._Mtime):
        async def __call__(self) -> float | None:
            polls.append(await super().__call__())
            return polls[-1]

    monkeypatch.setattr(daemon, "_Mtime", CountingMtime)
    volume = tmp_path / "etc-agentd"
    volume.mkdir()

    def publish(stamp: str, text: str, mtime: float) -> Path:
        data = volume / f"..{stamp}"
        data.mkdir()
        (data / "agentd.toml").write_text(text)
        os.utime(data / "agentd.toml", (mtime, mtime))
        (volume / "..data_tmp").symlink_to(data.name)
        os.replace(volume / "..data_tmp", volume / "..data")
        return data

    first = publish("2026_01_01_00_00_00.000000001", "first", mtime=1_700_000_000)
    (volume / "agentd.toml").symlink_to("..data/agentd.toml")
    watched = _Reloads()
    async with anyio.create_task_group() as tg:
        tg.start_soon(daemon._watch_config, watched, volume / "agentd.toml")
        with anyio.fail_after(10):
            while len(polls) < 3:  # its first reading and two polls of an unchanged file
                await anyio.sleep(0.01)
        assert watched.count == 0 and polls[0] == 1_700_000_000
        second = publish("2026_01_01_00_01_00.000000002", "second", mtime=1_700_000_060)
        shutil.rmtree(first)
        with anyio.fail_after(10):
            await watched.changed.wait()
        assert watched.count == 1 and (volume / "agentd.toml").read_text() == "second"
        watched.changed = anyio.Event()
        publish("2026_01_01_00_02_00.000000003", "third", mtime=1_700_000_120)
        shutil.rmtree(second)
        with anyio.fail_after(10):
            await watched.changed.wait()
        assert watched.count == 2
        tg.cancel_scope.cancel()


# --------------------------------------------------------------------------- systemd


UNIT = SYSTEMD / "agentd.service"
BEFORE_253 = SYSTEMD / "before-253.conf"


def test_the_unit_is_notify_reload_and_agentd_sends_what_that_needs() -> None:
    unit = read_unit(UNIT)
    assert value(unit, "Service", "Type") == "notify-reload"
    assert value(unit, "Service", "ReloadSignal") in (None, "SIGHUP"), "agentd reloads on SIGHUP"
    # systemd sends the signal itself; an ExecReload= as well would make some releases reload twice.
    assert values(unit, "Service", "ExecReload") == []
    assert value(unit, "Service", "NotifyAccess") in (None, "main"), "only the main process notifies"
    # notify-reload needs READY=1 at start and after a reload, RELOADING=1 with MONOTONIC_USEC when
    # one starts; STOPPING=1 tells a drain from a hang. tests/test_e2e_deploy.py checks them on the
    # wire; here, that the daemon's code sends each.
    source = inspect.getsource(daemon)
    for field in ("READY=1", "RELOADING=1", "MONOTONIC_USEC=", "STOPPING=1"):
        assert f'"{field}' in source, f"agentd no longer sends {field}"
    # agentd never sends WATCHDOG=1: a WatchdogSec= would have systemd kill a healthy daemon.
    assert "WATCHDOG=1" not in source and value(unit, "Service", "WatchdogSec") is None


def test_before_253_the_drop_in_makes_it_notify_with_a_sighup_reload() -> None:
    drop_in = read_unit(BEFORE_253)
    unit = merged(read_unit(UNIT), drop_in)
    assert value(unit, "Service", "Type") == "notify"
    assert values(unit, "Service", "ExecReload") == ["/bin/kill -HUP $MAINPID"]
    assert {k for k, _ in drop_in["Service"]} == {"Type", "ExecReload"}, "the drop-in changes only those"


def test_timeout_stop_covers_stop_grace_and_agentds_shutdown_bounds() -> None:
    unit = read_unit(UNIT)
    timeout = value(unit, "Service", "TimeoutStopSec")
    assert timeout is not None
    needed = SupervisorSettings().stop_grace + SHUTDOWN_TAIL + SHUTDOWN_MARGIN
    assert timespan_seconds(timeout) >= needed, f"TimeoutStopSec={timeout} < {needed:g}s"
    # SIGTERM to agentd alone: it drains, then stops its children (RFC 0003 §2); SIGKILL to all at the timeout.
    assert value(unit, "Service", "KillMode") == "mixed"
    assert value(unit, "Service", "KillSignal") in (None, "SIGTERM")


def test_the_unit_bounds_the_wait_for_the_store_on_purpose() -> None:
    """agentd waits for a PostgreSQL store that is not there yet, not READY=1 meanwhile (RFC 0009 §1):
    the unit says how long, rather than systemd's default 90 s deciding by accident."""
    timeout = value(read_unit(UNIT), "Service", "TimeoutStartSec")
    assert timeout is not None, "TimeoutStartSec= bounds agentd's wait for its store: set it on purpose"
    assert timeout == "infinity" or timespan_seconds(timeout) >= 120, f"TimeoutStartSec={timeout}"
    assert '"STATUS=' in inspect.getsource(daemon), "agentd no longer says why it is not ready yet"


def test_the_unit_runs_agentd_on_its_state_directory_with_secrets_from_a_file() -> None:
    unit = read_unit(UNIT)
    (start,) = values(unit, "Service", "ExecStart")
    command = start.split()
    assert command[0].endswith("/agentd") and command[1] == "run"
    assert flag(command, "--state-dir") == f"/var/lib/{value(unit, 'Service', 'StateDirectory')}"
    assert flag(command, "--config").startswith("/etc/")
    assert value(unit, "Service", "EnvironmentFile")
    for assignment in values(unit, "Service", "Environment"):
        for name in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", assignment):
            assert not SECRET_NAME.search(name), f"{name} belongs in EnvironmentFile=, not in the unit"
    assert str(EXIT_CONFIG) in (value(unit, "Service", "RestartPreventExitStatus") or "").split()
    assert int(value(unit, "Service", "LimitNOFILE") or 0) >= 4096


def test_the_unit_is_hardened() -> None:
    unit = read_unit(UNIT)
    expected = {
        "ProtectSystem": "strict",
        "NoNewPrivileges": "yes",
        "PrivateTmp": "yes",
        "ProtectHome": "yes",
        "CapabilityBoundingSet": "",
        "RestrictSUIDSGID": "yes",
    }
    assert {k: value(unit, "Service", k) for k in expected} == expected
    assert value(unit, "Service", "User") not in (None, "root")
    # ~@resources would block the setrlimit agentd raises its open-files limit with.
    assert "@resources" not in " ".join(values(unit, "Service", "SystemCallFilter"))
