"""The all-reduce on CuPy arrays (ranks use the GPUs round-robin), over both
transports: NCCL (needs one GPU per rank) and host-staged MPI.

Skipped unless the CUDA kernels were built and a GPU is usable.  The GPU
result must equal the CPU path's result on the same data, bit for bit, on
either transport, whatever the tile size.
"""
import numpy as np
import pytest
from mpi4py import MPI

import dynamiq_mpi as dq
from helpers import BF16, digest, exact_sum, rank_inputs, shared_seed, vnmse

comm = MPI.COMM_WORLD
N = comm.size
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not dq.has_cuda(), reason="needs the CUDA kernels and a GPU")]
TOPOLOGIES = ["ring"] + (["butterfly"] if N & (N - 1) == 0 else [])
# MXFP runs its fused kernels (mx_kernels.cu); THC and OmniReduce are array code on CuPy
CODECS = [dq.Exact(), dq.BF16(), dq.DynamiQ(small_input=0, bits=5), dq.DynamiQ(small_input=0, bits=3),
          dq.DynamiQ(small_input=0, bits=6, correlated=False, hierarchical=False, uniform=True),
          dq.DynamiQ(small_input=0, bits=5, scale_code="ceil", bf16_class=False),  # earlier defaults
          dq.DynamiQ(small_input=0, bits=9),      # the 16-bit class (on by default)
          dq.MXFP("e4m3"), dq.MXFP("e5m2"), dq.MXFP("e3m2"), dq.MXFP("e2m1"), dq.THC(),
          dq.OmniReduce(0.5)]


@pytest.fixture(scope="module")
def cp():
    import cupy
    cupy.cuda.Device(comm.rank % cupy.cuda.runtime.getDeviceCount()).use()
    return cupy


def _one_gpu_per_rank():
    import cupy
    return comm.allreduce(cupy.cuda.runtime.getDeviceCount() if dq.has_cuda() else 0,
                          op=MPI.MIN) >= N


NCCL_OK = dq.has_cuda() and _one_gpu_per_rank()
TRANSPORTS = [pytest.param("nccl", marks=pytest.mark.skipif(
                  not NCCL_OK, reason="NCCL needs one GPU per rank")), "mpi"]


@pytest.fixture(scope="module")
def colls(cp):
    """Collectives per (transport, tile bytes): small tiles exercise the pipeline."""
    made = {}

    def get(transport, tile_bytes):
        key = (transport, tile_bytes)
        if key not in made:
            made[key] = dq.Collective(comm, transport=transport, tile_bytes=tile_bytes,
                                      lanes=2 if transport == "nccl" else None)
        return made[key]
    yield get
    for c in made.values():
        c.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("tile_bytes", [4096, 8 << 20], ids=["tiles4K", "tiles8M"])
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: "-".join(map(str, c.signature()[:2] + c.signature()[-1:])))
def test_gpu_equals_cpu_bit_for_bit(cp, colls, codec, topology, dtype, transport, tile_bytes):
    seed = shared_seed(comm)
    xs = rank_inputs(seed, N, 256 * 300 + 77, dtype=dtype)
    for x in xs:
        x[256 * 5:256 * 9] = 0          # zero super-groups on every rank
    d_x = cp.asarray(xs[comm.rank])
    d_out, rep = colls(transport, tile_bytes).allreduce(
        d_x, codec=codec, topology=topology, seed=seed % 1000, return_report=True)
    assert rep.transport == transport
    assert isinstance(d_out, cp.ndarray) and d_out.dtype == dtype
    out = cp.asnumpy(d_out)
    assert np.array_equal(cp.asnumpy(d_x).view(np.uint8), xs[comm.rank].view(np.uint8))
    cpu = dq.simulate_allreduce(xs, codec=codec, topology=topology, seed=seed % 1000,
                                counter=rep.call_counter, tile_bytes=tile_bytes)[comm.rank]
    assert digest(out) == digest(cpu), f"seed {seed}"
    digests = comm.allgather(digest(out))
    assert len(set(digests)) == 1
    assert vnmse(out, exact_sum(xs)) < 0.5


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec", [dq.MXFP("e4m3"), dq.MXFP("e2m3")], ids=["e4m3", "e2m3"])
def test_gpu_mx_extreme_blocks_equal_cpu(cp, colls, codec):
    """Blocks from denormal to near-overflow scales, ties of the element grid
    and signed zeros: the fused kernels round like the NumPy path."""
    seed = shared_seed(comm)
    xs = []
    for r in range(N):
        g = np.random.default_rng(seed * 31 + r)
        x = g.standard_normal((900, 32)).astype(np.float32)
        x *= (2.0 ** g.integers(-140, 120, 900)).astype(np.float32)[:, None]
        x[::7] = np.float32(1.5) * np.float32(2.0) ** g.integers(-30, 30, (x[::7].shape[0], 1))
        x[3] = -0.0
        xs.append(x.reshape(-1)[:-5].copy())
    out = colls("mpi", 4096).allreduce(cp.asarray(xs[comm.rank]), codec=codec, topology="ring")
    cpu = dq.simulate_allreduce(xs, codec=codec, topology="ring", tile_bytes=4096)[comm.rank]
    assert digest(cp.asnumpy(out)) == digest(cpu), f"seed {seed}"
    assert len(set(comm.allgather(digest(cp.asnumpy(out))))) == 1


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_gpu_in_place_mean_equals_cpu(cp, colls, topology, dtype, transport):
    """DynamiQ decodes straight into the caller's buffer on the GPU (here the
    input itself, op="mean", small tiles, zero super-groups): the bytes equal
    the CPU path's decode-then-finish."""
    seed = shared_seed(comm)
    xs = rank_inputs(seed, N, 256 * 333 + 45, dtype=dtype)
    for x in xs:
        x[256 * 7:256 * 12] = 0
    codec = dq.DynamiQ(bits=5, small_input=0)
    coll = colls(transport, 4096)
    d_x = cp.asarray(xs[comm.rank])
    got, rep = coll.allreduce(d_x, codec=codec, topology=topology, op="mean", seed=seed % 1000,
                              out=d_x, return_report=True)
    assert got is d_x
    cpu = dq.simulate_allreduce(xs, codec=codec, topology=topology, op="mean", seed=seed % 1000,
                                counter=rep.call_counter, tile_bytes=4096)[comm.rank]
    assert digest(cp.asnumpy(d_x)) == digest(cpu), f"seed {seed}"
    assert len(set(comm.allgather(digest(cpu)))) == 1


