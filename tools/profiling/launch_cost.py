"""Host cost of the pieces a GPU all-reduce call is made of (one GPU, no MPI):
the kernel wrappers of ``dynamiq_mpi._gpu`` on tiny inputs (so the launch, not
the kernel, is timed), CuPy slicing, views and events, and the plan's
device-to-host copy.  Microseconds per call, median of 5 runs of 2000 calls.

    python tools/profiling/launch_cost.py
"""
import time

import numpy as np


def per_call_us(fn, calls=2000, runs=5):
    fn()
    best = []
    for _ in range(runs):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best.append((time.perf_counter() - t) / calls * 1e6)
    return float(np.median(best))


def main():
    import cupy as cp

    from dynamiq_mpi import _gpu
    from dynamiq_mpi.codecs.levels import build_tables

    def params_of(width, eps, keys=(1, 2)):
        t = build_tables(width, eps)
        return np.frombuffer(_gpu.make_params(width, True, True, 2, 1, *keys, t.mag, t.inv_gap,
                                              t.level, t.lut, 0), dtype=np.uint8)

    params = params_of(4, 0.20)
    # A call launches its kernels for widths 2, 4 and 8 in turn, with keys of
    # its own: what the kernels' host-side parameter cache sees.
    by_width = [params_of(w, e) for w, e in ((2, 0.27), (4, 0.20), (8, 0.08))]
    turn = [0]

    def compress_widths_in_turn():
        k = turn[0] % 3
        turn[0] += 1
        _gpu.compress(by_width[k], src, 1, 0, 0, width_pieces[k])

    new_keys = [0]

    def compress_new_keys():
        new_keys[0] += 1
        p = params.copy()
        p[24:32].view(np.uint32)[:] = (new_keys[0], 7)
        _gpu.compress(p, src, 1, 0, 0, piece)
    x = cp.ones(256 * 8, dtype=cp.float32)
    order = cp.arange(8, dtype=cp.int64)
    mean = cp.zeros(8, dtype=cp.float32)
    src = _gpu.Source(x, order, 0, mean)
    wire = cp.zeros(1 << 20, dtype=cp.uint8)
    nb = _gpu.run_bytes(1, 4, True)
    piece = wire[:nb]
    width_pieces = [wire[:_gpu.run_bytes(1, w, True)] for w in (2, 4, 8)]
    out = cp.zeros(256 * 8, dtype=cp.float32)
    stream = cp.cuda.get_current_stream()
    header = cp.zeros(10, dtype=cp.float64)
    rows = [
        ("_gpu.compress (1 super-group)", lambda: _gpu.compress(params, src, 1, 0, 0, piece)),
        ("_gpu.compress, widths 2/4/8 in turn", compress_widths_in_turn),
        ("_gpu.compress, new keys each call (+ copy)", compress_new_keys),
        ("_gpu.dar (1 super-group)", lambda: _gpu.dar(params, piece, src, 1, 0, 1, piece)),
        ("_gpu.decompress_out (1 super-group)",
         lambda: _gpu.decompress_out(params, piece, 1, 0, order, mean, 1.0, out)),
        ("_gpu.Source(x, order, 0, mean)", lambda: _gpu.Source(x, order, 0, mean)),
        ("cupy slice wire[a:b]", lambda: wire[64:64 + nb]),
        ("cupy view(dtype) of a slice", lambda: wire[:4096].view(cp.float32)),
        ("cupy Event() + record", lambda: cp.cuda.Event(block=False, disable_timing=True).record(stream)),
        ("cupy get_current_stream()", lambda: cp.cuda.get_current_stream()),
        ("header.get() (device-to-host, 80 bytes)", lambda: header.get()),
        ("numpy blob.copy() + key write", lambda: params.copy()[24:32].view(np.uint32).__setitem__(slice(None), (1, 2))),
        ("empty Python call", lambda: None),
    ]
    print(f"{'operation':44s} {'us per call':>11s}")
    for name, fn in rows:
        stream.synchronize()
        print(f"{name:44s} {per_call_us(fn):11.2f}", flush=True)
        stream.synchronize()


if __name__ == "__main__":
    main()
