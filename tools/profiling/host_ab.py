"""Host time per call of a steady all-reduce on host (NumPy) arrays, through
the public API only, so that two versions of the package can be compared
alternately in one job (each imports the `dynamiq_mpi` on PYTHONPATH):

    for r in 1 2 3 4; do for P in OLD_DIR .; do
      PYTHONSAFEPATH=1 PYTHONPATH=$P mpiexec -n 2 python tools/profiling/host_ab.py 10
    done; done

Prints, for 2^N float32 elements (argument, default 10): MPI_Allreduce, then
Collective(path=...).allreduce with out= reused for "native", "auto" and
"compressed" (DynamiQ, small_input=0) in microseconds per call: the slowest
rank's median of 7 loops of 300 calls after 20 untimed ones.
"""
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

import dynamiq_mpi as dq


def per_call_us(comm, fn, calls=300, rounds=7, warmup=20):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        comm.Barrier()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return comm.allreduce(statistics.median(times), op=MPI.MAX)


def main():
    comm = MPI.COMM_WORLD
    log2n = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    x = np.random.default_rng(comm.rank).standard_normal(1 << log2n).astype(np.float32)
    out = np.empty_like(x)
    rows = {"MPI_Allreduce": per_call_us(comm, lambda: comm.Allreduce(x, out))}
    codec = dq.DynamiQ(small_input=0)
    for path in ("native", "auto", "compressed"):
        coll = dq.Collective(comm, path=path)
        rows[path] = per_call_us(comm, lambda: coll.allreduce(x, codec=codec, out=out))
        coll.free()
    if comm.rank == 0:
        print(dq.__file__.rsplit("/", 2)[0], " ".join(f"{k}={v:.1f}" for k, v in rows.items()))


if __name__ == "__main__":
    main()
