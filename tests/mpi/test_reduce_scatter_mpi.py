"""dq.reduce_scatter under mpiexec (CPU, host MPI): every rank's chunk against
an independent float64 NumPy sum, every codec against its own all-reduce on
the same data, bad input raised alike on every rank, NaN/Inf semantics.

Run: mpiexec -n 4 python -m pytest --with-mpi --only-mpi tests/mpi/test_reduce_scatter_mpi.py
"""
import numpy as np
import pytest
from mpi4py import MPI

import dynamiq_mpi as dq
from helpers import BF16, exact_sum, rank_inputs, shared_seed

comm = MPI.COMM_WORLD
N = comm.size
R = comm.rank
LAST = N - 1
F32_EPS = float(np.finfo(np.float32).eps)


def my_inputs(seed, length, kind="heavy", dtype=np.float32):
    xs = rank_inputs(seed, N, length, kind, dtype)
    return xs, xs[R].copy()


def chunk(a, r=R):
    m = a.shape[0] // N
    return a[r * m:(r + 1) * m]


def all_ok(flag):
    return all(comm.allgather(bool(flag)))


def raises_everywhere(exc, fn, match):
    with pytest.raises(exc, match=match) as info:
        fn()
    messages = comm.allgather(str(info.value))
    assert len(set(messages)) == 1, messages


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("topology", ["ring", "butterfly"])
@pytest.mark.parametrize("length_per_rank", [1, 300, 5000])
def test_exact_equals_float64_chunk(topology, length_per_rank):
    if topology == "butterfly" and N & (N - 1):
        pytest.skip("butterfly needs a power-of-two world")
    seed = shared_seed(comm)
    xs, x = my_inputs(seed, N * length_per_rank)
    before = x.copy()
    out, rep = dq.reduce_scatter(x, codec=dq.Exact(), topology=topology, return_report=True)
    assert out.shape == (length_per_rank,) and out.dtype == np.float32
    assert np.array_equal(x, before)          # the input is never written
    S = chunk(exact_sum(xs))
    bound = N * F32_EPS * chunk(np.sum(np.abs(np.array(xs, dtype=np.float64)), axis=0))
    ok = np.all(np.abs(out.astype(np.float64) - S) <= bound + 1e-300)
    assert all_ok(ok), f"seed {seed}"
    assert rep.collective == "reduce_scatter" and rep.bits_per_coord == pytest.approx(32.0)
    assert rep.transport == "mpi"


@pytest.mark.mpi(min_size=2)
def test_mean_out_bf16_and_shapes():
    seed = shared_seed(comm)
    xs, x = my_inputs(seed, N * 512, kind="normal")
    x2 = x.reshape(N, 512)                   # any C-contiguous shape, treated as flat
    out = np.full(512, 7.0, dtype=np.float32)
    res = dq.reduce_scatter(x2, codec=dq.Exact(), op="mean", out=out)
    assert res is out
    S = chunk(exact_sum(xs)) / N
    assert all_ok(np.allclose(out, S, rtol=1e-5, atol=1e-6))
    xb = x.astype(BF16)
    ob = dq.reduce_scatter(xb, codec=dq.BF16())
    assert ob.dtype == BF16 and ob.shape == (512,)
    xb64 = [np.asarray(v.astype(BF16), dtype=np.float64) for v in xs]
    Sb = chunk(exact_sum(xb64))
    # every hop rounds a partial sum to BF16 (2^-8 relative), the output too
    bound = (N + 1) * 2.0 ** -8 * chunk(np.sum(np.abs(np.array(xb64)), axis=0))
    assert all_ok(np.all(np.abs(ob.astype(np.float64) - Sb) <= bound))
    # float64 input comes back as float64
    o64 = dq.reduce_scatter(x.astype(np.float64), codec=dq.Exact())
    assert o64.dtype == np.float64 and all_ok(np.allclose(o64, chunk(exact_sum(xs)), rtol=1e-5, atol=1e-5))


