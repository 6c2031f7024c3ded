"""Host time of an all-reduce call, four probes in one tool (one subcommand each;
under mpiexec rank 0 prints):

    mpiexec -n 2 python tools/profiling/host_time.py cost --sizes 20,23,27 --codecs bf16,dynamiq:5
    mpiexec -n 2 python tools/profiling/host_time.py floor --json floor.json
    python tools/profiling/host_time.py launch
    mpiexec -n 2 python tools/profiling/host_time.py profile --sizes 23,27

cost     where the host time of back-to-back GPU all-reduce calls goes, by part
         (NCCL, one GPU per rank)
floor    host time per call on host (NumPy) arrays against MPI's own all-reduce
         (no GPU; also over torch.distributed, or under torchrun)
launch   host cost of the pieces a GPU call is made of (one GPU, no MPI)
profile  device time of the statistics kernel and the planner, and a cProfile of
         the host side of back-to-back DynamiQ calls over NCCL

`host_time.py SUBCOMMAND --help` says what each one measures and takes.  CuPy,
NCCL and MPI are imported inside the subcommands, so --help needs none of them.
"""
import argparse
import os
import statistics
import time

import numpy as np


# ---------------------------------------------------------------- shared pieces

def log2_sizes(text):
    """"20,23,27" -> [20, 23, 27] (log2 of element counts)."""
    return [int(s) for s in text.split(",")]


def use_gpu(cp, comm, local=True):
    """One GPU per rank: that of the node-local rank (Open MPI's
    OMPI_COMM_WORLD_LOCAL_RANK, else the rank), or with local=False the rank's."""
    index = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", comm.rank)) if local else comm.rank
    cp.cuda.Device(index % cp.cuda.runtime.getDeviceCount()).use()


def per_call_us(fn, calls, rounds, warmup=1, barrier=None):
    """Microseconds per call of fn: the median of `rounds` loops of `calls`
    calls, after `warmup` calls; `barrier` (if any) runs before each loop."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        if barrier is not None:
            barrier()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times)


def event_ms(cp, fn, reps=20):
    """Device time of fn in ms: CUDA events around each of `reps` calls (after
    one warm-up), median."""
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


def _doc(fn):
    return fn.__doc__.strip("\n")


# ---------------------------------------------------------------- cost

def timed(fn, bucket, key):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            bucket[key(*a, **k) if callable(key) else key] += time.perf_counter() - t
    return wrapper


def cost(args):
    """Where the host time of back-to-back GPU all-reduce calls goes (run under
mpiexec, one rank per GPU; rank 0 prints).

    mpiexec -n 2 python tools/profiling/host_time.py cost --sizes 20,23,27 --codecs bf16,dynamiq:5

Per (size, codec): wall time per call over a loop of back-to-back calls
(one synchronisation at the end), the main thread's CPU time per call, and
that host time split by what the engine asked for: the agreement (MPI), the
transport's exchanges, claims and marks, the codec's local statistics and
plan (the plan's one device-to-host copy, which waits for the device, shown
apart), and the rest (engine, codec kernels' launches, Python). Then the
agreement alone and a bare 8-byte MPI Allgather, for scale.
"""
    import pickle
    from collections import defaultdict

    from mpi4py import MPI
    import cupy as cp

    import dynamiq_mpi as dq
    from dynamiq_mpi import backend as backend_mod
    from dynamiq_mpi.codecs import codec_from_string
    from dynamiq_mpi.bench.gradients import gradient_like_xp
    from dynamiq_mpi.control.agreement import agree

    comm = MPI.COMM_WORLD
    use_gpu(cp, comm)
    coll = dq.Collective(comm, transport="nccl")
    bucket = defaultdict(float)
    # what the engine asks the transports for, by request type
    coll._runtime.host.answer = timed(coll._runtime.host.answer, bucket, lambda r: "agree (MPI)")
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
    for log2 in log2_sizes(args.sizes):
        n = 1 << log2
        x = gradient_like_xp(cp, n, comm.rank, dtype=dq.backend.BFLOAT16)
        out = cp.empty_like(x)
        for spelling in args.codecs.split(","):
            codec = codec_from_string(spelling)
            for _ in range(3):
                coll.allreduce(x, codec=codec, out=out)
            for t in coll._runtime.nccl.values():
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
        agree(comm, meta)
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


# ---------------------------------------------------------------- floor

class _TorchWorld:
    """What `floor` asks of MPI.COMM_WORLD, from torch.distributed (torchrun)."""

    def __init__(self):
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo")
        self.torch, self.dist = torch, dist
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def Barrier(self):
        self.dist.barrier()

    def allreduce(self, value, op=None):
        t = self.torch.tensor([float(value)], dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t[0])


def _world():
    if "WORLD_SIZE" in os.environ and not any(v in os.environ for v in (
            "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")):
        return _TorchWorld(), None
    from mpi4py import MPI
    return MPI.COMM_WORLD, MPI


def floor(args):
    """Host time per call of the library's paths on host (NumPy) arrays, against
MPI's own all-reduce of the same array (run under mpiexec; rank 0 prints and
writes JSON).  The Python of a steady call is the same whatever the arrays,
so this measures, without a GPU, the floor a call adds to the transport's
own all-reduce.

    mpiexec -n 2 python tools/profiling/host_time.py floor --json floor.json

