"""``python -m dynamiq_mpi bench``: the compressed all-reduce against the
uncompressed one, in the style of nccl-tests:

    mpiexec -n 2 python -m dynamiq_mpi bench -b 1M -e 1G -f 2 \\
        --codec dynamiq:5,bf16 --topology ring --transport nccl --json out.json

Per size (bytes of gradient-like data) a reference row (NCCL's own
all-reduce, or MPI's in float32 for host arrays), then a row per codec and
topology: wire bits per coordinate, time per call (mean of ``-n`` calls,
slowest rank), algbw, busbw, vNMSE against the float64 sum, #wrong (ranks
differing from rank 0), speed-up; ``--breakdown``: a profiled call per row.
"""
from __future__ import annotations

import datetime
import json
import platform
import sys
import time

import numpy as np

from .. import schedules
from ..backend import BFLOAT16
from ..call.paths import measuring_calls
from ..codecs.base import DEFAULT_TILE_BYTES
from ..settings import environment
from ..transports import TRANSPORTS

DTYPES = {"bf16": BFLOAT16, "bfloat16": BFLOAT16, "f32": np.dtype(np.float32),
          "float32": np.dtype(np.float32), "f16": np.dtype(np.float16)}
NCCL_ENV_PREFIXES = ("NCCL_", "DYNAMIQ_", "OMPI_MCA_hwloc")
# warm-up calls of a path="auto" row: past the calls that measure both paths
AUTO_CALLS = measuring_calls(True) + 1     # a replayed class measures longest


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * mult)


def sizes_from(args) -> list:
    if args.sizes:
        return [parse_size(s) for s in args.sizes.split(",")]
    lo, hi, f = parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor
    if f < 2:
        raise SystemExit("-f must be >= 2")
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= f
    return out


class _Device:
    """The benchmark's arrays: CuPy with an NCCL reference, or NumPy with an MPI one."""

    def __init__(self, comm, use_gpu: bool):
        self.comm = comm
        self.gpu = use_gpu
        if use_gpu:
            import cupy
            from cupy.cuda import nccl
            self.xp, self.nccl = cupy, nccl
            env = environment()
            local = int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", env.get("MPI_LOCALRANKID", comm.rank)))
            cupy.cuda.Device(local % cupy.cuda.runtime.getDeviceCount()).use()
            uid = comm.bcast(nccl.get_unique_id() if comm.rank == 0 else None)
            self.ref = nccl.NcclCommunicator(comm.size, uid, comm.rank)
            self.name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
            self.name = self.name.decode() if isinstance(self.name, bytes) else self.name
        else:
            self.xp, self.ref = np, None
            self.name = f"CPU ({platform.processor() or platform.machine()})"

    def sync(self):
        if self.gpu:
            self.xp.cuda.get_current_stream().synchronize()

    def _nccl_type(self, dtype):
        n = self.nccl
        return {np.dtype(np.float32): n.NCCL_FLOAT32, BFLOAT16: n.NCCL_BFLOAT16,
                np.dtype(np.float16): n.NCCL_FLOAT16, np.dtype(np.float64): n.NCCL_FLOAT64}[dtype]

    def reference_allreduce(self, x, out):
        """The uncompressed all-reduce of the same data: NCCL's own (same
        dtype) on the GPU, MPI's on the host (float32; BF16 is summed as float32)."""
        if self.gpu:
            stream = self.xp.cuda.get_current_stream()
            self.ref.allReduce(x.data.ptr, out.data.ptr, x.size, self._nccl_type(x.dtype),
                               self.nccl.NCCL_SUM, stream.ptr)
        else:
            from mpi4py import MPI
            if x.dtype == np.float32:
                self.comm.Allreduce(x, out, op=MPI.SUM)
            else:
                tmp = np.empty(x.size, np.float32)
                self.comm.Allreduce(x.astype(np.float32), tmp, op=MPI.SUM)
                out[...] = tmp.astype(out.dtype)

    def exact_sum(self, x):
        x64 = x.astype(np.float64)
        out = self.xp.empty_like(x64)
        if self.gpu:
            stream = self.xp.cuda.get_current_stream()
            self.ref.allReduce(x64.data.ptr, out.data.ptr, x64.size, self.nccl.NCCL_FLOAT64,
                               self.nccl.NCCL_SUM, stream.ptr)
        else:
            from mpi4py import MPI
            self.comm.Allreduce(x64, out, op=MPI.SUM)
        return out

    def count_wrong(self, out):
        """Ranks whose result differs (in bytes) from rank 0's."""
        mine = out.view(np.uint8)
        first = mine.copy()
        if self.gpu:
            stream = self.xp.cuda.get_current_stream()
            self.ref.bcast(first.data.ptr, first.size, self.nccl.NCCL_UINT8, 0, stream.ptr)
            same = bool(self.xp.array_equal(first, mine))
        else:
            self.comm.Bcast(first, root=0)
            same = bool(np.array_equal(first, mine))
        return self.comm.allreduce(0 if same else 1)

    def vnmse(self, out, exact, norm):
        d = out.astype(np.float64) - exact
        return float(self.xp.sum(d * d)) / norm if norm > 0 else 0.0


