"""Step time of a DDP model with and without gradient compression.

    mpiexec -n 2 python mpi_examples/ddp_bench.py --params 268M --bucket-mb 25 \\
        --modes plain,bf16,dynamiq,dynamiq-compressed --json ddp.json

One rank per GPU (CPU with gloo where there is none).  The model is a stack of
square float32 Linear layers sized to ``--params``; every mode trains a fresh
copy from the same seed on the same batches with SGD:

* ``plain``: DDP as it comes (float32 all-reduce, overlapped with backward);
* ``torch-hook``: torch's own ``allreduce_hook`` (what DDP does, as a Python
  comm hook: the cost of any hook);
* ``bf16``: torch's ``bf16_compress_hook`` (``fp16_compress_hook`` on CPU: the BF16 one needs NCCL);
* ``dynamiq``: ``dynamiq_mpi.torch.ddp_comm_hook`` with the library's defaults
  (``path="auto"``: plain, BF16 or compressed, chosen by timing whole steps;
  its measuring steps run before the timed ones);
* ``dynamiq-compressed``: the same hook, always compressed.

``--fsdp``: the same model sharded by FSDP2 (``fully_shard`` per Linear, then
the model) instead of DDP; ``plain`` reduce-scatters float32, ``bf16`` sets
``MixedPrecisionPolicy(reduce_dtype=bfloat16)``, the ``dynamiq`` modes install
``dynamiq_mpi.torch.ReduceScatter`` with ``set_custom_reduce_scatter``
(``torch-hook`` does not apply).

Time per step: the mean over ``--steps`` steps after ``--warmup`` (each step
synchronised; the slowest rank).  Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dynamiq_mpi as dq
import dynamiq_mpi.torch as dqt

MODES = ("plain", "torch-hook", "bf16", "dynamiq", "dynamiq-compressed")
# more: "dynamiq-native" (our hook, path="native": torch.distributed's BF16
# all-reduce behind it), "dynamiq-inline" (compressed, calls run inside the hook: overlap=False)
EXTRA_MODES = ("dynamiq-native", "dynamiq-inline")
HOOK_PATHS = {"dynamiq": "auto", "dynamiq-compressed": "compressed", "dynamiq-native": "native",
              "dynamiq-inline": "compressed"}


def parse_count(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * mult)


def make_model(params: int, width: int, device, seed: int = 0) -> nn.Module:
    """Linear(width, width) layers with tanh between them, ~``params`` in all."""
    layers = max(1, round(params / (width * width + width)))
    torch.manual_seed(seed)
    mods = []
    for i in range(layers):
        mods.append(nn.Linear(width, width))
        if i < layers - 1:
            mods.append(nn.Tanh())
    return nn.Sequential(*mods).to(device)


def attach(model, mode: str, bits: float, seed: int, transport: str = "auto"):
    """The hook of ``mode`` on a DDP model; returns the HookState or None."""
    if mode == "plain":
        return None
    if mode == "torch-hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        model.register_comm_hook(None, default_hooks.allreduce_hook)
        return None
    if mode == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        hook = default_hooks.bf16_compress_hook
        if not torch.cuda.is_available():
            hook = default_hooks.fp16_compress_hook    # torch's BF16 hook needs NCCL
        model.register_comm_hook(None, hook)
        return None
    state = dqt.HookState(codec=dq.DynamiQ(bits=bits), seed=seed, reports=False,
                          path=HOOK_PATHS[mode], transport=transport,
                          overlap=False if mode == "dynamiq-inline" else None)
    model.register_comm_hook(state, dqt.ddp_comm_hook)
    return state


def shard(model, mode: str, bits: float, seed: int):
    """FSDP2 of ``model`` for ``mode``; returns (model, ReduceScatter or None)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if mode == "bf16" else None)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    if not mode.startswith("dynamiq"):
        return model, None
    state = dqt.ReduceScatter(codec=dq.DynamiQ(bits=bits), seed=seed, path=HOOK_PATHS[mode])
    for m in model.modules():
        if hasattr(m, "set_custom_reduce_scatter"):
            m.set_custom_reduce_scatter(state)
    return model, state


