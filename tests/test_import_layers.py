"""No import cycles between the modules of a package, read from the source without importing it.

Every import counts: top-level ones, lazy ones inside functions and those under
`if TYPE_CHECKING:`, since each says that one module needs another. A package's modules are
the files directly in its folder (its subpackages are packages of their own); its
`__init__.py`, which gathers the package's names, is not one of them.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping, Set
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "gpupool"

Graph = Mapping[str, Set[str]]


def modules_under(src: Path, root: str) -> dict[str, Path]:
    """Dotted module name → file, for every module and package under src/<root>."""
    found: dict[str, Path] = {}
    for path in sorted((src / root).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _known(name: str, modules: Mapping[str, Path]) -> str | None:
    """The module `name` is, or lies in (a class, a function of it), if it is one of ours."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imported_by(name: str, path: Path, modules: Mapping[str, Path]) -> set[str]:
    """Our modules that module `name` imports anywhere in its file."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # `from pkg import mod` imports the module mod; `from mod import name`, mod.
            for alias in node.names:
                candidate = f"{prefix}.{alias.name}"
                targets.append(candidate if candidate in modules else prefix)
        for target in targets:
            module = _known(target, modules)
            if module is not None and module != name:
                found.add(module)
    return found


def package_graphs(modules: Mapping[str, Path]) -> dict[str, dict[str, set[str]]]:
    """For each package: its own modules, each with those of them it imports."""
    members: dict[str, set[str]] = {}
    for name, path in modules.items():
        if path.name != "__init__.py":
            members.setdefault(name.rpartition(".")[0], set()).add(name)
    return {
        package: {m: imported_by(m, modules[m], modules) & own for m in sorted(own)}
        for package, own in sorted(members.items())
    }


def find_cycle(graph: Graph) -> list[str] | None:
    """One cycle of the graph as a path that ends where it starts (a, b, a), or None."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_path:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in done:
                cycle = visit(nxt)
                if cycle is not None:
                    return cycle
        path.pop()
        on_path.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            cycle = visit(start)
            if cycle is not None:
                return cycle
    return None


def cycles_in(graphs: Mapping[str, Graph]) -> list[str]:
    """One line per package with a cycle: the package, and the cycle by short module names."""
    lines = []
    for package, graph in graphs.items():
        cycle = find_cycle(graph)
        if cycle is not None:
            lines.append(f"{package}: " + " -> ".join(m.rpartition(".")[2] for m in cycle))
    return lines


def test_no_package_of_gpupool_has_an_import_cycle_between_its_modules() -> None:
    graphs = package_graphs(modules_under(SRC, ROOT))
    assert "gpupool.torch" in graphs and "gpupool.core" in graphs  # the walk found the code
    found = cycles_in(graphs)
    assert not found, "import cycles between the modules of a package:\n" + "\n".join(found)


def test_a_cycle_in_a_graph_is_found_and_named() -> None:
    graph = {"p.tensor": {"p.stream"}, "p.stream": {"p.session"}, "p.session": {"p.tensor"}}
    assert find_cycle(graph) == ["p.session", "p.tensor", "p.stream", "p.session"]
    assert cycles_in({"p": graph}) == ["p: session -> tensor -> stream -> session"]
    assert find_cycle({"p.a": {"p.b"}, "p.b": set(), "p.c": {"p.a", "p.b"}}) is None


@pytest.mark.parametrize(
    "line",
    [
        "from pkg.high import up",  # a name of the module
        "from pkg import high",  # the module itself, from its package
        "from . import high",
        "from .high import up",
        "import pkg.high",
        "import pkg.high as h",
    ],
)
@pytest.mark.parametrize("where", ["top", "function", "type_checking"])
def test_an_import_of_a_higher_module_makes_a_cycle_wherever_it_is(
    tmp_path: Path, line: str, where: str
) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from pkg.high import up\n")
    (package / "high.py").write_text("from pkg.low import base\n\n\ndef up():\n    return base\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "deep.py").write_text("from pkg.high import up\n")
    (package / "low.py").write_text(
        {
            "top": f"{line}\n",
            "function": f"def base():\n    {line}\n",
            "type_checking": f"from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    {line}\n",
        }[where]
    )
    graphs = package_graphs(modules_under(tmp_path, "pkg"))
    assert graphs == {
        "pkg": {"pkg.high": {"pkg.low"}, "pkg.low": {"pkg.high"}},
        "pkg.sub": {"pkg.sub.deep": set()},  # a subpackage's module is of its own package
    }
    assert cycles_in(graphs) == ["pkg: high -> low -> high"]
