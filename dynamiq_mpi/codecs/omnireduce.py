"""OmniReduce baseline (Fei et al., SIGCOMM'21) in a multi-hop all-reduce, as
the paper adapts it (docs/design.md, "Baselines"), array code.  Stateless,
a call takes the paper's converged k at once: a priority byte per block
(``254 - floor(254 rank / blocks)``, 255: NaN/Inf) reduced by MAX, and the
smallest threshold whose union holds at most ``density`` of the blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backend import as_float32, bf16_to_float32
from ..errors import NonFiniteInputError
from .base import DEFAULT_TILE_BYTES, Codec, Plan, StreamLayout, tile_stream
from .plain import finish_in_order

BLOCK = 256
TOP_PRIORITY = 254
NONFINITE = 255


def priority_bytes(xp, blocks):
    """uint8 priority of each row of ``blocks`` ((m, 256)): 254 the largest l2 norm .. 1."""
    m = blocks.shape[0]
    norm2 = xp.sum(xp.square(blocks.astype(np.float64)), axis=1)
    order = xp.argsort(-norm2, kind="stable")
    rank = xp.empty(m, dtype=np.int64)
    rank[order] = xp.arange(m, dtype=np.int64)
    return (TOP_PRIORITY - (rank * TOP_PRIORITY) // m).astype(np.uint8)


def local_k(blocks: int, threshold: int) -> int:
    """How many of a rank's blocks have priority >= ``threshold``."""
    # 254 - floor(254 r / m) >= t  <=>  254 r < (255 - t) m
    return min(blocks, -(-(TOP_PRIORITY + 1 - threshold) * blocks // TOP_PRIORITY))


def choose_threshold(counts, blocks: int, density: float) -> int:
    """The smallest priority threshold whose union (``counts[p]``: blocks of
    best priority p) holds at most density x blocks; else the top level."""
    union = 0
    for t in range(TOP_PRIORITY, 0, -1):
        union += int(counts[t])
        if union > density * blocks:
            return min(t + 1, TOP_PRIORITY)
    return 1


def _bf16_bits(xp, values):
    """float32 -> BF16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    u = xp.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return xp.where(xp.isnan(values), np.uint32(0x7FC0), rounded).astype(np.uint16)


@dataclass(frozen=True)
class OmniReduce(Codec):
    """Union of the ranks' top-k 256-entry blocks by norm, at most ``density``
    of all blocks, exchanged densely in BF16; other blocks are zero."""
    density: float = 0.5

    name = "omnireduce"
    fused_gpu = False             # CuPy array code on the GPU
    rejects_nonfinite = True

    def __post_init__(self):
        if not 0.0 < float(self.density) <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {self.density}")

    def signature(self):
        return ("omnireduce", float(self.density))

    def local_stats(self, x, backend, workspace, keys=None):
        xp = backend.xp
        length = x.shape[0]
        nb = -(-length // BLOCK)
        blocks = xp.zeros(nb * BLOCK, dtype=np.float32)
        blocks[:length] = as_float32(x)
        blocks = blocks.reshape(nb, BLOCK)
        priority = priority_bytes(xp, blocks)
        priority = xp.where(xp.isfinite(blocks).all(), priority, np.uint8(NONFINITE))
        return priority.astype(np.uint8), blocks

    def plan(self, x, reduced_stats, n, keys, backend, local_state, workspace,
             tile_bytes=DEFAULT_TILE_BYTES):
        return _OmniPlan(self, reduced_stats, n, backend, local_state, workspace, tile_bytes)


class _OmniPlan(Plan):
    def __init__(self, codec, reduced, n, backend, blocks, ws, tile_bytes):
        self.backend, self.xp, self.k, self.ws = backend, backend.xp, backend.kernels, ws
        xp = self.xp
        self.nb = blocks.shape[0]
        counts = backend.to_host(xp.bincount(reduced, minlength=256))
        if counts[NONFINITE]:
            raise NonFiniteInputError("input holds NaN or Inf on at least one rank")
        self.density = float(codec.density)
        self.threshold = choose_threshold(counts, self.nb, self.density)
        self.union = xp.nonzero(reduced >= self.threshold)[0]
        self.union_blocks = int(self.union.shape[0])
        self.values = blocks[self.union]                 # this rank's union blocks, in order
        layout = StreamLayout([(self.union_blocks, 2 * BLOCK)])
        self.tiling = tile_stream(layout, n, tile_bytes)
        self.wire = ws.take(xp, "omni.wire", self.tiling.wire_bytes, np.uint8)
        self.result = ws.take(xp, "omni.result", self.nb * BLOCK, np.float32)
        self.result[...] = 0

    def scratch(self, nbytes):
        return self.ws.take(self.xp, "omni.recv", nbytes, np.uint8)

    def _encode(self, values, slot):
        slot.view(np.uint16)[...] = _bf16_bits(self.xp, values.reshape(-1))

    def accumulate(self, tile, payload, acc):
        u0, u1 = self.tiling.units[tile]
        base = self.values[u0:u1].reshape(-1) if acc is None else acc
        with np.errstate(over="ignore", invalid="ignore"):   # an overflowing sum is inf (IEEE)
            return base + bf16_to_float32(payload.view(np.uint16))

    def compress(self, tile, event):
        u0, u1 = self.tiling.units[tile]
        slot = self.wire_slot(tile)
        self._encode(self.values[u0:u1], slot)
        return slot

    def dar(self, tile, payload, acc, event):
        slot = self.wire_slot(tile)
        self._encode(self.accumulate(tile, payload, acc), slot)
        return slot

    def decode(self, tile, payload):
        u0, u1 = self.tiling.units[tile]
        rows = self.union[u0:u1]
        self.result.reshape(self.nb, BLOCK)[rows] = \
            bf16_to_float32(payload.view(np.uint16)).reshape(-1, BLOCK)

    def finish(self, divisor, out):
        return finish_in_order(self.k, self.xp, self.ws, self.result, divisor, out)

    def report(self, detailed=True):
        info = {"density_target": self.density, "blocks": self.nb,
                "union_blocks": self.union_blocks,
                "density": self.union_blocks / self.nb if self.nb else 0.0,
                "local_k": local_k(self.nb, self.threshold), "priority_threshold": self.threshold}
        if detailed:
            info["union"] = self.backend.to_host(self.union)     # block indices, ascending
        return info
