"""Planning on the device equals planning on the host, bit for bit.

The allocation, the reorder and the statistics kernel run on CuPy arrays for
device inputs; here they are compared with the NumPy path on random and
adversarial norms (ties, exact 17:512 ratios, zeros, FLT_MAX, denormals) and
inputs (NaN, Inf, BF16).  The exact-size plain kernels (last super-group
partial) are compared with their NumPy definitions.  Skipped without a GPU.
"""
import numpy as np
import pytest

from dynamiq_mpi.cuda import has_cuda, why_not
from helpers import fresh_seed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not has_cuda(), reason=f"no CUDA: {why_not() if not has_cuda() else ''}")]

if has_cuda():  # pragma: no branch
    import cupy as cp
    import ml_dtypes

    from dynamiq_mpi import _cpu, _gpu

    BF16 = np.dtype(ml_dtypes.bfloat16)

FLT_MAX = float(np.finfo(np.float32).max)


def norm_sets(rng, m):
    return [
        (10.0 ** rng.uniform(-30, 30, m)).astype(np.float32),
        np.repeat(10.0 ** rng.uniform(-3, 3, m // 8 + 1), 8)[:m].astype(np.float32),
        (np.where(rng.random(m) < 0.5, 17.0, 512.0) * 2.0 ** rng.integers(-20, 20, m)).astype(np.float32),
        np.where(rng.random(m) < 0.3, 0.0, rng.random(m)).astype(np.float32),
        np.concatenate([[FLT_MAX, FLT_MAX, 1e-45, 1e-44], rng.random(m - 4)]).astype(np.float32),
    ]


@pytest.mark.parametrize("m", [1, 7, 1000, 100_000, 1 << 20])
def test_gpu_planner_equals_cpu_planner(m):
    from test_plan import MODES, compiled_plan
    rng = np.random.default_rng(fresh_seed())
    sets = norm_sets(rng, max(m, 8))
    for F in sets:
        F = F[:m]
        mean = rng.standard_normal(m).astype(np.float32)
        if m > 3:
            mean[3] = np.inf if rng.random() < 0.3 else mean[3]
        tail = np.array([1.0, 7.25], np.float32)
        for mode in MODES:
            for bits in (3.2, 5.0, 7.0, 12.0):
                cpu = compiled_plan(_cpu, F, mean, tail, bits, 64 * m + 64, **mode)
                scratch = cp.empty(_gpu.plan_scratch_bytes(m), cp.uint8)
                gpu = compiled_plan(_gpu, cp.asarray(F), cp.asarray(mean), cp.asarray(tail), bits,
                                    64 * m + 64, scratch=scratch, xp=cp, **mode)
                for c, g in zip(cpu, gpu):
                    g = cp.asnumpy(g)
                    assert np.array_equal(c, g, equal_nan=c.dtype.kind == "f"), (mode, bits)


@pytest.mark.parametrize("graph", ["1", "0"], ids=["graph", "launches"])
def test_steady_calls_replay_the_planner_with_new_norms(graph, monkeypatch):
    """The same arguments and buffers call after call (a Collective's
    workspace) replay one captured graph: each call must still plan its own
    norms, equal to the CPU's; interleaving two sizes keeps two graphs."""
    from test_plan import compiled_plan
    from dynamiq_mpi.codecs.allocation import record_bits
    monkeypatch.setenv("DYNAMIQ_PLAN_GRAPH", graph)
    rng = np.random.default_rng(fresh_seed())
    rec = [record_bits(w, True) for w in (2, 4, 8, 16)]
    buffers = {}
    for call in range(4):
        for m in (1000, 70_000):
            if m not in buffers:
                buffers[m] = dict(norm=cp.empty(m, cp.float32), mean=cp.empty(m, cp.float32),
                                  tail=cp.empty(2, cp.float32), widths=cp.empty(m, cp.int8),
                                  order=cp.empty(m, cp.int64), sos=cp.empty(m, cp.int64),
                                  header=cp.empty(_gpu.PLAN_HEADER, cp.float64),
                                  scratch=cp.empty(_gpu.plan_scratch_bytes(m), cp.uint8))
            b = buffers[m]
            F = norm_sets(rng, m)[call % 5][:m]
            mean = rng.standard_normal(m).astype(np.float32)
            tail = np.array([0.0, float(call) + 0.5], np.float32)
            b["norm"].set(F)
            b["mean"].set(mean)
            b["tail"].set(tail)
            _gpu.plan(m, True, True, True, 0, 64 * m + 64, rec, 5.0 * m * 256,
                      5.0 * m * 256 + 1e4, b["norm"], b["mean"], b["tail"], b["widths"],
                      b["order"], b["sos"], b["header"], b["scratch"])
            cpu = compiled_plan(_cpu, F, mean, tail, 5.0, 64 * m + 64)
            for c, g in zip(cpu, (b["widths"], b["order"], b["sos"], b["header"])):
                assert np.array_equal(c, cp.asnumpy(g), equal_nan=c.dtype.kind == "f"), (call, m)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("centre", [True, False])
def test_gpu_stats_tail_equals_cpu(dtype, centre):
    rng = np.random.default_rng(fresh_seed())
    length = 256 * 333 + 77
    nsg = -(-length // 256)
    x = (rng.standard_normal(length) * 10.0 ** rng.uniform(-8, 8, length)).astype(np.float32)
    for special in (None, np.nan, np.inf, -np.inf):
        y = x.copy()
        if special is not None:
            y[rng.integers(0, length)] = special
        y = y.astype(BF16) if dtype == "bfloat16" else y
        tail_c = np.empty(2, np.float32)
        norm_c = np.empty(nsg, np.float32)
        mean_c = np.empty(nsg, np.float32) if centre else None
        _cpu.stats_into(y, nsg, centre, mean_c, norm_c, tail_c)
        tail_g = cp.full(2, 7.0, cp.float32)
        norm_g = cp.empty(nsg, cp.float32)
        mean_g = cp.empty(nsg, cp.float32) if centre else None
        _gpu.stats_into(cp.asarray(y), nsg, centre, mean_g, norm_g, tail_g, cp.empty(1, cp.int64))
        assert np.array_equal(tail_g.get().view(np.uint32), tail_c.view(np.uint32)), special
        if special is None:
            assert np.array_equal(norm_g.get().view(np.uint32), norm_c.view(np.uint32))
            if centre:
                assert np.array_equal(mean_g.get().view(np.uint32), mean_c.view(np.uint32))
        assert (tail_c[0] == 1.0) == (special is not None)


@pytest.mark.parametrize("tail", [1, 7, 8, 9, 255, 256])
def test_gpu_plain_kernels_with_a_partial_last_super_group(tail):
    rng = np.random.default_rng(fresh_seed())
    nsg = 5
    n = (nsg - 1) * 256 + tail
    x = rng.standard_normal(n).astype(np.float32)
    src = _gpu.Source(cp.asarray(x))
    guard = 999
    out = cp.full(n + 8, guard, cp.uint16)
    _gpu.bf16_compress(src, nsg, out[:n])
    assert np.array_equal(out[:n].get(), x.astype(BF16).view(np.uint16))
    assert np.all(out[n:].get() == guard)                    # nothing written past n
    inp = rng.standard_normal(n).astype(np.float32)
    o = cp.full(n + 8, -1.0, cp.float32)
    _gpu.exact_dar(cp.asarray(inp), src, nsg, o[:n])
    assert np.array_equal(o[:n].get().view(np.uint32), (inp + x).view(np.uint32))
    assert np.all(o[n:].get() == -1.0)
    with pytest.raises(ValueError, match="do not end in the last"):
        _gpu.exact_compress(src, nsg + 1, cp.empty(n, cp.float32))
