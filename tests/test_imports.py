"""The import graph of the package, built from the modules' import statements: no circles, front doors apart.

Every ``import``/``from ... import`` counts, also inside functions and under ``TYPE_CHECKING``: a lazy
import hides a circle from Python, not from a reader. So does ``importlib.import_module``: in a module that
calls it, every string literal naming a module of the package is an edge to that module (a command table
such as the CLI's names its modules as strings). ``from package import name`` is an edge to the
submodule ``package.name`` when there is one, else to ``package``; the parent packages Python imports
on the way are not edges (they are always loaded first).
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

def package_modules(root: Path = REPO) -> dict[str, tuple[Path, bool]]:
    """Every module of the package: dotted name -> (file, is a package), from pyproject's package-dir."""
    package_dir = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    modules: dict[str, tuple[Path, bool]] = {}
    for package, folder in package_dir.items():
        if not package:
            continue
        for path in (root / folder).rglob("*.py"):
            parts = path.relative_to(root / folder).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            if not (path.parent / "__init__.py").exists():
                continue  # a script beside the package, not a module of it
            modules[".".join((package, *parts))] = (path, is_package)
    return modules


def _known(name: str, modules: Mapping[str, object]) -> str | None:
    """``name``, or its nearest enclosing module of the package; None for other packages."""
    while name not in modules:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def import_graph(modules: Mapping[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        here = name if is_package else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found = [_known(alias.name, modules) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(here.split(".")[: len(here.split(".")) - node.level + 1])
                    source = f"{base}.{node.module}" if node.module else base
                else:
                    source = node.module or ""
                found = [_known(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source, modules)
                         for alias in node.names]
            else:
                continue
            targets.update(t for t in found if t is not None and t != name)
        targets.update(_named_by_string(path, modules) - {name})
        graph[name] = targets
    return graph


def _named_by_string(path: Path, modules: Mapping[str, object]) -> set[str]:
    """The package's modules named by string literals in ``path``, when it imports modules by name."""
    tree = ast.parse(path.read_text(), str(path))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and (getattr(n.func, "attr", None) == "import_module" or getattr(n.func, "id", None) == "import_module")]
    if not calls:
        return set()
    # Literals given to import_module, or held in a container (a command table); not e.g. a logger's name.
    held = [n for n in ast.walk(tree) if isinstance(n, (ast.Dict, ast.List, ast.Tuple, ast.Set))]
    literals = [c for n in [*calls, *held] for c in ast.iter_child_nodes(n)]
    return {c.value for c in literals if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value in modules}


def circles(graph: Mapping[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
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
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(package_modules())


def test_the_package_has_no_import_circle(graph: dict[str, set[str]]) -> None:
    found = set(circles(graph))
    assert found == set(), "import circles: " + "; ".join(" <-> ".join(sorted(c)) for c in found)


@pytest.mark.parametrize(("importer", "imported"), [
    ("bagua_lightning.strategy", "bagua_lightning.torch_api"),
    ("bagua_lightning.torch_api", "bagua_lightning.strategy"),
    ("bagua_lightning.engine", "bagua_lightning.strategy"),
    ("bagua_lightning.engine", "bagua_lightning.torch_api"),
])
def test_the_front_doors_share_only_the_engine(graph: dict[str, set[str]], importer: str, imported: str) -> None:
    def inside(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    crossing = sorted(f"{m} -> {t}" for m, targets in graph.items() if inside(m, importer)
                      for t in targets if inside(t, imported))
    assert crossing == []


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_root_package_is_layered(graph: dict[str, set[str]]) -> None:
    """``core`` (errors, processes, the services file, redis-server) is the bottom layer: it imports nothing
    else of the package. The library never imports ``examples`` (the demo's report lives in the library)."""
    core = "bagua_lightning.core"
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() if _inside(m, core)
                    for t in targets if t != "bagua_lightning" and not _inside(t, core))
    assert upward == []
    examples = "bagua_lightning.examples"
    into_examples = sorted(f"{m} -> {t}" for m, targets in graph.items() if not _inside(m, examples)
                           for t in targets if _inside(t, examples))
    assert into_examples == []
    assert any(_inside(t, core) for t in graph["bagua_lightning.engine.comm"] | graph["bagua_lightning.cli"])


def test_the_graph_sees_circles_through_lazy_and_relative_imports(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools]\npackage-dir = { "" = "src", "pkg" = "pkg" }\n')
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .a import A\n")
    (pkg / "sub" / "a.py").write_text("A = 1\n\ndef f():\n    from ..b import B\n    return B\n")
    (pkg / "b.py").write_text("from pkg.sub import a\nB = 2\n")
    (pkg / "c.py").write_text("from .sub import a\nfrom . import b\n")
    graph = import_graph(package_modules(tmp_path))
    assert graph["pkg.c"] == {"pkg.sub.a", "pkg.b"}
    assert circles(graph) == [frozenset({"pkg.sub.a", "pkg.b"})]


def test_the_graph_sees_circles_through_importlib(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools]\npackage-dir = { "" = "src", "pkg" = "pkg" }\n')
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "main.py").write_text('import importlib\nCOMMANDS = {"x": "pkg.cmd"}\nHELPER = 1\n\n'
                                 'def run(name):\n    return importlib.import_module(COMMANDS[name])\n')
    (pkg / "cmd.py").write_text("from .main import HELPER\n")
    (pkg / "other.py").write_text('LOGGER = "pkg.cmd"  # a string alone, without import_module, is no edge\n')
    graph = import_graph(package_modules(tmp_path))
    assert graph["pkg.main"] == {"pkg.cmd"}
    assert graph["pkg.other"] == set()
    assert circles(graph) == [frozenset({"pkg.main", "pkg.cmd"})]


def _relative_imports(path: Path) -> list[tuple[int, str, int]]:
    """``(line, module, level)`` of every relative ``from`` import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [(node.lineno, node.module or "", node.level) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level > 0]


def _resolves_by_folder(path: Path, module: str, level: int) -> bool:
    base = path.parent
    for _ in range(level - 1):
        base = base.parent
    target = base.joinpath(*module.split(".")) if module else base
    return target.with_suffix(".py").is_file() or (target / "__init__.py").is_file()


def test_every_relative_import_resolves_to_the_folder_it_names() -> None:
    """A reader follows ``..core`` from ``engine/`` to ``core/``: no import leans on the package-dir map."""
    wrong = [f"{path.relative_to(REPO)}:{line}: from {'.' * level}{module}"
             for path, _ in package_modules().values() for line, module, level in _relative_imports(path)
             if not _resolves_by_folder(path, module, level)]
    assert wrong == []


def test_the_folder_check_sees_an_import_that_only_the_map_resolves(tmp_path: Path) -> None:
    (tmp_path / "engine").mkdir()
    (tmp_path / "src" / "pkg" / "core").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "core" / "__init__.py").write_text("")
    module = tmp_path / "engine" / "ddp.py"
    module.write_text("from ..core import x\n")
    [(line, name, level)] = _relative_imports(module)
    assert (line, name, level) == (1, "core", 2)
    assert not _resolves_by_folder(module, name, level)
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "__init__.py").write_text("")
    assert _resolves_by_folder(module, name, level)
