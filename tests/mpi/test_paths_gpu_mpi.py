"""The native path on device arrays (NCCL's own all-reduce, BF16 on the
wire), the measured path choice, NaN/Inf propagation over NCCL, and the DDP
hook under GradScaler on CUDA.  One GPU per rank; skipped without them.

Run on the GPU machine: mpiexec -n 2 python -m pytest --with-mpi --only-mpi tests/mpi/test_paths_gpu_mpi.py
"""
import numpy as np
import pytest
from mpi4py import MPI

import dynamiq_mpi as dq
from dynamiq_mpi.backend import BFLOAT16
from dynamiq_mpi.call.paths import measuring_calls

from helpers import shared_seed

comm = MPI.COMM_WORLD
N = comm.size
LAST = N - 1


def _gpus_per_rank_ok():
    if not dq.has_cuda():
        return False
    import cupy
    return comm.allreduce(cupy.cuda.runtime.getDeviceCount(), op=MPI.MIN) >= N


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _gpus_per_rank_ok(), reason="needs one GPU per rank")]


@pytest.fixture(scope="module")
def cp():
    import cupy
    cupy.cuda.Device(comm.rank % cupy.cuda.runtime.getDeviceCount()).use()
    return cupy


def my_input(cp, seed, length, dtype=np.float32):
    rng = np.random.default_rng([seed, comm.rank])
    return cp.asarray(rng.standard_normal(length).astype(dtype))


def same_on_every_rank(cp, a) -> bool:
    blobs = comm.allgather(cp.asnumpy(a).tobytes())
    return all(b == blobs[0] for b in blobs)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16, np.float16, np.float64],
                         ids=["float32", "bfloat16", "float16", "float64"])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_native_nccl_bf16_allreduce(cp, dtype, op):
    seed = shared_seed(comm)
    x = my_input(cp, seed, 300001, dtype)
    out, rep = dq.allreduce(x, path="native", op=op, return_report=True)
    assert rep.path == "native" and rep.transport == "nccl" and rep.bits_per_coord == 16.0
    assert out.dtype == x.dtype and same_on_every_rank(cp, out)
    host = [np.asarray(a, dtype=np.float64) for a in comm.allgather(cp.asnumpy(x).astype(np.float64))]
    want = np.sum(host, axis=0) / (N if op == "mean" else 1)
    scale = np.sum(np.abs(host), axis=0) / (N if op == "mean" else 1)
    # BF16 on the wire: the inputs rounded, n - 1 BF16 additions, the result's own rounding
    err = np.abs(cp.asnumpy(out).astype(np.float64) - want)
    assert np.all(err <= (N + 1) * 2.0 ** -8 * scale + 2.0 ** -7 * np.abs(want) + 1e-30)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [BFLOAT16, np.float32])
