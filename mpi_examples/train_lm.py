"""Train a LLaMA-style causal LM on Python's standard library, with the
gradients all-reduced by DDP's built-in hooks or by dynamiq_mpi's hook.

    torchrun --nproc_per_node 2 mpi_examples/train_lm.py --codec dynamiq:5 --json run.json
    mpiexec -n 2 python mpi_examples/train_lm.py --codec dynamiq:5      # the same under MPI
    torchrun --nproc_per_node 2 mpi_examples/train_lm.py --preset 0.8b --codec bf16
    mpiexec -n 2 python mpi_examples/train_lm.py --tiny --steps 20 --codec bf16   # CPU, gloo
    mpiexec -n 2 python mpi_examples/train_lm.py --fsdp --codec dynamiq:5          # FSDP2
    python mpi_examples/train_lm.py plot curves.png run1.json run2.json            # loss curves

Presets: ``default`` (~26M parameters), ``0.8b`` (a 0.8B LLaMA: hidden 2048,
16 layers, MLP 5504, 16 heads, 512 tokens, 8 sequences a rank), ``tiny``
(CPU tests; ``--tiny`` is ``--preset tiny``).  DDP keeps its own default
bucket size unless ``--bucket-cap-mb`` is given.  mpi_examples/lm_bench.py
times several configurations of the same model in one job.

Codecs: ``fp32`` (plain DDP, its own float32 all-reduce), ``bf16`` (DDP with
torch's ``bf16_compress_hook``: BF16 on the wire through NCCL/gloo), and
through ``dynamiq_mpi.torch.ddp_comm_hook``: ``dynamiq:B``, ``exact``,
``dq-bf16`` (our BF16 codec), ``mxfp:FMT``, ``thc``, ``omnireduce`` (the last
three where the installed dynamiq_mpi has them).  Every codec sees the same
model initialisation and the same batches for a given ``--seed``.

``--fsdp``: the same model sharded by FSDP2 (``fully_shard`` per decoder
layer, then the model; float32 parameters) instead of DDP; gradients leave
by a reduce-scatter: ``fp32`` is plain FSDP2 (float32 reduce-scatter of the
process group), ``bf16`` FSDP2 with ``MixedPrecisionPolicy(reduce_dtype=
bfloat16)`` (BF16 reduce-scatter of the group), any dynamiq_mpi codec
``dynamiq_mpi.torch.ReduceScatter`` (``set_custom_reduce_scatter``).

The corpus (docs/training.md): the files of ``CORPUS_FILES``
(``research/corpus.py``), relative to
``sysconfig.get_paths()["stdlib"]``: modules present under the same path in
Python 3.11 and 3.12.  In that sorted list every 10th file (index % 10 == 9)
is validation, the rest training; files are joined by a NUL byte, the
vocabulary is the 256 byte values.  The JSON records the corpus' sha256, so
runs are comparable only when it matches.
"""
import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time

# The corpus, the model and the batches are shared with the training simulator
# in research/ (a folder of the checkout, not installed): run from a checkout.
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from research.corpus import CORPUS_FILES, load_corpus  # noqa: E402,F401 (the example's API)

# Model and run sizes: GPU default (~26M parameters), a 0.8B LLaMA, --tiny (CPU tests).
PRESETS = {
    "default": dict(hidden=512, layers=8, heads=8, intermediate=1408, seq_len=512, batch=16,
                    steps=400, lr=1e-3, warmup=40, eval_every=100, val_windows=128,
                    vnmse_every=25),
    "0.8b": dict(hidden=2048, layers=16, heads=16, intermediate=5504, seq_len=512, batch=8,
                 steps=300, lr=3e-4, warmup=30, eval_every=50, val_windows=128, vnmse_every=25),
    "tiny": dict(hidden=64, layers=2, heads=2, intermediate=128, seq_len=32, batch=4,
                 steps=4, lr=3e-3, warmup=1, eval_every=2, val_windows=8, vnmse_every=2),
}


# --------------------------------------------------------------------- codecs
def resolve_codec(spec):
    """'fp32' / 'bf16' (DDP's own all-reduce) -> the string; anything else ->
    a dynamiq_mpi codec object, spelt as for ``python -m dynamiq_mpi bench``:
    'dynamiq:5', 'dynamiq:5:small_input=0', 'exact', 'dq-bf16' (our BF16 codec)."""
    if spec in ("fp32", "bf16"):
        return spec
    from dynamiq_mpi.codecs import codec_from_string
    return codec_from_string("bf16" if spec == "dq-bf16" else spec)


