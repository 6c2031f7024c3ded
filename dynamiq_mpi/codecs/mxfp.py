"""MX baselines (OCP Microscaling v1.0) in a multi-hop all-reduce, as the
paper adapts them (docs/design.md, "Baselines"): a byte per block of 32
(``floor(log2 max|x|) + 127``) reduced by MAX gives the shared exponent
``X_j = E_j + 1 + ceil(log2 n) - emax``.  The NumPy code is the CPU path and
the fused GPU kernels' reference (src_cuda/mx_kernels.cu), bit for bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..backend import as_float32
from ..errors import NonFiniteInputError, SumOverflowError
from .base import DEFAULT_TILE_BYTES, Codec, Plan, StreamLayout, tile_stream
from .plain import finish_in_order

BLOCK = 32
SUPER = 256
# name: (exponent bits, mantissa bits, exponent bias, largest normal)
FORMATS = {
    "e4m3": (4, 3, 7, 448.0),
    "e5m2": (5, 2, 15, 57344.0),
    "e3m2": (3, 2, 3, 28.0),
    "e2m3": (2, 3, 1, 7.5),
    "e2m1": (2, 1, 1, 6.0),
}


@dataclass(frozen=True)
class ElementFormat:
    name: str
    ebits: int
    mbits: int
    bias: int
    max_normal: float

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def emin(self) -> int:          # exponent of the smallest normal
        return 1 - self.bias

    @property
    def emax(self) -> int:          # exponent of the largest normal
        return int(math.floor(math.log2(self.max_normal)))

    def table(self) -> np.ndarray:
        """float32 value of every code (codes the encoder never makes: NaN)."""
        codes = np.arange(1 << self.bits)
        sign = np.where(codes >> (self.bits - 1), -1.0, 1.0)
        e = (codes >> self.mbits) & ((1 << self.ebits) - 1)
        m = codes & ((1 << self.mbits) - 1)
        mag = np.where(e == 0, m * 2.0 ** (self.emin - self.mbits),
                       (1 + m / 2.0 ** self.mbits) * 2.0 ** (e - self.bias))
        mag = np.where(mag > self.max_normal, np.nan, mag)
        return (sign * mag).astype(np.float32)

    def encode(self, xp, v):
        """Codes (uint8) of float32 values v, round to nearest even, saturated."""
        sign = xp.signbit(v).astype(np.uint8)
        a = xp.minimum(xp.abs(v), np.float32(self.max_normal))
        _, k = xp.frexp(a)
        e = xp.maximum(k.astype(np.int32) - 1, self.emin)        # the value's binade, or subnormal
        units = xp.rint(xp.ldexp(a, (self.mbits - e).astype(np.int32)))   # exact scaling, RNE
        q = xp.minimum(xp.ldexp(units, (e - self.mbits).astype(np.int32)),
                       np.float32(self.max_normal))
        _, kq = xp.frexp(q)
        normal = q >= np.float32(2.0 ** self.emin)
        ef = xp.where(normal, kq.astype(np.int32) - 1 + self.bias, 0)
        mant = xp.where(normal,
                        xp.ldexp(q, (self.mbits - (kq.astype(np.int32) - 1)).astype(np.int32))
                        - (1 << self.mbits),
                        xp.ldexp(q, np.int32(self.mbits - self.emin)))
        code = (ef.astype(np.uint32) << self.mbits) | mant.astype(np.uint32)
        return (code | (sign.astype(np.uint32) << (self.bits - 1))).astype(np.uint8)


def element_format(name: str) -> ElementFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown MX element format {name!r}; expected one of {sorted(FORMATS)}")
    return ElementFormat(name, *FORMATS[name])


def pack(xp, codes, bits: int):
    """uint8 codes (rows of 32) -> packed bytes, low bits first."""
    if bits == 8:
        return codes.reshape(-1)
    if bits == 4:
        c = codes.reshape(-1, 2)
        return (c[:, 0] | (c[:, 1] << 4)).astype(np.uint8)
    c = codes.reshape(-1, 4).astype(np.uint32)
    w = c[:, 0] | (c[:, 1] << 6) | (c[:, 2] << 12) | (c[:, 3] << 18)
    return xp.stack([w & 0xFF, (w >> 8) & 0xFF, w >> 16], axis=1).astype(np.uint8).reshape(-1)


def unpack(xp, data, bits: int):
    """Packed bytes -> uint8 codes (inverse of :func:`pack`)."""
    if bits == 8:
        return data
    if bits == 4:
        return xp.stack([data & 0x0F, data >> 4], axis=1).reshape(-1)
    b = data.reshape(-1, 3).astype(np.uint32)
    w = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
    return xp.stack([(w >> s) & 0x3F for s in (0, 6, 12, 18)], axis=1).astype(np.uint8).reshape(-1)


@dataclass(frozen=True)
class MXFP(Codec):
    """OCP MX element format ``fmt`` (e4m3, e5m2, e3m2, e2m3, e2m1), blocks of 32, shared scale."""
    fmt: str = "e4m3"

    name = "mxfp"
    rejects_nonfinite = True

    def __post_init__(self):
        element_format(self.fmt)

    def signature(self):
        return ("mxfp", self.fmt)

    def local_stats(self, x, backend, workspace, keys=None):
        xp = backend.xp
        nb = -(-x.shape[0] // BLOCK)
        if backend.name == "gpu":          # the kernels read x itself: no local copy
            byte = workspace.take(xp, "mx.stats", nb, np.uint8)
            backend.kernels.mx_stats(backend.kernels.Source(x), nb, byte)
            return byte, None
        vals = padded_blocks(xp, x, nb)
        with np.errstate(invalid="ignore"):
            amax = xp.max(xp.abs(vals), axis=1)
        _, k = xp.frexp(amax)
        byte = xp.clip(k.astype(np.int32) - 1 + 127, 1, 254)
        byte = xp.where(amax == 0, 0, byte)
        byte = xp.where(xp.isfinite(amax), byte, 255)
        return byte.astype(np.uint8), vals

    def plan(self, x, reduced_stats, n, keys, backend, local_state, workspace,
             tile_bytes=DEFAULT_TILE_BYTES):
        return _MXPlan(self, x, reduced_stats, n, backend, local_state, workspace, tile_bytes)


def padded_blocks(xp, x, nb):
    """``x`` as float32, zero-padded to ``nb`` blocks of BLOCK: (nb, BLOCK)."""
    vals = xp.zeros(nb * BLOCK, dtype=np.float32)
    vals[:x.shape[0]] = as_float32(x)
    return vals.reshape(nb, BLOCK)


class _MXPlan(Plan):
    def __init__(self, codec, x, reduced, n, backend, local, ws, tile_bytes):
        self.backend, self.xp, self.k, self.ws = backend, backend.xp, backend.kernels, ws
        xp = self.xp
        self.fmt = element_format(codec.fmt)
        self.length = x.shape[0]
        self.nb = -(-self.length // BLOCK)
        self.local = local                  # float32 blocks (host path) or None (GPU)
        self.gpu = backend.name == "gpu"
        if self.gpu:
            self.source = self.k.Source(x)
            self.kfmt = (self.fmt.bits, self.fmt.mbits, self.fmt.bias, self.fmt.max_normal)
            self.reduced = reduced
        top = int(xp.max(reduced)) if self.nb else 0
        if top == 255:
            raise NonFiniteInputError("input holds NaN or Inf on at least one rank")
        self.headroom = (n - 1).bit_length()                       # ceil(log2 n)
        if top and top - 127 + 1 + self.headroom > 127:
            raise SumOverflowError("the inputs' block maxima times the number of ranks exceed "
                                   "the float32 range: partial sums could overflow")
        if not self.gpu:                    # the kernels derive X from the bytes
            E = reduced.astype(np.int32) - 127
            self.X = xp.where(reduced == 0, 0, E + 1 + self.headroom - self.fmt.emax).astype(np.int32)
            self.table = xp.asarray(self.fmt.table())
        unit = BLOCK * self.fmt.bits // 8
        layout = StreamLayout([(self.nb, unit)])
        self.tiling = tile_stream(layout, n, tile_bytes)
        self.wire = ws.take(xp, "mx.wire", self.tiling.wire_bytes, np.uint8)
        nsg = -(-self.length // SUPER)
        self.result = ws.take(xp, "mx.result", max(nsg * SUPER, self.nb * BLOCK), np.float32)

    def _blocks(self, tile):
        return self.tiling.units[tile]

    def scratch(self, nbytes):
        return self.ws.take(self.xp, "mx.recv", nbytes, np.uint8)

    def _encode(self, values, b0, b1):
        xp = self.xp
        scaled = xp.ldexp(values, -self.X[b0:b1, None])
        return pack(xp, self.fmt.encode(xp, scaled), self.fmt.bits)

    def _decode(self, payload, b0, b1):
        xp = self.xp
        codes = unpack(xp, payload, self.fmt.bits).reshape(b1 - b0, BLOCK)
        return xp.ldexp(self.table[codes], self.X[b0:b1, None])

    # the GPU kernels (mx_api.h): stream block b's local values are source
    # elements b * 32 ..; an accumulator holds a tile's blocks from 0
    def _gpu_local(self, b0, acc):
        if acc is None:
            return self.source, b0 * BLOCK
        return self.k.Source(acc.reshape(-1)), 0

    def _gpu_encode(self, b0, b1, payload, acc, slot):
        src, base = self._gpu_local(b0, acc)
        self.k.mx_encode(self.kfmt, self.reduced[b0:b1], self.headroom, src, base, payload,
                         b1 - b0, slot)

    def compress(self, tile, event):
        b0, b1 = self._blocks(tile)
        slot = self.wire_slot(tile)
        if self.gpu:
            self._gpu_encode(b0, b1, None, None, slot)
        else:
            slot[...] = self._encode(self.local[b0:b1], b0, b1)
        return slot

    def accumulate(self, tile, payload, acc):
        b0, b1 = self._blocks(tile)
        if self.gpu:
            if acc is None:
                out = self.xp.empty((b1 - b0) * BLOCK, dtype=np.float32)
                self.k.mx_decode(self.kfmt, self.reduced[b0:b1], self.headroom, payload,
                                 b1 - b0, out, False, self.source, b0 * BLOCK)
                return out
            acc = acc.reshape(-1)
            self.k.mx_decode(self.kfmt, self.reduced[b0:b1], self.headroom, payload,
                             b1 - b0, acc, True)
            return acc
        base = self.local[b0:b1] if acc is None else acc
        return base + self._decode(payload, b0, b1)

    def dar(self, tile, payload, acc, event):
        b0, b1 = self._blocks(tile)
        slot = self.wire_slot(tile)
        if self.gpu:
            self._gpu_encode(b0, b1, payload, acc, slot)
        else:
            slot[...] = self._encode(self.accumulate(tile, payload, acc), b0, b1)
        return slot

    def decode(self, tile, payload):
        b0, b1 = self._blocks(tile)
        if self.gpu:
            self.k.mx_decode(self.kfmt, self.reduced[b0:b1], self.headroom, payload, b1 - b0,
                             self.result[b0 * BLOCK:b1 * BLOCK], False)
        else:
            self.result[b0 * BLOCK:b1 * BLOCK] = self._decode(payload, b0, b1).reshape(-1)

    def finish(self, divisor, out):
        return finish_in_order(self.k, self.xp, self.ws, self.result, divisor, out)

    def report(self, detailed=True):
        return {"format": self.fmt.name, "element_bits": self.fmt.bits,
                "headroom_bits": self.headroom}