def run_mode(mode, args, device, comm):
    model = make_model(args.n_params, args.width, device)
    if args.fsdp:
        ddp, state = shard(model, mode, args.bits, args.seed)
    else:
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                  bucket_cap_mb=args.bucket_mb)
        state = attach(ddp, mode, args.bits, args.seed, "mpi" if args.shared_gpu else "auto")
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    gen = torch.Generator(device="cpu").manual_seed(1234 + comm.rank)
    x = torch.randn(args.batch, args.width, generator=gen).to(device)
    y = torch.randn(args.batch, args.width, generator=gen).to(device) * 0.1

    def step():
        opt.zero_grad(set_to_none=False)
        loss = (ddp(x) - y).square().mean()
        loss.backward()
        opt.step()
        return loss

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # path="auto" chooses by whole steps: its measuring steps are warm-up too
    for _ in range(args.warmup + (getattr(state, "auto_steps", 0) if not args.fsdp else 0)):
        step()
    sync()
    comm.Barrier()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
    mine = sum(times) / len(times)
    worst = comm.allreduce(mine, op=__import__("mpi4py").MPI.MAX)
    decisions = {}
    if state is not None:
        decisions = {(k if isinstance(k, str) else f"2^{k[2]} elements"): f"{p}: {why}"
                     for k, (p, why) in state.path_decisions().items()}
    row = dict(mode=mode, step_ms=worst * 1e3, loss=loss.item(), paths=decisions)
    if hasattr(state, "free"):
        state.free()        # its worker thread, NCCL communicators and graphs (every rank)
    del ddp, model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", default="268M", help="parameters of the model (K/M/G)")
    p.add_argument("--width", type=int, default=4096, help="width of each Linear layer")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--bits", type=float, default=5.0)
    p.add_argument("--fsdp", action="store_true", help="FSDP2 reduce-scatter instead of DDP")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=10,
                   help="untimed steps (path='auto' measures both paths in its first 2-3)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--shared-gpu", action="store_true",
                   help="ranks share the GPUs there are (torch.distributed over gloo, our "
                        "collective over host-staged MPI): the hook's overlap on one GPU")
    args = p.parse_args(argv)
    args.n_params = parse_count(args.params)
    modes = [m for m in args.modes.split(",") if m and not (args.fsdp and m == "torch-hook")]
    bad = [m for m in modes if m not in MODES + EXTRA_MODES]
    if bad:
        p.error(f"unknown modes {bad}; choose from {MODES + EXTRA_MODES}")

    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    created = not torch.distributed.is_initialized()
    if args.shared_gpu:
        rank, size, _ = dqt.init_process_group_from_mpi("gloo")
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        rank, size, device = dqt.init_process_group_from_mpi()
    if device.type == "cpu":
        torch.set_num_threads(1)
    rows = []
    for mode in modes:
        rows.append(run_mode(mode, args, device, comm))
        if rank == 0:
            print(f"[{len(rows)}/{len(modes)}] {mode}: {rows[-1]['step_ms']:.1f} ms/step",
                  file=sys.stderr, flush=True)
    base = {r["mode"]: r["step_ms"] for r in rows}
    if rank == 0:
        n_params = sum(p.numel() for p in make_model(args.n_params, args.width, "cpu").parameters())
        env = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "DYNAMIQ_"))}
        print(f"# {'FSDP2' if args.fsdp else 'DDP'} step time: {size} ranks, {device.type}, {n_params / 1e6:.1f}M float32 "
              f"parameters, buckets of {args.bucket_mb} MB, batch {args.batch}, "
              f"mean of {args.steps} steps after {args.warmup}, slowest rank")
        if env:
            print("# environment: " + " ".join(f"{k}={v}" for k, v in sorted(env.items())))
        print(f"# {'mode':>20s} {'ms/step':>9s} {'vs plain':>9s} {'vs bf16':>9s} {'loss':>10s}")
        for r in rows:
            vp = f"{base['plain'] / r['step_ms']:.2f}x" if "plain" in base else "-"
            vb = f"{base['bf16'] / r['step_ms']:.2f}x" if "bf16" in base else "-"
            print(f"  {r['mode']:>20s} {r['step_ms']:9.2f} {vp:>9s} {vb:>9s} {r['loss']:10.5f}")
        for r in rows:
            for cls, why in r["paths"].items():
                print(f"# {r['mode']} path for {cls}: {why}")
        if args.json:
            meta = dict(command=" ".join(sys.argv), ranks=size, device=(
                torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
                params=n_params, date=datetime.datetime.now(datetime.timezone.utc)
                .isoformat(timespec="seconds"), env=env, torch=torch.__version__,
                python=platform.python_version(), args=vars(args))
            with open(args.json, "w") as f:
                json.dump(dict(meta=meta, rows=rows), f, indent=1)
    if created:
        torch.distributed.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
