"""The project's folders import each other only downwards (docs/architecture.md), no two of its files import
each other in a circle, no file of it grows past 600 lines, and every import names the installed package
(``fcl_emu.<folder>``, pyproject.toml's package-dir), never a bare folder. The experiment tables (``experiments/``)
sit above the product and are not installed with it: nothing in the product imports them, and they name only its
public surface. The imports are read from the code itself, function-level ones included, so a new arrow against the
layering or a new cycle fails here with the file and line that drew it."""

import ast
import re
import subprocess
import sys
import tomllib
from collections import deque
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Top-level folders with .py files that are not the project's code: the tests, setuptools' build outputs.
NOT_PROJECT = {"tests", "build", "dist"}

# Each top-level folder of code (package or folder of scripts) and the project packages it may import (besides
# itself), bottom to top.
MAY_IMPORT: dict[str, set[str]] = {
    "runtime": set(),
    "wire": set(),
    "scenario": set(),
    "secagg": set(),
    "aggregation": set(),
    "methods": {"scenario", "aggregation"},
    "monitoring": {"wire"},
    "runconfig": {"scenario", "aggregation", "methods", "secagg"},
    "edge_node": {"runtime", "wire", "secagg", "scenario", "aggregation", "methods", "monitoring"},
    "edge_aggregator": {"runtime", "wire", "secagg", "aggregation"},
    "gpu_worker": {"runtime", "wire", "methods", "monitoring"},
    "coordinator": {"runtime", "wire", "secagg", "scenario", "aggregation", "methods", "monitoring", "runconfig",
                    "gpu_worker"},
    "containers": {"wire", "secagg", "scenario", "methods", "monitoring", "runconfig"},
    "fcl_emu": {"runtime", "wire", "secagg", "scenario", "aggregation", "methods", "monitoring", "runconfig",
                "edge_node", "edge_aggregator", "gpu_worker", "coordinator", "containers"},
    # the experiment tables, above the product and not installed with it: what they may name of it is
    # EXPERIMENTS_SURFACE (test_the_experiments_use_the_product_s_public_surface)
    "experiments": {"fcl_emu", "monitoring", "methods", "scenario", "coordinator"},
}

# Folders of code run from a checkout, not installed (no package-dir entry): the experiment tables.
NOT_INSTALLED = {"experiments"}

# What the experiment tables may import of the product: the result files' readers (a run's summary, its final
# model), the method registry's public contract, the data sets' class counts, the generators' budgets they share
# with the synthesis bench and the writer of a page's generated blocks; the runs themselves they start as
# `fcl-emu up` processes.
EXPERIMENTS_SURFACE = {"fcl_emu.monitoring.results", "fcl_emu.run_model", "fcl_emu.methods.registry",
                       "fcl_emu.scenario.datasets", "fcl_emu.bench.synthesis_budget", "fcl_emu.page_blocks"}
# The analyses of a finished run's model that recompute what a method computes (AF-FCL's flow fitted to a run's
# features, GLFC's gradient inversion) reach into methods/ and scenario/ beyond that surface.
EXPERIMENTS_ANALYSES = {"experiments/flow_fit.py", "experiments/glfc_table.py"}

# The installed package's name for each folder of code (pyproject.toml's package-dir): fcl_emu.<folder> -> folder.
PACKAGE_DIR: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
FOLDERS = {name.partition(".")[2]: folder for name, folder in PACKAGE_DIR.items() if "." in name}


def folder_module(module: str) -> str:
    """The module path inside the repository of an installed module: ``fcl_emu.wire.framing`` is ``wire.framing``
    (the folder ``wire/``); ``fcl_emu.cli`` stays itself; anything else (a bare ``wire``) is returned as it is."""
    parts = module.split(".")
    if parts[0] == "fcl_emu" and len(parts) > 1 and parts[1] in FOLDERS:
        return ".".join([FOLDERS[parts[1]], *parts[2:]])
    return module

MAX_LINES = 600


@dataclass(frozen=True)
class Import:
    """One import: the absolute module it names (a relative one resolved) and, for ``from module import a, b``,
    the names."""
    module: str
    names: tuple[str, ...]
    line: int


