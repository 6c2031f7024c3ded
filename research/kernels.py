"""Kernel benchmark: DynamiQ codec kernels against the GPU's copy roofline.

    python -m research kernels --sizes 20,22,24,26,28 --json out.json

For each size 2^k elements of a BF16 gradient-like input (centred through a
super-group map, as the engine reads it), times compress, decompress,
decompress-accumulate and the fused decompress-accumulate-recompress (4-bit
codes, hierarchical scales, the hybrid group scale codes of the defaults,
independent rounding; then correlated rounding with 8 events, the default,
at every width), and the statistics pass, next to a device-to-device copy
measured in the same run (the roofline, bytes read + written), a plain
float32 -> BF16 cast and a BF16 add of the same size.

Bytes counted per kernel are what it must read plus write (each input once,
each output once, the small per-super-group mean and map included).  Times are
the median over CUDA-event-timed replays of a CUDA graph of back-to-back
launches, after warm-up (so wrapper/launch overhead is not counted; the host
time of one call is reported separately).  Prints progress and a
table; --json writes every number.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import sys
import time

import numpy as np

SUPER = 256


def _parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m research kernels",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="20,22,24,26,28", help="log2 of element counts")
    ap.add_argument("--widths", default="4,2,8", help="code widths (the first is the main one)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", default=None, help="write all results here")
    ap.add_argument("--no-variant", action="store_true",
                    help="skip the occupancy timing-study rows (builds for 5 / 6 blocks per SM)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--scale-code", choices=("hybrid", "ceil"), default="hybrid",
                    help="group scale codes (hybrid is DynamiQ()'s default)")
    ap.add_argument("--no-graphs", action="store_true",
                    help="time single launches with events (includes host overhead at small sizes)")
    return ap.parse_args(argv)


class Timer:
    """Median time of one launch of fn.

    Default: capture `per_graph` back-to-back launches in a CUDA graph and time
    graph replays with events (per launch = replay time / per_graph), so the
    Python and launch overhead of our wrappers is not counted.  Falls back to
    events around single launches (mode "events") where capture fails (e.g. an
    op that allocates).  Also reports the host time of one call (fn in a loop,
    synchronised), which includes the wrappers' overhead."""

    def __init__(self, cp, warmup, repeats, graphs=True, per_graph=10):
        self.cp, self.warmup, self.repeats = cp, warmup, repeats
        self.graphs, self.per_graph = graphs, per_graph

    def _events(self, fn):
        cp = self.cp
        for _ in range(self.warmup):
            fn()
        cp.cuda.get_current_stream().synchronize()
        evs = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(self.repeats)]
        for a, b in evs:
            a.record()
            fn()
            b.record()
        evs[-1][1].synchronize()
        return sorted(cp.cuda.get_elapsed_time(a, b) for a, b in evs)

    def _graph(self, fn):
        cp = self.cp
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            for _ in range(2):
                fn()
            stream.synchronize()
            stream.begin_capture()
            try:
                for _ in range(self.per_graph):
                    fn()
            finally:
                graph = stream.end_capture()
            for _ in range(2):
                graph.launch(stream)
            stream.synchronize()
            reps = max(3, self.repeats // self.per_graph * 2)
            evs = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(reps)]
            for a, b in evs:
                a.record(stream)
                graph.launch(stream)
                b.record(stream)
            evs[-1][1].synchronize()
        return sorted(cp.cuda.get_elapsed_time(a, b) / self.per_graph for a, b in evs)

    def __call__(self, fn, graph=True):
        mode = "events"
        ms = None
        if self.graphs and graph:
            try:
                ms = self._graph(fn)
                mode = "graph"
            except Exception:
                ms = None
        if ms is None:
            ms = self._events(fn)
        return float(np.median(ms)), float(ms[0]), float(ms[-1]), mode

    def host_us(self, fn, calls=200):
        """Host time of one synchronous-free call (enqueue only), microseconds."""
        cp = self.cp
        fn()
        cp.cuda.get_current_stream().synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        cp.cuda.get_current_stream().synchronize()
        return (t1 - t0) / calls * 1e6


