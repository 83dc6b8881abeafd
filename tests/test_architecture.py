"""The package map of kvtier/__init__.py holds: layers import only downwards, no cycles, only
kvtier.vllm imports vLLM, the engine side never imports the operator tools, every module says
what it is for.

Imports are read from the source (module level and inside functions; ``if TYPE_CHECKING:``
blocks excluded), so a lazy import cannot hide a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvtier"

ENGINE_SIDE = ("core", "policy", "tiers", "copy", "node", "runtime", "vllm")
OPERATOR_SIDE = ("models", "planning", "launch", "doctor", "cachetools", "bench", "replay", "cli")

ALLOWED: dict[str, set[str]] = {
    # engine side, bottom to top
    "core": set(),
    "policy": {"core"},
    "tiers": {"core", "policy"},
    "copy": {"core"},
    "node": {"core", "policy", "tiers"},  # tiers: the service owns the node's disk/Redis (node/below.py)
    "runtime": {"core", "policy", "tiers", "node"},  # node: the client NodeHost drives (runtime/node_host.py)
    "vllm": {"core", "policy", "tiers", "copy", "runtime", "node"},
    # operator side
    "models": {"core"},
    "planning": {"models"},
    "launch": {"core", "models"},
    "doctor": {"core", "planning", "launch", "models", "tiers", "node"},  # the S3 and node probes use their clients
    "cachetools": {"core", "tiers"},
    "bench": {"launch", "models"},
    "replay": {"core", "policy", "tiers", "runtime", "planning"},  # kvtier plan --trace runs the engine's own code
    "cli": {"core", "launch", "planning", "doctor", "cachetools", "bench", "replay", "models", "node", "tiers"},
}
"""Which kvtier packages each package may import (besides itself)."""


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Absolute names imported by ``path`` (relative imports resolved), TYPE_CHECKING excluded."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.orelse:
                    visit(stmt)
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in child.names)
            visit(child)

    visit(tree)
    return found


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def kvtier_graph() -> dict[str, set[str]]:
    """Module -> kvtier modules it imports (names folded to existing modules)."""
    modules = all_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for imported in imports_of(path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported.startswith("kvtier.") and imported != name and not name.startswith(imported + "."):
                deps.add(imported)
        graph[name] = deps
    return graph


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_module_belongs_to_a_known_package():
    strays = [m for m in all_modules() if m != "kvtier" and package_of(m) not in ALLOWED]
    assert not strays, f"modules outside the package map (add them to a package, or to ALLOWED): {strays}"
    top_level_files = [m for m, p in all_modules().items() if m.count(".") == 1 and p.name != "__init__.py"]
    assert not top_level_files, f"top-level modules: {top_level_files}; put each in the package of its concern"


def test_packages_import_only_downwards():
    violations = []
    for module, deps in kvtier_graph().items():
        mine = package_of(module)
        for dep in deps:
            theirs = package_of(dep)
            if theirs != mine and theirs not in ALLOWED.get(mine, set()):
                violations.append(f"{module} -> {dep}")
    assert not violations, "imports against the layering:\n" + "\n".join(sorted(violations))


def test_no_import_cycles():
    graph = kvtier_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            strong(v)
    assert not cycles, f"import cycles: {cycles}"


def test_package_graph_is_acyclic():
    """Also across packages (a module-level DAG could still tangle two packages)."""
    edges = {pkg: set(deps) for pkg, deps in ALLOWED.items()}
    seen: dict[str, int] = {}

    def visit(pkg: str, path: tuple[str, ...]) -> None:
        if seen.get(pkg) == 1:
            raise AssertionError(f"package cycle: {' -> '.join(path + (pkg,))}")
        if seen.get(pkg) == 2:
            return
        seen[pkg] = 1
        for dep in edges.get(pkg, ()):
            visit(dep, path + (pkg,))
        seen[pkg] = 2

    for pkg in edges:
        visit(pkg, ())


@pytest.mark.parametrize("side", [ENGINE_SIDE])
def test_engine_side_never_imports_operator_tools(side):
    bad = [
        f"{m} -> {d}"
        for m, deps in kvtier_graph().items()
        if package_of(m) in side
        for d in deps
        if package_of(d) in OPERATOR_SIDE
    ]
    assert not bad, bad


def test_only_kvtier_vllm_imports_vllm():
    bad = []
    for name, path in all_modules().items():
        if package_of(name) == "vllm":
            continue
        for imported in imports_of(path):
            if imported == "vllm" or imported.startswith("vllm."):
                bad.append(f"{name} imports {imported}")
    assert not bad, bad


def test_every_module_and_package_has_a_docstring():
    missing = [name for name, path in all_modules().items() if not ast.get_docstring(ast.parse(path.read_text()))]
    assert not missing, f"modules without a docstring saying their job: {missing}"


def test_rules_catch_violations(tmp_path, monkeypatch):
    """The checks above can fail: a planted upward import is reported."""
    planted = SRC / "core" / "_planted_for_test.py"
    planted.write_text('"""planted."""\nfrom kvtier.runtime.orchestrator import Orchestrator\n')
    try:
        with pytest.raises(AssertionError, match="core._planted_for_test -> kvtier.runtime.orchestrator"):
            test_packages_import_only_downwards()
    finally:
        planted.unlink()