CODECS = {
    "bf16": lambda: dq.BF16(),
    "dynamiq": lambda: dq.DynamiQ(bits=5, small_input=0),
    "mxfp8": lambda: dq.MXFP("e4m3"),
    "thc": lambda: dq.THC(),
    "omnireduce": lambda: dq.OmniReduce(),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", sorted(CODECS))
def test_codec_chunk_matches_its_allreduce_in_distribution(name):
    """vNMSE of the chunks (all ranks together) within 10 % of the same codec's
    all-reduce on the same data, averaged over a few calls (normal data:
    every chunk alike, so a per-chunk plan is the global one)."""
    codec = CODECS[name]()
    seed = shared_seed(comm)
    coll = dq.Collective(comm)
    err_rs = err_ar = ref = 0.0
    calls = 4 if name in ("thc", "bf16") else 2
    for k in range(calls):
        # OmniReduce picks whole 256-blocks per chunk: short chunks round its
        # top-k coarsely (1.12x the error at 32 blocks and n = 8, 1.03x at 128)
        per = 32768 if name == "omnireduce" else 8192
        xs, x = my_inputs(seed + k, N * per, kind="normal")
        S = exact_sum(xs)
        rs, rep = coll.reduce_scatter(x, codec=codec, seed=k, return_report=True)
        ar = coll.allreduce(x, codec=codec, seed=k)
        err_rs += comm.allreduce(float(np.sum((rs.astype(np.float64) - chunk(S)) ** 2)))
        err_ar += float(np.sum((ar.astype(np.float64) - S) ** 2))
        ref += float(np.sum(S ** 2))
        assert rep.nonfinite is False or rep.nonfinite is None
        assert 0 < rep.bits_per_coord < 33
    coll.free()
    ratio = err_rs / err_ar
    # THC rounds each Hadamard block's range up to a power of two, so its
    # ratio moves in jumps, not as noise; BF16 is deterministic.
    lower = 0.0 if name in ("thc", "bf16") else 0.9
    # At 2 ranks the whole vector's one block sits at a power-of-two edge: in
    # 1 call in 8 its range halves and that call's error with it, so over the
    # 4 calls the ratio is 0.5, 0.62, 0.8, 1.14 or 2.0 (binomial, q = 0.126;
    # 10 of 12000 simulated runs passed 1.35, worst 2.016).  At 4 ranks a
    # range that rounds up in one chunk weighs alone (worst 1.37 in 4000).
    # Past 3.0 takes all 4 calls halved and two more rare roundings (< 1e-9).
    upper = 3.0 if name == "thc" else 1.1
    assert lower <= ratio <= upper, \
        f"{name}: reduce-scatter vNMSE {err_rs / ref:.3e}, all-reduce {err_ar / ref:.3e}"


@pytest.mark.mpi(min_size=2)
def test_dynamiq_report_and_skewed_data():
    """Heavy-tailed, layer-skewed data: per-chunk thresholds cost a little
    accuracy against the all-reduce (docs/design.md); bits stay in budget."""
    seed = shared_seed(comm)
    xs, x = my_inputs(seed, N * 4096)
    codec = dq.DynamiQ(bits=5, small_input=0)
    out, rep = dq.reduce_scatter(x, codec=codec, return_report=True)
    S = exact_sum(xs)
    err = comm.allreduce(float(np.sum((out.astype(np.float64) - chunk(S)) ** 2)))
    vn = err / float(np.sum(S ** 2))
    assert vn < 0.05, f"seed {seed}: {vn}"
    sizes = rep.codec_info["block_bytes"]
    assert len(sizes) == N and max(sizes) <= 1.05 * min(sizes) + 4096
    assert rep.bits_per_coord <= 5.0 + 0.3
    assert comm.allgather(rep.wire_bytes_total) == [rep.wire_bytes_total] * N


@pytest.mark.mpi(min_size=2)
def test_small_input_falls_back_to_bf16():
    seed = shared_seed(comm)
    xs, x = my_inputs(seed, N * 100, kind="normal")
    out, rep = dq.reduce_scatter(x, return_report=True)     # default DynamiQ, tiny input
    assert "fallback" in rep.codec_info
    # BF16 on the wire: every hop rounds a partial sum (2^-8 relative), the inputs too
    bound = (2 * N + 1) * 2.0 ** -8 * chunk(np.sum(np.abs(np.array(xs, dtype=np.float64)), axis=0))
    assert all_ok(np.all(np.abs(out - chunk(exact_sum(xs))) <= bound))


# ------------------------------------------------------------------ bad input
@pytest.mark.mpi(min_size=2)
def test_length_not_divisible():
    x = np.ones(N * 10 + 1, dtype=np.float32)
    raises_everywhere(dq.InvalidInputError, lambda: dq.reduce_scatter(x, codec=dq.Exact()),
                      "divisible")


@pytest.mark.mpi(min_size=2)
def test_length_dtype_codec_differ_on_one_rank():
    x = np.ones(N * (10 if R != LAST else 11), dtype=np.float32)
    raises_everywhere(dq.InputMismatchError, lambda: dq.reduce_scatter(x), "disagree on length")
    x = np.ones(N * 10, dtype=np.float32 if R != LAST else np.float64)
    raises_everywhere(dq.InputMismatchError, lambda: dq.reduce_scatter(x), "disagree on dtype")
    x = np.ones(N * 10, dtype=np.float32)
    codec = dq.Exact() if R != LAST else dq.BF16()
    raises_everywhere(dq.InputMismatchError, lambda: dq.reduce_scatter(x, codec=codec),
                      "disagree on codec")


@pytest.mark.mpi(min_size=2)
def test_out_of_wrong_length():
    x = np.ones(N * 10, dtype=np.float32)
    out = np.empty(10 if R != LAST else 11, dtype=np.float32)
    raises_everywhere(dq.InvalidInputError,
                      lambda: dq.reduce_scatter(x, codec=dq.Exact(), out=out), "out must hold")
    # still usable afterwards
    assert np.all(dq.reduce_scatter(x, codec=dq.Exact()) == N)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("codec", ["dynamiq", "dynamiq-small", "exact"])
def test_nonfinite(bad, codec):
    c = {"dynamiq": dq.DynamiQ(bits=5, small_input=0), "dynamiq-small": dq.DynamiQ(bits=5),
         "exact": dq.Exact()}[codec]
    x = np.ones(N * 1024, dtype=np.float32)
    where = 3                                # in rank 0's chunk
    if R == LAST:
        x[where] = bad
    # propagate (default): no exception
    out, rep = dq.reduce_scatter(x, codec=c, return_report=True)
    if codec == "dynamiq":                   # statistics phase: every rank's output is NaN
        assert rep.nonfinite is True and np.all(np.isnan(out))
    else:                                    # per coordinate, as float sums do
        assert rep.nonfinite == (R == 0)
        assert (not np.all(np.isfinite(out))) == (R == 0)
    assert all_ok(True)
    if codec == "exact":
        return                               # no statistics: nothing to raise from
    before = x.copy()
    raises_everywhere(dq.NonFiniteInputError,
                      lambda: dq.reduce_scatter(x, codec=c, nonfinite="raise"), "NaN or Inf")
    assert np.array_equal(x, before, equal_nan=True)
    assert np.all(dq.reduce_scatter(np.ones(N * 4, dtype=np.float32), codec=dq.Exact()) == N)
