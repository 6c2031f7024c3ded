"""The layers' rules of docs/design.md ("Rules the code keeps"), read from the
source: who may import whom, who reads the environment, how long a module
may grow.  (No import circles: tests/test_imports.py.)"""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dynamiq_mpi"
RESEARCH = ROOT / "research"

# The ground floor: imports nothing of the package above it.
GROUND = {"dynamiq_mpi.errors", "dynamiq_mpi.settings", "dynamiq_mpi.backend", "dynamiq_mpi.rng",
          "dynamiq_mpi.report", "dynamiq_mpi.cuda", "dynamiq_mpi.schedules",
          "dynamiq_mpi._cpu", "dynamiq_mpi._gpu"}
PUBLIC = {"dynamiq_mpi"}
# What each upper layer may import of the package besides the public API and
# the ground floor (a name ending in ".*": the package and its modules).
DECLARED = {
    "adapter": {"dynamiq_mpi.torch.*"},       # itself
    "research": {"dynamiq_mpi.torch.*", "dynamiq_mpi.codecs.*", "dynamiq_mpi.cost_model.*",
                 "dynamiq_mpi.bench.gradients", "dynamiq_mpi.call.study"},
}
MAX_LINES = 600


def _module_name(path: Path, top: Path) -> str:
    parts = list(path.relative_to(top.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, top: Path):
    """(line, module, names) of every import in ``path``, lazy ones
    included, relative imports resolved; ``names`` is what a ``from`` import
    takes from the module (modules among them are counted as modules)."""
    name = _module_name(path, top)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[:len(up) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            yield node.lineno, base, tuple(a.name for a in node.names)


def _package_modules() -> set:
    return {_module_name(p, PACKAGE) for p in PACKAGE.rglob("*.py")} | {
        "dynamiq_mpi._cpu", "dynamiq_mpi._gpu"}


def _targets(module, names, known):
    """The package's modules an import reaches, and the names it takes from
    them that are not modules."""
    if not module.startswith("dynamiq_mpi"):
        return []
    out = []
    for n in names or ("",):
        sub = f"{module}.{n}" if n else module
        if sub in known:
            out.append((sub, None))
        else:
            out.append((module, n or None))
    return out


def _allowed(target: str, declared: set) -> bool:
    if target in PUBLIC or target in GROUND:
        return True
    return any(target == d or (d.endswith(".*") and (target == d[:-2] or
                                                       target.startswith(d[:-1])))
               for d in declared)


def _violations(files, top, declared, own=None):
    """Imports of the package outside ``declared``, and private names taken
    from it (a layer's own modules, under ``own``, may share private names)."""
    known = _package_modules()
    bad = []
    for path in files:
        for line, module, names in _imports(path, top):
            for target, name in _targets(module, names, known):
                where = f"{path.relative_to(ROOT)}:{line}"
                if not _allowed(target, declared):
                    bad.append(f"{where}: imports {target}")
                if name and name.startswith("_") and not (own and target.startswith(own)):
                    bad.append(f"{where}: takes the private name {target}.{name}")
    return bad


def test_the_adapter_imports_the_public_api_and_declared_interfaces():
    files = sorted((PACKAGE / "torch").rglob("*.py"))
    bad = _violations(files, PACKAGE, DECLARED["adapter"], own="dynamiq_mpi.torch")
    assert not bad, bad


def test_the_adapter_reaches_the_planes_and_the_choices_through_the_collective():
    """No module of the call machinery, the planes or the transports: the
    control plane and the measured choices come from the public face
    (``dq.plane_of``, ``Collective.class_choice`` / ``step_choice``)."""
    known = _package_modules()
    bad = [f"{p.relative_to(ROOT)}:{line}: imports {target}"
           for p in sorted((PACKAGE / "torch").rglob("*.py"))
           for line, module, names in _imports(p, PACKAGE)
           for target, _ in _targets(module, names, known)
           if target.startswith(("dynamiq_mpi.call", "dynamiq_mpi.control",
                                 "dynamiq_mpi.transports"))]
    assert not bad, bad


def test_the_studies_import_the_public_api_and_the_study_interface():
    files = sorted(RESEARCH.rglob("*.py"))
    assert files
    bad = _violations(files, RESEARCH, DECLARED["research"])
    assert not bad, bad


def test_the_ground_floor_imports_nothing_above_it():
    bad = []
    for name in sorted(GROUND - {"dynamiq_mpi._cpu", "dynamiq_mpi._gpu"}):
        path = PACKAGE / (name.split(".", 1)[1] + ".py")
        for line, module, names in _imports(path, PACKAGE):
            for target, _ in _targets(module, names, _package_modules()):
                if target not in GROUND:
                    bad.append(f"{path.relative_to(ROOT)}:{line}: imports {target}")
    assert not bad, bad


def test_the_public_names_come_from_the_public_face_not_the_call_machinery():
    bad = [f"dynamiq_mpi/__init__.py:{line}: imports {module}"
           for line, module, _ in _imports(PACKAGE / "__init__.py", PACKAGE)
           if module.startswith(("dynamiq_mpi.call", "dynamiq_mpi.transports",
                                 "dynamiq_mpi.control"))]
    assert not bad, bad


def test_the_package_never_imports_the_studies_or_the_examples():
    bad = [f"{p.relative_to(ROOT)}:{line}: imports {module}"
           for p in sorted(PACKAGE.rglob("*.py")) for line, module, _ in _imports(p, PACKAGE)
           if module.split(".")[0] in ("research", "mpi_examples", "tests")]
    assert not bad, bad


def test_the_package_and_its_setup_install_no_research():
    cfg = (ROOT / "setup.cfg").read_text()
    assert "include = dynamiq_mpi*" in cfg and "research" not in cfg


def test_settings_is_the_one_reader_of_the_environment():
    bad = []
    for p in sorted(PACKAGE.rglob("*.py")):
        if p.name == "settings.py" and p.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv") \
                    and isinstance(node.value, ast.Name) and node.value.id == "os":
                bad.append(f"{p.relative_to(ROOT)}:{node.lineno}: os.{node.attr}")
    assert not bad, bad


def test_every_variable_the_package_reads_is_in_the_docs_table():
    import re
    named = set()
    for p in PACKAGE.rglob("*.py"):
        named |= set(re.findall(r"\"(DYNAMIQ_[A-Z0-9_]+)\"", p.read_text()))
    reference = (ROOT / "docs" / "reference.md").read_text()
    table = set(re.findall(r"^\| `(DYNAMIQ_[A-Z0-9_]+)` \|", reference, re.M))
    assert named and named <= table, sorted(named - table)


@pytest.mark.parametrize("top", [PACKAGE, RESEARCH], ids=["package", "research"])
def test_no_module_is_over_600_lines(top):
    long = {str(p.relative_to(ROOT)): n for p in top.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_importing_the_package_imports_neither_torch_nor_the_cost_model():
    code = ("import sys, dynamiq_mpi; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.') "
            "or m.startswith('dynamiq_mpi.cost_model') or m.startswith('research')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=str(ROOT)).stdout.strip()
    assert out == "[]", out


def test_the_collective_is_one_thin_class():
    """Collective is defined in api.py alone, with no base class and a body
    of at most 250 lines: it owns its parts (call/runner.py) and delegates."""
    defs = [(p, n) for p in PACKAGE.rglob("*.py")
            for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ClassDef)
            and n.name == "Collective"]
    assert [p.relative_to(ROOT).as_posix() for p, _ in defs] == ["dynamiq_mpi/api.py"]
    cls = defs[0][1]
    assert not cls.bases and not cls.keywords
    assert cls.end_lineno - cls.lineno <= 250
