"""The fixed layout on the GPU (tests/test_fixed_layout.py has the CPU twin):

* ``plan_pieces`` on the device writes the CPU's piece table and zeroes the
  same padding;
* the table launchers (``encode_table``, ``decompress_table``,
  ``decompress_out_table``, ``local_values_table``), whose kernels read their
  piece from the device, write the bytes and values of the CPU's per-piece
  calls, for tiles of every class (raw BF16 included), new keys every call;
* whole calls on device arrays (fixed layout, the default there) equal the CPU
  path (exact layout) bit for bit, on every rank, ring and butterfly,
  several tiles per chunk, NaN input included;
* a whole fixed-layout call makes no host read: it is captured into a CUDA
  graph (stream capture fails on any synchronisation or device-to-host copy).

Skipped (with the reason) unless dynamiq_mpi.cuda.has_cuda().
"""
import numpy as np
import pytest

import dynamiq_mpi as dq
from dynamiq_mpi.cuda import has_cuda, why_not

from ..helpers import exact_sum, fresh_seed, rank_inputs, vnmse
from ..test_fixed_layout import CLASSES, TILE_INTS, header_with, host_pieces
from ..test_pieces import SUPER, params_by_width

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not has_cuda(), reason=f"no CUDA: {why_not() if not has_cuda() else ''}")]

if has_cuda():  # pragma: no branch
    import cupy as cp
    import ml_dtypes

    from dynamiq_mpi import _cpu, _gpu

    BF16 = np.dtype(ml_dtypes.bfloat16)

RB = [82, 146, 274, 512]     # record bytes of 2-, 4-, 8-bit (hierarchical) and raw BF16 runs


@pytest.mark.parametrize("trial", range(12))
def test_plan_pieces_matches_cpu(trial):
    rng = np.random.default_rng(fresh_seed())
    counts = [int(c) if rng.random() < 0.8 else 0 for c in rng.integers(0, 400, 4)]
    n, tiles = int(rng.integers(1, 9)), int(rng.integers(1, 4))
    cap = max(b for *_, b in host_pieces(counts, RB, n, tiles)) + int(rng.integers(0, 999))
    want_t = np.zeros(n * tiles * TILE_INTS, np.int64)
    want_w = np.full(n * tiles * cap, 0x5A, np.uint8)
    _cpu.plan_pieces(header_with(counts), n, tiles, RB, cap, want_t, want_w)
    header = cp.asarray(header_with(counts))
    got_t = cp.full(n * tiles * TILE_INTS, -1, cp.int64)
    got_w = cp.full(n * tiles * cap, 0x5A, cp.uint8)
    _gpu.plan_pieces(header, n, tiles, RB, cap, got_t, got_w)
    assert np.array_equal(got_t.get(), want_t)
    assert np.array_equal(got_w.get(), want_w)
    assert float(header[11].get()) == 0.0