def imports(path: Path, root: Path = ROOT) -> list[Import]:
    """Every import in ``path``, function-level ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [Import(alias.name, (), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = ".".join([*package_of(path, node.level, root), *([node.module] if node.module else [])])
            found.append(Import(module, tuple(alias.name for alias in node.names), node.lineno))
    return found


def bare_imports(path: Path) -> list[str]:
    """The imports in ``path`` that name a folder of code by its bare name (``from methods.base import x``)
    instead of the installed package's (``from fcl_emu.methods.base import x``): they work from the repository's
    root only, and load a second copy of the module beside the installed one."""
    found = [f"{path.relative_to(ROOT)}:{i.line}: {i.module}" for i in imports(path)
             if i.module.split(".")[0] in FOLDERS]
    snippet = re.compile(rf"(?:^|;)\s*(?:from|import) ({'|'.join(FOLDERS)})\b")  # code run as ``python -c``
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {m.group(1)} (in a string of code)"
                      for m in snippet.finditer(node.value)]
    return found


def package_of(path: Path, level: int, root: Path) -> tuple[str, ...]:
    """The package that a ``level``-dots relative import in ``path`` starts from (none for an absolute one)."""
    if not level:
        return ()
    package = path.relative_to(root).parent.parts  # a module's package, or an __init__'s own
    return package[:len(package) - level + 1]


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """(folder of code, line) of every import in ``path`` (a module outside the project: its top-level name)."""
    return {(folder_module(i.module).split(".")[0], i.line) for i in imports(path)}


def code_folders(root: Path = ROOT) -> set[str]:
    """Every top-level folder holding .py files that is the project's code."""
    return {p.name for p in root.iterdir()
            if p.is_dir() and not p.name.startswith(".") and p.name not in NOT_PROJECT and any(p.rglob("*.py"))}


def code_files(root: Path = ROOT) -> list[Path]:
    """Every .py file of the project's code."""
    return sorted(path for folder in code_folders(root) for path in (root / folder).rglob("*.py"))


def module_file(module: str, search: list[Path]) -> Path | None:
    """The file that ``import module`` loads from the first folder of ``search`` that has it."""
    for folder in search:
        stem = folder.joinpath(*module.split("."))
        for candidate in (stem.parent / f"{stem.name}.py", stem / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def imported_files(path: Path, root: Path = ROOT) -> dict[Path, int]:
    """The project files that the imports in ``path`` load, each with its first import's line: ``from pkg import
    name`` loads ``pkg/name.py`` where that is a module, else ``pkg/__init__.py``; a script (a file outside any
    package) finds its neighbours by their bare names first."""
    search = [root] if (path.parent / "__init__.py").is_file() else [path.parent, root]
    found: dict[Path, int] = {}
    for imp in imports(path, root):
        module = folder_module(imp.module)
        for name in imp.names or [None]:
            target = ((name and module_file(f"{module}.{name}", search)) or module_file(module, search))
            if target and target != path:
                found[target] = min(found.get(target, imp.line), imp.line)
    return found


def arrows() -> list[tuple[str, str, str]]:
    """(importing folder, imported package, file:line) for every import between the project's folders."""
    found = []
    for path in code_files():
        source = path.relative_to(ROOT).parts[0]
        for target, line in imported_packages(path):
            if target in MAY_IMPORT and target != source:
                found.append((source, target, f"{path.relative_to(ROOT)}:{line}"))
    return found


def import_cycles(graph: dict[Path, dict[Path, int]]) -> list[list[Path]]:
    """One shortest cycle through each arrow of ``graph`` that lies on a cycle (so every such arrow shows),
    each cycle once, starting from its first file."""
    def path_back(start: Path, goal: Path) -> list[Path] | None:
        came_from: dict[Path, Path | None] = {start: None}
        queue = deque([start])
        while queue:
            node = queue.popleft()
            if node == goal:
                chain = [node]
                while came_from[chain[-1]] is not None:
                    chain.append(came_from[chain[-1]])
                return chain[::-1]
            for nxt in graph.get(node, {}):
                if nxt not in came_from:
                    came_from[nxt] = node
                    queue.append(nxt)
        return None

    found: set[tuple[Path, ...]] = set()
    for source, targets in graph.items():
        for target in targets:
            if back := path_back(target, source):
                cycle = [source, *back[:-1]]
                first = cycle.index(min(cycle))
                found.add(tuple(cycle[first:] + cycle[:first]))
    return [list(cycle) for cycle in sorted(found)]


def describe(cycle: list[Path], graph: dict[Path, dict[Path, int]], root: Path = ROOT) -> str:
    """``a.py:3 -> b.py:10 -> a.py``: each file with the line of its import of the next."""
    hops = zip(cycle, cycle[1:] + cycle[:1])
    return " -> ".join(f"{a.relative_to(root)}:{graph[a][b]}" for a, b in hops) + f" -> {cycle[0].relative_to(root)}"


def file_graph(root: Path = ROOT) -> dict[Path, dict[Path, int]]:
    """Each file of the code and the files it imports, with the line of the first import of each."""
    return {path: imported_files(path, root) for path in code_files(root)}


def test_every_code_folder_is_in_the_table():
    folders = code_folders()
    assert folders == set(MAY_IMPORT), (f"MAY_IMPORT and docs/architecture.md must name every top-level folder of "
                                        f"code: add {sorted(folders - set(MAY_IMPORT))}, "
                                        f"drop {sorted(set(MAY_IMPORT) - folders)}")


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


def test_no_two_files_import_each_other_in_a_circle():
    graph = file_graph()
    cycles = [describe(cycle, graph) for cycle in import_cycles(graph)]
    assert not cycles, "import cycles between files:\n" + "\n".join(cycles)


def test_no_file_is_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in code_files() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_nothing_in_the_product_imports_the_experiments():
    wrong = [f"{where}: {source} imports experiments" for source, target, where in arrows()
             if target in NOT_INSTALLED and source not in NOT_INSTALLED]
    assert not wrong, "the product must not import the experiment tables:\n" + "\n".join(wrong)


def test_the_experiments_are_not_installed():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {name.split(".")[0] for name in setuptools["packages"]} | set(setuptools["package-dir"].values())
    assert not packages & NOT_INSTALLED


def test_the_experiments_use_the_product_s_public_surface():
    def named(i: Import) -> list[str]:  # ``from fcl_emu.methods import registry`` names fcl_emu.methods.registry
        return [i.module] if i.module in EXPERIMENTS_SURFACE or not i.names else [f"{i.module}.{n}" for n in i.names]

    files = [p for p in sorted((ROOT / "experiments").rglob("*.py"))
             if str(p.relative_to(ROOT)) not in EXPERIMENTS_ANALYSES]
    wrong = [f"{path.relative_to(ROOT)}:{i.line}: {module}" for path in files for i in imports(path)
             if i.module.split(".")[0] == "fcl_emu" for module in named(i) if module not in EXPERIMENTS_SURFACE]
    assert not wrong, ("the experiment tables import the product beyond its public surface (EXPERIMENTS_SURFACE):\n"
                       + "\n".join(wrong))


def test_the_reader_catches_function_level_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from fcl_emu.coordinator.lifecycle import Coordinator\n"
                    "    import fcl_emu.edge_node.node\n    from fcl_emu import cli\n")
    assert imported_packages(path) == {("coordinator", 2), ("edge_node", 3), ("fcl_emu", 4)}


