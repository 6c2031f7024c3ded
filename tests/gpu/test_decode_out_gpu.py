"""decompress_out (decode straight into the caller's layout) == the CPU's
decompress followed by finish, bit for bit: every width, both scale layouts,
float32 and BF16 outputs, divisors, a partial last super-group, runs that
start inside the stream (sg_base), a permuted order with absent rows, and
finish(None, ...) filling exactly the rows absent from the stream.

Skipped (with the reason) unless dynamiq_mpi.cuda.has_cuda().
"""
import numpy as np
import pytest

from dynamiq_mpi.cuda import has_cuda, why_not

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not has_cuda(), reason=f"no CUDA: {why_not() if not has_cuda() else ''}")]

if has_cuda():  # pragma: no branch
    import cupy as cp
    import ml_dtypes

    from dynamiq_mpi import _cpu, _gpu
    from dynamiq_mpi.codecs.levels import build_tables

    BF16 = np.dtype(ml_dtypes.bfloat16)

SUPER = 256
EPS = {2: 0.27, 4: 0.20, 8: 0.08}


@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("hierarchical", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("divisor", [1.0, 3.0])
def test_decompress_out_equals_decompress_then_finish(width, hierarchical, dtype, divisor):
    rng = np.random.default_rng()
    t = build_tables(width, EPS[width])
    keys = [int(k) for k in rng.integers(0, 2 ** 32, 2, dtype=np.uint64)]
    P = np.frombuffer(_cpu.make_params(width, hierarchical, False, 1, 0, *keys,
                                       t.mag, t.inv_gap, t.level, t.lut), dtype=np.uint8)
    out_dtype = np.float32 if dtype == "float32" else BF16
    for length in (300, 256 * 40 + 17):
        nrows = -(-length // SUPER)
        n_live = int(rng.integers(1, nrows + 1))
        order = rng.permutation(nrows)[:n_live].astype(np.int64)   # some rows absent
        stream_of_sg = np.full(nrows, -1, np.int64)
        stream_of_sg[order] = np.arange(n_live)
        vals = (rng.standard_normal(n_live * SUPER)
                * 10.0 ** rng.uniform(-5, 5, n_live).repeat(SUPER)).astype(np.float32)
        vals[:SUPER] = 0.0                                          # a zero super-group
        mean_sum = (rng.standard_normal(nrows) * 2).astype(np.float32)
        # the wire of the whole stream, compressed by the CPU twin
        nbytes = _cpu.run_bytes(n_live, width, hierarchical)
        wire = np.zeros(nbytes, np.uint8)
        _cpu.compress(P, _cpu.Source(vals, None, 0, None), n_live, 0, 5, wire)
        # reference: CPU decompress of the stream, then CPU finish
        stream = np.zeros(n_live * SUPER, np.float32)
        _cpu.decompress(P, wire, n_live, stream, False)
        want = np.zeros(length, out_dtype)
        _cpu.finish(stream, stream_of_sg, mean_sum, divisor, want)
        # GPU: the stream decoded in two runs [0, a) and [a, n_live) (pieces of
        # tiles), each from its own compressed bytes, into a poisoned output
        a = int(rng.integers(0, n_live + 1))
        got = cp.full(length + 1, 7, out_dtype)[1:]              # misaligned destination
        g_order, g_ms = cp.asarray(order), cp.asarray(mean_sum)
        for s0, s1 in ((0, a), (a, n_live)):
            if s1 == s0:
                continue
            run = np.zeros(_cpu.run_bytes(s1 - s0, width, hierarchical), np.uint8)
            _cpu.compress(P, _cpu.Source(vals, None, 0, None), s1 - s0, s0, 5, run)
            _gpu.decompress_out(P, cp.asarray(run), s1 - s0, s0, g_order, g_ms, divisor, got)
        # rows in the stream are final now; absent rows still hold the poison
        host = got.get()
        present = np.zeros(length, bool)
        for g in order:
            present[g * SUPER:(g + 1) * SUPER] = True
        present = present[:length]
        assert np.array_equal(host[present].view(np.uint8), want[present].view(np.uint8))
        assert np.all(host[~present].astype(np.float32) == 7)
        _gpu.finish(None, cp.asarray(stream_of_sg), g_ms, divisor, got)
        assert np.array_equal(got.get().view(np.uint8), want.view(np.uint8))
