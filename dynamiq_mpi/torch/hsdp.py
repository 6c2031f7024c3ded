"""HSDP with a compressed replicate all-reduce (docs/training.md, which has
the example): FSDP2 shards parameters inside a shard group (a node, its
reduce-scatter uncompressed); FSDP2's all-reduce hook then replaces each
gradient shard's mean over the shard group, in place, by its mean over the
replicate group, compressed, so every gradient is the mean over all ranks.
Replicas must start from the same parameters, as with HSDP's own.

    hsdp = dqt.HSDP(mesh, codec=dq.DynamiQ(bits=5))   # mesh: (replicate, shard)
    fully_shard(model, mesh=hsdp.shard_mesh)           # and its layers
    hsdp.attach(model)
"""
from __future__ import annotations

import torch

from .ddp import HookState

__all__ = ["HSDP"]


class HSDP(HookState):
    """The replicate all-reduce of HSDP as FSDP2's all-reduce hook.
    ``mesh``: a 2-D device mesh, its dimensions named ``replicate_dim`` and
    ``shard_dim``; or ``replicate_group`` (shard as you choose).  The rest is
    :class:`HookState`'s, over the replicate group."""

    shard_mesh = None           # (not pickled: a mesh belongs to one job)

    def __init__(self, mesh=None, codec=None, seed: int = 0, *, replicate_group=None,
                 replicate_dim: str = "replicate", shard_dim: str = "shard", **options):
        if (mesh is None) == (replicate_group is None):
            raise ValueError("HSDP: give a 2-D device mesh or a replicate_group")
        if mesh is not None:
            if mesh.ndim != 2:
                raise ValueError(f"HSDP: the mesh must have 2 dimensions (replicate, shard), "
                                 f"got {mesh.ndim}")
            replicate_group = mesh.get_group(replicate_dim)
            self.shard_mesh = mesh[shard_dim]
        options.setdefault("overlap", False)    # the hook already runs on FSDP's own stream
        HookState.__init__(self, codec=codec, seed=seed, process_group=replicate_group,
                           **options)

    def __call__(self, reduce_output: torch.Tensor) -> None:
        """FSDP2's all-reduce hook: the shard's mean over the replicas, in place."""
        if not reduce_output.is_contiguous():
            raise ValueError("HSDP: FSDP handed a non-contiguous gradient shard")
        self.allreduce_(reduce_output)

    def attach(self, module) -> int:
        """Register the hook on every FSDP module in ``module`` (itself included): how many."""
        count = 0
        for m in module.modules():
            if hasattr(m, "set_all_reduce_hook"):
                m.set_all_reduce_hook(self)
                count += 1
        if count == 0:
            raise ValueError("HSDP.attach: no FSDP module found (apply fully_shard first)")
        return count

    def __repr__(self):
        return (f"HSDP(codec={self.codec!r}, seed={self.seed}, topology={self.topology!r}, "
                f"counter={self.counter})")