def test_every_folder_of_code_is_installed_under_the_project_s_name():
    assert set(FOLDERS.values()) | {"fcl_emu"} == code_folders() - NOT_INSTALLED
    assert all(name == f"fcl_emu.{folder}" for name, folder in PACKAGE_DIR.items() if folder != "fcl_emu")


def test_every_package_of_code_is_in_the_wheel():
    """Each folder of an installed folder that holds an ``__init__.py`` is in pyproject's ``packages``: an editable
    install finds a package left out of that list, the wheel that containers and a plain install use does not."""
    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {folder: name for name, folder in PACKAGE_DIR.items()}
    found = {".".join((folders[init.relative_to(ROOT).parts[0]], *init.relative_to(ROOT).parts[1:-1]))
             for folder in folders for init in (ROOT / folder).rglob("__init__.py")}
    assert found == packages, f"missing from packages: {sorted(found - packages)}; not code: {sorted(packages - found)}"


def test_no_code_or_test_imports_a_folder_by_its_bare_name():
    files = code_files() + sorted((ROOT / "tests").rglob("*.py"))
    bare = [line for path in files for line in bare_imports(path)]
    assert not bare, "import these as fcl_emu.<folder>:\n" + "\n".join(bare)


def test_the_install_owns_its_names_and_a_user_s_own_modules_do_not_shadow_them(tmp_path):
    """Outside the repository no generic top-level name is installed; a user's own ``methods/`` and
    ``monitoring.py`` in the working directory neither break the project's imports nor are broken by them."""
    (tmp_path / "methods").mkdir()
    (tmp_path / "methods" / "__init__.py").write_text("MINE = True\n")
    (tmp_path / "monitoring.py").write_text("MINE = True\n")
    code = ("import importlib.util, sys\n"
            "assert all(importlib.util.find_spec(n) is None for n in ('wire', 'coordinator', 'secagg', 'runconfig'))\n"
            "import methods, monitoring\n"
            "assert methods.MINE and monitoring.MINE\n"
            "from fcl_emu.methods.registry import get\n"
            "from fcl_emu.monitoring.results import RunSummary\n"
            "from fcl_emu.coordinator.lifecycle import Coordinator\n"
            "assert get('fedavg').name == 'fedavg'\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_reader_resolves_files_and_finds_their_cycles(tmp_path):
    files = {
        "pkg/__init__.py": "from pkg.a import A\n",
        "pkg/a.py": "from . import b, missing\nA = 1\n",
        "pkg/b.py": "import json\ndef f():\n    from .sub.c import C\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from ..a import A\nC = 2\n",
        "scripts/run.py": "import helpers\nfrom pkg import A\n",
        "scripts/helpers.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = file_graph(tmp_path)
    assert graph[tmp_path / "pkg/a.py"] == {tmp_path / "pkg/b.py": 1, tmp_path / "pkg/__init__.py": 1}
    assert graph[tmp_path / "scripts/run.py"] == {tmp_path / "scripts/helpers.py": 1, tmp_path / "pkg/__init__.py": 2}
    assert [describe(c, graph, tmp_path) for c in import_cycles(graph)] == [
        "pkg/__init__.py:1 -> pkg/a.py:1 -> pkg/__init__.py",
        "pkg/a.py:1 -> pkg/b.py:3 -> pkg/sub/c.py:1 -> pkg/a.py",
    ]
