"""Command line: ``python -m dynamiq_mpi {doctor,demo,bench,model}`` (the MPI
commands under ``mpiexec -n N``; an exception on any rank aborts the job).
The studies and the CUDA kernel benchmark run from a checkout:
``python -m research {vnmse,train-sim,schedule,kernels,...}``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
import traceback

import numpy as np


def _world():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def _codec_rows(n):
    from . import BF16, DynamiQ, Exact
    # small_input=0: the demo's 2^20 elements would go as BF16
    return [("exact", Exact()), ("bf16", BF16())] + [
        (f"dynamiq b={b:g}", DynamiQ(bits=b, small_input=0)) for b in (3, 5, 8.25)]


def _widths(report) -> str:
    info = report.codec_info
    if "widths" not in info:
        return ""
    w = info["widths"]
    note = "" if info["budget_binds"] else " (budget does not bind)"
    return "/".join(str(w.get(k, 0)) for k in (0, 2, 4, 8, 16)) + note


def cmd_demo(args):
    """Compressed all-reduce of gradient-like data with each codec and topology
    (the codecs' own path: ``path="compressed"``, whatever the size)."""
    from mpi4py import MPI

    from . import Collective
    from .bench.gradients import gradient_like

    comm = _world()
    rank, n = comm.rank, comm.size
    coll = Collective(comm, path="compressed")
    x = gradient_like(args.length, rank, seed=args.seed)
    exact = np.empty(args.length, np.float64)
    comm.Allreduce(x.astype(np.float64), exact, op=MPI.SUM)
    where = "CPU (NumPy)"
    if args.gpu:
        import cupy
        cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
        x = cupy.asarray(x)
        where = f"GPU (CuPy, {cupy.cuda.runtime.getDeviceCount()} device(s), host-staged MPI)"
    norm = float(np.sum(exact ** 2))
    rows = []
    for name, codec in _codec_rows(n):
        for topo in ("ring", "butterfly"):
            if topo == "butterfly" and n & (n - 1):
                rows.append((name, topo, None, None, None, None, ""))
                continue
            # one untimed call first: CuPy compiles its kernels on first use
            coll.allreduce(x, codec=codec, topology=topo, seed=args.seed)
            comm.Barrier()
            out, rep = coll.allreduce(x, codec=codec, topology=topo, seed=args.seed,
                                      return_report=True)
            t = comm.allreduce(rep.seconds, op=MPI.MAX)
            if args.gpu:
                out = out.get()
            digest = hashlib.sha256(out.tobytes()).hexdigest()
            same = all(d == digest for d in comm.allgather(digest))
            err = float(np.sum((out.astype(np.float64) - exact) ** 2)) / norm
            rows.append((name, topo, rep.bits_per_coord, err, t, same, _widths(rep)))
    if rank == 0:
        print(f"dynamiq-mpi demo on {where}: {n} ranks, {args.length} float32 gradient-like entries per rank "
              "(heavy-tailed, layer scales over 5 decades, a quarter of it an embedding table, 90% zero rows)")
        print(f"{'codec':16s} {'topology':10s} {'bits/coord':>10s} {'vNMSE':>10s} "
              f"{'time (ms)':>10s} {'identical':>9s}  super-groups at 0/2/4/8/16 bits")
        print("(time: slowest rank, second call; the first call of each row warms up)")
        for name, topo, bits, err, t, same, widths in rows:
            if bits is None:
                print(f"{name:16s} {topo:10s} {'n/a (butterfly needs a power-of-two n)':>43s}")
                continue
            print(f"{name:16s} {topo:10s} {bits:10.3f} {err:10.3e} {t * 1e3:10.1f} "
                  f"{'yes' if same else 'NO':>9s}  {widths}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump([dict(codec=r[0], topology=r[1], bits_per_coord=r[2], vnmse=r[3],
                                seconds=r[4], identical=r[5]) for r in rows], f, indent=1)
    if not all(r[5] for r in rows if r[2] is not None):
        raise RuntimeError("ranks disagree on the all-reduce result")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["kernels"]:
        sys.exit("the CUDA kernel benchmark runs from a checkout of the repository: "
                 "python -m research kernels")
    parser = argparse.ArgumentParser(prog="python -m dynamiq_mpi", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from .bench import doctor
    p = sub.add_parser("doctor", help="what the library found: kernels, CuPy, NCCL, torch, MPI, "
                                      "launcher, and what the default call would choose",
                       description=doctor.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    doctor.add_arguments(p)
    p.set_defaults(func=doctor.run, mpi=False)
    p = sub.add_parser("demo", help="all-reduce gradient-like data with every codec (mpiexec)")
    p.add_argument("--length", type=int, default=1 << 20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the table as JSON")
    p.add_argument("--gpu", action="store_true", help="all-reduce CuPy arrays (rank r on GPU r % count)")
    p.set_defaults(func=cmd_demo, mpi=True)
    from .cost_model import io as cost_model_io, model as cost_model
    p = sub.add_parser("model", help="predicted time of NCCL's, our flat and our hierarchical "
                                     "all-reduce on a cluster (CPU only)",
                       description=cost_model.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    cost_model_io.add_arguments(p)
    p.set_defaults(func=cost_model_io.run, mpi=False)
    p = sub.add_parser("bench", help="nccl-tests-style benchmark against the uncompressed "
                                     "all-reduce (mpiexec)")
    from .bench import add_arguments, run as bench_run
    add_arguments(p)
    p.set_defaults(func=bench_run, mpi=True)
    args = parser.parse_args(argv)
    if not args.mpi:
        return args.func(args)
    try:
        return args.func(args)
    except BaseException:
        comm = _world()
        sys.stdout.flush()
        sys.stderr.write(f"[rank {comm.rank}] error, aborting the job:\n{traceback.format_exc()}")
        sys.stderr.flush()
        if comm.size > 1:
            time.sleep(0.2)
            comm.Abort(1)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
