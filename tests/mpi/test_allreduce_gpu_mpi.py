"""The all-reduce on CuPy arrays over MPI (ranks share the GPUs round-robin).

Skipped unless the CUDA kernels were built and a GPU is usable.  The GPU
result must equal the CPU path's result on the same data, bit for bit.
"""
import numpy as np
import pytest
from mpi4py import MPI

import dynamiq_mpi as dq
from helpers import BF16, digest, exact_sum, fresh_seed, rank_inputs, vnmse

comm = MPI.COMM_WORLD
N = comm.size
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not dq.has_cuda(), reason="needs the CUDA kernels and a GPU")]
TOPOLOGIES = ["ring"] + (["butterfly"] if N & (N - 1) == 0 else [])
CODECS = [dq.Exact(), dq.BF16(), dq.DynamiQ(small_input=0, bits=5), dq.DynamiQ(small_input=0, bits=3),
          dq.DynamiQ(small_input=0, bits=6, correlated=False, hierarchical=False, uniform=True)]


@pytest.fixture(scope="module")
def cp():
    import cupy
    cupy.cuda.Device(comm.rank % cupy.cuda.runtime.getDeviceCount()).use()
    return cupy


def shared_seed():
    return comm.bcast(fresh_seed() if comm.rank == 0 else None)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: "-".join(map(str, c.signature()[:2])))
def test_gpu_equals_cpu_bit_for_bit(cp, codec, topology, dtype):
    seed = shared_seed()
    xs = rank_inputs(seed, N, 256 * 300 + 77, dtype=dtype)
    for x in xs:
        x[256 * 5:256 * 9] = 0          # zero super-groups on every rank
    d_x = cp.asarray(xs[comm.rank])
    d_out, rep = dq.allreduce(d_x, codec=codec, topology=topology, seed=seed % 1000,
                              return_report=True)
    assert isinstance(d_out, cp.ndarray) and d_out.dtype == dtype
    out = cp.asnumpy(d_out)
    assert np.array_equal(cp.asnumpy(d_x).view(np.uint8), xs[comm.rank].view(np.uint8))
    cpu = dq.simulate_allreduce(xs, codec=codec, topology=topology, seed=seed % 1000,
                                counter=rep.call_counter)[comm.rank]
    assert digest(out) == digest(cpu), f"seed {seed}"
    digests = comm.allgather(digest(out))
    assert len(set(digests)) == 1
    assert vnmse(out, exact_sum(xs)) < 0.5


@pytest.mark.mpi(min_size=2)
def test_gpu_bad_input_raises_everywhere(cp):
    x = cp.asarray(rank_inputs(5, N, 1000)[comm.rank])
    if comm.rank == N - 1:
        x[3] = cp.nan
    with pytest.raises(dq.NonFiniteInputError):
        dq.allreduce(x, codec=dq.DynamiQ(small_input=0))