def _tile_case(rng, dtype):
    """Two tiles of one chunk holding every class, the source read through a
    permutation and centred."""
    counts = [int(rng.integers(1, 7)), int(rng.integers(0, 5)), int(rng.integers(1, 5)),
              int(rng.integers(1, 4))]
    rows = sum(counts) + 3
    length = rows * SUPER - 61
    x = (rng.standard_normal(length) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
    if dtype == "bfloat16":
        x = x.astype(BF16)
    order = rng.permutation(rows).astype(np.int64)
    mean = rng.standard_normal(rows).astype(np.float32)
    tiles = 2
    cap = (max(b for *_, b in host_pieces(counts, RB, 1, tiles)) + 255) // 256 * 256
    table = np.zeros(tiles * TILE_INTS, np.int64)
    _cpu.plan_pieces(header_with(counts), 1, tiles, RB, cap, table)
    caps = [min(cap // rb, rows) for rb in RB]
    return counts, rows, x, order, mean, tiles, cap, table, caps


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_table_launchers_match_cpu(dtype, out_dtype):
    rng = np.random.default_rng(fresh_seed())
    counts, rows, x, order, mean, tiles, cap, table, caps = _tile_case(rng, dtype)
    cpu_src = _cpu.Source(x, order, 0, mean)
    gpu_src = _gpu.Source(cp.asarray(x), cp.asarray(order), 0, cp.asarray(mean))
    gtable = cp.asarray(table)
    nsg = sum(counts)
    for call in range(2):                        # new keys every call
        params = params_by_width(rng)
        for t in range(tiles):
            want = np.zeros(cap, np.uint8)
            _cpu.encode_table(params, cpu_src, table, t, caps, CLASSES, True, 1, want)
            got = cp.zeros(cap, cp.uint8)
            _gpu.encode_table(params, gpu_src, gtable, t, caps, CLASSES, True, 1, got)
            assert np.array_equal(got.get(), want), f"compress, tile {t}, call {call}"
            want_dar = np.zeros(cap, np.uint8)
            _cpu.encode_table(params, cpu_src, table, t, caps, CLASSES, True, 2, want_dar, want)
            got_dar = cp.zeros(cap, cp.uint8)
            _gpu.encode_table(params, gpu_src, gtable, t, caps, CLASSES, True, 2, got_dar, got)
            assert np.array_equal(got_dar.get(), want_dar), f"dar, tile {t}"
            # the accumulator path (butterfly): local values into a whole-stream
            # buffer, decompress-accumulate, dar from it
            acc_src = rng.standard_normal(rows * SUPER).astype(np.float32)
            got_acc = cp.asarray(acc_src)
            _gpu.local_values_table(gpu_src, gtable, t, min(cap // 82, rows), got_acc)
            row = table[t * TILE_INTS + 16:t * TILE_INTS + 20]
            a, c = int(row[0]), int(row[1])
            want_acc = acc_src.copy()
            padded = np.zeros(rows * SUPER, np.float32)
            padded[:x.shape[0]] = x.astype(np.float32)
            want_acc[a * SUPER:(a + c) * SUPER] = (padded.reshape(rows, SUPER)[order[a:a + c]]
                                                   - mean[order[a:a + c]][:, None]).reshape(-1)
            assert np.array_equal(got_acc.get().view(np.uint32), want_acc.view(np.uint32))
            for accumulate in (False, True):
                want_v = want_acc.copy()
                _cpu.decompress_table(params, want_dar, table, t, caps, CLASSES, True, want_v,
                                      accumulate)
                got_v = cp.asarray(want_acc)
                _gpu.decompress_table(params, got_dar, gtable, t, caps, CLASSES, True, got_v,
                                      accumulate)
                assert np.array_equal(got_v.get().view(np.uint32), want_v.view(np.uint32))
            want_e = np.zeros(cap, np.uint8)
            _cpu.encode_table(params, _cpu.Source(want_v, None, 0, None), table, t, caps,
                              CLASSES, True, 0, want_e, want_dar)
            got_e = cp.zeros(cap, cp.uint8)
            _gpu.encode_table(params, _gpu.Source(cp.asarray(want_v), None, 0, None), gtable, t,
                              caps, CLASSES, True, 0, got_e, got_dar)
            assert np.array_equal(got_e.get(), want_e), "dar from an accumulator"
            dt = np.float32 if out_dtype == "float32" else BF16
            length = nsg * SUPER - 9
            full_order = rng.permutation(nsg + 2).astype(np.int64)
            mean_sum = rng.standard_normal(nsg + 2).astype(np.float32)
            want_o = np.zeros(length, dt)
            _cpu.decompress_out_table(params, want_dar, table, t, caps, CLASSES, True, full_order,
                                      mean_sum, 3.0, want_o)
            got_o = cp.zeros(length, cp.float32 if out_dtype == "float32" else BF16)
            _gpu.decompress_out_table(params, got_dar, gtable, t, caps, CLASSES, True,
                                      cp.asarray(full_order), cp.asarray(mean_sum), 3.0, got_o)
            view = np.uint16 if out_dtype == "bfloat16" else np.uint32
            assert np.array_equal(got_o.get().view(view), want_o.view(view))


def test_table_launchers_refuse_capacities_beyond_the_slot():
    rng = np.random.default_rng(fresh_seed())
    counts, rows, x, order, mean, tiles, cap, table, caps = _tile_case(rng, "float32")
    params = params_by_width(rng)
    src = _gpu.Source(cp.asarray(x), cp.asarray(order), 0, cp.asarray(mean))
    with pytest.raises(ValueError, match="do not fit"):
        _gpu.encode_table(params, src, cp.asarray(table), 0, [c + 1 for c in caps], CLASSES, True,
                          0, cp.zeros(cap, cp.uint8))
    with pytest.raises(ValueError, match="2-byte aligned"):
        _gpu.encode_table(params, src, cp.asarray(table), 0, caps, CLASSES, True, 0,
                          cp.zeros(cap + 1, cp.uint8)[1:])
    with pytest.raises(ValueError, match="do not cover"):
        _gpu.decompress_table(params, cp.zeros(cap, cp.uint8), cp.asarray(table), 0, caps, CLASSES,
                              True, cp.zeros(rows * SUPER - 1, cp.float32), False, rows=rows)
    with pytest.raises(ValueError, match="no tile"):
        _gpu.encode_table(params, src, cp.asarray(table), tiles, caps, CLASSES, True, 0,
                          cp.zeros(cap, cp.uint8))


def _gpu_inputs(xs, dtype):
    return [cp.asarray(x.astype(BF16) if dtype == "bfloat16" else x) for x in xs]


@pytest.mark.parametrize("n,topology", [(2, "ring"), (3, "ring"), (4, "butterfly"), (4, "ring")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fixed_layout_calls_equal_the_cpu(n, topology, dtype):
    seed = fresh_seed()
    for codec in (dq.DynamiQ(small_input=0), dq.DynamiQ(small_input=0, bits=3, bf16_class=False),
                  dq.DynamiQ(small_input=0, bits=9, correlated=False)):
        for length, tile_bytes in ((256 * 3000 + 11, 1 << 25), (256 * 3000 + 11, 40_000),
                                   (777, 1 << 25)):
            xs = rank_inputs(seed + length, n, length)
            for x in xs:
                x[256 * 5:256 * 7] = 0                 # the 0-bit class
            cpu_in = [x.astype(BF16) if dtype == "bfloat16" else x for x in xs]
            kw = dict(codec=codec, topology=topology, seed=seed, counter=3, tile_bytes=tile_bytes,
                      return_reports=True)
            want, wrep = dq.simulate_allreduce(cpu_in, layout="exact", **kw)
            got, grep = dq.simulate_allreduce(_gpu_inputs(xs, dtype), **kw)   # fixed: the default
            assert grep[0].codec_info["layout"] == "fixed"
            view = np.uint16 if dtype == "bfloat16" else np.uint32
            for r in range(n):
                assert np.array_equal(got[r].get().view(view), want[r].view(view)), \
                    (seed, codec, length, tile_bytes, r)
            assert grep[0].codec_info["widths"] == wrep[0].codec_info["widths"]
            info = grep[0].codec_info
            if info["planned_budget_bits"] < codec.bits * length:     # the padding reserved
                assert grep[0].bits_per_coord <= codec.bits


def test_fixed_layout_nan_on_every_rank_without_raising():
    xs = rank_inputs(fresh_seed(), 3, 256 * 100)
    xs[1][1234] = np.nan
    outs, reps = dq.simulate_allreduce([cp.asarray(x) for x in xs], codec=dq.DynamiQ(small_input=0),
                                       return_reports=True)
    for out, rep in zip(outs, reps):
        assert bool(cp.isnan(out).all()) and rep.nonfinite is True
    clean = rank_inputs(fresh_seed(), 3, 256 * 100)
    outs = dq.simulate_allreduce([cp.asarray(x) for x in clean], codec=dq.DynamiQ(small_input=0))
    assert vnmse(outs[0].get(), exact_sum(clean)) < 0.05


def test_a_fixed_layout_call_captures_into_a_graph():
    """No synchronisation and no device-to-host copy anywhere in a call: the
    whole simulated two-rank call (statistics, exchange, plan, pieces,
    encodes, messages, decodes, finish) is captured on one stream."""
    from dynamiq_mpi.call.engine import CallSpec, rank_program
    from dynamiq_mpi.transports.simulate import SimulatedTransport
    from dynamiq_mpi.call.workspace import Workspace
    length = 256 * 4000 + 3
    xs = [cp.asarray(x) for x in rank_inputs(fresh_seed(), 2, length)]
    outs = [cp.empty_like(x) for x in xs]
    spaces = [Workspace(), Workspace()]
    spec = CallSpec(dq.DynamiQ(small_input=0), "ring", "sum", 5, 0, layout="fixed")

    def call():
        return SimulatedTransport(2).run([
            rank_program(r, 2, xs[r], spec, outs[r], spaces[r], detailed_report=False)
            for r in range(2)])
    call()                                       # buffers made outside the capture
    want = [o.copy() for o in outs]
    for o in outs:
        o.fill(0)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            call()
        finally:
            graph = stream.end_capture()
        graph.launch(stream)
    stream.synchronize()
    for o, w in zip(outs, want):
        assert np.array_equal(o.get().view(np.uint32), w.get().view(np.uint32))
