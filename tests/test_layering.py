"""The import graph of ``src/kvsieve`` against the layer order written in ``docs/design.md``.

Every import counts: module level, inside functions (lazy) and under ``TYPE_CHECKING``. A module may
import modules of its own package (with no cycle among them) and of packages on a *lower* layer; never
a package on its own layer or above. The layer table is read from the design document, so the picture
users read and the code cannot drift apart.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "kvsieve"
DESIGN = ROOT / "docs" / "design.md"


def module_files() -> dict[str, Path]:
    """``kvsieve.a.b`` → its file, for every module and package ``__init__`` under ``src/kvsieve``."""
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """kvsieve modules ``name`` imports anywhere in its file (a ``from package import name`` of a submodule
    counts as that submodule; of anything else as the package)."""
    found: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, base] if base else package)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        for target in targets:
            if target.split(".")[0] != "kvsieve":
                continue
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def package_of(module: str) -> str:
    """The top-level package (or module) of ``kvsieve.x.y``: ``x``; the package itself: ``kvsieve``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kvsieve"


def layer_table() -> dict[str, int]:
    """Package → layer number, from the table between the layer markers of ``docs/design.md``."""
    text = DESIGN.read_text(encoding="utf-8")
    match = re.search(r"<!-- layers: begin -->(.*?)<!-- layers: end -->", text, re.S)
    assert match, "docs/design.md must hold the layer table between <!-- layers: begin/end --> markers"
    layers: dict[str, int] = {}
    for line in match.group(1).splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].isdigit():
            continue
        for package in re.findall(r"`([a-z_]+)`", cells[1]):
            assert package not in layers, f"{package} is listed twice in the layer table"
            layers[package] = int(cells[0])
    return layers


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_package_has_a_layer():
    layers = layer_table()
    missing = sorted({package_of(m) for m in module_files()} - set(layers))
    assert not missing, f"packages missing from the layer table of docs/design.md: {missing}"
    stale = sorted(set(layers) - {package_of(m) for m in module_files()})
    assert not stale, f"the layer table names packages that do not exist: {stale}"


def test_no_import_runs_upward_or_sideways():
    layers = layer_table()
    wrong = []
    for module, targets in import_graph().items():
        for target in targets:
            source, dest = package_of(module), package_of(target)
            if source != dest and layers[dest] >= layers[source]:
                wrong.append(f"{module} (layer {layers[source]}) imports {target} (layer {layers[dest]})")
    assert not wrong, "imports that run upward or sideways:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, f"import cycles: {found}"


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": set()}, []),
        ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b"], ["c", "d"]]),
    ],
)
def test_the_cycle_finder_finds_cycles(graph, expected):
    assert sorted(cycles(graph)) == expected


def test_lazy_and_type_checking_imports_count(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvsieve.engine.engine import Engine\n"
        "def f():\n    from kvsieve.parts import schedules\n    import kvsieve.ops.gqa\n"
        "from .sibling import x\n",
        encoding="utf-8",
    )
    modules = {"kvsieve.core.mod": path, "kvsieve.core.sibling": path, "kvsieve.engine.engine": path,
               "kvsieve.parts": path, "kvsieve.parts.schedules": path, "kvsieve.ops.gqa": path}
    found = imported_modules("kvsieve.core.mod", path, modules)
    assert found == {"kvsieve.engine.engine", "kvsieve.parts.schedules", "kvsieve.ops.gqa", "kvsieve.core.sibling"}
