"""A small run of every CUDA kernel, for compute-sanitizer (memcheck, racecheck).

CuPy's memory pool is disabled so every array is its own cudaMalloc and an
out-of-bounds access is reported.  Odd sizes, odd byte offsets, odd super-group
counts (a half-empty warp) and in-place dar are included.
    compute-sanitizer --tool memcheck python3 tools/profiling/gpu_sanitize.py
"""
import sys

import cupy as cp
import ml_dtypes
import numpy as np

sys.path.insert(0, ".")
from dynamiq_mpi import _gpu  # noqa: E402
from dynamiq_mpi.codecs.levels import build_tables  # noqa: E402

cp.cuda.set_allocator(None)
BF16 = np.dtype(ml_dtypes.bfloat16)
rng = np.random.default_rng(0)
EPS = {2: 0.27, 4: 0.2, 8: 0.08}


def exact_size(nbytes, offset, dtype=cp.uint8):
    base = cp.empty(nbytes + offset, dtype)
    return base[offset:]


for dtype in (np.float32, BF16):
    length = 5 * 256 + 3
    nrows = 6
    x = cp.asarray((rng.standard_normal(length) * 10).astype(dtype))
    mean = cp.asarray(rng.standard_normal(nrows).astype(np.float32))
    sg_map = cp.asarray(rng.permutation(nrows).astype(np.int64))
    m, f, bad = _gpu.stats(x, nrows, True)
    for w in (2, 4, 8):
        for hier in (True, False):
            for corr in (False, True):
                t = build_tables(w, EPS[w])
                P = np.frombuffer(_gpu.make_params(w, hier, corr, 5 if corr else 1, 3 if corr else 0,
                                                   1, 2, t.mag, t.inv_gap, t.level, t.lut), np.uint8)
                src = _gpu.Source(x, sg_map, 0, mean)
                for nsg in (1, 5):
                    nb = _gpu.run_bytes(nsg, w, hier)
                    a = exact_size(nb, 3)
                    _gpu.compress(P, src, nsg, 1, 2, a)
                    o = exact_size(nsg * 256, 1, cp.float32)
                    _gpu.decompress(P, a, nsg, o, False)
                    _gpu.decompress(P, a, nsg, o, True)
                    b = exact_size(nb, 0)
                    _gpu.dar(P, a, src, nsg, 1, 1, b)
                    _gpu.dar(P, b, src, nsg, 1, 0, b)          # in place
    so = cp.asarray(np.array([2, -1, 0, 1, -1, 3], np.int64))
    ms = cp.asarray(rng.standard_normal(6).astype(np.float32))
    stream = cp.asarray(rng.standard_normal(4 * 256).astype(np.float32))
    out = exact_size(length, 0, cp.float32 if dtype == np.float32 else cp.uint16)
    if dtype == BF16:
        out = out.view(BF16)
    _gpu.finish(stream, so, ms, 3.0, out)
    src = _gpu.Source(x, None, 0, None)
    u = exact_size(6 * 256, 0, cp.uint16)
    _gpu.bf16_compress(src, 6, u)
    _gpu.bf16_dar(u, src, 6, u)
    fl = exact_size(6 * 256, 1, cp.float32)
    _gpu.bf16_decompress(u[:1001], fl[:1001], True)
    _gpu.exact_compress(src, 6, fl)
    _gpu.exact_dar(fl, src, 6, fl)
    _gpu.exact_decompress(fl[:999], exact_size(999, 0, cp.float32), False)

# the fixed layout: the device cut into slots of exactly their capacity (odd
# offsets), every table launcher, the statistics without a count, the keys of
# a graph replay; then whole calls (all ranks on this stream), ring and butterfly
RB = [82, 146, 274, 512]
for counts, tiles in (([3, 0, 2, 1], 2), ([1, 1, 1, 0], 1), ([0, 0, 0, 0], 1)):
    header = cp.zeros(_gpu.PLAN_HEADER, cp.float64)
    header[2] = 1.0
    header[4], header[5], header[6], header[10] = counts
    cap = 1600
    table = exact_size(tiles * _gpu.TILE_INTS, 0, cp.int64)
    wire = exact_size(tiles * cap, 0)
    _gpu.plan_pieces(header, 1, tiles, RB, cap, table, wire)
    caps = [min(cap // rb, 6) for rb in RB]
    xs = cp.asarray((rng.standard_normal(6 * 256 - 5) * 3).astype(np.float32))
    src = _gpu.Source(xs, cp.asarray(rng.permutation(6).astype(np.int64)), 0,
                      cp.asarray(rng.standard_normal(6).astype(np.float32)))
    t = {w: build_tables(w, EPS[w]) for w in (2, 4, 8)}
    params = {w: np.frombuffer(_gpu.make_params(w, True, True, 5, 3, 1, 2, t[w].mag, t[w].inv_gap,
                                                t[w].level, t[w].lut, 1), np.uint8) for w in t}
    for tile in range(tiles):
        slot = wire[tile * cap:(tile + 1) * cap]
        _gpu.encode_table(params, src, table, tile, caps, (2, 4, 8, 16), True, 1, slot)
        other = exact_size(cap, 2)           # (the raw BF16 class needs 2-byte alignment)
        _gpu.encode_table(params, src, table, tile, caps, (2, 4, 8, 16), True, 2, other, slot)
        acc = exact_size(6 * 256, 0, cp.float32)
        _gpu.local_values_table(src, table, tile, 6, acc)
        _gpu.decompress_table(params, other, table, tile, caps, (2, 4, 8, 16), True, acc, True)
        out = exact_size(6 * 256 - 5, 1, cp.float32)
        _gpu.decompress_out_table(params, other, table, tile, caps, (2, 4, 8, 16), True,
                                  cp.arange(6, dtype=cp.int64), cp.zeros(6, cp.float32), 2.0, out)
mean, norm, tail = cp.empty(6, cp.float32), cp.empty(6, cp.float32), cp.empty(2, cp.float32)
_gpu.stats_into(cp.asarray(rng.standard_normal(6 * 256 - 9).astype(np.float32)), 6, True, mean,
                norm, tail)
_gpu.set_keys(exact_size(2, 0, cp.uint32), 5, 6)
import dynamiq_mpi as dq  # noqa: E402
for n, topology in ((2, "ring"), (3, "ring"), (4, "butterfly")):
    ins = [cp.asarray((rng.standard_normal(256 * 9 + 7)).astype(BF16)) for _ in range(n)]
    dq.simulate_allreduce(ins, codec=dq.DynamiQ(small_input=0), topology=topology, layout="fixed",
                          tile_bytes=700)
_gpu.synchronize()
print("gpu_sanitize: all kernels ran")
