"""The package's layout keeps the rules of RFC 0000 §8 and the README's "Layout": no import cycles
anywhere in ``agentd/``, every log event named by a constant of ``agentd/events.py``, and no
module over 700 lines.

Read from the source with ``ast`` (nothing is imported), so a function-level import counts as an
edge like any other: a cycle that only a lazy import hides is still a cycle in the design.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "agentd"
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports (a ``from package import submodule`` is an edge
    to the submodule, not to the package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            edges |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            subs = {f"{base}.{alias.name}" for alias in node.names} & known.keys()
            edges |= subs
            if len(subs) < len(node.names) and base in known:
                edges.add(base)
    edges.discard(name)
    return edges


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_cycles() -> None:
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def literal_log_events(path: Path) -> Iterator[str]:
    """``file:line event`` for each log call whose event is a string literal, not a constant."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in LEVELS
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "log"
            and node.args
            and any(isinstance(part, ast.Constant) and isinstance(part.value, str) for part in ast.walk(node.args[0]))
        ):
            yield f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"


def test_every_log_event_is_named_by_a_constant_of_the_events_module() -> None:
    assert [where for path in sorted(PACKAGE.rglob("*.py")) for where in literal_log_events(path)] == []


#: The most lines a module of the package may have (the README's "Layout": split by responsibility).
MAX_MODULE_LINES = 700


def test_no_module_is_over_the_bound() -> None:
    sizes = {
        str(path.relative_to(PACKAGE.parent)): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")
    }
    assert {name: lines for name, lines in sizes.items() if lines > MAX_MODULE_LINES} == {}


#: The state of a hot session and of its turn in flight (``agentd.supervisor.session``): only that
#: module's methods assign it (RFC 0006 §12, "one owner").
OWNED_FIELDS = set(
    [
        "pending",
        "child",
        "state",
        "generation",
        "model",
        "assistant",
        "crashes",
        "quarantined",
        "backlog",
        "lease",
        "last_token",
        "closing",
        "intel_waiting",
        "idle_since",
        "record",
        "cut",
        "cut_code",
        "runs",
        "elsewhere",
        "cancel_requested",
        "budget_start",
        "entries",
        "journal_writes",
        "lost",
        "crashed",
        "settled",
    ]
)
OWNER = PACKAGE / "supervisor" / "session.py"


def foreign_assignments(path: Path) -> Iterator[str]:
    """Assignments to a session's or turn's fields through anything but ``self``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in ast.walk(target)]
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.ctx, ast.Store)
                and target.attr in OWNED_FIELDS
                and not (isinstance(target.value, ast.Name) and target.value.id == "self")
            ):
                yield f"{path.name}:{node.lineno} .{target.attr}"


def test_only_the_session_module_assigns_a_hot_sessions_state() -> None:
    others = sorted(p for p in PACKAGE.rglob("*.py") if p != OWNER)
    assert [where for path in others for where in foreign_assignments(path)] == []


def test_the_owner_check_finds_a_foreign_assignment(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f(runtime, turn):\n    runtime.child = None\n    turn.runs += 1\n    self.state = 1\n")
    assert [w.rsplit(" ", 1)[1] for w in foreign_assignments(module)] == [".child", ".runs"]


#: What starts, ends or commits a turn: only the turns package (``agentd.supervisor.turns``) calls
#: these (the store defines its own), and only it makes a ``PendingTurn`` (RFC 0006 §12).
TURN_LIFECYCLE_CALLS = {"begin_turn", "commit_turn", "abandon_turn", "end_without_result", "commit_done", "PendingTurn"}
TURNS_PACKAGE = PACKAGE / "supervisor" / "turns"


def turn_lifecycle_calls(path: Path) -> Iterator[str]:
    """Calls that start, end or commit a turn, in ``path``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if name in TURN_LIFECYCLE_CALLS:
            yield f"{path.name}:{node.lineno} {name}"


def test_only_the_turns_package_starts_ends_or_commits_a_turn() -> None:
    outside = sorted(
        p for p in PACKAGE.rglob("*.py") if TURNS_PACKAGE not in p.parents and PACKAGE / "store" not in p.parents
    )
    assert [where for path in outside for where in turn_lifecycle_calls(path)] == []


def test_the_turn_check_finds_a_turn_ended_elsewhere(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("async def f(runner, store, t):\n    await runner.end_without_result(t)\n    PendingTurn(id=1)\n")
    assert sorted(w.rsplit(" ", 1)[1] for w in turn_lifecycle_calls(module)) == ["PendingTurn", "end_without_result"]
