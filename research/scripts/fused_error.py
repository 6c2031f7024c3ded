"""What fusing DDP buckets into one compressed call does to the error: the
gradients of one LLaMA step (mpi_examples/train_lm.py's model and batches),
cut into DDP-sized buckets, all-reduced by DynamiQ bucket by bucket and in
fused groups (the hook's rule), each against the exact float64 mean.

    mpiexec -n 2 python research/scripts/fused_error.py --preset default --json out.json

Prints vNMSE and bits a coordinate for every grouping (one bucket a call,
the hook's default fuse_mb, the whole model in one call), the same seed and
gradients for all.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "mpi_examples"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="default")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--fuse-mb", default="0,64,256,100000")
    p.add_argument("--bits", type=float, default=5.0)
    p.add_argument("--json")
    args = p.parse_args(argv)

    import torch
    from mpi4py import MPI

    import dynamiq_mpi as dq
    import train_lm
    from research.corpus import load_corpus
    from research.workloads import build_model, lm_loss, rank_batch
    from dynamiq_mpi.torch.ddp import gradient_buckets
    from dynamiq_mpi.torch.ddp_buckets import fused_groups

    comm = MPI.COMM_WORLD
    ns = argparse.Namespace(**train_lm.PRESETS[args.preset])
    ns.batch, ns.seq_len, ns.seed = args.batch, args.seq_len, 0
    torch.manual_seed(0)
    model = build_model(ns, torch.device("cpu"))
    data = torch.frombuffer(bytearray(load_corpus()[0]), dtype=torch.uint8)
    w = rank_batch(3, comm.rank, comm.size, data, ns)
    lm_loss(model, w, torch.device("cpu")).backward()
    # DDP's order: gradients ready last-layer first
    grads = [p.grad.detach().reshape(-1).numpy() for p in reversed(list(model.parameters()))]
    buckets = [np.concatenate([grads[i] for i in b]).astype(np.float32)
               for b in gradient_buckets([torch.from_numpy(g) for g in grads], args.bucket_mb)]
    exact = [comm.allreduce(b.astype(np.float64)) / comm.size for b in buckets]
    coll = dq.Collective(comm=comm)
    codec = dq.DynamiQ(bits=args.bits)
    sizes = [b.size for b in buckets]
    rows = []
    for fuse in [float(f) for f in args.fuse_mb.split(",")]:
        cap = max(1, int(fuse * 2 ** 20) // 4)
        err = ref = bits = 0.0
        groups = fused_groups(sizes, cap)
        for g in groups:
            x = np.concatenate([buckets[i] for i in g])
            mean, rep = coll.allreduce(x, codec=codec, op="mean", seed=11, path="compressed",
                                       return_report=True)
            e = np.concatenate([exact[i] for i in g])
            err += float(np.sum((mean - e) ** 2))
            ref += float(np.sum(e ** 2))
            bits += rep.bits_per_coord * x.size
        rows.append({"fuse_mb": fuse, "calls": len(groups), "vnmse": err / ref,
                     "bits_per_coord": bits / sum(sizes)})
    if comm.rank == 0:
        n = sum(sizes)
        print(f"{args.preset}: {n / 1e6:.1f}M gradients in {len(buckets)} buckets of "
              f"{args.bucket_mb:g} MB, {comm.size} ranks, DynamiQ {args.bits:g} bits")
        print("| fuse_mb | calls | vNMSE | bits/coord |\n|---|---|---|---|")
        for r in rows:
            print(f"| {r['fuse_mb']:g} | {r['calls']} | {r['vnmse']:.3e} | "
                  f"{r['bits_per_coord']:.3f} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"preset": args.preset, "ranks": comm.size, "buckets": sizes,
                           "rows": rows, "command": " ".join(sys.argv)}, f, indent=1)
    coll.free()


if __name__ == "__main__":
    main()
