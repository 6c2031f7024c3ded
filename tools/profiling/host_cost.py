"""Where the host time of back-to-back GPU all-reduce calls goes (run under
mpiexec, one rank per GPU; rank 0 prints).

    mpiexec -n 2 python tools/profiling/host_cost.py --sizes 20,23,27 --codecs bf16,dynamiq:5

Per (size, codec): wall time per call over a loop of back-to-back calls
(one synchronisation at the end), the main thread's CPU time per call, and
that host time split by what the engine asked for: the agreement (MPI), the
transport's exchanges, claims and marks, the codec's local statistics and
plan (the plan's one device-to-host copy, which waits for the device, shown
apart), and the rest (engine, codec kernels' launches, Python). Then the
agreement alone and a bare 8-byte MPI Allgather, for scale.
"""
import argparse
import os
import pickle
import time
from collections import defaultdict

import numpy as np
from mpi4py import MPI


def timed(fn, bucket, key):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            bucket[key(*a, **k) if callable(key) else key] += time.perf_counter() - t
    return wrapper


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="20,23,27", help="log2 of element counts")
    ap.add_argument("--codecs", default="bf16,dynamiq:5")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=1,
                    help="timed loops per (size, codec): wall/call is their minimum (the host "
                         "of a lent machine is noisy), the parts are averaged over all of them")
    ap.add_argument("--by-kernel", action="store_true",
                    help="also bucket the host time of each compiled wrapper of dynamiq_mpi._gpu "
                         "(cProfile cannot see inside Cython)")
    ap.add_argument("--pstats", default=None,
                    help="also write a cProfile of each (size, codec) loop to PSTATS.<log2>.<codec>")
    args = ap.parse_args()
    import cupy as cp

    import dynamiq_mpi as dq
    from dynamiq_mpi import backend as backend_mod
    from dynamiq_mpi.codecs import codec_from_string
    from dynamiq_mpi.studies.gradients import gradient_like_xp
    from dynamiq_mpi.transports import mpi_host

    comm = MPI.COMM_WORLD
    local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", comm.rank))
    cp.cuda.Device(local % cp.cuda.runtime.getDeviceCount()).use()
    coll = dq.Collective(comm, transport="nccl")
    bucket = defaultdict(float)
    # what the engine asks the transports for, by request type
    coll._host.answer = timed(coll._host.answer, bucket, lambda r: "agree (MPI)")
    gpu_backend = type(backend_mod.backend_for(cp.zeros(1)))
    gpu_backend.to_host = timed(gpu_backend.to_host, bucket, "plan: device-to-host wait")
    for cls in (dq.DynamiQ, dq.BF16):
        for name in ("local_stats", "plan"):
            if name in cls.__dict__:
                setattr(cls, name, timed(cls.__dict__[name], bucket, f"codec.{name}"))
    if args.by_kernel:
        from dynamiq_mpi import _gpu
        for name in dir(_gpu):
            fn = getattr(_gpu, name)
            if not name.startswith("_") and callable(fn) and not isinstance(fn, type):
                setattr(_gpu, name, timed(fn, bucket, f"_gpu.{name}"))
        # a Source made by Python code (the Cython wrappers make theirs in C)
        source_cls = _gpu.Source
        _gpu.Source = timed(source_cls, bucket, "_gpu.Source")
    # NCCL's own host work inside an exchange (shown, not subtracted: it is
    # part of "exchange")
    from cupy.cuda import nccl as nccl_module
    nccl_module.groupEnd = timed(nccl_module.groupEnd, bucket, "exchange: NCCL groupEnd")
    patched = set()

    if comm.rank == 0:
        print(f"{'size':>5s} {'codec':>10s} {'wall/call':>10s} {'cpu/call':>9s}  host us per call by part")
    for log2 in (int(s) for s in args.sizes.split(",")):
        n = 1 << log2
        x = gradient_like_xp(cp, n, comm.rank, dtype=dq.backend.BFLOAT16)
        out = cp.empty_like(x)
        for spelling in args.codecs.split(","):
            codec = codec_from_string(spelling)
            for _ in range(3):
                coll.allreduce(x, codec=codec, out=out)
            for t in coll._nccl.values():
                if id(t) not in patched:
                    patched.add(id(t))
                    t.answer = timed(t.answer, bucket, lambda r: type(r).__name__.lower())
            cp.cuda.get_current_stream().synchronize()
            comm.Barrier()
            bucket.clear()
            walls, cpus, host = [], [], 0.0
            for _ in range(args.rounds):
                comm.Barrier()
                w0, c0 = time.perf_counter(), time.thread_time()
                for _ in range(args.calls):
                    coll.allreduce(x, codec=codec, out=out)
                c1, h1 = time.thread_time(), time.perf_counter()
                cp.cuda.get_current_stream().synchronize()
                w1 = time.perf_counter()
                walls.append(w1 - w0)
                cpus.append(c1 - c0)
                host += h1 - w0
            parts = dict(bucket)
            if args.pstats and comm.rank == 0:
                import cProfile
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.calls):
                    coll.allreduce(x, codec=codec, out=out)
                prof.disable()
                prof.dump_stats(f"{args.pstats}.{log2}.{spelling.replace(':', '_').replace('=', '-')}")
            elif args.pstats:
                for _ in range(args.calls):
                    coll.allreduce(x, codec=codec, out=out)
            cp.cuda.get_current_stream().synchronize()
            calls = args.calls * args.rounds
            wall, cpu = min(walls) / args.calls * 1e6, min(cpus) / args.calls * 1e6
            wall_median = float(np.median(walls)) / args.calls * 1e6
            # wrappers run inside the buckets above: shown, not subtracted twice
            accounted = sum(v for k, v in parts.items()
                            if k != "plan: device-to-host wait" and not k.startswith("_gpu."))
            accounted -= parts.get("exchange: NCCL groupEnd", 0.0)
            parts["rest (engine, launches, Python)"] = host - accounted
            if comm.rank == 0:
                detail = ", ".join(f"{k} {v / calls * 1e6:.0f}" for k, v in sorted(parts.items()))
                print(f"2^{log2:<3d} {spelling:>10s} {wall:10.0f} {cpu:9.0f}  (median wall "
                      f"{wall_median:.0f})  {detail}", flush=True)

    meta = {"error": None, "length": 1 << 23, "dtype": "bfloat16", "backend": "gpu",
            "codec": dq.DynamiQ().signature(), "topology": "ring", "op": "sum", "seed": 0,
            "counter": 7, "transport": "nccl", "tile_bytes": 1 << 25, "can": ("nccl", "mpi")}
    comm.Barrier()
    t = time.perf_counter()
    for _ in range(200):
        mpi_host.agree(comm, meta)
    t_agree = (time.perf_counter() - t) / 200 * 1e6
    t = time.perf_counter()
    for _ in range(200):
        pickle.dumps(meta, protocol=4)
    t_pickle = (time.perf_counter() - t) / 200 * 1e6
    a, b = np.zeros(1, np.int64), np.zeros(comm.size, np.int64)
    comm.Barrier()
    t = time.perf_counter()
    for _ in range(200):
        comm.Allgather(a, b)
    t_ag = (time.perf_counter() - t) / 200 * 1e6
    if comm.rank == 0:
        print(f"agreement alone {t_agree:.1f} us per call (pickle {t_pickle:.1f} us); "
              f"bare 8-byte Allgather {t_ag:.1f} us")
    coll.free()


if __name__ == "__main__":
    main()
