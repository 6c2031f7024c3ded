"""``python -m dynamiq_mpi doctor`` as a user types it: alone (one process,
nothing launched) it reports the version, kernels, packages, MPI, launcher
and the default call's choices; under ``mpiexec -n 2`` rank 0 alone prints,
listing both ranks."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import dynamiq_mpi
from dynamiq_mpi.bench import doctor

ROOT = Path(__file__).resolve().parent.parent
LAUNCH_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK", "WORLD_SIZE", "RANK",
               "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_STEP_ID")


def _env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("DYNAMIQ_") and k not in LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    return env


def _doctor(tmp_path, *launch):
    """The command under ``launch`` (a launcher and its options, which then
    starts ``python -m dynamiq_mpi``; none: this interpreter)."""
    out_json = tmp_path / "found.json"
    interpreter = [] if "torch.distributed.run" in launch else [sys.executable]
    proc = subprocess.run([*launch, *interpreter, "-m", "dynamiq_mpi", "doctor", "--json",
                           str(out_json)], env=_env(), cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads(out_json.read_text())


def test_doctor_alone(tmp_path):
    out, found = _doctor(tmp_path)
    assert out.startswith(f"dynamiq-mpi {dynamiq_mpi.__version__} ")
    assert "CPU codec (dynamiq_mpi._cpu): built" in out
    assert "CUDA kernels (dynamiq_mpi._gpu): " in out
    assert f"NumPy {found['packages']['numpy']}" in out
    assert "launcher: none (one process)" in out
    assert "codec for 2^16 elements: BF16 (below DynamiQ's small_input" in out
    assert "codec for 2^22 elements: DynamiQ at 5 bits" in out
    assert found["ranks"] and len(found["ranks"]) == 1
    if found["mpi"]["mpi4py"] is not None:
        assert "CUDA-aware: " in out


def test_doctor_under_mpiexec_prints_once_for_every_rank(tmp_path):
    launcher = Path(sys.executable).parent / "mpiexec"
    launcher = str(launcher) if launcher.exists() else shutil.which("mpiexec")
    if launcher is None:
        pytest.skip("no mpiexec")
    pytest.importorskip("mpi4py")
    out, found = _doctor(tmp_path, launcher, "-n", "2")
    assert out.count("dynamiq-mpi ") == 1, out          # rank 0 alone prints
    assert "launcher: mpiexec" in out and "control plane: mpi (2 ranks)" in out
    assert "rank 0: " in out and "rank 1: " in out and "links: one host" in out
    assert len(found["ranks"]) == 2


def test_doctor_under_torchrun_prints_once(tmp_path):
    pytest.importorskip("torch", exc_type=ImportError)
    out, found = _doctor(tmp_path, sys.executable, "-m", "torch.distributed.run", "--standalone",
                         "--nproc_per_node=2")
    assert out.count("dynamiq-mpi ") == 1, out
    assert "launcher: torchrun" in out and "control plane: torch" in out
    if found["mpi"]["mpi4py"] is not None:
        assert "CUDA-aware: not asked" in out       # MPI is left uninitialised


def test_launcher_is_named_from_the_environment():
    assert doctor.launcher({}) == "none (one process)"
    assert doctor.launcher({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2"}).startswith("torchrun")
    assert doctor.launcher({"OMPI_COMM_WORLD_SIZE": "4"}).startswith("mpiexec")
    assert doctor.launcher({"PMI_SIZE": "2"}).startswith("mpiexec")


def test_cuda_binaries_of_the_built_kernels():
    try:
        from dynamiq_mpi import _gpu
    except ImportError:
        pytest.skip("the CUDA kernels are not built here")
    found = doctor.cuda_binaries(_gpu.__file__)
    assert found["sass"] and all(a >= 50 for a in found["sass"]), found
    assert found["ptx"] and max(found["ptx"]) >= max(found["sass"]), found


def test_cuda_binaries_refuses_what_is_not_elf(tmp_path):
    path = tmp_path / "not.so"
    path.write_bytes(b"#!/bin/sh\n")
    with pytest.raises(ValueError, match="not a 64-bit ELF"):
        doctor.cuda_binaries(str(path))
