"""Step time of a LLaMA under DDP or FSDP2 with each way of reducing its
gradients, the configurations alternating in rounds inside one job (a
loopback socket link drifts by up to 2x over minutes: only ratios from one
job count).

    torchrun --nproc_per_node 2 mpi_examples/lm_bench.py --preset 0.8b --json ddp.json
    torchrun --nproc_per_node 2 mpi_examples/lm_bench.py --preset 0.8b --fsdp --json fsdp.json
    mpiexec -n 2 python mpi_examples/lm_bench.py --tiny          # CPU, gloo

DDP (``gradient_as_bucket_view=True``, BF16 autocast, AdamW), at every
``--bucket-caps`` (``default``: DDP's own 25 MB; then 100 and 400 MB):

* ``fp32``: plain DDP (its float32 all-reduce);
* ``bf16``: torch's one-line ``bf16_compress_hook``;
* ``ours``: ``dynamiq_mpi.torch.register_comm_hook`` with the library's
  defaults (DynamiQ 5 bits, ``path="auto"``: plain, BF16 or compressed
  chosen by timing whole steps; its measuring steps are warm-up here);
* ``fp32-hook``: torch's ``allreduce_hook``, plain DDP's all-reduce made from
  a Python comm hook (what any Python hook costs); ``ours:plain``,
  ``ours:native``, ``ours:compressed``: our hook held on one path.

FSDP2 (``--fsdp``; ``fully_shard`` per decoder layer, BF16 parameters):
``fp32`` (``reduce_dtype=float32``), ``bf16`` (``reduce_dtype=bfloat16``)
and ``ours`` (``dqt.ReduceScatter()``, float32 reduce buffers).

For every configuration: the median step time (slowest rank), the
compute-only step (forward and backward again without communication, under
``no_sync``, plus the optimiser step; the median of every probe of the job,
at least 20), the exposed communication (step minus compute; also at the
probes' 25th and 75th percentiles), tokens/s, and the ratios to ``fp32`` and
``bf16`` at the same bucket cap.  The JSON keeps every step's time and our
hook's calls, buckets, paths and bits, and its path decisions.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_lm  # noqa: E402  (the training example beside this file)

CONFIGS = ("fp32", "bf16", "ours")
OURS_GRAPHS = {"ours:eager": False, "ours:graphs": True}     # our hook, graphs forced
OURS_PATHS = {"ours:plain": "plain", "ours:native": "native", "ours:compressed": "compressed"}
TORCH_HOOKS = ("fp32-hook",)    # torch's allreduce_hook: the cost of any Python comm hook
BASELINES = ("fp32", "bf16") + TORCH_HOOKS


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", choices=sorted(train_lm.PRESETS), default="0.8b")
    p.add_argument("--tiny", action="store_true", help="--preset tiny (CPU tests)")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 instead of DDP")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="fp32, bf16, ours (our hook: HookState(reports=False), CUDA "
                        "graphs on as by default), ours:FUSE_MB (fusing FUSE_MB), "
                        "ours:eager (graphs=False), ours:graphs (graphs=True), ours:plain / "
                        "ours:native / ours:compressed (our hook held on one path), fp32-hook "
                        "(torch's allreduce_hook: plain DDP through a Python hook), or any "
                        "train_lm codec (dynamiq:4, ...)")
    p.add_argument("--bucket-caps", default="default,100,400",
                   help="DDP bucket_cap_mb values ('default': DDP's own)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="timed steps a configuration a round")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps a configuration a round (more in the first: the "
                        "library's path measurement)")
    p.add_argument("--min-probes", type=int, default=20, help="compute-only probes in all")
    p.add_argument("--auto-rounds", type=int, default=None,
                   help="our hook's timed rounds of path='auto' (default the library's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--profile", action="store_true",
                   help="after the rounds, one steady step of each configuration under "
                        "torch.profiler: GPU busy time by kind (NCCL, codec kernels, other), "
                        "the compute stream's idle time split by what the other streams "
                        "run meanwhile, and the host time of the step's named ranges "
                        "(FSDP2's post_backward_reduce: its reduce-scatter calls)")
    p.add_argument("--json", help="write the results here (rank 0)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.tiny:
        args.preset = "tiny"
    shape = ("hidden", "layers", "heads", "intermediate", "seq_len", "batch", "lr")
    for k in shape:         # the model and batch of the preset; the run's length is ours
        setattr(args, k, train_lm.PRESETS[args.preset][k])
    args.tiny = args.preset == "tiny"
    # train_lm.ddp_model's settings of our hook for other codecs: the library's defaults
    args.transport, args.topology, args.path, args.fuse_mb = "auto", "ring", None, None
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    caps = [c.strip() for c in args.bucket_caps.split(",") if c.strip()]
    args.bucket_caps = [None] if args.fsdp else [None if c == "default" else float(c)
                                                 for c in caps]
    for c in args.configs:
        if c in TORCH_HOOKS and args.fsdp:
            raise SystemExit(f"lm_bench: {c} is a DDP comm hook (not with --fsdp)")
        if c.startswith("ours:") and c not in OURS_GRAPHS and c not in OURS_PATHS:
            if args.fsdp:
                raise SystemExit(f"lm_bench: {c}: FSDP2 fuses nothing (ours:eager, ours:graphs "
                                 f"and ours:PATH apply)")
            float(c[5:])
        elif c != "ours" and c not in OURS_GRAPHS and c not in OURS_PATHS and c not in TORCH_HOOKS:
            train_lm.resolve_codec(c)     # a bad name fails before any set-up
    if args.rounds < 1 or args.steps < 1:
        raise SystemExit("lm_bench: --rounds and --steps must be >= 1")
    return args


class Config:
    """One configuration: its model wrapper, state, optimiser and timings."""

    def __init__(self, codec, cap):
        self.codec, self.cap = codec, cap
        self.name = codec if cap is None else f"{codec} @{cap:g}MB"
        self.state = None       # our HookState / ReduceScatter (kept across rounds)
        self.model = self.opt = None
        self.step_ms, self.update_ms, self.hook = [], [], []
        self.comm_hook = None   # the DDP comm hook's name, as DDP logs it


def _cap_label(cap, mode):
    if mode == "fsdp":
        return "-"
    return "DDP default (25)" if cap is None else f"{cap:g}"


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch
    import torch.distributed as dist

    import dynamiq_mpi as dq
    import dynamiq_mpi.torch as dqt
    from research.corpus import load_corpus
    from research.workloads import build_model, rank_batch

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    owns_group = not dist.is_initialized()
    rank, world, device = train_lm.init_distributed(use_cuda)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    train_b, _, corpus = load_corpus()
    data = torch.frombuffer(bytearray(train_b), dtype=torch.uint8)

    configs = [Config(c, cap) for cap in args.bucket_caps for c in args.configs]
    shared = None if args.fsdp else build_model(args, device)
    if shared is not None:
        shared_opt = torch.optim.AdamW(shared.parameters(), lr=args.lr, betas=(0.9, 0.95))
    for cfg in configs:
        if args.fsdp:
            cfg.model, cfg.state = _fsdp(build_model(args, device), cfg.codec, args, dqt, torch)
            cfg.opt = torch.optim.AdamW(cfg.model.parameters(), lr=args.lr, betas=(0.9, 0.95))
        else:
            cfg.opt = shared_opt
    n_params = sum(p.numel() for p in (shared if shared is not None
                                       else configs[0].model).parameters())
    probes_each = max(1, math.ceil(args.min_probes / (args.rounds * len(configs))))
    probes, step_no = [], [0]

    def one_step(model, opt, cfg, timed):
        w = rank_batch(step_no[0], rank, world, data, args).to(device, non_blocking=True)
        step_no[0] += 1
        loss, t0, t1, t2 = train_lm.train_step(model, opt, w, device, torch, sync)
        stats = cfg.state.pop_stats() if cfg.state is not None else None
        if not math.isfinite(float(loss.detach())):
            raise FloatingPointError(f"{cfg.name}: loss {float(loss)}")
        if timed:
            cfg.step_ms.append((t2 - t0) * 1e3)
            cfg.update_ms.append((t2 - t1) * 1e3)
            cfg.hook.append(None if stats is None else
                            {k: stats[k] for k in ("calls", "buckets", "paths", "bits_per_coord",
                                                   "host_s")})
        return w

    def model_of(cfg):
        """The configuration's model: its FSDP model, or a fresh DDP wrapper of
        the shared model (the previous one's hooks gone with it)."""
        if args.fsdp:
            return cfg.model
        shared_opt.zero_grad(set_to_none=True)
        gc.collect()
        model, cfg.state = _ddp(shared, cfg, args, device, dqt)
        cfg.comm_hook = model._get_ddp_logging_data().get("comm_hook") or None
        return model

    from dynamiq_mpi.torch.ddp_buckets import STEP_ROUNDS, auto_steps
    first_warm = 8 if args.fsdp else auto_steps(args.auto_rounds or STEP_ROUNDS)
    total = (args.rounds * len(configs) * (args.steps + args.warmup)
             + first_warm * sum(c.codec not in BASELINES
                                and (args.fsdp or c.codec not in OURS_PATHS) for c in configs))
    progress = train_lm._Progress(total, rank == 0, args.no_progress)
    t_start = time.perf_counter()
    for r in range(args.rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for cfg in order:
            model = model_of(cfg)
            warm = args.warmup
            if r == 0 and cfg.codec not in BASELINES:
                warm += getattr(cfg.state, "auto_steps", 0) or (8 if args.fsdp else 0)
            for i in range(warm + args.steps):
                w = one_step(model, cfg.opt, cfg, timed=i >= warm)
                progress.update(step_no[0], f"round {r + 1}/{args.rounds} {cfg.name}")
            for _ in range(probes_each):
                probes.append(train_lm._compute_probe(model, cfg.opt, w, device, torch, sync))
            del model
    progress.close()
    profiles = {}
    if args.profile:
        for cfg in configs:
            model = model_of(cfg)
            for _ in range(2):
                one_step(model, cfg.opt, cfg, timed=False)
            profiles[cfg.name] = _profile(lambda: one_step(model, cfg.opt, cfg, timed=False),
                                          torch)
            del model

    # the slowest rank's time of every step, and of every probe
    times = torch.tensor([t for c in configs for t in c.step_ms] + probes, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        times = times.to(device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    times = times.cpu().tolist()
    k = 0
    for c in configs:
        c.step_ms, k = times[k:k + len(c.step_ms)], k + len(c.step_ms)
    probes = times[k:]
    result = _summarise(configs, probes, args, world, n_params)
    for row in result["rows"]:
        row["profile"] = profiles.get(row["name"])
    result["meta"] = _meta(args, world, device, torch, dq, corpus, time.perf_counter() - t_start)
    if rank == 0:
        print(_table(result), flush=True)
        if profiles:
            print(_profile_table(result), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    for c in configs:
        if hasattr(c.state, "free"):
            c.state.free()      # its worker threads, NCCL communicators and graphs (every rank)
    if owns_group:
        dist.destroy_process_group()
    return result


def _ddp(model, cfg, args, device, dqt):
    """A fresh DDP wrapper of the shared model for ``cfg`` (the old one is
    gone: its hooks left with its reducer); our state is kept across rounds."""
    import copy
    a = copy.copy(args)
    a.bucket_cap_mb = cfg.cap
    codec = cfg.codec
    if codec in TORCH_HOOKS:        # plain DDP's wrapper, torch's own hook unwrapped
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp, _ = train_lm.ddp_model(model, "fp32", a, device, dqt, state=cfg.state,
                                    init_sync=False)
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        return ddp, None
    if _is_ours(codec):
        kw = _ours_options(codec)
        if args.auto_rounds is not None:
            kw["auto_rounds"] = args.auto_rounds
        state = cfg.state or dqt.HookState(seed=args.seed, reports=False, **kw)
        ddp, state = train_lm.ddp_model(model, None, a, device, dqt, state=state,
                                        init_sync=False)
        return ddp, state
    codec = train_lm.resolve_codec(codec)
    ddp, state = train_lm.ddp_model(model, codec, a, device, dqt, state=cfg.state,
                                    init_sync=False)
    return ddp, state if not isinstance(codec, str) else None


def _is_ours(codec) -> bool:
    return codec == "ours" or codec.startswith("ours:")


def _ours_options(codec) -> dict:
    """Our hook's or reduce-scatter's options for ``ours[:VARIANT]``."""
    if codec in OURS_GRAPHS:
        return {"graphs": OURS_GRAPHS[codec]}
    if codec in OURS_PATHS:
        return {"path": OURS_PATHS[codec]}
    return {"fuse_mb": float(codec[5:])} if codec.startswith("ours:") else {}


def _fsdp(model, codec, args, dqt, torch):
    """FSDP2 with BF16 parameters over every decoder layer, then the model."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    reduce = torch.bfloat16 if codec == "bf16" else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    if codec in ("fp32", "bf16"):
        return model, None
    rs = (dqt.ReduceScatter(seed=args.seed, **_ours_options(codec)) if _is_ours(codec)
          else dqt.ReduceScatter(codec=train_lm.resolve_codec(codec), seed=args.seed))
    for m in model.modules():
        if hasattr(m, "set_custom_reduce_scatter"):
            m.set_custom_reduce_scatter(rs)
    return model, rs


def _kind(name: str) -> str:
    low = name.lower()
    if "nccl" in low:
        return "nccl"
    if re.search(r"\bk_[a-z0-9_]+", name):        # the codec's kernels (src_cuda/)
        return "codec"
    if "copy" in low or "memcpy" in low or "cat" in low.split("_") or "to_copy" in low:
        return "copy"
    return "compute"


def _timeline_kind(name: str) -> str:
    """A kernel's kind on the timeline: NCCL's collectives by name, else _kind."""
    low = name.lower()
    if "memset" in low:
        return "copy"
    if "nccl" in low:       # (the library's own statistics all-gathers count as all-gathers)
        for key, kind in (("allgather", "all-gather"), ("reducescatter", "reduce-scatter"),
                          ("allreduce", "all-reduce"), ("sendrecv", "send/recv")):
            if key in low.replace("_", ""):
                return kind
        return "nccl"
    return _kind(name)


def _merged(intervals) -> list:
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def compute_stream_idle(kernels) -> dict:
    """Where the compute stream waits.  ``kernels``: (stream, kind, start_ms,
    end_ms) of one step's GPU kernels.  The compute stream is the one with
    the most compute-kernel time; between the step's first and last kernel,
    its idle time is split by what the other streams run meanwhile (a label
    per set of kinds, "nothing" when no kernel runs)."""
    import bisect
    by_stream = {}
    for stream, kind, a, b in kernels:
        if kind == "compute":
            by_stream[stream] = by_stream.get(stream, 0.0) + (b - a)
    if not by_stream:
        return {}
    main = max(by_stream, key=by_stream.get)
    lo, hi = min(k[2] for k in kernels), max(k[3] for k in kernels)
    busy = _merged([(a, b) for s, _, a, b in kernels if s == main])
    idle, t = [], lo
    for a, b in busy:
        if a > t:
            idle.append((t, a))
        t = max(t, b)
    if hi > t:
        idle.append((t, hi))
    others = {}
    for s, kind, a, b in kernels:
        if s != main:
            others.setdefault(kind, []).append((a, b))
    others = {k: _merged(v) for k, v in others.items()}
    starts = {k: [a for a, _ in v] for k, v in others.items()}
    while_ = {}
    for a, b in idle:
        cuts = sorted({a, b} | {x for v in others.values() for iv in v for x in iv if a < x < b})
        for x, y in zip(cuts, cuts[1:]):
            mid = (x + y) / 2
            active = [k for k, v in others.items()
                      if (i := bisect.bisect_right(starts[k], mid) - 1) >= 0 and v[i][1] > mid]
            label = "+".join(sorted(active)) or "nothing"
            while_[label] = while_.get(label, 0.0) + (y - x)
    return {"window_ms": hi - lo, "busy_ms": sum(b - a for a, b in busy),
            "idle_ms": sum(b - a for a, b in idle),
            "idle_while_ms": dict(sorted(while_.items(), key=lambda kv: -kv[1]))}


def _device_work(events, cuda) -> list:
    """The GPU kernels, copies and sets among a profile's ``events``
    (``device_type == cuda``), without the profiler's annotation ranges,
    which it also lays on the streams."""
    return [e for e in events
            if e.device_type == cuda and not getattr(e, "is_user_annotation", False)]


def kernel_timeline(events, cuda) -> list:
    """(stream, kind, start_ms, end_ms) of the device work among ``events``."""
    return [(int(e.device_resource_id), _timeline_kind(e.name),
             e.time_range.start / 1e3, e.time_range.end / 1e3)
            for e in _device_work(events, cuda)]


def host_ranges(events, cpu, top=12) -> dict:
    """Host time (ms) and count of the named ranges on the CPU side of a
    profile (record_function: FSDP2's ``FSDP::post_backward_reduce (layer)``,
    DDP's ``DistributedDataParallel.forward``, ...), grouped by name without
    the module in brackets; the ``top`` longest."""
    out = {}
    for e in events:
        if e.device_type != cpu or not getattr(e, "is_user_annotation", False):
            continue
        name = e.name.split(" (")[0]
        ms, n = out.get(name, (0.0, 0))
        out[name] = (ms + (e.time_range.end - e.time_range.start) / 1e3, n + 1)
    return {k: {"ms": v[0], "count": v[1]}
            for k, v in sorted(out.items(), key=lambda kv: -kv[1][0])[:top]}


def _profile(step, torch) -> dict:
    """One step under torch.profiler: wall time, GPU busy time by kind summed
    over the kernels (kernels of several streams overlap: the kinds can sum
    past the wall), the ten costliest kernels, and where the compute stream
    waits (compute_stream_idle)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        step()
    wall = (time.perf_counter() - t0) * 1e3
    events, cuda = prof.events(), torch.autograd.DeviceType.CUDA
    kinds, per_name = {}, {}
    for e in _device_work(events, cuda):
        ms = (e.time_range.end - e.time_range.start) / 1e3
        kind = _kind(e.name)
        kinds[kind] = kinds.get(kind, 0.0) + ms
        t, n = per_name.get(e.name, (0.0, 0))
        per_name[e.name] = (t + ms, n + 1)
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:10]
    return {"wall_ms": wall, "gpu_ms_by_kind": kinds,
            "top_kernels": [{"ms": ms, "count": n, "name": k[:90]} for k, (ms, n) in top],
            "compute_stream": compute_stream_idle(kernel_timeline(events, cuda)),
            "host_ranges": host_ranges(events, torch.autograd.DeviceType.CPU)}


def _profile_table(result) -> str:
    lines = ["One profiled step each (torch.profiler; GPU busy ms by kind, streams overlap):",
             "| config | step (ms) | NCCL | codec kernels | copies/casts | compute |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        p = r.get("profile")
        if not p:
            continue
        k = p["gpu_ms_by_kind"]
        lines.append(f"| {r['name']} | {p['wall_ms']:.1f} | {k.get('nccl', 0):.1f} | "
                     f"{k.get('codec', 0):.1f} | {k.get('copy', 0):.1f} | "
                     f"{k.get('compute', 0):.1f} |")
    lines.append("The compute stream's idle time (ms) in that step, by what other streams run:")
    for r in result["rows"]:
        c = (r.get("profile") or {}).get("compute_stream")
        if c:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in c["idle_while_ms"].items())
            lines.append(f"  {r['name']}: {c['idle_ms']:.1f} of {c['window_ms']:.1f} "
                         f"({parts})")
    lines.append("Host time (ms) in the step's named ranges, the longest:")
    for r in result["rows"]:
        h = (r.get("profile") or {}).get("host_ranges")
        if h:
            parts = ", ".join(f"{k} {v['ms']:.1f} (x{v['count']})" for k, v in list(h.items())[:5])
            lines.append(f"  {r['name']}: {parts}")
    return "\n".join(lines)


def _pct(xs, q):
    xs = sorted(xs)
    i = (len(xs) - 1) * q
    lo, hi = math.floor(i), math.ceil(i)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def _summarise(configs, probes, args, world, n_params) -> dict:
    tokens = world * args.batch * args.seq_len
    probe_q = {q: _pct(probes, q) for q in (0.25, 0.5, 0.75)}
    rows = []
    for c in configs:
        step = statistics.median(c.step_ms)
        update = statistics.median(c.update_ms)
        compute = {q: v + update for q, v in probe_q.items()}
        rows.append({
            "config": c.codec, "bucket_cap_mb": c.cap, "name": c.name, "comm_hook": c.comm_hook,
            "step_ms": step, "compute_ms": compute[0.5],
            "exposed_ms": step - compute[0.5],
            "exposed_ms_p25_p75": [step - compute[0.75], step - compute[0.25]],
            "tokens_per_s": tokens / (step / 1e3),
            "steps_ms": c.step_ms, "update_ms": update, "hook": c.hook,
            "hook_host_ms": _hook_host_ms(c.hook),
            "paths": ({str(k): list(v) for k, v in c.state.path_decisions().items()}
                      if hasattr(c.state, "path_decisions") else {}),
            "auto_step_periods_ms": ({k: [t * 1e3 for t in v]
                                      for k, v in c.state.step_periods().items()}
                                     if hasattr(c.state, "step_periods") else {}),
        })
    for row in rows:
        same = {r["config"]: r for r in rows if r["bucket_cap_mb"] == row["bucket_cap_mb"]}
        for ref in ("fp32", "bf16"):
            if ref in same:
                row[f"step_vs_{ref}"] = row["step_ms"] / same[ref]["step_ms"]
                lo_hi = [row["exposed_ms_p25_p75"][i] / same[ref]["exposed_ms_p25_p75"][i]
                         if same[ref]["exposed_ms_p25_p75"][i] > 0 else None for i in (0, 1)]
                e = same[ref]["exposed_ms"]
                row[f"exposed_vs_{ref}"] = row["exposed_ms"] / e if e > 0 else None
                row[f"exposed_vs_{ref}_p25_p75"] = lo_hi
    return {"rows": rows, "probes_ms": probes, "probe_quartiles_ms": list(probe_q.values()),
            "n_params": n_params, "tokens_per_step": tokens}


def _hook_host_ms(hook) -> float | None:
    """Median host time a step inside our hook or reduce-scatter (the
    autograd thread's), None for torch's own."""
    host = [h["host_s"] * 1e3 for h in hook if h is not None and h.get("host_s") is not None]
    return statistics.median(host) if host else None


def _meta(args, world, device, torch, dq, corpus, wall_s) -> dict:
    nccl = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "DYNAMIQ_"))}
    return {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
            "mode": "fsdp" if args.fsdp else "ddp", "world_size": world,
            "device": train_lm._device_name(device, torch), "host": platform.node(),
            "torch": torch.__version__, "dynamiq_mpi": getattr(dq, "__version__", ""),
            "preset": args.preset, "rounds": args.rounds, "steps": args.steps,
            "warmup": args.warmup, "env": nccl, "corpus_sha256": corpus.get("sha256"),
            "wall_s": wall_s}


def _fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def _table(result) -> str:
    m = result["meta"]
    lines = [f"{m['mode'].upper()}, {result['n_params'] / 1e6:.0f}M parameters, "
             f"{m['world_size']} ranks, {m['device']}, {m['date']}; medians over "
             f"{m['rounds']} rounds x {m['steps']} steps; compute-only step from "
             f"{len(result['probes_ms'])} probes (quartiles "
             + "/".join(f"{q:.1f}" for q in result["probe_quartiles_ms"]) + " ms)",
             "| bucket cap (MB) | config | step (ms) | compute (ms) | exposed comm (ms) | "
             "tokens/s | step vs fp32 | step vs bf16 | exposed vs bf16 (p25-p75 probes) | "
             "path | our host ms a step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lo, hi = r.get("exposed_vs_bf16_p25_p75") or (None, None)
        spread = (f" ({_fmt(min(lo, hi))}-{_fmt(max(lo, hi))})"
                  if lo is not None and hi is not None else "")
        chosen = [p for p, _why in r["paths"].values()]
        paths = ", ".join(f"{p}" + (f" x{chosen.count(p)}" if len(chosen) > 1 else "")
                          for p in sorted(set(chosen))) or "-"
        lines.append(f"| {_cap_label(r['bucket_cap_mb'], m['mode'])} | {r['config']} | {r['step_ms']:.1f} | "
                     f"{r['compute_ms']:.1f} | {r['exposed_ms']:.1f} | "
                     f"{r['tokens_per_s']:.0f} | {_fmt(r.get('step_vs_fp32'))} | "
                     f"{_fmt(r.get('step_vs_bf16'))} | {_fmt(r.get('exposed_vs_bf16'))}{spread} | "
                     f"{paths} | {_fmt(r.get('hook_host_ms'), '.1f')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
