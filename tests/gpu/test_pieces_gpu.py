"""The GPU's one-call-per-tile launchers (``encode_pieces``,
``decompress_pieces``, ``decompress_out_pieces``) == the CPU twin's, bit for
bit, for tiles of widths 2, 4, 8 and 16 (raw BF16) whose calls each bring new keys (the
kernels' host-side parameter cache keeps an entry per width and only rewrites
the keys: a stale key would show here as different bytes).

Skipped (with the reason) unless dynamiq_mpi.cuda.has_cuda().
"""
import numpy as np
import pytest

from dynamiq_mpi.cuda import has_cuda, why_not

from ..test_pieces import SUPER, params_by_width, raw_tile, tile_pieces

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not has_cuda(), reason=f"no CUDA: {why_not() if not has_cuda() else ''}")]

if has_cuda():  # pragma: no branch
    import cupy as cp
    import ml_dtypes

    from dynamiq_mpi import _cpu, _gpu

    BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pieces_match_cpu_call_after_call(dtype):
    rng = np.random.default_rng()
    counts = [(2, 5), (4, 3), (8, 4)]
    first = 2
    pieces, nbytes = tile_pieces(counts, first)
    rows = first + sum(c for _, c in counts)
    x = (rng.standard_normal(rows * SUPER) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
    if dtype == "bfloat16":
        x = x.astype(BF16)
    order = rng.permutation(rows).astype(np.int64)
    mean = rng.standard_normal(rows).astype(np.float32)
    cpu_src = _cpu.Source(x, order, 0, mean)
    gpu_src = _gpu.Source(cp.asarray(x), cp.asarray(order), 0, cp.asarray(mean))
    for call in range(3):                       # new keys every call, same tables
        params = params_by_width(rng)
        want = np.zeros(nbytes, np.uint8)
        _cpu.encode_pieces(params, cpu_src, pieces, 1, want)
        got = cp.zeros(nbytes, cp.uint8)
        _gpu.encode_pieces(params, gpu_src, pieces, 1, got)
        assert np.array_equal(got.get(), want), f"compress, call {call}"
        want_dar = np.zeros(nbytes, np.uint8)
        _cpu.encode_pieces(params, cpu_src, pieces, 2, want_dar, want)
        got_dar = cp.zeros(nbytes, cp.uint8)
        _gpu.encode_pieces(params, gpu_src, pieces, 2, got_dar, got)
        assert np.array_equal(got_dar.get(), want_dar), f"dar, call {call}"
        for accumulate in (False, True):
            start = rng.standard_normal((rows - first) * SUPER).astype(np.float32)
            want_v = start.copy()
            _cpu.decompress_pieces(params, want_dar, pieces, want_v, accumulate, first)
            got_v = cp.asarray(start)
            _gpu.decompress_pieces(params, got_dar, pieces, got_v, accumulate, first)
            assert np.array_equal(got_v.get().view(np.uint32), want_v.view(np.uint32))


@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_decompress_out_pieces_is_a_call_per_piece(out_dtype):
    rng = np.random.default_rng()
    pieces, nbytes = tile_pieces([(2, 3), (4, 2), (8, 3)], 1)
    rows = 1 + 8
    length = rows * SUPER - 77
    params = params_by_width(rng)
    vals = rng.standard_normal(rows * SUPER).astype(np.float32)
    wire = np.zeros(nbytes, np.uint8)
    _cpu.encode_pieces(params, _cpu.Source(vals, None, 0, None), pieces, 0, wire)
    order = cp.asarray(rng.permutation(rows).astype(np.int64))
    mean_sum = cp.asarray(rng.standard_normal(rows).astype(np.float32))
    dt = cp.float32 if out_dtype == "float32" else BF16
    got = cp.zeros(length, dt)
    _gpu.decompress_out_pieces(params, cp.asarray(wire), pieces, order, mean_sum, 2.0, got)
    want = cp.zeros(length, dt)
    for w, s0, cnt, off, nb in pieces:
        _gpu.decompress_out(params[w], cp.asarray(wire[off:off + nb]), cnt, s0, order, mean_sum,
                            2.0, want)
    assert np.array_equal(got.get().view(np.uint16 if out_dtype == "bfloat16" else np.uint32),
                          want.get().view(np.uint16 if out_dtype == "bfloat16" else np.uint32))
    assert bool((got != 0).any())


def test_pieces_outside_the_buffers_are_refused():
    rng = np.random.default_rng()
    pieces, nbytes = tile_pieces([(2, 2), (8, 2)])
    params = params_by_width(rng)
    x = cp.asarray(rng.standard_normal(4 * SUPER).astype(np.float32))
    src = _gpu.Source(x)
    out = cp.zeros(nbytes, cp.uint8)
    with pytest.raises(ValueError, match="outside"):
        _gpu.encode_pieces(params, src, pieces, 0, out[:nbytes - 1])
    with pytest.raises(ValueError, match="outside"):
        _gpu.decompress_pieces(params, out, pieces, cp.zeros(4 * SUPER - 1, cp.float32), False)
    with pytest.raises(ValueError, match="order map"):
        _gpu.decompress_out_pieces(params, out, pieces, cp.arange(3, dtype=cp.int64),
                                   cp.zeros(4, cp.float32), 1.0, cp.zeros(3 * SUPER, cp.float32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_raw_pieces_match_cpu(dtype, out_dtype):
    """Tiles mixing coded and raw BF16 pieces (the 16-bit class): compress,
    dar, decompress (both modes) and the decode straight into the caller's
    layout, GPU == CPU bit for bit; the source is read through a permutation
    and centred, so the raw pieces' shifted sources are checked too."""
    rng = np.random.default_rng()
    first = 2
    pieces, nbytes, rows, x, order, mean = raw_tile(rng, first)
    if dtype == "bfloat16":
        x = x.astype(BF16)
    params = params_by_width(rng)
    cpu_src = _cpu.Source(x, order, 0, mean)
    gpu_src = _gpu.Source(cp.asarray(x), cp.asarray(order), 0, cp.asarray(mean))
    want = np.zeros(nbytes, np.uint8)
    _cpu.encode_pieces(params, cpu_src, pieces, 1, want)
    got = cp.zeros(nbytes, cp.uint8)
    _gpu.encode_pieces(params, gpu_src, pieces, 1, got)
    assert np.array_equal(got.get(), want), "compress"
    want_dar = np.zeros(nbytes, np.uint8)
    _cpu.encode_pieces(params, cpu_src, pieces, 2, want_dar, want)
    got_dar = cp.zeros(nbytes, cp.uint8)
    _gpu.encode_pieces(params, gpu_src, pieces, 2, got_dar, got)
    assert np.array_equal(got_dar.get(), want_dar), "dar"
    # dar from a float32 accumulator (the engine's Source(acc, None, a, None))
    acc = rng.standard_normal((rows - first) * SUPER).astype(np.float32)
    want_acc = np.zeros(nbytes, np.uint8)
    _cpu.encode_pieces(params, _cpu.Source(acc, None, first, None), pieces, 0, want_acc, want_dar)
    got_acc = cp.zeros(nbytes, cp.uint8)
    _gpu.encode_pieces(params, _gpu.Source(cp.asarray(acc), None, first, None), pieces, 0, got_acc,
                       got_dar)
    assert np.array_equal(got_acc.get(), want_acc), "dar from an accumulator"
    for accumulate in (False, True):
        start = rng.standard_normal((rows - first) * SUPER).astype(np.float32)
        want_v = start.copy()
        _cpu.decompress_pieces(params, want_acc, pieces, want_v, accumulate, first)
        got_v = cp.asarray(start)
        _gpu.decompress_pieces(params, got_acc, pieces, got_v, accumulate, first)
        assert np.array_equal(got_v.get().view(np.uint32), want_v.view(np.uint32))
    full_order = rng.permutation(rows + 3).astype(np.int64)
    mean_sum = rng.standard_normal(rows + 3).astype(np.float32)
    length = (rows + 3) * SUPER - 100
    dt = np.float32 if out_dtype == "float32" else BF16
    want_o = np.zeros(length, dt)
    _cpu.decompress_out_pieces(params, want_acc, pieces, full_order, mean_sum, 3.0, want_o)
    got_o = cp.zeros(length, cp.float32 if out_dtype == "float32" else BF16)
    _gpu.decompress_out_pieces(params, got_acc, pieces, cp.asarray(full_order),
                               cp.asarray(mean_sum), 3.0, got_o)
    view = np.uint16 if out_dtype == "bfloat16" else np.uint32
    assert np.array_equal(got_o.get().view(view), want_o.view(view))
