"""Python and C calls per steady all-reduce on host (NumPy) arrays, counted
with sys.setprofile (deterministic, unlike a timing), for a package on
PYTHONPATH:

    PYTHONSAFEPATH=1 PYTHONPATH=OLD_DIR mpiexec -n 2 python tools/profiling/host_calls.py
    PYTHONSAFEPATH=1 PYTHONPATH=. mpiexec -n 2 python tools/profiling/host_calls.py [top]

2^10 float32, out= reused, DynamiQ(small_input=0), after 20 untimed calls;
path "compressed" and "native".  ``top``: list rank 0's calls by function.
"""
import collections
import sys

import numpy as np
from mpi4py import MPI

import dynamiq_mpi as dq


def count_one_call(coll, x, out, codec) -> collections.Counter:
    counts = collections.Counter()

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            counts[(code.co_filename.rsplit("dynamiq_mpi/", 1)[-1], code.co_name)] += 1
        elif event == "c_call":
            counts[("C", getattr(arg, "__qualname__", str(arg)))] += 1
    sys.setprofile(profile)
    coll.allreduce(x, codec=codec, out=out)
    sys.setprofile(None)
    return counts


def main():
    comm = MPI.COMM_WORLD
    x = np.random.default_rng(comm.rank).standard_normal(1 << 10).astype(np.float32)
    out = np.empty_like(x)
    codec = dq.DynamiQ(small_input=0)
    for path in ("compressed", "native"):
        coll = dq.Collective(comm, path=path)
        for _ in range(20):
            coll.allreduce(x, codec=codec, out=out)
        counts = count_one_call(coll, x, out, codec)
        coll.free()
        python = sum(v for k, v in counts.items() if k[0] != "C")
        c = sum(v for k, v in counts.items() if k[0] == "C")
        if comm.rank == 0:
            print(f"{path}: {python} Python calls, {c} C calls")
            if sys.argv[1:] == ["top"]:
                for (where, name), v in counts.most_common(25):
                    print(f"  {v:4d} {where}:{name}")


if __name__ == "__main__":
    main()
