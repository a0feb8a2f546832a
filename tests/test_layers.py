"""The packages import each other only downwards (docs/architecture.md): read from the code's own imports,
function-level ones included, so a new arrow against the layering fails here with the file that drew it."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Each package and the project packages it may import (besides itself), bottom to top.
MAY_IMPORT: dict[str, set[str]] = {
    "runtime": set(),
    "wire": set(),
    "scenario": set(),
    "secagg": set(),
    "methods": {"scenario"},
    "monitoring": {"wire"},
    "runconfig": {"scenario", "methods"},
    "edge_node": {"runtime", "wire", "secagg", "scenario", "methods", "monitoring"},
    "coordinator": {"runtime", "wire", "secagg", "scenario", "methods", "monitoring", "runconfig"},
    "containers": {"wire", "secagg", "scenario", "methods", "monitoring", "runconfig"},
    "fcl_emu": {"runtime", "wire", "secagg", "scenario", "methods", "monitoring", "runconfig", "edge_node",
                "coordinator", "containers"},
}


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """(top-level package, line) of every absolute import in ``path``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update((alias.name.split(".")[0], node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add((node.module.split(".")[0], node.lineno))
    return out


def arrows() -> list[tuple[str, str, str]]:
    """(importing package, imported package, file:line) for every import between project packages."""
    found = []
    for package in MAY_IMPORT:
        for path in sorted((ROOT / package).rglob("*.py")):
            for target, line in imported_packages(path):
                if target in MAY_IMPORT and target != package:
                    found.append((package, target, f"{path.relative_to(ROOT)}:{line}"))
    return found


def test_every_package_is_in_the_table():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert packages == set(MAY_IMPORT), "add the new package to MAY_IMPORT and docs/architecture.md"


def test_packages_import_only_downwards():
    wrong = [f"{where}: {source} imports {target}" for source, target, where in arrows()
             if target not in MAY_IMPORT[source]]
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_coordinator_and_edge_node_never_import_each_other():
    both = {"coordinator", "edge_node"}
    assert not [a for a in arrows() if {a[0], a[1]} == both]


def test_the_table_is_acyclic():
    order: list[str] = []
    pending = dict(MAY_IMPORT)
    while pending:
        ready = [p for p, deps in pending.items() if deps <= set(order)]
        assert ready, f"cycle among {sorted(pending)}"
        order += sorted(ready)
        for p in ready:
            del pending[p]


def test_the_reader_catches_function_level_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from coordinator.engine import Coordinator\n    import edge_node.node\n")
    assert imported_packages(path) == {("coordinator", 2), ("edge_node", 3)}
