"""Reading ``deploy/``: the Kubernetes manifests (as kustomize would assemble them) and systemd units.

Shared by ``tests/test_deploy.py`` (the files themselves) and ``tests/test_e2e_deploy.py`` (the
files against a real daemon). Nothing here decides whether a file is right; the tests do.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "kubernetes"
SYSTEMD = REPO / "deploy" / "systemd"


def load_yaml(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def kustomization() -> dict[str, Any]:
    (doc,) = load_yaml(K8S / "kustomization.yaml")
    return doc


def generated_config_maps() -> list[dict[str, Any]]:
    """The ConfigMaps ``configMapGenerator`` makes: one key per file, named after the file."""
    made = []
    for generator in kustomization().get("configMapGenerator", []):
        options = generator.get("options", {})
        made.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": generator["name"], "labels": options.get("labels", {})},
                "data": {Path(f).name: (K8S / f).read_text() for f in generator.get("files", [])},
            }
        )
    return made


def manifests() -> list[dict[str, Any]]:
    """Every object ``kubectl apply -k deploy/kubernetes`` would create."""
    objects = [doc for resource in kustomization()["resources"] for doc in load_yaml(K8S / resource)]
    return objects + generated_config_maps()


def one(kind: str) -> dict[str, Any]:
    (found,) = [m for m in manifests() if m["kind"] == kind]
    return found


def pod_spec() -> dict[str, Any]:
    spec: dict[str, Any] = one("Deployment")["spec"]["template"]["spec"]
    return spec


def container() -> dict[str, Any]:
    (agentd,) = pod_spec()["containers"]
    return agentd


def flag(command: list[str], name: str) -> str:
    """The value after ``name`` in ``command`` (which must have it exactly once)."""
    assert command.count(name) == 1, f"{name} appears {command.count(name)} times in {command}"
    return command[command.index(name) + 1]


def probe_command(probe: str, *, port: int | None = None, python: str | None = None) -> list[str]:
    """The exec command of ``probe`` (``readinessProbe``, …), optionally aimed at another port or Python."""
    command = list(container()[probe]["exec"]["command"])
    if python is not None:
        command[0] = python
    if port is not None:
        command[-2] = str(port)
    return command


def documented_secrets(readme: Path = K8S / "README.md") -> dict[str, set[str]]:
    """Secret name → keys, from every ``kubectl … create secret generic NAME --from-…=KEY=…`` in ``readme``."""
    text = readme.read_text().replace("\\\n", " ")
    found: dict[str, set[str]] = {}
    for match in re.finditer(r"create secret generic (\S+)([^\n]*)", text):
        keys = re.findall(r"--from-(?:file|literal)=([^=\s]+)=", match.group(2))
        found.setdefault(match.group(1), set()).update(keys)
    return found


# --------------------------------------------------------------------------- systemd units


def read_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A unit file as systemd reads it: sections of ``(key, value)`` in order, repeats kept.

    Not configparser: a unit repeats keys (``ExecReload=`` then ``ExecReload=…``), and an empty
    assignment resets a list, which only the order tells.
    """
    sections: dict[str, list[tuple[str, str]]] = {}
    current: str | None = None
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        line, pending = pending + line, ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
            sections.setdefault(current, [])
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"{path}: not a unit line: {raw!r}"
        sections[current].append((key.strip(), value.strip()))
    return sections


def merged(*units: dict[str, list[tuple[str, str]]]) -> dict[str, list[tuple[str, str]]]:
    """A unit and its drop-ins, in the order systemd applies them."""
    out: dict[str, list[tuple[str, str]]] = {}
    for unit in units:
        for section, pairs in unit.items():
            out.setdefault(section, []).extend(pairs)
    return out


def values(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    """Every value ``key`` holds after all assignments (an empty assignment clears the list)."""
    held: list[str] = []
    for k, v in unit.get(section, []):
        if k == key:
            held = [] if v == "" else [*held, v]
    return held


def value(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> str | None:
    """The value of a single-valued ``key``: the last assignment wins."""
    held = [v for k, v in unit.get(section, []) if k == key]
    return held[-1] if held else None


def timespan_seconds(text: str) -> float:
    """A systemd time span (``30``, ``30s``, ``1min 30s``, ``500ms``) in seconds."""
    units = {"": 1.0, "s": 1.0, "sec": 1.0, "ms": 0.001, "m": 60.0, "min": 60.0, "h": 3600.0}
    return sum(float(n) * units[unit] for n, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text))