Rows: MPI_Allreduce alone; the control plane's digest exchange alone (the
agreement of a steady call); ``path="native"`` (a steady call: one digest
exchange and the all-reduce); the default ``path="auto"`` (its class decided
native); ``path="compressed"`` with DynamiQ at 5 bits (small_input=0: the
codec's CPU kernels included).  Median of --rounds rounds of --calls calls.
``--planes mpi,torch`` adds the same rows over the torch control plane
(torch.distributed started from MPI with gloo; the collective over its
default group): gloo's all-reduce alone, then the library's calls.  Under
torchrun (no MPI in the job) it measures the torch plane alone:

    torchrun --nproc_per_node 2 tools/profiling/host_time.py floor --planes torch
"""
    import json

    import dynamiq_mpi as dq

    comm, MPI = _world()
    x = np.random.default_rng(comm.rank).standard_normal(1 << args.log2n).astype(np.float32)
    out = np.empty_like(x)
    codec = dq.DynamiQ(bits=5, small_input=0)
    colls, cases = [], []
    for plane in args.planes.split(","):
        if plane == "torch":
            import torch
            import dynamiq_mpi.torch as dqt
            if MPI is not None:
                dqt.init_process_group_from_mpi("gloo")
            group = torch.distributed.group.WORLD
            xt = torch.from_numpy(x.copy())
            cases.append(("gloo all_reduce", lambda: torch.distributed.all_reduce(xt)))
            coll = dq.Collective(group)
        else:
            cases.append(("MPI_Allreduce", lambda: comm.Allreduce(x, out)))
            coll = dq.Collective(comm)
        colls.append(coll)
        tag = f" [{plane}]"
        digest, digests = np.ones(1, np.uint64), np.empty(comm.size, np.uint64)
        cases.append(("agreement: 8-byte digest all-gather" + tag,
                      lambda p=coll._runtime.plane: p.allgather_array(digest, digests)))
        cases += [
            ("dq path=native (steady)" + tag, lambda c=coll: c.allreduce(x, out=out,
                                                                         path="native")),
            ("dq path=auto (decided)" + tag, lambda c=coll: c.allreduce(x, out=out, path="auto")),
            ("dq path=compressed, DynamiQ 5 bits" + tag, lambda c=coll: c.allreduce(
                x, codec=codec, out=out, path="compressed")),
        ]
    rows = []
    for name, fn in cases:
        calls = args.calls if "compressed" not in name else max(50, args.calls // 10)
        us = comm.allreduce(per_call_us(fn, calls, args.rounds, warmup=max(10, calls // 10),
                                        barrier=comm.Barrier),
                            op=None if MPI is None else MPI.MAX)
        rows.append({"case": name, "us_per_call": us})
    if comm.rank == 0:
        print(f"# host time per call, {comm.size} ranks, 2^{args.log2n} float32 "
              f"(slowest rank, median of {args.rounds} rounds)")
        for r in rows:
            print(f"  {r['case']:<46s} {r['us_per_call']:8.1f} us")
        if args.json:
            meta = {"ranks": comm.size, "log2n": args.log2n, "launcher": "torchrun" if MPI is None
                    else MPI.Get_library_version().splitlines()[0],
                    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    for coll in colls:
        coll.free()


# ---------------------------------------------------------------- launch

def launch(args):
    """Host cost of the pieces a GPU all-reduce call is made of (one GPU, no MPI):
the kernel wrappers of ``dynamiq_mpi._gpu`` on tiny inputs (so the launch, not
the kernel, is timed), CuPy slicing, views and events, and the plan's
device-to-host copy.  Microseconds per call, median of 5 runs of 2000 calls.

    python tools/profiling/host_time.py launch
"""
    import cupy as cp

    from dynamiq_mpi import _gpu
    from dynamiq_mpi.codecs.levels import build_tables

    def params_of(width, eps, keys=(1, 2)):
        t = build_tables(width, eps)
        return np.frombuffer(_gpu.make_params(width, True, True, 2, 1, *keys, t.mag, t.inv_gap,
                                              t.level, t.lut, 0), dtype=np.uint8)

    params = params_of(4, 0.20)
    # A call launches its kernels for widths 2, 4 and 8 in turn, with keys of
    # its own: what the kernels' host-side parameter cache sees.
    by_width = [params_of(w, e) for w, e in ((2, 0.27), (4, 0.20), (8, 0.08))]
    turn = [0]

    def compress_widths_in_turn():
        k = turn[0] % 3
        turn[0] += 1
        _gpu.compress(by_width[k], src, 1, 0, 0, width_pieces[k])

    new_keys = [0]

    def compress_new_keys():
        new_keys[0] += 1
        p = params.copy()
        p[24:32].view(np.uint32)[:] = (new_keys[0], 7)
        _gpu.compress(p, src, 1, 0, 0, piece)
    x = cp.ones(256 * 8, dtype=cp.float32)
    order = cp.arange(8, dtype=cp.int64)
    mean = cp.zeros(8, dtype=cp.float32)
    src = _gpu.Source(x, order, 0, mean)
    wire = cp.zeros(1 << 20, dtype=cp.uint8)
    nb = _gpu.run_bytes(1, 4, True)
    piece = wire[:nb]
    width_pieces = [wire[:_gpu.run_bytes(1, w, True)] for w in (2, 4, 8)]
    out = cp.zeros(256 * 8, dtype=cp.float32)
    stream = cp.cuda.get_current_stream()
    header = cp.zeros(10, dtype=cp.float64)
    rows = [
        ("_gpu.compress (1 super-group)", lambda: _gpu.compress(params, src, 1, 0, 0, piece)),
        ("_gpu.compress, widths 2/4/8 in turn", compress_widths_in_turn),
        ("_gpu.compress, new keys each call (+ copy)", compress_new_keys),
        ("_gpu.dar (1 super-group)", lambda: _gpu.dar(params, piece, src, 1, 0, 1, piece)),
        ("_gpu.decompress_out (1 super-group)",
         lambda: _gpu.decompress_out(params, piece, 1, 0, order, mean, 1.0, out)),
        ("_gpu.Source(x, order, 0, mean)", lambda: _gpu.Source(x, order, 0, mean)),
        ("cupy slice wire[a:b]", lambda: wire[64:64 + nb]),
        ("cupy view(dtype) of a slice", lambda: wire[:4096].view(cp.float32)),
        ("cupy Event() + record", lambda: cp.cuda.Event(block=False, disable_timing=True).record(stream)),
        ("cupy get_current_stream()", lambda: cp.cuda.get_current_stream()),
        ("header.get() (device-to-host, 80 bytes)", lambda: header.get()),
        ("numpy blob.copy() + key write", lambda: params.copy()[24:32].view(np.uint32).__setitem__(slice(None), (1, 2))),
        ("empty Python call", lambda: None),
    ]
    print(f"{'operation':44s} {'us per call':>11s}")
    for name, fn in rows:
        stream.synchronize()
        print(f"{name:44s} {per_call_us(fn, 2000, 5):11.2f}", flush=True)
        stream.synchronize()


# ---------------------------------------------------------------- profile

def profile(args):
    """Where the time of one GPU all-reduce goes (run under mpiexec, one rank per GPU).

1. device time of the statistics kernel and of the planner (CUDA events,
   median of 20 runs) at the given sizes;
2. a cProfile of the host side of back-to-back DynamiQ calls over NCCL
   (rank 0 prints the top functions by own time).

    mpiexec -n 2 python tools/profiling/host_time.py profile --sizes 23,27
"""
    import cProfile
    import io
    import pstats

    from mpi4py import MPI
    import cupy as cp

    import dynamiq_mpi as dq
    from dynamiq_mpi import _gpu
    from dynamiq_mpi.codecs.allocation import record_bits
    from dynamiq_mpi.bench.gradients import gradient_like_xp

    comm = MPI.COMM_WORLD
    use_gpu(cp, comm)
    coll = dq.Collective(comm, transport="nccl")
    for log2 in log2_sizes(args.sizes):
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


# ---------------------------------------------------------------- command line

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", metavar="SUBCOMMAND", required=True)

    def command(fn, help):
        p = sub.add_parser(fn.__name__, help=help, description=_doc(fn),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(run=fn)
        return p

    p = command(cost, "where the host time of back-to-back GPU calls goes, by part")
    p.add_argument("--sizes", default="20,23,27", help="log2 of element counts")
    p.add_argument("--codecs", default="bf16,dynamiq:5")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--rounds", type=int, default=1,
                   help="timed loops per (size, codec): wall/call is their minimum (the host "
                        "of a lent machine is noisy), the parts are averaged over all of them")
    p.add_argument("--by-kernel", action="store_true",
                   help="also bucket the host time of each compiled wrapper of dynamiq_mpi._gpu "
                        "(cProfile cannot see inside Cython)")
    p.add_argument("--pstats", default=None,
                   help="also write a cProfile of each (size, codec) loop to PSTATS.<log2>.<codec>")

    p = command(floor, "host time per call on host (NumPy) arrays against MPI's all-reduce")
    p.add_argument("--log2n", type=int, default=10, help="float32 elements per call: 2^N")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json")
    p.add_argument("--planes", default="mpi", help="mpi, torch or mpi,torch")

    command(launch, "host cost of kernel launches and CuPy pieces (one GPU, no MPI)")

    p = command(profile, "device time of statistics and planner, cProfile of the host side")
    p.add_argument("--sizes", default="23,27", help="log2 of element counts")
    p.add_argument("--calls", type=int, default=20)

    args = ap.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
