"""dq.reduce_scatter on CuPy arrays over NCCL and host-staged MPI: every
rank's chunk equals the CPU path's bit for bit (the codecs' CPU and GPU
kernels are twins), for every codec, tile size and transport; NaN semantics.

Skipped unless the CUDA kernels were built and a GPU is usable.
"""
import numpy as np
import pytest
from mpi4py import MPI

import dynamiq_mpi as dq
from helpers import BF16, digest, exact_sum, rank_inputs, shared_seed

comm = MPI.COMM_WORLD
N = comm.size
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not dq.has_cuda(), reason="needs the CUDA kernels and a GPU")]
TOPOLOGIES = ["ring"] + (["butterfly"] if N & (N - 1) == 0 else [])
CODECS = [dq.Exact(), dq.BF16(), dq.DynamiQ(small_input=0, bits=5),
          dq.DynamiQ(small_input=0, bits=9, bf16_class=True), dq.MXFP("e4m3"), dq.THC(),
          dq.OmniReduce(0.5)]


def _one_gpu_per_rank():
    import cupy
    return comm.allreduce(cupy.cuda.runtime.getDeviceCount() if dq.has_cuda() else 0,
                          op=MPI.MIN) >= N


NCCL_OK = dq.has_cuda() and _one_gpu_per_rank()
TRANSPORTS = [pytest.param("nccl", marks=pytest.mark.skipif(
                  not NCCL_OK, reason="NCCL needs one GPU per rank")), "mpi"]


@pytest.fixture(scope="module")
def cp():
    import cupy
    cupy.cuda.Device(comm.rank % cupy.cuda.runtime.getDeviceCount()).use()
    return cupy


@pytest.fixture(scope="module")
def colls(cp):
    made = {}

    def get(transport, tile_bytes):
        key = (transport, tile_bytes)
        if key not in made:
            made[key] = dq.Collective(comm, transport=transport, tile_bytes=tile_bytes)
        return made[key]
    yield get
    for c in made.values():
        c.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name + str(c.signature()[1:2]))
@pytest.mark.parametrize("tile_bytes", [4096, 32 << 20])
def test_gpu_chunk_equals_cpu_chunk(cp, colls, transport, topology, codec, tile_bytes):
    seed = shared_seed(comm)
    x = rank_inputs(seed, N, N * 20000 + N * 3)[comm.rank]
    cpu_coll = colls("mpi", tile_bytes)
    cpu_coll.counter = 0
    want = cpu_coll.reduce_scatter(x, codec=codec, topology=topology, seed=seed % 1000)
    coll = colls(transport, tile_bytes)
    coll.counter = 0
    got, rep = coll.reduce_scatter(cp.asarray(x), codec=codec, topology=topology,
                                   seed=seed % 1000, return_report=True)
    assert rep.transport == transport
    assert digest(cp.asnumpy(got)) == digest(want), f"seed {seed}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_gpu_exact_bf16_out_and_nan(cp, colls, transport):
    seed = shared_seed(comm)
    xs = rank_inputs(seed, N, N * 4096, kind="normal")
    coll = colls(transport, 32 << 20)
    out = cp.empty(4096, dtype=BF16)
    res = coll.reduce_scatter(cp.asarray(xs[comm.rank]).astype(BF16), codec=dq.BF16(),
                              op="mean", out=out)
    assert res is out
    S = exact_sum(xs)[comm.rank * 4096:(comm.rank + 1) * 4096] / N
    assert np.allclose(cp.asnumpy(out).astype(np.float64), S, rtol=2e-2, atol=2e-2)
    x = cp.ones(N * 4096, dtype=cp.float32)
    if comm.rank == N - 1:
        x[7] = cp.nan
    got, rep = coll.reduce_scatter(x, codec=dq.DynamiQ(small_input=0), return_report=True)
    assert rep.nonfinite is True and bool(cp.isnan(got).all())
