"""The launchers a PyTorch user already has, on CPU with gloo: torchrun,
mpiexec, ``mp.spawn`` and Lightning, each running real training steps through
the DDP hook, FSDP2's compressed reduce-scatter or ``dq.allreduce``
(tests/launchers/ holds the rank programs).

Checked: every rank ends with identical parameters; the first step's
gradient is near the exact float64 mean over the rank's own group (a world
of one, or the wrong group, would be far off); torchrun's ranks (the torch
control plane) equal mpiexec's (the MPI control plane) bit for bit; a job
whose launcher says several processes but that has no communicator raises
on every rank.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", exc_type=ImportError)

HERE = Path(__file__).resolve().parent
WORKER = HERE / "launchers" / "train_worker.py"
TIMEOUT = 300
# Open MPI's switches (the GPU machine); MPICH ignores them
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMP_NUM_THREADS": "1"}
# A DynamiQ 5-bit all-reduce of these gradients measured vNMSE 7.5e-3 (the
# reduce-scatter's BF16 class 3.4e-6); a world of one is >= 0.1.
VNMSE_BOUND = 0.03


def _env(defaults=False):
    """The launch's environment; ``defaults``: none of the library's
    ``DYNAMIQ_*`` settings (the suite's conftest sets some), as a user has."""
    env = dict(os.environ, **MPI_ENV)
    if defaults:
        env = {k: v for k, v in env.items() if not k.startswith("DYNAMIQ_")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent)] + [p for p in
                                        env.get("PYTHONPATH", "").split(os.pathsep) if p])
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK", "WORLD_SIZE",
                "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)      # this process's own launcher, if any
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _killed_from_outside(proc) -> bool:
    """A launch whose processes were killed by a signal with no Python error
    (seen once on a loaded 2-core machine: SIGKILL, no traceback): not a
    failure of the code under test."""
    signalled = proc.returncode < 0 or proc.returncode in (9, 137)
    return signalled and "Killed (signal 9)" in proc.stdout and "Traceback" not in proc.stdout


def _run(cmd, what, defaults=False):
    for attempt in range(2):        # one more launch only for a kill from outside
        proc = subprocess.run(cmd, env=_env(defaults), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
        if proc.returncode == 0 or not (attempt == 0 and _killed_from_outside(proc)):
            break
    if proc.returncode != 0:
        pytest.fail(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-6000:]}")
    return proc.stdout


