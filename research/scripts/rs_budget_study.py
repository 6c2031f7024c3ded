"""Reduce-scatter: one DynamiQ threshold per chunk or one global threshold?

Runs the simulator (all ranks in one process, the code that runs under
mpiexec) on gradient-like data (dynamiq_mpi.bench.gradients: layers over five
decades of scale, an embedding table with 90 % zero rows) in two layouts:

* ``zero``: the flat gradient cut into n contiguous chunks (ZeRO: chunk r
  holds whole layers, so chunks differ by orders of magnitude);
* ``fsdp``: FSDP2's layout, every tensor (layer) split into n pieces along
  dim 0 and chunk r the concatenation of the r-th pieces (chunks alike).

and prints, per (layout, n): vNMSE over all chunks and the bytes of the
largest chunk message relative to the mean, for the all-reduce of the same
data (reference), the per-chunk threshold (the default), the global
threshold at the same total budget, and the global threshold with the budget
lowered until its largest message is no larger than the per-chunk one (equal
time: a ring step lasts as long as its largest message, a chunk travels n-1
hops in sequence).

    PYTHONPATH=. python research/scripts/rs_budget_study.py [--length 1048576] [--seeds 2]
"""
import argparse
import json

import numpy as np

import dynamiq_mpi as dq
from dynamiq_mpi.bench.gradients import gradient_like, layer_layout


def fsdp_layout(x, n, length):
    emb, _, bounds, _ = layer_layout(length)
    tensors = [(0, emb)] + [(int(bounds[i]), int(bounds[i + 1])) for i in range(len(bounds) - 1)]
    pieces = [[] for _ in range(n)]
    for a, b in tensors:
        t = x[a:b]
        m = -(-t.shape[0] // n)
        t = np.concatenate([t, np.zeros(m * n - t.shape[0], t.dtype)])   # FSDP pads dim 0
        for r in range(n):
            pieces[r].append(t[r * m:(r + 1) * m])
    return np.concatenate([np.concatenate(p) for p in pieces])


def run(xs, n, bits, seed, budget):
    codec = dq.DynamiQ(bits=bits, small_input=0)
    outs, reps = dq.simulate_reduce_scatter(xs, codec=codec, seed=seed, return_reports=True,
                                            budget=budget)
    sizes = reps[0].codec_info["block_bytes"]
    return np.concatenate(outs), max(sizes), float(np.mean(sizes)), reps[0].bits_per_coord


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=1 << 20)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--bits", type=float, default=5.0)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for layout in ("zero", "fsdp"):
        for n in args.ranks:
            acc = {}
            for seed in range(args.seeds):
                xs = [gradient_like(args.length, r, seed=seed) for r in range(n)]
                if layout == "fsdp":
                    xs = [fsdp_layout(x, n, args.length) for x in xs]
                L = xs[0].shape[0] // n * n
                xs = [x[:L].copy() for x in xs]
                S = np.sum(np.array(xs, dtype=np.float64), axis=0)
                ref = float(np.sum(S ** 2))

                def err(est):
                    return float(np.sum((est.astype(np.float64) - S) ** 2)) / ref

                ar = dq.simulate_allreduce(xs, codec=dq.DynamiQ(bits=args.bits, small_input=0),
                                           seed=seed)[0]
                res = {"allreduce": (err(ar), float("nan"), float("nan"))}
                est, mx, mean, _ = run(xs, n, args.bits, seed, "per-chunk")
                res["per-chunk"] = (err(est), mx, mean)
                target = mx
                est, gmx, gmean, _ = run(xs, n, args.bits, seed, "global")
                res["global"] = (err(est), gmx, gmean)
                lo, hi = 2.5, args.bits        # bisect the budget for equal largest message
                best = None
                for _ in range(12):
                    mid = 0.5 * (lo + hi)
                    est, gmx2, gmean2, _ = run(xs, n, mid, seed, "global")
                    if gmx2 <= target:
                        lo, best = mid, (err(est), gmx2, gmean2, mid)
                    else:
                        hi = mid
                res["global, equal time"] = best[:3] if best else (float("nan"),) * 3
                res["_eq_bits"] = (best[3] if best else float("nan"),) * 3
                # and the other way round: per-chunk with the budget raised
                # until its largest message matches the global one's
                lo, hi, best = args.bits, 8.6, None
                for _ in range(10):
                    mid = 0.5 * (lo + hi)
                    est, pmx, pmean, _ = run(xs, n, mid, seed, "per-chunk")
                    if pmx <= gmx:
                        lo, best = mid, (err(est), pmx, pmean, mid)
                    else:
                        hi = mid
                res["per-chunk, time of global"] = best[:3] if best else (float("nan"),) * 3
                res["_eq_bits2"] = (best[3] if best else float("nan"),) * 3
                for k, v in res.items():
                    acc.setdefault(k, []).append(v)
            for k, vs in acc.items():
                if k.startswith("_"):
                    continue
                e = float(np.mean([v[0] for v in vs]))
                mx = float(np.mean([v[1] for v in vs]))
                mean = float(np.mean([v[2] for v in vs]))
                row = {"layout": layout, "n": n, "mode": k, "vnmse": e,
                       "max_msg_bytes": mx, "max_over_mean": mx / mean if mean == mean else None}
                if k == "global, equal time":
                    row["global_bits"] = float(np.mean([v[0] for v in acc["_eq_bits"]]))
                if k == "per-chunk, time of global":
                    row["global_bits"] = float(np.mean([v[0] for v in acc["_eq_bits2"]]))
                rows.append(row)
                extra = f" (budget {row['global_bits']:.2f} bits)" if "global_bits" in row else ""
                print(f"{layout:5s} n={n} {k:26s} vNMSE {e:.3e}  largest msg {mx/1024:8.1f} KiB"
                      f"  max/mean {row['max_over_mean'] or float('nan'):.2f}{extra}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"length": args.length, "bits": args.bits, "seeds": args.seeds,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
