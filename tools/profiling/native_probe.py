"""Where a native call's time goes on GPUs: per call, back to back on one
stream, for one size (BF16, one GPU a rank, under mpiexec):

  nccl       NCCL's all-reduce through CuPy (the benchmark's reference)
  nccl host  the same calls' host time alone (no synchronisation)
  allgather  the control plane's 8-byte digest all-gather (MPI, host)
  ours       Collective(path="native").allreduce, wall time
  ours host  its host time alone
  profile    cProfile of rank 0's host time over the calls, top functions

    mpiexec -n 4 python tools/profiling/native_probe.py [log2=20] [calls=2000]
"""
import cProfile
import io
import pstats
import sys
import time

import cupy as cp
import numpy as np
from cupy.cuda import nccl
from mpi4py import MPI

import dynamiq_mpi as dq


def main():
    log2 = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    comm = MPI.COMM_WORLD
    cp.cuda.Device(comm.rank % cp.cuda.runtime.getDeviceCount()).use()
    import ml_dtypes
    x = cp.asarray(np.random.default_rng(comm.rank).standard_normal(1 << log2)
                   .astype(ml_dtypes.bfloat16))
    out = cp.empty_like(x)
    uid = comm.bcast(nccl.get_unique_id() if comm.rank == 0 else None)
    ref = nccl.NcclCommunicator(comm.size, uid, comm.rank)
    coll = dq.Collective(comm, path="native")
    stream = cp.cuda.get_current_stream()
    digest, gathered = np.zeros(1, np.int64), np.zeros(comm.size, np.int64)

    def nccl_call():
        ref.allReduce(x.data.ptr, out.data.ptr, x.size, nccl.NCCL_BFLOAT16, nccl.NCCL_SUM,
                      stream.ptr)

    def ours():
        coll.allreduce(x, out=out)

    def allgather():
        comm.Allgather(digest, gathered)

    def timed(fn, sync_at_end=True):
        for _ in range(50):
            fn()
        stream.synchronize()
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host = time.perf_counter() - t0
        if sync_at_end:
            stream.synchronize()
        wall = time.perf_counter() - t0
        return (comm.allreduce(wall, op=MPI.MAX) / calls * 1e6,
                comm.allreduce(host, op=MPI.MAX) / calls * 1e6)

    rows = {}
    for rnd in range(3):
        for name, fn in (("nccl", nccl_call), ("ours", ours), ("allgather", allgather)):
            wall, host = timed(fn)
            rows.setdefault(name, []).append((wall, host))
    if comm.rank == 0:
        print(f"2^{log2} BF16, {comm.size} ranks, {calls} calls a round, us a call "
              "(wall / host, median of 3 rounds)")
        for name, v in rows.items():
            w = sorted(a for a, _ in v)[1]
            h = sorted(b for _, b in v)[1]
            print(f"  {name:10s} wall {w:7.1f}   host {h:7.1f}")
    prof = cProfile.Profile()
    stream.synchronize()
    comm.Barrier()
    prof.enable()
    for _ in range(calls):
        ours()
    prof.disable()
    stream.synchronize()
    if comm.rank == 0:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        print(s.getvalue())
    coll.free()


if __name__ == "__main__":
    main()