def torchrun(n, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={n}", *map(str, args)]


def mpiexec(n, *args):
    launcher = Path(sys.executable).parent / "mpiexec"
    launcher = str(launcher) if launcher.exists() else shutil.which("mpiexec")
    if launcher is None:
        pytest.skip("no mpiexec")
    return [launcher, "-n", str(n), sys.executable, *map(str, args)]


def results(out: Path, n: int) -> list:
    ranks = []
    for r in range(n):
        with np.load(out / f"rank{r}.npz") as d:
            ranks.append({k: d[k] for k in d.files})
    for r in ranks:
        if "info" in r:
            r["info"] = json.loads(str(r["info"]))
    return ranks


def check_training(ranks, plane, groups=None):
    """Identical parameters inside each group, gradients near the group's mean."""
    groups = groups or [list(range(len(ranks)))]
    for members in groups:
        first = ranks[members[0]]["params"]
        for r in members:
            assert np.array_equal(ranks[r]["params"], first), f"rank {r} diverged from its group"
            info = ranks[r]["info"]
            assert info["control_plane"] == plane
            assert info["hook_size"] == len(members)
            assert info["vnmse_step0"] < VNMSE_BOUND, info
    return [ranks[m[0]]["params"] for m in groups]


# World sizes: an even and an odd one each (FSDP's uneven shards at 3, its
# power-of-two butterfly at 4); the MPI suites cover the schedules at 2-8.
@pytest.mark.parametrize("mode,n", [("ddp", 2), ("ddp", 3), ("fsdp", 3), ("fsdp", 4)])
def test_torchrun_trains_like_mpiexec(tmp_path, mode, n):
    _run(torchrun(n, WORKER, "--mode", mode, "--out", tmp_path / "torchrun"), "torchrun")
    _run(mpiexec(n, WORKER, "--mode", mode, "--out", tmp_path / "mpiexec"), "mpiexec")
    by_torch = check_training(results(tmp_path / "torchrun", n), "torch")
    by_mpi = check_training(results(tmp_path / "mpiexec", n), "mpi")
    assert np.array_equal(by_torch[0], by_mpi[0]), "the control planes gave different bits"


def test_torchrun_fsdp2_bf16_parameters_against_fsdp2s_own(tmp_path):
    """Under torchrun, MixedPrecisionPolicy(param_dtype=bfloat16) with
    reduce_dtype float32 and bfloat16: ours with the Exact codec follows
    FSDP2's own reduce-scatter, ours with the defaults stays close, and every
    rank holds the same parameters."""
    _run(torchrun(2, WORKER, "--mode", "fsdp_bf16", "--out", tmp_path), "torchrun")
    ranks = results(tmp_path, 2)
    for reduce, tol in (("fp32", 1e-5), ("bf16", 1e-2)):
        own, exact, defaults = (ranks[0][f"{w}_{reduce}"] for w in ("own", "exact", "defaults"))
        scale = np.linalg.norm(own - ranks[0]["init"])     # the training's own change
        assert scale > 0
        assert np.linalg.norm(exact - own) / scale < tol, reduce
        assert np.linalg.norm(defaults - own) / scale < 0.05, reduce
        for r in ranks[1:]:
            for w in ("own", "exact", "defaults"):
                assert np.array_equal(r[f"{w}_{reduce}"], ranks[0][f"{w}_{reduce}"]), (w, reduce)


def _gpus() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


ON_DEVICES = [pytest.param("cpu", id="cpu-gloo"),
              pytest.param("cuda", id="gpu-nccl", marks=pytest.mark.skipif(
                  _gpus() < 2, reason="needs 2 GPUs (one a rank)"))]


@pytest.mark.parametrize("device", ON_DEVICES)
def test_a_stalled_peer_gives_every_survivor_a_clear_error_in_the_groups_timeout(tmp_path, device):
    """torchrun, the group's timeout 4 s: the last rank stops calling in the
    middle of a run of calls; the others get a TimeoutError that names it,
    after the timeout and not much later.  CPU: 3 ranks, NumPy arrays over
    gloo; GPU: 2 ranks, CuPy arrays whose payload goes over NCCL."""
    n = 3 if device == "cpu" else 2
    _run(torchrun(n, WORKER, "--mode", "stall", "--device", device, "--timeout", "4",
                  "--out", tmp_path), "torchrun")
    ranks = results(tmp_path, n)
    assert ranks[-1]["info"] == {"stalled": True}
    for r in ranks[:-1]:
        info = r["info"]
        assert info["call"] == 2 and info["error"] == "TimeoutError", info
        assert f"ranks [{n - 1}]" in info["message"] and "4 s" in info["message"], info
        assert 3.9 < info["seconds"] < 10, info


@pytest.mark.parametrize("device", ON_DEVICES)
def test_a_dead_peer_ends_the_job_instead_of_hanging(tmp_path, device):
    """torchrun: the last rank exits in the middle of a run of calls; the job
    ends with an error well within the group's timeout (60 s), not at it and
    never hangs (CPU: 3 ranks over gloo; GPU: 2 ranks, NCCL payload)."""
    t0 = time.perf_counter()
    proc = subprocess.run(torchrun(3 if device == "cpu" else 2, WORKER, "--mode", "stall",
                                   "--device", device, "--die", "--timeout", "60",
                                   "--out", tmp_path), env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert time.perf_counter() - t0 < 45, proc.stdout[-2000:]


@pytest.mark.parametrize("launch", ["torchrun", "mpiexec"])
def test_ddp_over_subgroups_averages_each_group_alone(tmp_path, launch):
    cmd = (torchrun if launch == "torchrun" else mpiexec)(4, WORKER, "--mode", "subgroups",
                                                          "--out", tmp_path)
    _run(cmd, launch)
    a, b = check_training(results(tmp_path, 4), "torch", groups=[[0, 1], [2, 3]])
    assert not np.array_equal(a, b), "the two groups' gradients were mixed"


def test_mp_spawn_with_tcp_init(tmp_path):
    _run([sys.executable, WORKER, "--mode", "ddp", "--spawn", "2", "--port", str(_free_port()),
          "--out", tmp_path / "spawn"], "mp.spawn")
    _run(torchrun(2, WORKER, "--mode", "ddp", "--out", tmp_path / "torchrun"), "torchrun")
    spawned = check_training(results(tmp_path / "spawn", 2), "torch")
    assert np.array_equal(spawned[0], check_training(results(tmp_path / "torchrun", 2),
                                                     "torch")[0])


def test_allreduce_takes_the_launchers_group(tmp_path):
    _run(torchrun(3, WORKER, "--mode", "allreduce", "--out", tmp_path / "t"), "torchrun")
    _run(mpiexec(3, WORKER, "--mode", "allreduce", "--out", tmp_path / "m"), "mpiexec")
    t, m = results(tmp_path / "t", 3), results(tmp_path / "m", 3)
    for r in range(3):
        assert t[r]["info"]["control_plane"] == "torch" and m[r]["info"]["control_plane"] == "mpi"
        assert t[r]["info"]["world_size"] == 3
        assert not t[r]["info"]["mpi_imported"], "a torchrun job must not start MPI"
        assert t[r]["info"]["vnmse"] < VNMSE_BOUND
        assert np.array_equal(t[r]["params"], t[0]["params"])
        assert np.array_equal(t[r]["params"], m[r]["params"])


def test_no_communicator_is_an_error_on_every_rank(tmp_path):
    _run(torchrun(2, WORKER, "--mode", "nogroup", "--out", tmp_path), "torchrun")
    for r in results(tmp_path, 2):
        message = str(r["message"])
        assert "2 processes" in message and "init_process_group" in message, message


@pytest.mark.gpu
def test_torchrun_on_device_arrays(tmp_path):
    import dynamiq_mpi as dq
    if not dq.has_cuda():
        pytest.skip("needs the CUDA kernels and a GPU")
    _run(torchrun(2, WORKER, "--mode", "gpu_allreduce", "--out", tmp_path), "torchrun")
    ranks = results(tmp_path, 2)
    for r in ranks:
        info = r["info"]
        assert info["same_as_cpu"] and info["control_plane"] == "torch", info
        assert not info["mpi_imported"], "a torchrun job must not start MPI"
        assert np.array_equal(r["params"], ranks[0]["params"])


@pytest.mark.parametrize("codec", ["exact", "dynamiq"])
def test_hsdp_replicate_all_reduce_counts_every_gradient_once(tmp_path, codec):
    """2 replicas x 2 shards under torchrun: dqt.ReduceScatter inside a shard
    group (FSDP2 calls it with that group), dqt.HSDP's all-reduce across
    replicas; the gradient is the
    mean over all four ranks (Exact: to float32 rounding, so none is dropped
    or counted twice)."""
    _run(torchrun(4, WORKER, "--mode", "hsdp", "--codec", codec, "--out", tmp_path), "torchrun")
    ranks = results(tmp_path, 4)
    for r in ranks:
        assert np.array_equal(r["params"], ranks[0]["params"]), "replicas diverged"
        info = r["info"]
        assert info["hook_size"] == 2 and info["hooks"] == 4
        assert info["rs_size"] == 2 and info["rs_plane"] == "torch"   # the shard group
        assert info["vnmse_step0"] < (1e-12 if codec == "exact" else VNMSE_BOUND), info