def test_steady_native_calls_across_streams_are_exact(cp, dtype):
    """Steady native calls (no event on an unchanged stream) on one stream,
    then alternating between two with no synchronisation in between: every
    result exact on every rank (a switch orders the new stream after the
    old one's calls)."""
    coll = dq.Collective(comm, path="native")
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
    seed = shared_seed(comm)
    hosts = [np.random.default_rng([seed, i, comm.rank]).integers(-8, 9, size=1 << 16)
             .astype(dtype) for i in range(16)]                        # exact in BF16 sums
    outs = []
    for i, host in enumerate(hosts):
        with streams[0] if i < 4 else streams[(i // 2) % 2]:
            x = cp.asarray(host)
            outs.append(coll.allreduce(x.reshape(256, -1) if i % 3 == 0 else x))
    cp.cuda.Device().synchronize()
    for i, (host, out) in enumerate(zip(hosts, outs)):
        expect = np.asarray(comm.allreduce(host.astype(np.float64)))
        assert np.array_equal(cp.asnumpy(out).astype(np.float64).reshape(-1), expect), i
    coll.free()


@pytest.mark.mpi(min_size=2)
def test_native_exact_keeps_float32(cp):
    x = my_input(cp, shared_seed(comm), 70000)
    out, rep = dq.allreduce(x, codec=dq.Exact(), path="native", return_report=True)
    assert rep.bits_per_coord == 32.0 and "float32 on the wire" in rep.codec_info["native"]
    host = comm.allgather(cp.asnumpy(x).astype(np.float64))
    want = np.sum(host, axis=0)
    assert np.max(np.abs(cp.asnumpy(out) - want) / (np.sum(np.abs(host), axis=0) + 1e-30)) \
        <= N * 2.0 ** -23


@pytest.mark.mpi(min_size=2)
def test_auto_path_on_nccl_measures_and_agrees(cp):
    coll = dq.Collective(comm, path="auto")
    calls = measuring_calls(coll.graphs)
    seen = []
    for i in range(calls + 2):
        x = my_input(cp, 1000 + i, 1 << 16, BFLOAT16)
        out, rep = coll.allreduce(x, codec=dq.DynamiQ(small_input=0), return_report=True)
        seen.append(rep.path)
        assert same_on_every_rank(cp, out)
    assert seen[:calls] == ["compressed", "native"] * (calls // 2)
    assert seen[calls] == seen[calls + 1]
    assert all(s == seen for s in comm.allgather(seen))
    (_, (path, why)), = coll.path_decisions().items()
    assert "measured" in why and len(set(comm.allgather(why))) == 1
    # inputs the codec would send as BF16 anyway go to NCCL's BF16 all-reduce unmeasured
    x = my_input(cp, 999, 1 << 16, BFLOAT16)
    out, rep = coll.allreduce(x, return_report=True)
    assert rep.path == "native" and "same bytes" in rep.path_reason
    assert same_on_every_rank(cp, out)
    coll.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path", ["compressed", "native"])
@pytest.mark.parametrize("codec", [dq.DynamiQ(small_input=0), dq.DynamiQ()],
                         ids=["dynamiq", "dynamiq-small-as-bf16"])
def test_nonfinite_propagates_over_nccl(cp, path, codec):
    x = my_input(cp, shared_seed(comm), 256 * 40)
    if comm.rank == LAST:
        x[77] = cp.inf
    out, rep = dq.allreduce(x, codec=codec, path=path, return_report=True)
    assert rep.nonfinite is True and not bool(cp.isfinite(out[77]))
    assert same_on_every_rank(cp, out)
    y = my_input(cp, shared_seed(comm), 256 * 40)
    out, rep = dq.allreduce(y, codec=codec, path=path, return_report=True)
    assert rep.nonfinite is False and bool(cp.isfinite(out).all())


@pytest.mark.mpi(min_size=2)
def test_grad_scaler_with_the_hook_on_cuda(cp):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    import dynamiq_mpi.torch as dqt

    created = not dist.is_initialized()
    _, _, device = dqt.init_process_group_from_mpi("nccl")

    def train(state, steps=6, bad=(1, 3, 4)):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8)).to(device)
        model = DDP(net, device_ids=[device.index], bucket_cap_mb=0.05)
        if state is not None:
            model.register_comm_hook(state, dqt.ddp_comm_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 12, growth_interval=1000)
        skipped, scales = [], []
        for step in range(steps):
            gen = torch.Generator().manual_seed(100 * step + comm.rank)
            x = torch.randn(32, 64, generator=gen).to(device)
            y = torch.randn(32, 8, generator=gen).to(device)
            if step in bad and comm.rank == LAST:
                x[3, 5] = float("inf")
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            scaler.scale((model(x) - y).square().mean()).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            skipped.append(all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
        return model, skipped, scales

    try:
        _, skipped0, scales0 = train(None)
        for path in ("compressed", "native", "auto"):
            state = dqt.HookState(codec=dq.DynamiQ(bits=5, small_input=0), path=path)
            model, skipped, scales = train(state)
            assert skipped == skipped0 == [False, True, False, True, True, False], (path, skipped)
            assert scales == scales0
            blob = b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())
            assert all(b == blob for b in comm.allgather(blob)), path
    finally:
        if created:
            dist.destroy_process_group()
