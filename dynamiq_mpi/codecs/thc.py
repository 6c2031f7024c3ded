"""THC baseline (Li et al., NSDI'24) in a multi-hop all-reduce, as the paper
adapts it (docs/design.md, "Baselines"), array code: a randomized Hadamard
rotation per power-of-two block (``H D x * 2^-floor(k/2)``); per block the
smallest power of two R >= max|y|, reduced by MAX (nothing clamped: unbiased,
where the paper clamps at 3.297 deviations); ``v = (y / R + 1) (L - 1) / 2``
rounded stochastically; exact integer sums at ``ceil(log2((L - 1) n + 1))``
bits; decoded as ``(2 S - (L - 1) n) R / (L - 1)``, then rotated back.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..backend import as_float32
from ..errors import NonFiniteInputError, SumOverflowError
from ..rng import splitmix64
from .base import DEFAULT_TILE_BYTES, Codec, Plan, StreamLayout, tile_stream
from .plain import finish_in_order

UNIT = 256              # coordinates per stream record; the smallest Hadamard block
MAX_BLOCK_LOG2 = 23     # the artifact's partitions hold at most 2^23 entries
ROTATION_DOMAIN = 0x7448_4321_5EED_0001
_MASK32 = 0xFFFFFFFF
_GOLDEN32 = np.uint32(0x9E3779B9)
# Statistics bytes: the range exponent e (R = 2^e) is stored as e + _BIAS.
_BIAS = 126
NONFINITE = 255


def aggregation_bits(levels: int, n: int) -> int:
    """ceil(log2((levels - 1) n + 1)): the width of a sum of n codes."""
    return ((levels - 1) * n).bit_length()


# -- shared randomness ---------------------------------------------------------
def _mix32(h):
    """A bijective 32-bit integer hash (lowbias32) of a uint32 array."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x7FEB352D)
    h = h ^ (h >> np.uint32(15))
    h = h * np.uint32(0x846CA68B)
    return h ^ (h >> np.uint32(16))


def coordinate_hash(xp, key: int, start: int, count: int):
    """32 random bits for each coordinate start .. start + count - 1, a pure
    function of (64-bit ``key``, coordinate) on every rank and backend."""
    lo, hi = np.uint32(key & _MASK32), np.uint32(key >> 32)
    c = xp.arange(start, start + count, dtype=np.int64).astype(np.uint32)
    return _mix32(_mix32(c * _GOLDEN32 + lo) ^ hi)


def rotation_key(seed: int) -> int:
    return splitmix64(splitmix64(seed) ^ ROTATION_DOMAIN)


def rotation_signs(xp, key: int, start: int, count: int):
    """float32 +-1 of the diagonal D for coordinates start .. start + count - 1."""
    bit = (coordinate_hash(xp, key, start, count) >> np.uint32(31)).astype(np.float32)
    return np.float32(1) - np.float32(2) * bit


def rounding_uniforms(xp, value_key: int, event: int, start: int, count: int):
    """float32 uniforms on the grid k 2^-24 for the rounding done in ``event``."""
    key = splitmix64(value_key ^ ((event + 1) * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF))
    bits = coordinate_hash(xp, key, start, count) >> np.uint32(8)
    return bits.astype(np.float32) * np.float32(2.0 ** -24)


