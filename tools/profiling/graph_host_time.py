"""Host time per call of a compressed all-reduce on one GPU, eager against
replayed as a CUDA graph (graphs.CallGraph), all ranks simulated in this
process on one stream (the NCCL path needs a GPU per rank; see
docs/benchmarks.md for what this does and does not measure).

For each size: the exact layout (one device-to-host read of the plan per
call), the fixed layout (none), and the fixed layout captured once and
replayed with new keys.  Host time = wall time of the enqueueing calls,
``--calls`` in a row with no synchronisation between them (device work
overlaps), divided by the calls; device time = the same calls timed with CUDA
events.  Prints a table and writes JSON; ``--plot`` draws it (matplotlib),
``--from-json`` redraws a run without a GPU.

    python tools/profiling/graph_host_time.py --sizes 20,23,26 --ranks 2 --json out.json
    python tools/profiling/graph_host_time.py --from-json out.json --plot out.png
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="20,23,26", help="log2 of the elements per rank")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="draw the table into this PNG")
    ap.add_argument("--from-json", default=None, help="redraw a run's JSON (no GPU needed)")
    args = ap.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            run = json.load(f)
        if args.plot:
            plot(run, args.plot)
        return 0

    import cupy as cp
    import ml_dtypes

    import dynamiq_mpi as dq
    from dynamiq_mpi.call.engine import CallSpec, rank_program
    from dynamiq_mpi.call.graphs import CallGraph
    from dynamiq_mpi.rng import call_keys
    from dynamiq_mpi.transports.simulate import SimulatedTransport
    from dynamiq_mpi.call.workspace import Workspace

    n = args.ranks
    codec = dq.DynamiQ()
    stream = cp.cuda.Stream(non_blocking=True)
    rows = []
    for log2 in [int(s) for s in args.sizes.split(",")]:
        length = 1 << log2
        rng = np.random.default_rng(log2)
        xs = [cp.asarray(rng.standard_normal(length).astype(np.float32)
                         .astype(ml_dtypes.bfloat16)) for _ in range(n)]
        outs = [cp.empty_like(x) for x in xs]

        def program(counter, layout, spaces, keys_at=0):
            spec = CallSpec(codec, "ring", "sum", 1, counter, layout=layout, keys_at=keys_at)
            return SimulatedTransport(n).run([
                rank_program(r, n, xs[r], spec, outs[r], spaces[r], detailed_report=False)
                for r in range(n)])

        def timed(run):
            with stream:
                run(0)                                  # warm: buffers, caches
                stream.synchronize()
                start, end = cp.cuda.Event(), cp.cuda.Event()
                start.record(stream)
                t0 = time.perf_counter()
                for c in range(1, args.calls + 1):
                    run(c)
                host = (time.perf_counter() - t0) / args.calls
                end.record(stream)
                end.synchronize()
                device = cp.cuda.get_elapsed_time(start, end) / 1e3 / args.calls
            return host, device

        for layout in ("exact", "fixed"):
            spaces = [Workspace() for _ in range(n)]
            host, device = timed(lambda c, lay=layout, sp=spaces: program(c, lay, sp))
            rows.append({"log2": log2, "ranks": n, "mode": f"eager, {layout} layout",
                         "host_us": host * 1e6, "device_ms_per_call": device * 1e3})
        graph = CallGraph()
        spaces = [graph.workspace] + [Workspace() for _ in range(n - 1)]
        with stream:
            program(0, "fixed", spaces, graph.keys_at)      # buffers made outside the capture
            stream.synchronize()
            graph.capture(lambda: program(0, "fixed", spaces, graph.keys_at), stream)
        host, device = timed(lambda c: graph.launch(call_keys(1, c), stream))
        rows.append({"log2": log2, "ranks": n, "mode": "graph replay, fixed layout",
                     "host_us": host * 1e6, "device_ms_per_call": device * 1e3})
        graph.free()
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"{dev}; {n} ranks simulated on one stream, BF16 input, DynamiQ defaults, "
          f"{args.calls} calls in a row per row")
    print(f"{'elements':>9} {'mode':<28} {'host us/call':>13} {'device ms/call':>15}")
    for r in rows:
        print(f"  2^{r['log2']:<5} {r['mode']:<28} {r['host_us']:13.1f} {r['device_ms_per_call']:15.3f}")
    run = {"device": dev, "ranks": n, "calls": args.calls, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(run, f, indent=1)
    if args.plot:
        plot(run, args.plot)
    return 0


def plot(run, path):
    """Host and device time per call by size and mode, side by side (log scale)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = run["rows"]
    sizes = sorted({r["log2"] for r in rows})
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.8 / len(modes)
    for ax, key, label, fmt in ((axes[0], "host_us", "host time per call (us)", "%.0f"),
                                (axes[1], "device_ms_per_call", "device time per call (ms)",
                                 "%.2g")):
        for i, mode in enumerate(modes):
            vals = [next(r[key] for r in rows if r["log2"] == s and r["mode"] == mode)
                    for s in sizes]
            xs = [k + (i - (len(modes) - 1) / 2) * width for k in range(len(sizes))]
            bars = ax.bar(xs, vals, width, label=mode)
            ax.bar_label(bars, fmt=fmt, fontsize=7)
        ax.set_yscale("log")
        ax.set_xticks(range(len(sizes)), [f"2^{s}" for s in sizes])
        ax.set_xlabel("elements per rank")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{run['device']}: {run['ranks']} ranks simulated on one stream "
                 f"({run['calls']} calls in a row)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
