"""Where the time of one GPU all-reduce goes (run under mpiexec, one rank per GPU).

1. device time of the statistics kernel and of the planner (CUDA events,
   median of 20 runs) at the given sizes;
2. a cProfile of the host side of back-to-back DynamiQ calls over NCCL
   (rank 0 prints the top functions by own time).

    mpiexec -n 2 python tools/profiling/profile_call.py --sizes 23,27
"""
import argparse
import cProfile
import io
import os
import pstats

import numpy as np
from mpi4py import MPI


def event_ms(cp, fn, reps=20):
    fn()
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b))
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="23,27", help="log2 of element counts")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    import cupy as cp

    import dynamiq_mpi as dq
    from dynamiq_mpi import _gpu
    from dynamiq_mpi.codecs.allocation import record_bits
    from dynamiq_mpi.studies.gradients import gradient_like_xp

    comm = MPI.COMM_WORLD
    local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", comm.rank))
    cp.cuda.Device(local % cp.cuda.runtime.getDeviceCount()).use()
    coll = dq.Collective(comm, transport="nccl")
    for log2 in (int(s) for s in args.sizes.split(",")):
        n = 1 << log2
        nsg = n // 256
        x = gradient_like_xp(cp, n, comm.rank, dtype=dq.backend.BFLOAT16)
        mean, norm2 = cp.empty(nsg, cp.float32), cp.empty(nsg, cp.float32)
        tail, scratch = cp.empty(2, cp.float32), cp.empty(1, cp.int64)
        t_stats = event_ms(cp, lambda: _gpu.stats_into(x, nsg, True, mean, norm2, tail, scratch))
        widths, order = cp.empty(nsg, cp.int8), cp.empty(nsg, cp.int64)
        pos, header = cp.empty(nsg, cp.int64), cp.empty(_gpu.PLAN_HEADER, cp.float64)
        pscratch = cp.empty(_gpu.plan_scratch_bytes(nsg), cp.uint8)
        rec = [record_bits(w, True) for w in (2, 4, 8, 16)]
        t_plan = event_ms(cp, lambda: _gpu.plan(nsg, True, True, True, 0, 64 * nsg + 64, rec,
                                                5.0 * n, 5.0 * n, norm2, mean, tail, widths,
                                                order, pos, header, pscratch))
        out = cp.empty_like(x)
        codec = dq.DynamiQ(bits=5)
        for _ in range(3):
            coll.allreduce(x, codec=codec, out=out)
        cp.cuda.get_current_stream().synchronize()
        prof = cProfile.Profile()
        comm.Barrier()
        prof.enable()
        for _ in range(args.calls):
            coll.allreduce(x, codec=codec, out=out)
        cp.cuda.get_current_stream().synchronize()
        prof.disable()
        if comm.rank == 0:
            s = io.StringIO()
            st = pstats.Stats(prof, stream=s)
            st.sort_stats("tottime").print_stats(22)
            per_call = st.total_tt / args.calls * 1e6
            print(f"== 2^{log2} elements (bf16): stats kernel {t_stats * 1e3:.1f} us, "
                  f"planner {t_plan * 1e3:.1f} us (device, median of 20); host time per call "
                  f"{per_call:.0f} us (cProfile, {args.calls} calls, incl. waits)")
            print("\n".join(s.getvalue().splitlines()[:45]))
    coll.free()


if __name__ == "__main__":
    main()
