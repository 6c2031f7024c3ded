"""The package's house rules that show in its imports (docs/design.md):

* every relative import, lazy ones included, names a module and names that
  exist (some run only on a GPU);
* no import circle between the package's modules, counting imports inside
  functions too (a lazy import still ties two modules together);
* the top level shows the public face and the layers, at most 13 modules;
  the machinery of a call lives in ``dynamiq_mpi.call``.
"""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dynamiq_mpi"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(name: str, level: int, current: str, is_package: bool) -> str:
    if level == 0:
        return name
    base = current.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def import_graph() -> dict:
    """{module: {package modules it imports}} (``from x import y`` counts y
    when y is a module of the package, else x)."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        deps = set()
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node.module or "", node.level, name, is_package)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:          # a name inside a module: the module
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith("dynamiq_mpi"):
                    deps.add(t)
        graph[name] = deps
    return graph


def cycles(graph: dict) -> list:
    """Every strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


# A package's __init__ that re-exports its modules' names, and the modules
# that import a sibling through the package: not a circle of logic.
def _without_package_reexports(graph):
    return {m: {d for d in deps if not (m.startswith(d + ".") or d.startswith(m + "."))}
            for m, deps in graph.items()}


def test_no_import_circles():
    found = cycles(_without_package_reexports(import_graph()))
    assert not found, f"import circles between the package's modules: {found}"


def test_the_checker_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_top_level_is_small_and_the_call_machinery_is_below():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 13, top
    for moved in ("engine.py", "engine_rs.py", "native.py", "graphs.py", "paths.py",
                  "workspace.py", "hierarchy.py"):
        assert moved not in top and (PACKAGE / "call" / moved).exists()


def test_every_relative_import_names_a_module_that_exists():
    """A lazy import inside a function runs only on its path (some only on a
    GPU): check them all here.  Each ``from .x import y`` must name a module
    or package of the installed package (compiled extensions included)."""
    import importlib.util
    missing = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = _resolve(node.module or "", node.level, name, path.name == "__init__.py")
                if importlib.util.find_spec(base) is None:
                    missing.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {base}")
    assert not missing, missing


def test_every_relative_import_takes_a_name_its_module_has():
    """The same for the names: ``from .x import y`` (lazy ones included) takes
    a ``y`` that module ``x`` defines or that is its submodule.  Modules that
    need what this machine lacks (CuPy, torch) are left out."""
    import importlib
    missing = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.level):
                continue
            base = _resolve(node.module or "", node.level, name, path.name == "__init__.py")
            try:
                module = importlib.import_module(base)
            except ImportError:
                continue
            for alias in node.names:
                if alias.name == "*" or hasattr(module, alias.name):
                    continue
                try:
                    importlib.import_module(f"{base}.{alias.name}")
                except ImportError:
                    missing.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: "
                                   f"{base}.{alias.name}")
    assert not missing, missing
