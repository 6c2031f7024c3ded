"""One reduce-scatter at FSDP2's per-layer sizes (float32 input, as FSDP2's
reduce_dtype=float32 hands it): NCCL's BF16 and float32 reduce-scatter through
CuPy against ours (DynamiQ 5 bits, ``out=`` reused) with CUDA graphs off and on;
medians of 6 calls (slowest rank), the host time of a quiet call, and one
profiled eager call's phases.

    mpiexec -n 2 python tools/profiling/reduce_scatter_probe.py   (+ the socket settings)
"""
import statistics
import time

import cupy as cp
import ml_dtypes
import numpy as np
from mpi4py import MPI
import dynamiq_mpi as dq
from cupy.cuda import nccl
comm = MPI.COMM_WORLD; r, n = comm.rank, comm.size
cp.cuda.Device(r % cp.cuda.runtime.getDeviceCount()).use()
uid = comm.bcast(nccl.get_unique_id() if r == 0 else None)
nc = nccl.NcclCommunicator(n, uid, r)
def timeit(f, reps=6, warm=2):
    for _ in range(warm): f()
    ts = []
    for _ in range(reps):
        cp.cuda.Device().synchronize(); comm.Barrier(); t = time.perf_counter(); f(); cp.cuda.Device().synchronize(); ts.append(time.perf_counter() - t)
    return comm.allreduce(statistics.median(ts), op=MPI.MAX) * 1e3
for L in [1 << 23, 1 << 25]:
  for graphs in (False, True):
      x32 = cp.random.standard_normal(L, dtype=cp.float32) * 1e-3
      xbf = cp.asarray(cp.asnumpy(x32).astype(ml_dtypes.bfloat16).view(np.uint16)).view(cp.uint16)
      outb = cp.empty(L // n, dtype=cp.uint16)
      s = cp.cuda.get_current_stream()
      t_nccl = timeit(lambda: nc.reduceScatter(xbf.data.ptr, outb.data.ptr, L // n, nccl.NCCL_BFLOAT16, nccl.NCCL_SUM, s.ptr))
      out32 = cp.empty(L // n, dtype=cp.float32)
      t_nccl32 = timeit(lambda: nc.reduceScatter(x32.data.ptr, out32.data.ptr, L // n, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, s.ptr))
      coll = dq.Collective(comm, graphs=graphs)
      t_ours = timeit(lambda: coll.reduce_scatter(x32, out=out32, op="sum"))
      t_ours_rep = timeit(lambda: coll.reduce_scatter(x32, out=out32, op="sum", return_report=True))
      _, rep = coll.reduce_scatter(x32, out=out32, op="sum", return_report=True, profile=True)
      host = []
      for _ in range(5):
          cp.cuda.Device().synchronize(); t = time.perf_counter(); coll.reduce_scatter(x32, out=out32, op="sum"); host.append(time.perf_counter() - t)
      cp.cuda.Device().synchronize()
      if r == 0:
          print(f"2^{L.bit_length()-1} fp32 in, graphs {graphs}: NCCL RS bf16 {t_nccl:.2f} ms, NCCL RS fp32 {t_nccl32:.2f} ms, ours quiet {t_ours:.2f} ms, "
                f"ours with report {t_ours_rep:.2f} ms, host {statistics.median(host)*1e3:.2f} ms; bits {rep.bits_per_coord:.2f} "
                f"path {rep.path} transport {rep.transport}")
          print("   phases (profiled):", {k: (round(v * 1e3, 3) if isinstance(v, float) else v) for k, v in rep.phases.items()})
          print("   graphs:", getattr(coll, "graph_stats", lambda: None)())
      coll.free()