def main(argv=None):
    args = _parse(argv)
    try:
        import cupy as cp
    except Exception as exc:
        sys.exit(f"python -m research kernels needs CuPy: {exc}")
    from dynamiq_mpi import cuda
    if not cuda.has_cuda():
        sys.exit(f"python -m research kernels needs the CUDA kernels and a GPU: {cuda.why_not()}")
    import ml_dtypes

    from dynamiq_mpi import _gpu
    from dynamiq_mpi.codecs.levels import build_tables
    from dynamiq_mpi.rng import call_keys

    BF16 = np.dtype(ml_dtypes.bfloat16)
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    device_name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    widths = [int(w) for w in args.widths.split(",") if w.strip()]
    eps = {2: 0.27, 4: 0.20, 8: 0.08}
    keys = call_keys(args.seed, 0)
    timer = Timer(cp, args.warmup, args.repeats, graphs=not args.no_graphs)
    host_overhead = {}
    print(f"# device: {device_name} ({props['multiProcessorCount']} SMs, "
          f"L2 {props['l2CacheSize'] / 2**20:.0f} MiB), CuPy {cp.__version__}", flush=True)

    scale_rule = {"ceil": 0, "hybrid": 1}[args.scale_code]

    def params(width, correlated, n_events=8):
        t = build_tables(width, eps[width])
        n = n_events if correlated else 1
        return np.frombuffer(_gpu.make_params(
            width, True, correlated, n, max(0, (n - 1).bit_length()),
            keys.value, keys.perm, t.mag, t.inv_gap, t.level, t.lut, scale_rule), np.uint8)

    rows = []
    copy_gbps = {}

    def add(kernel, k, n, nbytes, res, **extra):
        med, lo, hi, mode = res
        gbps = nbytes / (med * 1e-3) / 1e9
        row = dict(kernel=kernel, log2n=k, elements=n, bytes=int(nbytes), time_ms=med,
                   time_min_ms=lo, time_max_ms=hi, timing=mode, gbps=gbps,
                   pct_copy=100.0 * gbps / copy_gbps[k] if k in copy_gbps else None, **extra)
        rows.append(row)
        pct = f"{row['pct_copy']:6.1f}%" if row["pct_copy"] is not None else "      -"
        print(f"  2^{k:<2d} {kernel:<44s} {med * 1e3:10.1f} us {gbps:8.1f} GB/s {pct} [{mode}]",
              flush=True)

    for k in sizes:
        n = 1 << k
        nsg = n // SUPER
        print(f"# size 2^{k} = {n} elements", flush=True)
        rng = cp.random.default_rng(args.seed + k)
        x32 = rng.standard_normal(n, dtype=cp.float32)
        x32 *= cp.repeat(cp.power(10.0, rng.uniform(-3, 3, nsg)).astype(cp.float32), SUPER)
        xb = cp.empty(n, cp.uint16)
        _gpu.bf16_compress(_gpu.Source(x32), nsg, xb)          # RNE cast, our own kernel
        xbf = xb.view(BF16)
        mean, _, _ = _gpu.stats(xbf, nsg, True)
        order = cp.arange(nsg, dtype=cp.int64)
        src = _gpu.Source(xbf, order, 0, mean)
        meta_bytes = nsg * (4 + 8)                              # mean + map read per super-group
        out32 = cp.empty(n, cp.float32)

        # the roofline: device-to-device copy of the BF16 input, timed both ways
        # (graph replays and single launches); the faster one is the roofline
        dst = cp.empty_like(xb)
        copy = lambda: dst.data.copy_from_device_async(xb.data, xb.nbytes)  # noqa: E731
        res_g = timer(copy)
        res_e = timer(copy, graph=False)
        res = min(res_g, res_e, key=lambda r: r[0])
        copy_gbps[k] = 2 * xb.nbytes / (res[0] * 1e-3) / 1e9
        add("copy D2D (bf16 input bytes)", k, n, 2 * xb.nbytes, res,
            other_timing_ms=max(res_g, res_e, key=lambda r: r[0])[0])

        # scale: a plain BF16 cast (float32 -> bf16) and a BF16 add
        src32 = _gpu.Source(x32)
        cast_out = cp.empty(n, cp.uint16)
        add("bf16 cast f32->bf16 (ours)", k, n, 6 * n,
            timer(lambda: _gpu.bf16_compress(src32, nsg, cast_out)))
        other = cp.empty(n, cp.uint16)                           # a second, distinct input
        _gpu.bf16_compress(_gpu.Source(x32[::-1].copy()), nsg, other)
        srcb = _gpu.Source(xbf)
        add("bf16 add bf16+bf16->bf16 (ours)", k, n, 6 * n,
            timer(lambda: _gpu.bf16_dar(other, srcb, nsg, cast_out)))
        del other
        try:
            add("bf16 cast f32->bf16 (cupy astype)", k, n, 6 * n,
                timer(lambda: x32.astype(BF16), graph=False))
        except Exception as exc:  # CuPy without BF16 arithmetic
            print(f"  (cupy astype to bfloat16 not available: {type(exc).__name__})", flush=True)
        try:
            yb = xbf.copy()
            add("bf16 add (cupy a + b)", k, n, 6 * n, timer(lambda: xbf + yb, graph=False))
            del yb
        except Exception as exc:
            print(f"  (cupy bfloat16 add not available: {type(exc).__name__})", flush=True)

        # the statistics pass (per super-group mean and norm of the centred
        # values, flags): reads the input once, writes 8 bytes per super-group
        # (as the codec calls it: the tail's flag, no count of non-finite entries)
        stats_out = (cp.empty(nsg, cp.float32), cp.empty(nsg, cp.float32),
                     cp.empty(2, cp.float32))
        add("dq statistics (centred)", k, n, 2 * n + 8 * nsg,
            timer(lambda: _gpu.stats_into(xbf, nsg, True, *stats_out)))
        del stats_out

        def codec_rows(width, correlated, label_extra="", variant=0, full=True):
            P = params(width, correlated)
            wire = int(_gpu.run_bytes(nsg, width, True))
            w_in = cp.empty(wire, cp.uint8)
            w_out = cp.empty(wire, cp.uint8)
            tag = f"w={width}{' corr n=8' if correlated else ''}{label_extra}"
            _gpu.set_variant(variant)
            try:
                _gpu.compress(P, src, nsg, 0, 3, w_in)        # a valid incoming message
                add(f"dq compress {tag}", k, n, 2 * n + meta_bytes + wire,
                    timer(lambda: _gpu.compress(P, src, nsg, 0, 3, w_out)),
                    width=width, correlated=correlated, variant=variant)
                if k == sizes[0] and width == widths[0] and not correlated and variant == 0:
                    host_overhead["compress_call_us"] = timer.host_us(
                        lambda: _gpu.compress(P, src, nsg, 0, 3, w_out))
                    print(f"  host time of one compress call (enqueue, Python wrapper + launch): "
                          f"{host_overhead['compress_call_us']:.1f} us", flush=True)
                if full:
                    add(f"dq decompress {tag}", k, n, wire + 4 * n,
                        timer(lambda: _gpu.decompress(P, w_in, nsg, out32, False)),
                        width=width, correlated=correlated, variant=variant)
                    add(f"dq decompress-accumulate {tag}", k, n, wire + 8 * n,
                        timer(lambda: _gpu.decompress(P, w_in, nsg, out32, True)),
                        width=width, correlated=correlated, variant=variant)
                add(f"dq fused dar {tag}", k, n, wire + 2 * n + meta_bytes + wire,
                    timer(lambda: _gpu.dar(P, w_in, src, nsg, 0, 2, w_out)),
                    width=width, correlated=correlated, variant=variant)
            finally:
                _gpu.set_variant(0)

        for i, w in enumerate(widths):
            codec_rows(w, False)
            codec_rows(w, True, full=False)
            if i == 0:
                if not args.no_variant and w == 4:
                    codec_rows(w, False, " [built for 5 blocks/SM]", variant=2, full=False)
                    codec_rows(w, False, " [built for 6 blocks/SM]", variant=3, full=False)
        del x32, xb, xbf, src, out32, dst, cast_out
        cp.get_default_memory_pool().free_all_blocks()

    # the table
    print()
    print(f"Kernel benchmark on {device_name}; copy roofline measured in the same run (r+w).")
    hdr = f"{'kernel':<50s} {'elements':>10s} {'bytes r+w':>12s} {'time us':>10s} {'GB/s':>8s} {'%copy':>7s}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        pct = f"{r['pct_copy']:6.1f}%" if r["pct_copy"] is not None else "      -"
        print(f"{r['kernel']:<50s} {'2^%d' % r['log2n']:>10s} {r['bytes']:>12d} "
              f"{r['time_ms'] * 1e3:10.1f} {r['gbps']:8.1f} {pct}")
    if args.json:
        meta = dict(device=device_name, sms=props["multiProcessorCount"],
                    date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                    command=" ".join([sys.executable, "-m", "research", "kernels"] + sys.argv[1:]),
                    cupy=cp.__version__, python=platform.python_version(),
                    repeats=args.repeats, warmup=args.warmup,
                    note=("bytes = each input read once + each output written once; "
                          "time = median of CUDA-event-timed launches; %copy = GB/s over the "
                          "device-to-device copy's r+w GB/s at the same size"),
                    copy_gbps=copy_gbps, host_overhead=host_overhead, rows=rows)
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