def _codec_call(coll, x, codec, topo, seed, out, path, hierarchy):
    def call():
        coll.allreduce(x, codec=codec, topology=topo, seed=seed, out=out, path=path,
                       hierarchy=hierarchy)
    return call


def _row_paths(codec, paths):
    """The paths a codec's rows run: every one asked for codecs that
    path="auto" may hand to the native all-reduce, else the compressed one."""
    return paths if getattr(codec, "auto_path", False) else ["compressed"]


def _time(fn, dev, comm, warmup, iters):
    from mpi4py import MPI
    for _ in range(warmup):
        fn()
    dev.sync()
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    dev.sync()
    return comm.allreduce((time.perf_counter() - t0) / iters, op=MPI.MAX)


def _progress(rank, text):
    if rank == 0:
        print(text, file=sys.stderr, flush=True)


def run(args) -> list:
    from mpi4py import MPI

    from .. import codecs as codec_mod
    from ..api import Collective
    from .gradients import gradient_like_xp

    comm = MPI.COMM_WORLD
    n, rank = comm.size, comm.rank
    use_gpu = args.array == "cupy" or (args.array == "auto" and _has_cuda())
    dev = _Device(comm, use_gpu)
    dtype = DTYPES[args.dtype]
    codecs = [(s, codec_mod.codec_from_string(s)) for s in args.codec.split(",") if s]
    topologies = [t for t in args.topology.split(",") if t]
    paths = [p for p in args.paths.split(",") if p]
    hierarchies = [h for h in args.hierarchy.split(",") if h]
    bad = [h for h in hierarchies if h not in ("flat", "nodes", "auto")]
    if bad:
        raise SystemExit(f"--hierarchy takes flat, nodes, auto; got {bad}")
    bad = [p for p in paths if p not in ("auto", "compressed", "native")]
    if bad:
        raise SystemExit(f"--paths takes auto, compressed, native; got {bad}")
    tile_bytes = parse_size(args.tile_bytes) if args.tile_bytes else DEFAULT_TILE_BYTES
    coll = Collective(comm, transport=args.transport, tile_bytes=tile_bytes,
                      lanes=args.lanes, node_size=args.node_size)
    sizes = sizes_from(args)
    total = len(sizes) * (sum(len(_row_paths(c, paths)) for _, c in codecs) * len(topologies)
                          * len(hierarchies) + (0 if args.no_reference else 1))
    done = 0
    rows = []
    ref_name = "nccl" if use_gpu else "mpi"
    for size in sizes:
        count = max(1, size // dtype.itemsize)
        x = gradient_like_xp(dev.xp, count, rank, seed=args.seed, dtype=dtype)
        exact = dev.exact_sum(x)
        norm = float(dev.xp.sum(exact * exact))
        out = dev.xp.empty_like(x)
        base = dict(size=count * dtype.itemsize, count=count, dtype=args.dtype, ranks=n)
        # timed in `rounds` alternating rounds, so a drifting link weighs on all alike
        runs = [] if args.no_reference else [("ref", lambda: dev.reference_allreduce(x, out))]
        for label, codec in codecs:
            for topo in topologies:
                for path in _row_paths(codec, paths):
                    for hier in hierarchies:
                        if topo == "butterfly" and n & (n - 1) and hier == "flat":
                            done += 1
                            continue
                        runs.append(((label, topo, path, hier), _codec_call(
                            coll, x, codec, topo, args.seed, out, path, hier)))
        times = {key: 0.0 for key, _ in runs}
        for key, fn in runs:
            # path="auto" measures both paths on its first calls: warm it up past them
            auto = key != "ref" and "auto" in key[2:]
            for _ in range(max(args.warmup, AUTO_CALLS if auto else 0)):
                fn()
        for _ in range(args.rounds):
            for key, fn in runs:
                times[key] += _time(fn, dev, comm, 0, args.iters) / args.rounds
        ref_time = times.get("ref")
        if ref_time is not None:
            dev.reference_allreduce(x, out)
            dev.sync()
            rows.append(dict(base, codec=f"{ref_name} all-reduce", bits=8.0 * dtype.itemsize,
                             topology="-", transport=ref_name, time_us=ref_time * 1e6,
                             vnmse=dev.vnmse(out, exact, norm), wrong=dev.count_wrong(out),
                             speedup=1.0))
            done += 1
            _progress(rank, f"[{done}/{total}] {count} {args.dtype} {ref_name} all-reduce: "
                            f"{ref_time * 1e6:.1f} us")
        for label, codec in codecs:
            for topo, path, hier in [(t, p, h) for t in topologies
                                     for p in _row_paths(codec, paths) for h in hierarchies]:
                if (label, topo, path, hier) not in times:
                    continue
                t = times[(label, topo, path, hier)]
                _, rep = coll.allreduce(x, codec=codec, topology=topo, seed=args.seed, out=out,
                                        return_report=True, path=path, hierarchy=hier,
                                        profile=args.breakdown and hier == "flat")
                dev.sync()
                row = dict(base, codec=label, bits=rep.bits_per_coord, topology=topo,
                           hierarchy=rep.hierarchy, levels=rep.levels,
                           path=path, ran=rep.path, path_reason=rep.path_reason,
                           transport=rep.transport, time_us=t * 1e6,
                           vnmse=dev.vnmse(out, exact, norm), wrong=dev.count_wrong(out),
                           speedup=(ref_time / t) if ref_time else None,
                           tiles_per_chunk=rep.tiles_per_chunk, gather=rep.gather,
                           fallback=rep.codec_info.get("fallback", ""),
                           widths=rep.codec_info.get("widths"),
                           array_code=bool(use_gpu and not codec.fused_gpu),
                           transport_reason=rep.transport_reason)
                if args.breakdown and rep.phases:
                    row["phases_us"] = {k: v * 1e6 for k, v in rep.phases.items()
                                        if k != "timeline"}
                    if "timeline" in rep.phases:
                        row["timeline_ms"] = rep.phases["timeline"]
                rows.append(row)
                done += 1
                _progress(rank, f"[{done}/{total}] {count} {args.dtype} {label} {topo} "
                                f"{rep.hierarchy} {path}"
                                f"{'->' + rep.path if path == 'auto' else ''} "
                                f"{rep.transport}: {t * 1e6:.1f} us, {rep.bits_per_coord:.3f} bits")
        del x, exact, out
    for r in rows:
        r["algbw"] = r["size"] / (r["time_us"] * 1e-6) / 1e9
        r["busbw"] = r["algbw"] * (2.0 * (n - 1) / n if n > 1 else 1.0)
    if rank == 0:
        print_table(rows, n, dev.name, args)
        if args.json:
            meta = dict(command=" ".join(sys.argv), ranks=n, device=dev.name,
                        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        env={k: v for k, v in environment().items() if k.startswith(NCCL_ENV_PREFIXES)},
                        python=platform.python_version(), args=vars(args),
                        # CUDA graphs of steady compressed calls ($DYNAMIQ_GRAPHS)
                        graphs=coll.graphs, graph_stats=coll.graph_stats(),
                        # up to how many ranks and bytes the statistics travel directly
                        stats_direct_ranks=schedules.STATS_DIRECT_RANKS,
                        stats_direct_bytes=schedules.STATS_DIRECT_BYTES,
                        # the all-gather's schedule ($DYNAMIQ_GATHER)
                        gather=coll.gather)
            with open(args.json, "w") as f:
                json.dump(dict(meta=meta, rows=rows), f, indent=1, default=_jsonable)
    coll.free()
    return rows


def _jsonable(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    return str(o)


def _has_cuda():
    from ..cuda import has_cuda
    return has_cuda()


def print_table(rows, n, device, args):
    env = {k: v for k, v in environment().items() if k.startswith("NCCL_")}
    print(f"# dynamiq-mpi bench: {n} ranks, {device}, {args.dtype}, "
          f"{args.iters} timed calls after {args.warmup} warm-up, slowest rank")
    if env:
        print("# NCCL environment: " + " ".join(f"{k}={v}" for k, v in sorted(env.items())))
    print(f"#{'size':>11s} {'count':>11s} {'type':>5s} {'codec':>18s} {'bits':>6s} {'topo':>15s} "
          f"{'path':>17s} {'transport':>9s} {'time(us)':>10s} {'algbw':>7s} {'busbw':>7s} "
          f"{'vNMSE':>9s} {'#wrong':>6s} {'speedup':>7s}")
    for r in rows:
        sp = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
        note = "  (BF16 fallback)" if r.get("fallback") and r.get("ran") != "native" else ""
        if r.get("array_code"):
            note += "  (array code: time not representative)"
        path = r.get("path", "-")
        if path == "auto":
            path = f"auto->{r.get('ran')}"
        topo = r["topology"] + ("/nodes" if r.get("hierarchy") == "nodes" else "")
        print(f" {r['size']:>11d} {r['count']:>11d} {r['dtype']:>5s} {r['codec']:>18s} "
              f"{r['bits']:6.2f} {topo:>15s} {path:>17s} {r['transport']:>9s} "
              f"{r['time_us']:10.1f} {r['algbw']:7.2f} {r['busbw']:7.2f} {r['vnmse']:9.2e} "
              f"{r['wrong']:>6d} {sp:>7s}{note}")
    wrong = sum(r["wrong"] for r in rows)
    print(f"# out of bounds values (#wrong total): {wrong}")
    chosen = [(r["count"], r["codec"], r["path_reason"]) for r in rows if r.get("path") == "auto"]
    for count, codec, why in chosen:
        print(f"# path of {codec} at {count} elements: {why}")
    reasons = sorted({r["transport_reason"] for r in rows if r.get("transport_reason")})
    if reasons:
        print("# transport: " + " | ".join(reasons))
    if args.breakdown:
        print("# breakdown of one profiled call per row (us; phases serialised; kernels / wire / "
              "idle inside the data phases)")
        keys = ["agreement", "statistics", "plan", "reduce-scatter", "all-gather", "finish"]
        print(f"#{'count':>11s} {'codec':>18s} {'topo':>9s} " + " ".join(f"{k:>14s}" for k in keys)
              + f" {'kernels':>9s} {'wire':>9s} {'idle':>9s}")
        for r in rows:
            ph = r.get("phases_us")
            if not ph:
                continue
            data = ph.get("reduce-scatter", 0) + ph.get("all-gather", 0)
            busy = ph.get("kernels_or_wire")
            idle = f"{data - busy:9.1f}" if busy is not None else f"{'-':>9s}"
            kern = ph.get("kernels")
            wire = ph.get("wire")
            print(f" {r['count']:>11d} {r['codec']:>18s} {r['topology']:>9s} "
                  + " ".join(f"{ph.get(k, 0.0):14.1f}" for k in keys)
                  + (f" {kern:9.1f} {wire:9.1f} {idle}" if kern is not None else ""))


def add_arguments(p):
    p.add_argument("-b", "--minbytes", default="1M", help="smallest size in bytes (K/M/G)")
    p.add_argument("-e", "--maxbytes", default="64M", help="largest size in bytes")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="size multiplier")
    p.add_argument("--sizes", default=None, help="explicit comma-separated sizes (overrides -b/-e/-f)")
    p.add_argument("--codec", default="dynamiq:5,bf16",
                   help="comma-separated codecs: dynamiq[:bits[:field=value...]], bf16, exact, "
                        "mxfp:e4m3 (e5m2, e3m2, e2m3, e2m1), thc, omnireduce[:density]")
    p.add_argument("--topology", default="ring", help="ring,butterfly")
    p.add_argument("--paths", default="compressed,native,auto",
                   help="rows per codec that path='auto' may hand to the native all-reduce: "
                        "compressed, native (the transport's own all-reduce), auto (the "
                        "library's choice, measured on its first calls)")
    p.add_argument("--transport", default="auto", choices=list(TRANSPORTS),
                   help="auto: NCCL, else CUDA-aware MPI (mpi-cuda), else host-staged MPI")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--array", default="auto", choices=["auto", "cupy", "numpy"],
                   help="device (CuPy) or host (NumPy) arrays; auto: CuPy when the CUDA path works")
    p.add_argument("-n", "--iters", type=int, default=10)
    p.add_argument("-w", "--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="time the reference and the codecs in this many alternating rounds of "
                        "--iters calls each (reported: the mean), so link drift hits all alike")
    p.add_argument("--tile-bytes", default=None,
                   help="compressed bytes per message (default: the library's, 32M)")
    p.add_argument("--lanes", default=None,
                   help="NCCL communicators per message: a count or auto (default: "
                        "$DYNAMIQ_NCCL_LANES, else auto)")
    p.add_argument("--hierarchy", default="flat",
                   help="flat,nodes,auto: rows per hierarchy (nodes: uncompressed inside a "
                        "node, --transport and the codec on the rails; docs/design.md)")
    p.add_argument("--node-size", type=int, default=None,
                   help="consecutive ranks form nodes of this size (default: "
                        "$DYNAMIQ_NODE_SIZE, else the ranks sharing a host)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-reference", action="store_true", help="skip the uncompressed reference row")
    p.add_argument("--breakdown", action="store_true", help="time per phase (one profiled call per row)")
    p.add_argument("--json", default=None, help="write rows and metadata as JSON")