# -- rotation --------------------------------------------------------------------
def hadamard_blocks(padded: int, max_block_log2: int = MAX_BLOCK_LOG2) -> list:
    """Runs of equal Hadamard blocks covering ``padded`` (a multiple of 256)
    entries: [(start, block size, count)], largest first."""
    if padded % UNIT:
        raise ValueError(f"padded length {padded} is not a multiple of {UNIT}")
    top = 1 << max_block_log2
    runs, at = [], 0
    if padded >= top:
        runs.append((0, top, padded // top))
        at = (padded // top) * top
    for k in range(max_block_log2 - 1, UNIT.bit_length() - 2, -1):
        if (padded - at) & (1 << k):
            runs.append((at, 1 << k, 1))
            at += 1 << k
    return runs


def fwht(rows):
    """Unnormalised Walsh-Hadamard transform (Sylvester order) of the rows of (m, 2^k)."""
    a = rows.copy()
    m, size = a.shape
    h = 1
    while h < size:
        v = a.reshape(m, size // (2 * h), 2, h)
        top = v[:, :, 0, :] + v[:, :, 1, :]
        v[:, :, 1, :] = v[:, :, 0, :] - v[:, :, 1, :]
        v[:, :, 0, :] = top
        h *= 2
    return a


def run_signs(xp, runs, key: int) -> list:
    """The diagonal D of every run of ``runs``: [(count, size) float32 +-1]."""
    return [rotation_signs(xp, key, start, size * count).reshape(count, size)
            for start, size, count in runs]


def rotate(xp, values, runs, key: int, inverse: bool = False, signs=None, out=None):
    """The randomized Hadamard transform (or its inverse) of every block of
    ``values`` ((padded,) or (m, padded) float32) into ``out`` (default new;
    may be ``values``); ``signs``: :func:`run_signs` of (runs, key)."""
    if out is None:
        out = xp.empty_like(values)
    if signs is None:
        signs = run_signs(xp, runs, key)
    lead = values.shape[:-1]
    with np.errstate(over="ignore", invalid="ignore"):     # overflow: caught by the caller
        for (start, size, count), sign in zip(runs, signs, strict=True):
            end = start + size * count
            k = size.bit_length() - 1
            block = values[..., start:end].reshape(*lead, count, size)
            if inverse:
                y = fwht(block.reshape(-1, size)).reshape(block.shape)
                y = y * np.float32(2.0 ** -(k - k // 2)) * sign
            else:
                y = fwht((block * sign).reshape(-1, size)) * np.float32(2.0 ** -(k // 2))
            out[..., start:end] = y.reshape(*lead, end - start)
    return out


def range_bytes(xp, rotated, finite, runs):
    """A range byte per Hadamard block of ``rotated``: the biased exponent of
    the smallest power of two >= max |y|; 0 all zero, 254 the rotation
    overflowed, 255 input not all finite (``finite``: () or (m,) bool)."""
    lead = rotated.shape[:-1]
    amax = xp.concatenate([xp.abs(rotated[..., s:s + b * c].reshape(*lead, c, b)).max(axis=-1)
                           for s, b, c in runs], axis=-1)
    m, k = xp.frexp(amax)
    exponent = k.astype(np.int32) - (m == np.float32(0.5)).astype(np.int32)  # R = 2^e >= amax
    byte = xp.clip(exponent + _BIAS, 1, NONFINITE - 1)
    byte = xp.where(amax == 0, 0, byte)
    byte = xp.where(xp.isfinite(amax), byte, NONFINITE - 1)   # the rotation overflowed
    byte = xp.where(finite[..., None], byte, NONFINITE)
    return byte.astype(np.uint8)


# -- packing ---------------------------------------------------------------------
@lru_cache(maxsize=64)
def _bit_pieces(bits: int) -> tuple:
    """How 8 codes of ``bits`` bits fill ``bits`` bytes, low bits first:
    (code, byte, shift in the byte, bits taken, bit offset in the code)."""
    pieces = []
    for j in range(8):
        pos, done = j * bits, 0
        while done < bits:
            byte, shift = divmod(pos, 8)
            take = min(8 - shift, bits - done)
            pieces.append((j, byte, shift, take, done))
            pos += take
            done += take
    return tuple(pieces)


def pack_codes(xp, codes, bits: int):
    """uint32 codes (a multiple of 8, each < 2^bits) -> bits/8 bytes per code."""
    groups = codes.reshape(-1, 8)
    out = xp.zeros((groups.shape[0], bits), dtype=np.uint32)
    for j, byte, shift, take, offset in _bit_pieces(bits):
        piece = (groups[:, j] >> np.uint32(offset)) & np.uint32((1 << take) - 1)
        out[:, byte] |= piece << np.uint32(shift)
    return out.astype(np.uint8).reshape(-1)


def unpack_codes(xp, data, bits: int):
    """Inverse of :func:`pack_codes`: uint32 codes."""
    rows = data.reshape(-1, bits).astype(np.uint32)
    codes = xp.zeros((rows.shape[0], 8), dtype=np.uint32)
    for j, byte, shift, take, offset in _bit_pieces(bits):
        piece = (rows[:, byte] >> np.uint32(shift)) & np.uint32((1 << take) - 1)
        codes[:, j] |= piece << np.uint32(offset)
    return codes.reshape(-1)


@dataclass(frozen=True)
class THC(Codec):
    """Randomized Hadamard transform, ``levels``-level unbiased quantization per
    block, exact integer sums at ``agg_bits`` (None: the minimum) bits."""
    levels: int = 16
    agg_bits: int | None = None
    max_block_log2: int = MAX_BLOCK_LOG2
    rotation_seed: int = 0

    name = "thc"
    fused_gpu = False             # CuPy array code on the GPU
    rejects_nonfinite = True

    def __post_init__(self):
        if not 2 <= int(self.levels) <= 256:
            raise ValueError(f"levels must be in [2, 256], got {self.levels}")
        if self.agg_bits is not None and not 1 <= int(self.agg_bits) <= 32:
            raise ValueError(f"agg_bits must be in [1, 32] or None, got {self.agg_bits}")
        if not UNIT.bit_length() - 1 <= int(self.max_block_log2) <= 30:
            raise ValueError(f"max_block_log2 must be in [8, 30], got {self.max_block_log2}")
        if int(self.rotation_seed) < 0:
            raise ValueError("rotation_seed must be non-negative")

    def signature(self):
        return ("thc", int(self.levels), self.agg_bits, int(self.max_block_log2),
                int(self.rotation_seed))

    def rotation(self, length: int, keys=None) -> tuple:
        """(padded length, Hadamard runs, rotation key) of ``length`` entries,
        alike on every rank (``rotation_seed`` and the call keys)."""
        padded = -(-length // UNIT) * UNIT
        key = rotation_key(int(self.rotation_seed))
        if keys is not None:                     # the engine's call keys: a rotation per call
            key ^= int(keys.perm)
        return padded, hadamard_blocks(padded, int(self.max_block_log2)), key

    def local_stats(self, x, backend, workspace, keys=None):
        """Rotate the padded input; one range byte per Hadamard block."""
        xp = backend.xp
        length = x.shape[0]
        padded, runs, key = self.rotation(length, keys)
        values = xp.zeros(padded, dtype=np.float32)
        values[:length] = as_float32(x)
        rotated = rotate(xp, values, runs, key)
        return range_bytes(xp, rotated, xp.isfinite(values).all(), runs), (rotated, runs, key)

    def plan(self, x, reduced_stats, n, keys, backend, local_state, workspace,
             tile_bytes=DEFAULT_TILE_BYTES):
        return _THCPlan(self, x, reduced_stats, n, keys, backend, local_state, workspace,
                        tile_bytes)


class _THCPlan(Plan):
    def __init__(self, codec, x, reduced, n, keys, backend, local, ws, tile_bytes):
        self.xp, self.k, self.ws = backend.xp, backend.kernels, ws
        xp = self.xp
        self.rotated, self.runs, self.rotation_key = local
        self.value_key = keys.value
        self.length, self.n = x.shape[0], n
        self.levels = int(codec.levels)
        top = int(xp.max(reduced))
        if top == NONFINITE:
            raise NonFiniteInputError("input holds NaN or Inf on at least one rank")
        need = aggregation_bits(self.levels, n)
        self.bits = need if codec.agg_bits is None else int(codec.agg_bits)
        if self.bits < need:
            raise ValueError(f"THC at n={n} with {self.levels} levels needs at least {need} "
                             f"aggregation bits, got agg_bits={self.bits}")
        largest_k = max(b for _, b, _ in self.runs).bit_length() - 1
        if top and top - _BIAS + (n - 1).bit_length() + largest_k > 127:
            raise SumOverflowError("the rotated inputs times the number of ranks exceed the "
                                   "float32 range: the sum or its inverse rotation could overflow")
        # per 256-entry unit: its block's range exponent, and whether it is zero
        repeats = [b // UNIT for _, b, c in self.runs for _ in range(c)]
        unit_byte = xp.repeat(reduced, repeats)
        self.zero_units = (unit_byte == 0)[:, None]
        self.unit_exp = xp.where(unit_byte == 0, 0,
                                 unit_byte.astype(np.int32) - _BIAS).astype(np.int32)[:, None]
        self.units = int(unit_byte.shape[0])
        self.tiling = tile_stream(StreamLayout([(self.units, UNIT * self.bits // 8)]), n,
                                  tile_bytes)
        self.wire = ws.take(xp, "thc.wire", self.tiling.wire_bytes, np.uint8)
        self.result = ws.take(xp, "thc.result", self.units * UNIT, np.float32)
        self.blocks = len(repeats)
        self.stats_bytes = int(reduced.shape[0])

    def scratch(self, nbytes):
        return self.ws.take(self.xp, "thc.recv", nbytes, np.uint8)

    def _codes(self, tile, event):
        """This rank's stochastically rounded codes (uint32) of ``tile``."""
        xp = self.xp
        u0, u1 = self.tiling.units[tile]
        y = self.rotated[u0 * UNIT:u1 * UNIT].reshape(-1, UNIT)
        half = np.float32((self.levels - 1) / 2)
        v = (xp.ldexp(y, -self.unit_exp[u0:u1]) + np.float32(1)) * half     # in [0, L-1]
        low = xp.floor(v)
        u = rounding_uniforms(xp, self.value_key, event, u0 * UNIT, (u1 - u0) * UNIT)
        up = u.reshape(-1, UNIT) < v - low
        return (low.astype(np.uint32) + up.astype(np.uint32)).reshape(-1)

    def compress(self, tile, event):
        slot = self.wire_slot(tile)
        slot[...] = pack_codes(self.xp, self._codes(tile, event), self.bits)
        return slot

    def accumulate(self, tile, payload, acc):
        # the received sums only: own codes join in ``dar``, which knows the event
        sums = unpack_codes(self.xp, payload, self.bits)
        return sums if acc is None else sums + acc

    def dar(self, tile, payload, acc, event):
        slot = self.wire_slot(tile)
        total = self.accumulate(tile, payload, acc) + self._codes(tile, event)
        slot[...] = pack_codes(self.xp, total, self.bits)
        return slot

    def decode(self, tile, payload):
        xp = self.xp
        u0, u1 = self.tiling.units[tile]
        sums = unpack_codes(xp, payload, self.bits).reshape(-1, UNIT).astype(np.int64)
        centred = (2 * sums - (self.levels - 1) * self.n).astype(np.float32)
        values = xp.ldexp(centred / np.float32(self.levels - 1), self.unit_exp[u0:u1])
        values = xp.where(self.zero_units[u0:u1], np.float32(0), values)
        self.result[u0 * UNIT:u1 * UNIT] = values.reshape(-1)

    def finish(self, divisor, out):
        restored = rotate(self.xp, self.result, self.runs, self.rotation_key, inverse=True)
        return finish_in_order(self.k, self.xp, self.ws, restored, divisor, out)

    def report(self, detailed=True):
        return {"levels": self.levels, "aggregation_bits": self.bits,
                "hadamard_blocks": [(b, c) for _, b, c in self.runs],
                "padded_length": self.units * UNIT, "range_bytes": self.stats_bytes}
