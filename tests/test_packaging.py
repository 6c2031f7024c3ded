"""The package as a user installs it: the sdist carries every build input
and the licence, its metadata states the version, licence and extras; built
from the sdist in a fresh virtual environment it installs its CPU codec even
where nvcc fails, and imports; and neither ``import dynamiq_mpi`` nor a
torch.distributed job needs mpi4py.

The fresh environment reuses this interpreter's packages (numpy, Cython,
setuptools, pip) through a ``.pth`` line and installs offline
(``--no-build-isolation --no-index``): nothing is downloaded.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
from pathlib import Path

import pytest

import dynamiq_mpi

ROOT = Path(__file__).resolve().parent.parent
# What a build reads, besides the package's Python: (folder, suffixes).
BUILD_INPUTS = (("pyx", (".pyx", ".pxd", ".pxi")),
                ("src_cuda", (".h", ".hpp", ".cuh", ".cu", ".cpp")))
TOP_FILES = ("setup.py", "setup.cfg", "pyproject.toml", "MANIFEST.in", "LICENSE", "README.md")


def _tracked_files() -> list:
    """The checkout's files (tracked, and new ones git does not ignore)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (the files an sdist is made from)")
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                         cwd=ROOT, capture_output=True, check=True).stdout
    return [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]


def _expected_members(files) -> set:
    want = {f for f in files if f in TOP_FILES}
    for folder, suffixes in BUILD_INPUTS:
        want |= {f for f in files if f.startswith(folder + "/") and f.endswith(suffixes)}
    want |= {f for f in files if f.startswith("dynamiq_mpi/") and f.endswith((".py", ".json"))}
    return want


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    """The sdist made from a copy of the checkout (the tree itself stays clean)."""
    pytest.importorskip("Cython")
    pytest.importorskip("setuptools")
    tree = tmp_path_factory.mktemp("tree")
    for f in _tracked_files():
        (tree / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, tree / f)
    dist = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(dist)], cwd=tree,
                          env=dict(os.environ, DYNAMIQ_NO_CUDA="1"), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (archive,) = dist.glob("dynamiq_mpi-*.tar.gz")
    return archive


def test_sdist_carries_every_build_input(sdist):
    prefix = f"dynamiq_mpi-{dynamiq_mpi.__version__}/"
    with tarfile.open(sdist) as tar:
        names = {m.name[len(prefix):] for m in tar.getmembers()
                 if m.isfile() and m.name.startswith(prefix)}
        info = tar.extractfile(prefix + "PKG-INFO").read().decode()
    missing = sorted(_expected_members(_tracked_files()) - names)
    assert not missing, f"the sdist lacks build inputs: {missing}"
    generated = sorted(n for n in names if n.startswith("pyx/") and n.endswith(".cpp"))
    assert not generated, f"the sdist carries Cython output: {generated}"
    assert f"Version: {dynamiq_mpi.__version__}" in info
    assert "License: MIT" in info and "Author: dynamiq-mpi developers" in info
    assert "Requires-Python: >=3.10" in info
    for extra in ("mpi", "torch", "cuda12", "cuda13"):
        assert f"Provides-Extra: {extra}" in info, extra
    assert 'Requires-Dist: mpi4py>=4.0; extra == "mpi"' in info   # not a hard requirement


def _fresh_venv(path: Path) -> Path:
    """A venv without pip that sees this interpreter's packages after its own."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                          "['purelib'])"], capture_output=True, text=True, check=True).stdout
    # a plain path line: the parent's own .pth files (an editable install of
    # this checkout) are not processed, so only the sdist's install is seen
    (Path(own.strip()) / "parent_site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def test_sdist_installs_cpu_only_when_nvcc_fails_and_imports(sdist, tmp_path):
    """A CUDA toolkit whose nvcc fails: the install goes on without the GPU
    extension, says why, and the package imports from the fresh venv."""
    pytest.importorskip("pip")
    python = _fresh_venv(tmp_path / "venv")
    toolkit = tmp_path / "broken-cuda"
    (toolkit / "bin").mkdir(parents=True)
    nvcc = toolkit / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'nvcc: this toolkit is broken' >&2\nexit 1\n")
    nvcc.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "DYNAMIQ_NO_CUDA", "DYNAMIQ_CUDA_ARCH", "CUDA_PATH")}
    env["CUDA_HOME"] = str(toolkit)
    proc = subprocess.run([str(python), "-m", "pip", "install", "-v", "--no-build-isolation",
                           "--no-deps", "--no-index", str(sdist)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert "the CUDA kernels failed to build" in log, log[-6000:]
    check = textwrap.dedent("""
        import sys, numpy as np, dynamiq_mpi as dq
        assert dq.__file__.startswith(sys.argv[1]), dq.__file__
        import dynamiq_mpi._cpu
        try:
            import dynamiq_mpi._gpu
        except ImportError:
            pass
        else:
            raise AssertionError("a GPU extension was installed from a failing nvcc")
        xs = [np.full(4096, r + 1.0, np.float32) for r in range(2)]
        out = dq.simulate_allreduce(xs, codec=dq.Exact())
        assert np.array_equal(out[0], np.full(4096, 3.0, np.float32))
        print("imported", dq.__version__)
    """)
    proc = subprocess.run([str(python), "-c", check, str(tmp_path / "venv")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"imported {dynamiq_mpi.__version__}" in proc.stdout


def test_torch_jobs_never_import_mpi4py(tmp_path):
    """With mpi4py unimportable: the package and its torch adapter import, a
    DDP step with the hook and FSDP2's reduce-scatter run over a gloo group,
    and the MPI plane's default says what to install."""
    pytest.importorskip("torch", exc_type=ImportError)
    program = textwrap.dedent("""
        import sys
        sys.modules["mpi4py"] = None            # as if it were not installed
        import torch, torch.distributed as dist
        import dynamiq_mpi as dq, dynamiq_mpi.torch as dqt
        from dynamiq_mpi.control import default_comm
        try:
            default_comm(environ={})
        except ImportError as exc:
            assert "dynamiq-mpi[mpi]" in str(exc), exc
        else:
            raise AssertionError("the MPI plane came up without mpi4py")
        dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0,
                                world_size=1)
        model = torch.nn.Linear(64, 4)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        state = dqt.register_comm_hook(ddp, dqt.HookState(codec=dq.DynamiQ(bits=5)))
        ddp(torch.randn(8, 64)).square().sum().backward()
        assert state.pop_stats()["buckets"] >= 1
        rs = dqt.ReduceScatter(codec=dq.Exact())          # FSDP2's reduce-scatter alike
        shard = torch.empty(512)
        rs.reduce_scatter_(shard, torch.ones(512))
        assert torch.equal(shard, torch.ones(512))
        assert "mpi4py.MPI" not in sys.modules
        dist.destroy_process_group()
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYNAMIQ_")}
    proc = subprocess.run([sys.executable, "-c", program, str(tmp_path / "store")], env=env,
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr
