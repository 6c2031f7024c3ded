"""Uncompressed baselines: ``exact`` (float32 on the wire; it also carries
the compressed codecs' statistics) and ``bf16`` (each partial sum rounded to
BF16, nearest even); both add in float32 at every hop.  Tiles are whole
super-groups of 256 (the last partial), so GPU kernels and NumPy cut alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backend import BFLOAT16, as_float32, bf16_to_float32, float32_to_bf16
from ..errors import NonFiniteInputError
from .base import DEFAULT_TILE_BYTES, Codec, Plan, StreamLayout, tile_stream

SUPER = 256


class ElementwisePlan(Plan):
    """One wire value per element; ``bf16`` selects BF16 on the wire."""

    sync_free = True        # sizes from the length alone: nothing is read back

    def __init__(self, x, n, backend, workspace, tile_bytes=DEFAULT_TILE_BYTES, bf16=False,
                 prefix="plain"):
        self.backend, self.xp, self.k = backend, backend.xp, backend.kernels
        self.ws, self.prefix = workspace, prefix
        self.bf16 = bf16
        self.wire_dtype = BFLOAT16 if bf16 else np.dtype(np.float32)
        self.x = x
        self.length = x.shape[0]
        self.nsg = -(-self.length // SUPER)
        last = self.length - (self.nsg - 1) * SUPER if self.nsg else 0
        item = self.wire_dtype.itemsize
        layout = StreamLayout([(max(self.nsg - 1, 0), SUPER * item), (1 if self.nsg else 0, last * item)])
        self.tiling = tile_stream(layout, n, tile_bytes)
        self.wire = self._take("wire", self.tiling.wire_bytes, np.uint8)
        self.result = self._take("result", self.nsg * SUPER, np.float32)
        self._padded = None

    def _take(self, name, count, dtype):
        return self.ws.take(self.xp, f"{self.prefix}.{name}", count, dtype)

    def scratch(self, nbytes):
        return self._take("recv", nbytes, np.uint8)

    def _units(self, tile):
        return self.tiling.units[tile]

    def _elems(self, tile):     # (a chunk beyond the last super-group is empty)
        s0, s1 = self.tiling.units[tile]
        return min(s0 * SUPER, self.length), min(s1 * SUPER, self.length)

    def _wire_values(self, payload):
        return payload.view(np.uint16 if self.bf16 else np.float32)

    # -- the local values of a tile -------------------------------------------
    def _source(self, tile):
        s0, _ = self._units(tile)
        return self.k.Source(self.x, None, -s0, None)     # stream sg s reads row s0 + s

    def _local(self, tile):
        """float32 local values of a tile (zero-padded), host path."""
        if self._padded is None:
            self._padded = as_float32(self.x)
        e0, e1 = self._elems(tile)
        return self._padded[e0:e1]

    def _encode_host(self, values, slot):
        if self.bf16:
            slot.view(BFLOAT16)[:] = float32_to_bf16(values)
        else:
            slot.view(np.float32)[:] = values

    def _decode_host(self, payload):
        return bf16_to_float32(payload.view(BFLOAT16)) if self.bf16 else payload.view(np.float32)

    # -- the four operations ----------------------------------------------------
    def compress(self, tile, event):
        slot = self.wire_slot(tile)
        s0, s1 = self._units(tile)
        if self.backend.name == "gpu":
            op = self.k.bf16_compress if self.bf16 else self.k.exact_compress
            op(self._source(tile), s1 - s0, self._wire_values(slot))
        else:
            self._encode_host(self._local(tile), slot)
        return slot

    def accumulate(self, tile, payload, acc):
        s0, s1 = self._units(tile)
        if self.backend.name == "gpu":
            if acc is None:
                e0, e1 = self._elems(tile)
                acc = self.xp.empty(e1 - e0, dtype=np.float32)
                self.k.exact_compress(self._source(tile), s1 - s0, acc)
            op = self.k.bf16_decompress if self.bf16 else self.k.exact_decompress
            op(self._wire_values(payload), acc, True)
            return acc
        base = self._local(tile) if acc is None else acc
        with np.errstate(over="ignore"):   # an overflowing sum is inf, as in IEEE
            return base + self._decode_host(payload)

    def dar(self, tile, payload, acc, event):
        slot = self.wire_slot(tile)
        s0, s1 = self._units(tile)
        if self.backend.name == "gpu":
            src = self._source(tile) if acc is None else self.k.Source(acc, None, 0, None)
            op = self.k.bf16_dar if self.bf16 else self.k.exact_dar
            op(self._wire_values(payload), src, s1 - s0, self._wire_values(slot))
            return slot
        base = self._local(tile) if acc is None else acc
        with np.errstate(over="ignore"):
            self._encode_host(base + self._decode_host(payload), slot)
        return slot

    def decode(self, tile, payload):
        e0, e1 = self._elems(tile)
        dest = self.result[e0:e1]
        if self.backend.name == "gpu":
            op = self.k.bf16_decompress if self.bf16 else self.k.exact_decompress
            op(self._wire_values(payload), dest, False)
        else:
            dest[:] = self._decode_host(payload)

    def finish(self, divisor, out):
        return finish_in_order(self.k, self.xp, self.ws, self.result, divisor, out)

    def check_finite(self):
        """NonFiniteInputError unless the decoded sum (alike on every rank) is finite."""
        if not bool(self.xp.isfinite(self.result[:self.length]).all()):
            raise NonFiniteInputError("input holds NaN or Inf on at least one rank, or the sum "
                                      "overflows float32")

    def reduced_values(self):
        """The float32 result itself (the statistics phase reads it as is)."""
        return self.result[:self.length]


@dataclass(frozen=True)
class Exact(Codec):
    """float32 on the wire, float32 adds at every hop (about n ulp of error)."""
    name = "exact"
    native_wire = None      # the native path keeps the input's precision

    def signature(self):
        return ("exact",)

    def plan(self, x, reduced_stats, n, keys, backend, local_state, workspace,
             tile_bytes=DEFAULT_TILE_BYTES):
        return ElementwisePlan(x, n, backend, workspace, tile_bytes, bf16=False)


@dataclass(frozen=True)
class BF16(Codec):
    """BF16 on the wire (nearest-even), float32 accumulation at every hop."""
    name = "bf16"
    auto_path = True

    def signature(self):
        return ("bf16",)

    def plan(self, x, reduced_stats, n, keys, backend, local_state, workspace,
             tile_bytes=DEFAULT_TILE_BYTES):
        return ElementwisePlan(x, n, backend, workspace, tile_bytes, bf16=True)


def exact_sum_into(backend, a, b, out):
    """out = a + b in float32 with IEEE denormals (CuPy's own kernels flush
    them); a + b == b + a, so two ranks adding in opposite order agree."""
    if backend.name == "gpu":
        nsg = -(-a.shape[0] // SUPER)
        backend.kernels.exact_dar(b, backend.kernels.Source(a), nsg, out)
    else:
        with np.errstate(over="ignore"):     # saturation is the caller's business
            np.add(a, b, out=out)
    return out


class ByteMaxPlan(Plan):
    """The element-wise maximum of a small uint8 vector over the ranks (the
    baselines' shared block exponents): ``max`` at every hop, array code."""

    UNIT = 256

    def __init__(self, x, n, backend, workspace, tile_bytes=DEFAULT_TILE_BYTES, prefix="stats"):
        self.xp, self.ws, self.prefix = backend.xp, workspace, prefix
        self.x = x
        self.length = x.shape[0]
        units = -(-self.length // self.UNIT)
        last = self.length - (units - 1) * self.UNIT if units else 0
        layout = StreamLayout([(max(units - 1, 0), self.UNIT), (1 if units else 0, last)])
        self.tiling = tile_stream(layout, n, tile_bytes)
        self.wire = workspace.take(self.xp, f"{prefix}.max.wire", self.tiling.wire_bytes, np.uint8)
        self.result = workspace.take(self.xp, f"{prefix}.max.result", self.length, np.uint8)

    def _range(self, tile):
        s0, s1 = self.tiling.units[tile]
        return s0 * self.UNIT, min(s1 * self.UNIT, self.length)

    def scratch(self, nbytes):
        return self.ws.take(self.xp, f"{self.prefix}.max.recv", nbytes, np.uint8)

    def compress(self, tile, event):
        e0, e1 = self._range(tile)
        slot = self.wire_slot(tile)
        slot[...] = self.x[e0:e1]
        return slot

    def accumulate(self, tile, payload, acc):
        e0, e1 = self._range(tile)
        return self.xp.maximum(self.x[e0:e1] if acc is None else acc, payload)

    def dar(self, tile, payload, acc, event):
        slot = self.wire_slot(tile)
        slot[...] = self.accumulate(tile, payload, acc)
        return slot

    def decode(self, tile, payload):
        e0, e1 = self._range(tile)
        self.result[e0:e1] = payload

    def finish(self, divisor, out):
        raise NotImplementedError("a statistics reduction has no caller-facing result")

    def reduced_values(self):
        return self.result


def finish_in_order(kernels, xp, workspace, result, divisor, out):
    """``out`` = ``result`` (float32 in the caller's order, padded to whole
    super-groups) / divisor in out's dtype, through DynamiQ's scatter kernel
    (identity map, zero means): one final rounding for every codec."""
    nsg = -(-out.shape[0] // SUPER)
    identity = workspace.constant(xp, "finish.identity", nsg, np.int64, "arange")
    zeros = workspace.constant(xp, "finish.zeros", nsg, np.float32, "zeros")
    kernels.finish(result, identity, zeros, float(divisor), out)
    return out
