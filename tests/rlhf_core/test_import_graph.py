"""The shape of the code: `rlhf_core`'s modules import one another without a cycle, and no file
in src/ is over 500 lines.

Every `import` and `from ... import` counts, wherever it stands: at the top of a module, inside
a function, under `if TYPE_CHECKING:`, relative or absolute. An import moved into a function to
dodge a cycle is still a cycle here.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

SRC = REPO / "src"
MAX_LINES = 500


def module_names(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package (subpackages included)."""
    names = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imported_names(path: Path, module: str) -> list[str]:
    """Every dotted name `path` imports (a `from a import b` gives both `a` and `a.b`), with
    relative imports resolved against `module`, the file's own dotted name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(tree):  # every statement, top level or nested in a function
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return names


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    modules = module_names(package_dir)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for name in imported_names(path, module):
            while name and name not in modules:  # `pkg.mod.attr` -> `pkg.mod`
                name = name.rpartition(".")[0]
            if name and name != module:
                graph[module].add(name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None when the graph is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_rlhf_core_has_no_import_cycle():
    graph = import_graph(SRC / "rlhf_core")
    assert len(graph) > 20 and graph["rlhf_core.bookkeeping"] >= {"rlhf_core.checkpoint"}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in rlhf_core: " + " -> ".join(cycle or [])


def test_the_checker_sees_cycles_through_functions_and_relative_imports(tmp_path):
    """The check above can fail: a cycle closed by an import inside a function, written as a
    relative import from a subpackage, is found and printed."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from . import c\n")
    (pkg / "sub" / "c.py").write_text("def late():\n    from ..a import thing\n")
    (pkg / "d.py").write_text("import pkg.a\nfrom typing import TYPE_CHECKING\n")
    graph = import_graph(pkg)
    assert graph["pkg.sub.b"] == {"pkg.sub.c", "pkg.sub"} and graph["pkg.d"] == {"pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"]
    (pkg / "sub" / "c.py").write_text("def late():\n    import json\n    from .. import sub\n")
    assert find_cycle(import_graph(pkg)) is None


def test_src_files_under_500_lines():
    """Files in src/ stay under 500 lines (issue 34)."""
    long = {
        str(path.relative_to(REPO)): n
        for path in sorted(SRC.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files in src/ over {MAX_LINES} lines: {long}"
