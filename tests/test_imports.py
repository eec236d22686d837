"""The package's imports run one way: no import loops (function-local imports included) and no
module importing from a layer above its own.

The walk reads the source with ``ast`` (nothing is imported), resolves relative imports, and
counts ``from .pkg.mod import x`` as an import of ``pkg.mod`` and of the package ``pkg``
(Python runs the package's ``__init__`` first) for importers outside that package.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "autofp4"

# Layers from the ground up: a module may import modules of its own layer or below, never above.
# Each entry is a module or a package (its modules); more specific entries win.
LAYERS: list[tuple[str, ...]] = [
    ("autofp4.problem", "autofp4.hopper", "autofp4.blackwell", "autofp4.pdl", "autofp4.timing", "autofp4.env", "autofp4.graph_pools",
     "autofp4.patterns", "autofp4.paths"),
    ("autofp4.formats", "autofp4.kernel_cache"),
    ("autofp4.weights",),
    ("autofp4.loaders", "autofp4.kernels", "autofp4.routing", "autofp4.router"),  # these run the routing kernels
    ("autofp4.backends",),
    ("autofp4.schema",),
    ("autofp4.db",),
    ("autofp4.dispatch", "autofp4.models", "autofp4.w4a8"),
    ("autofp4.ops",),
    ("autofp4.nn", "autofp4.tuning"),
    ("autofp4.integrations", "autofp4.integrations.vllm"),
    ("autofp4.cli_db",),
    ("autofp4.cli",),
    ("autofp4", "autofp4.__main__"),
]


def module_names(root: Path) -> dict[str, Path]:
    """``{dotted module name: file}`` of every module under the package directory ``root``."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _is_package(name: str, mods: dict[str, Path]) -> bool:
    return mods[name].name == "__init__.py"


def _resolve(importer: str, node: ast.ImportFrom | ast.Import, mods: dict[str, Path]) -> set[str]:
    """The package's modules that ``node`` (in module ``importer``) imports."""
    targets: set[str] = set()
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = importer.split(".") if _is_package(importer, mods) else importer.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        subs = [f"{base}.{a.name}" for a in node.names]
        # ``from pkg import mod`` imports the submodule; ``from pkg import name`` needs pkg itself
        names = subs + ([base] if any(sub not in mods for sub in subs) else [])
    for name in names:
        # the longest known module that the dotted name starts with
        parts = name.split(".")
        while parts and ".".join(parts) not in mods:
            parts.pop()
        if parts:
            targets.add(".".join(parts))
    return targets


def import_graph(root: Path) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``, function-local imports included."""
    mods = module_names(root)
    top = root.name
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for t in _resolve(name, node, mods):
                graph[name].add(t)
                # importing pkg.sub.mod runs pkg.sub's __init__ first (for importers outside it)
                parts = t.split(".")[:-1]
                while len(parts) > 1:
                    pkg = ".".join(parts)
                    if not (name == pkg or name.startswith(pkg + ".")):
                        graph[name].add(pkg)
                    parts.pop()
        graph[name].discard(name)
        graph[name].discard(top)  # the root package is the API face, above everything
    return graph


def import_loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of two or more modules (Tarjan), each as one loop path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    sccs: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_path(graph, comp) for comp in sccs]


def _cycle_path(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """One loop through the strongly connected ``comp``, as ``[a, b, ..., a]``."""
    members = set(comp)
    start = comp[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:  # breadth-first from start until an edge comes back to it
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def layer_of(module: str) -> int:
    best, depth = None, -1
    for i, entries in enumerate(LAYERS):
        for e in entries:
            if (module == e or module.startswith(e + ".")) and e.count(".") > depth:
                best, depth = i, e.count(".")
    if best is None:
        raise KeyError(f"{module} has no layer in tests/test_imports.py LAYERS: place it there")
    return best


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
            for a in sorted(graph) for b in sorted(graph[a]) if layer_of(b) > layer_of(a)]


def test_the_package_has_no_import_loops():
    loops = import_loops(import_graph(ROOT))
    assert not loops, "import loops: " + "; ".join(" -> ".join(p) for p in loops)


def test_no_module_imports_from_a_layer_above_it():
    bad = upward_imports(import_graph(ROOT))
    assert not bad, "\n".join(bad)


def _write_pkg(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_a_planted_loop_is_found_and_named(tmp_path):
    root = _write_pkg(tmp_path, {
        "__init__.py": "",
        "a.py": "from .b import x\n",
        "b.py": "def f():\n    from .sub.c import y  # function-local\n",
        "sub/__init__.py": "from .c import y\n",
        "sub/c.py": "from .. import a\n",
        "d.py": "import pkg.a\n",
    })
    g = import_graph(root)
    loops = import_loops(g)
    assert len(loops) == 1, loops
    path = loops[0]
    assert path[0] == path[-1] == "pkg.a" and "pkg.sub.c" in path and "pkg.d" not in path
    assert all(b in g[a] for a, b in zip(path, path[1:])), path  # each step is a real import
    with pytest.raises(AssertionError, match="pkg.a -> pkg.b"):
        assert not loops, "import loops: " + "; ".join(" -> ".join(p) for p in loops)


def test_a_name_from_the_own_package_init_is_a_loop_a_submodule_is_not(tmp_path):
    root = _write_pkg(tmp_path, {
        "__init__.py": "from .run import go\n", "run.py": "from . import util\nfrom .util import f\n",
        "util.py": "def f(): pass\n", "late.py": "def g():\n    from . import go  # a name of the package\n",
    })
    g = import_graph(root)
    assert g["pkg.run"] == {"pkg.util"} and not import_loops(g)
    assert g["pkg.late"] == set()  # the root package itself is the API face: not counted
    root2 = _write_pkg(tmp_path / "two", {
        "__init__.py": "", "sub/__init__.py": "from .run import go\n",
        "sub/run.py": "def go():\n    from . import helper\n    from autofp4_x import y\n",
        "sub/other.py": "from . import go\n", "sub/helper.py": "from . import other\n",
    })
    assert [set(p) for p in import_loops(import_graph(root2))] == [{"pkg.sub", "pkg.sub.run", "pkg.sub.helper",
                                                                    "pkg.sub.other"}]


def test_a_loop_free_package_passes_and_a_package_init_counts(tmp_path):
    root = _write_pkg(tmp_path, {
        "__init__.py": "", "a.py": "from .sub.c import y\n", "sub/__init__.py": "from .c import y\n",
        "sub/c.py": "import os\n",
    })
    g = import_graph(root)
    assert g["pkg.a"] == {"pkg.sub", "pkg.sub.c"} and not import_loops(g)
    # the init importing its importer is a loop through the package
    root2 = _write_pkg(tmp_path / "two", {
        "__init__.py": "", "a.py": "from .sub.c import y\n", "sub/__init__.py": "from .. import a\n",
        "sub/c.py": "",
    })
    assert [set(p) for p in import_loops(import_graph(root2))] == [{"pkg.a", "pkg.sub"}]


@pytest.mark.parametrize("module", sorted(module_names(ROOT)))
def test_every_module_has_a_layer(module):
    layer_of(module)
