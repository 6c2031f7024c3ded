"""The scale simulator (research/scale_sim.py) on CuPy arrays: the GPU
kernels walked role by role give simulate_allreduce's bits on the same
device arrays (and so the CPU path's), for every codec with an adapter.
The training simulator (train-sim) reduces its buckets this way on a GPU.
Skipped without a GPU.
"""
import numpy as np
import pytest

import dynamiq_mpi as dq
from dynamiq_mpi.cuda import has_cuda, why_not
from helpers import fresh_seed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not has_cuda(), reason=f"no CUDA: {why_not() if not has_cuda() else ''}")]

# MX on CuPy differed in 10 of 10 cases until the walk bound each role's
# input to the plan's GPU source (the fused kernels read it, not the host
# blocks the adapter used to set): these cases guard that.
CODECS = {"dynamiq:5": dq.DynamiQ(small_input=0), "bf16": dq.BF16(), "mxfp:e2m1": dq.MXFP("e2m1"),
          "mxfp:e4m3": dq.MXFP("e4m3"), "thc": dq.THC(),
          "thc:blocks <= 2^10": dq.THC(max_block_log2=10),     # several blocks of one size
          "omnireduce": dq.OmniReduce(), "omnireduce:0.2": dq.OmniReduce(density=0.2)}
NAMES = sorted(CODECS)


@pytest.mark.parametrize("n", [2, 5, 8])
@pytest.mark.parametrize("topology", ["ring", "butterfly"])
@pytest.mark.parametrize("name", NAMES)
def test_scale_allreduce_on_cupy_equals_simulate_allreduce(n, topology, name):
    import cupy as cp

    from research.scale_sim import ArraySource, scale_allreduce
    from dynamiq_mpi.bench.gradients import gradient_like
    if topology == "butterfly" and n & (n - 1):
        pytest.skip("butterfly needs a power of two")
    seed = fresh_seed()
    length = 7 * 1024 + 300 + seed % 256
    host = [gradient_like(length, r, seed=seed % 997) for r in range(n)]
    dev = [cp.asarray(x) for x in host]
    codec = CODECS[name]
    res = scale_allreduce(ArraySource(dev), n, codec=codec, topology=topology, op="mean",
                          seed=seed % 1000, counter=seed % 7, xp=cp, exact=False)
    assert isinstance(res.out, cp.ndarray)
    gpu = dq.simulate_allreduce(dev, codec=codec, topology=topology, op="mean",
                                seed=seed % 1000, counter=seed % 7)
    cpu = dq.simulate_allreduce(host, codec=codec, topology=topology, op="mean",
                                seed=seed % 1000, counter=seed % 7)
    got = cp.asnumpy(res.out).view(np.uint32)
    assert np.array_equal(got, cp.asnumpy(gpu[0]).view(np.uint32)), (seed, name, topology, n)
    assert np.array_equal(got, cpu[0].view(np.uint32)), (seed, name, topology, n)


@pytest.mark.parametrize("chunk", [32, 4])
def test_thc_statistics_pass_on_cupy_equals_each_rank_on_the_host(chunk, monkeypatch):
    """THC's statistics pass rotates a chunk of ranks at once on CuPy: the
    rotated vectors and the reduced range bytes are NumPy's local_stats rank
    by rank, with several chunks, a shorter last one, a rank holding NaN or
    Inf (255) and one whose rotation overflows (254)."""
    import cupy as cp

    from dynamiq_mpi.backend import backend_for
    from dynamiq_mpi.call.workspace import FRESH
    from research import scale_sim
    from dynamiq_mpi.bench.gradients import gradient_like
    seed = fresh_seed()
    n, length = 9, 5 * 1024 + 300 + seed % 256
    host = [gradient_like(length, r, seed=seed % 997) for r in range(n)]
    host[4][seed % length] = np.inf if seed % 2 else np.nan
    host[7][:] = np.float32(3e38)
    keys = scale_sim.call_keys(seed % 1000, 1 + seed % 5)
    codec = dq.THC(max_block_log2=10)
    cpu = backend_for(host[0])
    alone = [codec.local_stats(x, cpu, FRESH, keys=keys) for x in host]
    monkeypatch.setattr(scale_sim, "THC_CHUNK_ROWS", chunk)
    adapter = scale_sim._adapter_for(codec)
    sim = scale_sim._Sim(scale_sim.ArraySource([cp.asarray(x) for x in host]), n, codec, "ring",
                         scale_sim.DEFAULT_TILE_BYTES, cp, scale_sim._Progress(0, "", False), keys)
    reduced, _ = adapter.reduce_stats(sim)
    rotated = cp.asnumpy(adapter._rotated)
    expected = np.stack([state[0] for _, state in alone])
    # bit for bit, except the NaN payloads of the non-finite row (a GPU's NaN is
    # canonical, x86's keeps the sign): that row's range bytes are 255 anyway
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(rotated), nan), seed
    assert np.array_equal(rotated[~nan].view(np.uint32), expected[~nan].view(np.uint32)), seed
    assert np.array_equal(cp.asnumpy(reduced), np.max(np.stack([st for st, _ in alone]), axis=0))
    assert int(reduced.max()) == 255 and alone[7][0].max() == 254
