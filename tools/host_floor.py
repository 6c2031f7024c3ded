"""Host time per call of the library's paths on host (NumPy) arrays, against
MPI's own all-reduce of the same array (run under mpiexec; rank 0 prints and
writes JSON).  The Python of a steady call is the same whatever the arrays,
so this measures, without a GPU, the floor a call adds to the transport's
own all-reduce.

    mpiexec -n 2 python tools/host_floor.py --json floor.json

Rows: MPI_Allreduce alone; ``path="native"`` (a steady call: one digest
exchange and the all-reduce); the default ``path="auto"`` (its class decided
native); ``path="compressed"`` with DynamiQ at 5 bits (small_input=0: the
codec's CPU kernels included).  Median of --rounds rounds of --calls calls.
"""
import argparse
import json
import statistics
import time

import numpy as np
from mpi4py import MPI

import dynamiq_mpi as dq


def per_call_us(fn, comm, calls, rounds):
    for _ in range(max(10, calls // 10)):
        fn()
    times = []
    for _ in range(rounds):
        comm.Barrier()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--log2n", type=int, default=10, help="float32 elements per call: 2^N")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    x = np.random.default_rng(comm.rank).standard_normal(1 << args.log2n).astype(np.float32)
    out = np.empty_like(x)
    coll = dq.Collective(comm)
    codec = dq.DynamiQ(bits=5, small_input=0)
    cases = [
        ("MPI_Allreduce", lambda: comm.Allreduce(x, out)),
        ("dq path=native (steady)", lambda: coll.allreduce(x, out=out, path="native")),
        ("dq path=auto (decided)", lambda: coll.allreduce(x, out=out, path="auto")),
        ("dq path=compressed, DynamiQ 5 bits", lambda: coll.allreduce(
            x, codec=codec, out=out, path="compressed")),
    ]
    rows = []
    for name, fn in cases:
        calls = args.calls if "compressed" not in name else max(50, args.calls // 10)
        us = comm.allreduce(per_call_us(fn, comm, calls, args.rounds), op=MPI.MAX)
        rows.append({"case": name, "us_per_call": us})
    if comm.rank == 0:
        print(f"# host time per call, {comm.size} ranks, 2^{args.log2n} float32 "
              f"(slowest rank, median of {args.rounds} rounds)")
        for r in rows:
            print(f"  {r['case']:<38s} {r['us_per_call']:8.1f} us")
        if args.json:
            meta = {"ranks": comm.size, "log2n": args.log2n, "mpi": MPI.Get_library_version()
                    .splitlines()[0], "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    coll.free()


if __name__ == "__main__":
    main()
