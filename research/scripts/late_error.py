"""Why the compressed all-reduce's error grows along a training run: train
with the exact mean (``train-sim``'s simulated ranks, codec fp32) and, at
the given steps, reduce the same per-rank buckets with codec variants on
the side (the run itself never sees them).

    python research/scripts/late_error.py --ranks 2 --hidden 256 --layers 4 --heads 4 \\
        --intermediate 704 --seq-len 128 --batch 8 --steps 300 --lr 1e-3 \\
        --at 25,100,200,299 --json late.json

Per step and variant: vNMSE against the exact mean (the hook's metric);
the error against the ranks' own gradients' scale, sum_i |g_i|^2 / n^2
(flat where the growth is the ranks' gradients disagreeing more, so that
their mean shrinks); the mean over parameter tensors of each tensor's own
vNMSE (what an optimiser that normalises per coordinate, like Adam, feels);
and the agreement |mean|^2 / mean_i |g_i|^2 (1: the ranks agree; 1/n:
orthogonal gradients).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

VARIANTS = {
    "dynamiq:5": {},
    "dynamiq:6": {"bits": 6.0},
    "dynamiq:5 no centring": {"centring": False},
    "dynamiq:5 fixed width 4": {"variable_width": False, "fixed_width": 4},
    "dynamiq:5 one call a tensor": {"per_tensor": True},
}


def main(argv=None):
    import numpy as np
    import torch

    import dynamiq_mpi as dq
    from research import train_sim

    p = argparse.ArgumentParser()
    p.add_argument("--at", default="25,100,200,299", help="steps to measure")
    p.add_argument("--json", default=None)
    own, rest = p.parse_known_args(argv)
    at = {int(s) for s in own.at.split(",")}
    args = train_sim.parse_args(rest + ["--codec", "fp32", "--device", "cpu", "--quiet"])
    n = args.ranks
    rows = []
    step_box = [0]
    sizes_box = [None]

    class Diagnosing(train_sim.Reducer):
        def __call__(self, xs):
            out = super().__call__(xs)
            if step_box[0] in at:
                self._diagnose([x.detach().cpu().numpy() for x in xs])
            return out

        def take_vnmse(self):
            if step_box[0] in at:
                self._flush_step()
            step_box[0] += 1
            return super().take_vnmse()

        def _diagnose(self, arrays):
            acc = self.__dict__.setdefault("_acc", {})
            exact = np.mean(np.stack(arrays).astype(np.float64), axis=0)
            own = sum(float(np.sum(a.astype(np.float64) ** 2)) for a in arrays) / n
            bounds = self._tensor_bounds(len(exact))
            for name, kw in VARIANTS.items():
                if kw.get("per_tensor"):    # one call a tensor: no budget shared between tensors
                    codec = dq.DynamiQ(small_input=0)
                    parts = [dq.simulate_allreduce([a[lo:hi] for a in arrays], codec=codec,
                                                   op="mean", seed=args.seed,
                                                   counter=self.counter)[0] for lo, hi in bounds]
                    outs = [np.concatenate(parts)]
                else:
                    codec = dq.DynamiQ(small_input=0, **kw)
                    outs = dq.simulate_allreduce(arrays, codec=codec, op="mean", seed=args.seed,
                                                 counter=self.counter)
                d = outs[0].astype(np.float64) - exact
                a = acc.setdefault(name, {"err": 0.0, "tensors": []})
                a["err"] += float(np.sum(d * d))
                for lo, hi in bounds:
                    ref = float(np.sum(exact[lo:hi] ** 2))
                    if ref > 0:
                        a["tensors"].append(float(np.sum(d[lo:hi] ** 2)) / ref)
            g = acc.setdefault("_norms", {"exact": 0.0, "own": 0.0})
            g["exact"] += float(np.sum(exact * exact))
            g["own"] += own

        def _tensor_bounds(self, length):
            bounds, lo = [], 0
            for size in sizes_box[0].pop(0) if sizes_box[0] else [length]:
                bounds.append((lo, lo + size))
                lo += size
            return bounds

        def _flush_step(self):
            acc = self.__dict__.pop("_acc", {})
            norms = acc.pop("_norms", {"exact": 1.0, "own": 1.0})
            row = {"step": step_box[0], "agreement": norms["exact"] / norms["own"]}
            for name, a in acc.items():
                row[name] = {"vnmse": a["err"] / norms["exact"],
                             "vs_own": a["err"] / (norms["own"] / n),
                             "tensor_mean": float(np.mean(a["tensors"])),
                             "tensor_p90": float(np.percentile(a["tensors"], 90))}
            rows.append(row)
            print(json.dumps(row), flush=True)

    # the per-tensor split of each bucket: gradient_buckets' order, read per step
    import dynamiq_mpi.torch.ddp as ddp_mod
    original = ddp_mod.gradient_buckets
    layout = {}

    def buckets_spy(grads, cap_mb):
        out = original(grads, cap_mb)
        layout["sizes"] = [[grads[i].numel() for i in b] for b in out]
        return out
    ddp_mod.gradient_buckets = buckets_spy
    original_call = Diagnosing.__call__

    def call_with_layout(self, xs):
        if step_box[0] in at and not sizes_box[0]:
            sizes_box[0] = [list(s) for s in layout.get("sizes", [])]
        return original_call(self, xs)
    Diagnosing.__call__ = call_with_layout
    train_sim.Reducer = Diagnosing
    torch.manual_seed(args.seed)
    record = train_sim.run(args)
    out = {"config": record["config"], "rows": rows,
           "evals": record["evals"]}
    if own.json:
        with open(own.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
