"""Whether a Python comm hook can pay on a DDP model's group at all.

DDP calls a comm hook once per bucket on its autograd thread.  A hook
written in Python costs host time there on every bucket, even one that
makes plain DDP's own NCCL call (torch's ``allreduce_hook``: 14 ms a step,
~170 us a bucket, over plain DDP's C++ all-reduce for the 0.8B LLaMA's 82
buckets on 4x H200 over NVLink; docs/benchmarks.md).  No path, compressed
or not, can save a bucket more than the float32 all-reduce of that bucket
takes.  So where that all-reduce is faster than a hook's own cost, no hook
can pay, and :func:`~dynamiq_mpi.torch.register_comm_hook` with
``path="auto"`` leaves DDP's C++ reducer as it is (``path_decisions()``:
``"step": ("ddp", why)``).

The gate times the group's own all-reduce of one bucket (in the gradients'
dtype; DDP's ``bucket_cap_mb``, at most the model's gradients) before
training, takes the slowest rank's median (so every rank decides alike)
and compares it with :data:`HOOK_HOST_COST_S`.  Over a slow link (NCCL's sockets: ~3.6 ms
for a 25 MB bucket) the hook is registered; over NVLink (~0.1 ms) it is
not.  Only CUDA models are gated: there the hook's host time delays the
backward pass's kernel launches.
"""
from __future__ import annotations

import statistics
import time
import warnings

import torch
import torch.distributed as dist

from .ddp_buckets import NO_HOOK

# Below this a bucket's all-reduce leaves a Python hook nothing to win: a
# hook's own cost a bucket above the all-reduce it makes (torch's
# allreduce_hook against plain DDP, 0.8B LLaMA over NVLink: 70-230 us on
# 2x and 4x H200), with a margin.
HOOK_HOST_COST_S = 300e-6
GATED_DEVICES = ("cuda",)
PROBE_MAX_BYTES = 64 * 2 ** 20      # beyond it the time is scaled by the bytes
PROBE_WARMUP = 2
PROBE_REPS = 5


def bucket_probe(ddp) -> tuple | None:
    """(bytes of one bucket, dtype, device) of ``ddp``'s gradients: DDP's
    bucket cap, at most every gradient; None without trainable parameters."""
    params = [p for p in ddp.parameters() if p.requires_grad]
    if not params:
        return None
    dtype = max((p.dtype for p in params), key=lambda d: d.itemsize)
    total = sum(p.numel() * p.element_size() for p in params)
    cap = int(getattr(ddp, "bucket_bytes_cap", 25 * 2 ** 20))
    return min(cap, total), dtype, params[0].device


def group_allreduce_seconds(group, nbytes: int, dtype, device) -> float:
    """The group's all-reduce of ``nbytes`` of ``dtype``: the slowest rank's
    median over :data:`PROBE_REPS` calls (probed at most
    :data:`PROBE_MAX_BYTES`, scaled by the bytes beyond), the same on every
    rank."""
    size = dtype.itemsize
    n = max(1, min(nbytes, PROBE_MAX_BYTES) // size)
    buf = torch.zeros(n, dtype=dtype, device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(PROBE_WARMUP):
        dist.all_reduce(buf, group=group)
    times = []
    for _ in range(PROBE_REPS):
        sync()
        t0 = time.perf_counter()
        dist.all_reduce(buf, group=group)
        sync()
        times.append(time.perf_counter() - t0)
    seconds = torch.tensor([statistics.median(times) * nbytes / (n * size)],
                           dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
    return float(seconds.item())


def hook_cannot_pay(ddp, group) -> str | None:
    """Why no Python comm hook can pay on ``ddp``'s ``group`` (its all-reduce
    of a bucket is faster than a hook's own cost), or None."""
    probe = bucket_probe(ddp)
    if probe is None or probe[2].type not in GATED_DEVICES:
        return None
    nbytes, dtype, device = probe
    seconds = group_allreduce_seconds(group, nbytes, dtype, device)
    if seconds >= HOOK_HOST_COST_S:
        return None
    return (f"the group's own all-reduce of a {nbytes / 2 ** 20:.1f} MiB bucket takes "
            f"{seconds * 1e3:.3f} ms, less than a Python comm hook costs a bucket "
            f"(~{HOOK_HOST_COST_S * 1e3:.1f} ms): no hook can pay here, so DDP reduces "
            "as it does without one")


def leaves_ddp_alone(ddp, state, group) -> bool:
    """Whether ``path="auto"`` leaves DDP without a hook (decided here once,
    or restored from a checkpoint)."""
    router = state._buckets
    auto = state.path == "auto" and getattr(state.codec, "auto_path", False)
    if router.decided is None and auto:
        why = hook_cannot_pay(ddp, group)
        if why is not None:
            router.decided = (NO_HOOK, why)
            if state.plane.rank == 0:
                warnings.warn(f"dynamiq_mpi.torch.register_comm_hook: no hook registered: {why} "
                              "(HookState(path='compressed') registers it regardless)",
                              stacklevel=3)
    return auto and router.decided is not None and router.decided[0] == NO_HOOK


__all__ = ["leaves_ddp_alone", "hook_cannot_pay", "group_allreduce_seconds", "bucket_probe",
           "HOOK_HOST_COST_S"]