def _builtin_hook(kind):
    """DDP's bf16_compress_hook / allreduce_hook, wrapped so that the state can
    measure their error like ours (the name also avoids DDP's check that
    bf16_compress_hook runs on NCCL: gloo carries BF16 too)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    inner = default_hooks.bf16_compress_hook if kind == "bf16" else default_hooks.allreduce_hook

    def measured_builtin_hook(state, bucket):
        # The exact mean first: the inner hook divides the buffer in place.
        exact = state.exact_mean(bucket.buffer()) if state.measure_error else None
        fut = inner(None, bucket)
        if bucket.is_last():
            state.iteration += 1
        if exact is None:
            return fut

        def record(f):
            out = f.value()
            state.record_error(out, exact)
            return out
        return fut.then(record)
    return measured_builtin_hook


# --------------------------------------------------------------------- training
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--codec", default="dynamiq:5", help="fp32, bf16, dynamiq:B, exact, ...")
    p.add_argument("--path", default=None,
                   help="our hook's path: auto (default), compressed, native, plain")
    p.add_argument("--fuse-mb", type=float, default=None,
                   help="our hook's fused group size (MiB; default the library's)")
    p.add_argument("--seed", type=int, default=0, help="model init, data order, codec seed")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default",
                   help="model and run sizes (any of them overridden by its own flag)")
    p.add_argument("--tiny", action="store_true", help="--preset tiny (CPU tests)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="DDP's bucket_cap_mb (unset: DDP's default, 25 MB)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--topology", default="ring")
    p.add_argument("--transport", default="auto", help="dynamiq_mpi transport")
    p.add_argument("--fsdp", action="store_true",
                   help="FSDP2 (fully_shard) with a reduce-scatter instead of DDP")
    for k, v in PRESETS["default"].items():
        p.add_argument("--" + k.replace("_", "-"), type=type(v), default=None,
                       help=f"default {v}, 0.8b {PRESETS['0.8b'][k]}, tiny {PRESETS['tiny'][k]}")
    p.add_argument("--probe-every", type=int, default=None,
                   help="after every N-th step, time its forward+backward again without "
                        "communication (compute alone; 0: never)")
    p.add_argument("--json", help="write the run (config, curves, summary) here (rank 0)")
    p.add_argument("--png", help="draw the loss curves here (rank 0; needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="plain lines, no progress bar")
    args = p.parse_args(argv)
    if args.tiny:
        args.preset = "tiny"
    args.tiny = args.preset == "tiny"
    preset = PRESETS[args.preset]
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.probe_every is None:
        args.probe_every = 2 if args.tiny else 10
    return args


def lr_at(step, args):
    """Linear warm-up, then cosine decay to 10 % of the peak."""
    from research.workloads import lr_at as schedule    # one definition for both
    return schedule(step, args)


def batch_for(step, rank, world, data, args, torch):
    """Rank ``rank``'s share of the global batch of ``step``: a function of
    (seed, step, world, batch) only, so identical for every codec (the
    training simulator's rule, research/workloads.py)."""
    from research.workloads import rank_batch
    return rank_batch(step, rank, world, data, args)


def evaluate(model, val, args, rank, world, device, torch):
    """Mean validation loss (nats/byte) over the first ``val_windows``
    consecutive windows, split over the ranks and summed exactly."""
    import torch.distributed as dist
    n = min(args.val_windows, (len(val) - 1) // args.seq_len)
    mine = torch.arange(rank, n, world)
    total = torch.zeros(2, dtype=torch.float64, device=device)
    model.eval()
    with torch.no_grad():
        for chunk in mine.split(args.batch):
            idx = chunk[:, None] * args.seq_len + torch.arange(args.seq_len + 1)
            w = val[idx].to(device)
            loss = _loss(model, w, device, torch, reduction="sum")
            total += torch.stack([loss.double(), torch.tensor(float(w[:, 1:].numel()),
                                                              dtype=torch.float64, device=device)])
    model.train()
    dist.all_reduce(total)
    return float(total[0] / total[1])


@contextlib.contextmanager
def _no_sync(model):
    """DDP's no_sync, or FSDP2's set_requires_gradient_sync(False)."""
    if hasattr(model, "no_sync"):
        with model.no_sync():
            yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def train_step(model, opt, w, device, torch, sync):
    """One training step on batch ``w`` (forward, backward with the gradient
    reduction, clipping at 1.0, the optimiser), the device synchronised at
    both ends and after the backward pass: (loss, t0, t1, t2) with t1 the
    end of the backward pass."""
    sync()
    t0 = time.perf_counter()
    loss = _loss(model, w, device, torch)
    opt.zero_grad(set_to_none=True)
    loss.backward()                        # gradients reduced by DDP / FSDP / the hook
    sync()
    t1 = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sync()
    return loss, t0, t1, time.perf_counter()


def _compute_probe(ddp, opt, w, device, torch, sync):
    """Forward and backward of batch ``w`` again, under ``no_sync`` (no
    communication): the compute of a step, timed between steps so that it sees
    the same machine state.  The gradients are dropped, the optimiser is not
    stepped: training is unchanged."""
    sync()
    t0 = time.perf_counter()
    with _no_sync(ddp):
        _loss(ddp, w, device, torch).backward()
    sync()
    ms = (time.perf_counter() - t0) * 1e3
    opt.zero_grad(set_to_none=True)
    return ms


def _loss(model, w, device, torch, reduction="mean"):
    from research.workloads import lm_loss    # one definition for both
    return lm_loss(model, w, device, reduction)


class _Progress:
    """tqdm on rank 0 when importable, else a line every tenth of the run."""

    def __init__(self, total, enabled, plain):
        self.bar, self.total, self.enabled = None, total, enabled
        if enabled and not plain:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="step", file=sys.stderr,
                                mininterval=1.0 if sys.stderr.isatty() else 15.0)
            except ImportError:
                pass

    def update(self, step, text):
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif self.enabled and (step % max(1, self.total // 10) == 0 or step == self.total - 1):
            print(f"step {step + 1}/{self.total}: {text}", flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def main(argv=None):
    """Run one training; returns the run's dict (on every rank)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "plot":
        if len(argv) < 3:
            raise SystemExit("usage: train_lm.py plot OUT.png RUN.json [RUN.json ...]")
        plot_runs(argv[2:], argv[1])
        return None
    t_start = time.perf_counter()
    args = parse_args(argv)
    codec = resolve_codec(args.codec)         # a bad codec fails before any set-up

    import torch
    import torch.distributed as dist
    import transformers

    import dynamiq_mpi.torch as dqt
    from research.workloads import build_model

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    owns_group = not dist.is_initialized()    # else the caller's (e.g. a test's) group
    rank, world, device = init_distributed(use_cuda)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    train_b, val_b, corpus = load_corpus()
    train = torch.frombuffer(bytearray(train_b), dtype=torch.uint8)
    val = torch.frombuffer(bytearray(val_b), dtype=torch.uint8)

    model = build_model(args, device)          # same initial model on every rank and codec
    n_params = sum(p.numel() for p in model.parameters())
    if args.fsdp:
        ddp, state = _fsdp_model(model, codec, args, device, dqt, torch)
    else:
        ddp, state = ddp_model(model, codec, args, device, dqt)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)

    run = {"config": dict(vars(args), world_size=world, n_params=n_params,
                          backend=dist.get_backend(), device=_device_name(device, torch),
                          torch=torch.__version__, transformers=transformers.__version__),
           "corpus": corpus, "steps": [], "evals": [], "vnmse": [],
           "mode": "fsdp" if args.fsdp else "ddp"}
    progress = _Progress(args.steps, rank == 0, args.no_progress)
    if rank == 0 and args.no_progress:
        print(f"{args.codec}: {n_params / 1e6:.2f}M parameters, {world} ranks, "
              f"{run['config']['backend']}, corpus {corpus['bytes_train']} B", flush=True)
    hook_ms, probe_ms = [], []
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        w = batch_for(step, rank, world, train, args, torch).to(device, non_blocking=True)
        measure = (codec != "fp32" and not (args.fsdp and isinstance(codec, str))
                   and (step % args.vnmse_every == 0 or step == args.steps - 1))
        state.measure_error = state.reports = measure   # both cost host syncs: logged steps only
        loss, t0, t1, t2 = train_step(ddp, opt, w, device, torch, sync)
        state.measure_error = state.reports = False
        stats = state.pop_stats()
        loss_v = float(loss.detach())
        if not math.isfinite(loss_v):
            raise FloatingPointError(f"training loss is {loss_v} at step {step}")
        run["steps"].append({"step": step, "loss": loss_v, "lr": lr_at(step, args),
                             "step_ms": (t2 - t0) * 1e3, "backward_ms": (t1 - t0) * 1e3,
                             "update_ms": (t2 - t1) * 1e3, "measured": measure,
                             "hook": {k: stats[k] for k in ("calls", "buckets", "paths",
                                                            "bits_per_coord")}})
        if not measure and stats["paths"].get("compressed"):   # timed calls: the collective's
            hook_ms.append(stats["comm_s"] * 1e3)
        if measure:
            run["vnmse"].append({"step": step, "vnmse": stats["vnmse"],
                                 "bits_per_coord": stats["bits_per_coord"]})
        if args.probe_every and step % args.probe_every == args.probe_every - 1:
            probe_ms.append(_compute_probe(ddp, opt, w, device, torch, sync))
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            run["evals"].append({"step": step + 1, "val_loss": evaluate(
                ddp if args.fsdp else ddp.module, val, args, rank, world, device, torch)})
        text = f"loss {loss_v:.4f}"
        if run["evals"]:
            text += f" val {run['evals'][-1]['val_loss']:.4f}"
        progress.update(step, text)
    progress.close()

    # Medians over the steps after the first 10 % (warm-up: allocations, NCCL
    # and kernel set-up), without the steps that measured the error.
    ours_ddp = not args.fsdp and not isinstance(codec, str)
    skip = max(1, args.steps // 10, state.auto_steps if ours_ddp else 0)  # path="auto" measures
    timed = [s for s in run["steps"][skip:] if not s["measured"]]
    med = (lambda xs: statistics.median(xs) if xs else float("nan"))
    step_ms = med([s["step_ms"] for s in timed])
    probes = probe_ms[len(probe_ms) // 10:] or probe_ms
    compute_ms = med(probes) + med([s["update_ms"] for s in timed])
    run["probe_ms"] = probe_ms
    vn = [v["vnmse"] for v in run["vnmse"] if v["vnmse"] is not None]
    bits = [v["bits_per_coord"] for v in run["vnmse"] if v["bits_per_coord"]]
    bits = bits or {"fp32": [32.0], "bf16": [16.0]}.get(args.codec)   # NCCL/gloo payloads
    run["summary"] = {
        "codec": args.codec, "seed": args.seed, "steps": args.steps,
        "final_val_loss": run["evals"][-1]["val_loss"],
        "final_train_loss": statistics.mean(s["loss"] for s in run["steps"][-10:]),
        "step_ms": step_ms, "compute_ms": compute_ms, "comm_ms": step_ms - compute_ms,
        "hook_ms": statistics.median(hook_ms) if hook_ms else None,
        "vnmse_mean": statistics.mean(vn) if vn else None,
        "bits_per_coord": statistics.mean(bits) if bits else None,
        "wall_s": time.perf_counter() - t_start,
        "paths": {str(k): list(v) for k, v in state.path_decisions().items()},
    }
    if rank == 0:
        s = run["summary"]
        print(f"{args.codec} seed {args.seed}: final val loss {s['final_val_loss']:.4f}, "
              f"step {s['step_ms']:.1f} ms = compute {s['compute_ms']:.1f} + comm "
              f"{s['comm_ms']:.1f} ms, vNMSE {_fmt(s['vnmse_mean'])}, bits/coord "
              f"{_fmt(s['bits_per_coord'])}, {s['wall_s']:.1f} s", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(run, f, indent=1)
        if args.png:
            plot_runs([run], args.png)
    if hasattr(state, "free"):
        state.free()        # its worker threads, NCCL communicators and graphs (every rank)
    if owns_group:
        dist.destroy_process_group()
    return run


def init_distributed(use_cuda):
    """(rank, world, device): torch.distributed as the launcher set it up
    (torchrun's RANK/WORLD_SIZE/LOCAL_RANK), else from MPI (mpiexec), else a
    group the caller made; the GPU of the local rank."""
    import os

    import torch
    import torch.distributed as dist

    import dynamiq_mpi.torch as dqt
    backend = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized() and "TORCHELASTIC_RUN_ID" not in os.environ:
        return dqt.init_process_group_from_mpi(backend)
    device = torch.device("cpu")
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK",
                                                         torch.cuda.current_device())))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, device_id=device if use_cuda else None)
    return dist.get_rank(), dist.get_world_size(), device


def ddp_model(model, codec, args, device, dqt, state=None, **ddp_kw):
    """DDP over ``model`` for ``codec`` (with ``--bucket-cap-mb`` when given)
    and its state: fp32 plain DDP, bf16 torch's ``bf16_compress_hook``,
    anything else our hook (``state`` reused when given)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    if args.bucket_cap_mb is not None:
        ddp_kw["bucket_cap_mb"] = args.bucket_cap_mb
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              gradient_as_bucket_view=True, **ddp_kw)
    if state is None:
        kw = {} if args.fuse_mb is None else {"fuse_mb": args.fuse_mb}
        state = dqt.HookState(codec=None if isinstance(codec, str) else codec, seed=args.seed,
                              transport=args.transport, topology=args.topology,
                              reports=False, timing=True, path=args.path, **kw)
    if codec == "bf16":
        ddp.register_comm_hook(state, _builtin_hook("bf16"))
    elif codec != "fp32":                      # fp32: DDP's own all-reduce, no hook
        dqt.register_comm_hook(ddp, state)
    return ddp, state


def _fsdp_model(model, codec, args, device, dqt, torch):
    """FSDP2 over every decoder layer, then the model, on a mesh of
    ``device``'s type (FSDP2's default is the GPU wherever one exists, even
    for ``--device cpu``); (model, state): the state is our ReduceScatter (a
    HookState) for dynamiq_mpi codecs, else a HookState that only carries the
    statistics (none: the group reduces)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if codec == "bf16" else None)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp, mesh=mesh)
    fully_shard(model, mp_policy=mp, mesh=mesh)
    if isinstance(codec, str):                 # fp32 / bf16: the process group's reduce-scatter
        return model, dqt.HookState(seed=args.seed, reports=False, timing=False)
    state = dqt.ReduceScatter(codec=codec, seed=args.seed, transport=args.transport,
                              topology=args.topology, reports=False, timing=True)
    for m in model.modules():
        if hasattr(m, "set_custom_reduce_scatter"):
            m.set_custom_reduce_scatter(state)
    return model, state


def _fmt(x):
    return "-" if x is None else f"{x:.3g}"


def _device_name(device, torch):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform
    return f"cpu ({platform.processor() or platform.machine()})"


# --------------------------------------------------------------------- plots
def plot_runs(runs, png):
    """Draw training (smoothed) and validation loss of several runs into one
    PNG.  ``runs``: run dicts, paths of run JSON files, or of JSON files
    holding ``{"runs": [...]}``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loaded = []
    for r in runs:
        if isinstance(r, (str, os.PathLike)):
            with open(r) as f:
                r = json.load(f)
        loaded.extend(r["runs"] if "runs" in r else [r])
    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in loaded:
        cfg = r["config"]
        label = f"{cfg['codec']} (seed {cfg['seed']})"
        steps = [s["step"] for s in r["steps"]]
        losses = [s["loss"] for s in r["steps"]]
        k = max(1, len(losses) // 50)          # moving average over ~2 % of the run
        smooth = [statistics.mean(losses[max(0, i - k + 1):i + 1]) for i in range(len(losses))]
        ax_t.plot(steps, smooth, label=label, lw=1)
        ax_v.plot([e["step"] for e in r["evals"]], [e["val_loss"] for e in r["evals"]],
                  marker="o", ms=3, label=label, lw=1)
    for ax, title in ((ax_t, "training loss (moving average)"), (ax_v, "validation loss")):
        ax.set_xlabel("step")
        ax.set_ylabel("nats / byte")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if loaded:
        c = loaded[0]["config"]
        fig.suptitle(f"{c['n_params'] / 1e6:.3g}M-parameter LLaMA, {c['world_size']} ranks, "
                     f"{c['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