@pytest.mark.mpi(min_size=2)
def test_gpu_bad_input_raises_everywhere(cp):
    x = cp.asarray(rank_inputs(5, N, 1000)[comm.rank])
    if comm.rank == N - 1:
        x[3] = cp.nan
    with pytest.raises(dq.NonFiniteInputError):
        dq.allreduce(x, codec=dq.DynamiQ(small_input=0), nonfinite="raise")
    out, rep = dq.allreduce(x, codec=dq.DynamiQ(small_input=0), return_report=True)
    assert rep.nonfinite and bool(cp.isnan(out).all())      # propagated (the default)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_gpu_in_place_other_stream_and_profile(cp, colls, transport):
    seed = shared_seed(comm)
    xs = rank_inputs(seed, N, 1 << 17, dtype=BF16)
    coll = colls(transport, 1 << 16)
    codec = dq.DynamiQ(bits=5, small_input=0)
    coll.counter = 11
    ref = cp.asnumpy(coll.allreduce(cp.asarray(xs[comm.rank]), codec=codec, op="mean"))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:                         # the caller's stream: results valid in its order
        coll.counter = 11
        x = cp.asarray(xs[comm.rank])
        got = coll.allreduce(x, codec=codec, op="mean", out=x)
        stream.synchronize()
    assert got is x and digest(cp.asnumpy(x)) == digest(ref)
    coll.counter = 11
    out, rep = coll.allreduce(cp.asarray(xs[comm.rank]), codec=codec, op="mean",
                              return_report=True, profile=True)
    assert digest(cp.asnumpy(out)) == digest(ref)
    for phase in ("agreement", "statistics", "plan", "reduce-scatter", "all-gather", "finish"):
        assert rep.phases[phase] >= 0.0
    assert len(set(comm.allgather(digest(ref)))) == 1


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_gpu_float16_input(cp, colls, transport):
    seed = shared_seed(comm)
    xs = [x.astype(np.float16) for x in rank_inputs(seed, N, 70000, kind="normal")]
    out = colls(transport, 8 << 20).allreduce(cp.asarray(xs[comm.rank]), codec=dq.DynamiQ(bits=6, small_input=0))
    assert out.dtype == np.float16
    host = cp.asnumpy(out)
    assert vnmse(host, exact_sum(xs)) < 0.05
    assert len(set(comm.allgather(digest(host)))) == 1
