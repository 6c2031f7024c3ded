"""An independent pure-NumPy model of the DynamiQ codec math (spec section 2).

Written from the spec and from the *description* of the header
(``src_cuda/dq_codec.h``), never calling the compiled extension.  Conventions:

* 32-bit hash arithmetic is done in ``uint64`` arrays with explicit masking to
  32 bits (``& MASK32``), so no NumPy overflow warning and no wraparound
  surprise can hide a difference;
* rounding probabilities and the value math are float64 (the model rounds
  "toward +inf iff u < p" with the exact p of the spec);
* decoded values are the float32 product ``level * scale`` (that is the wire
  format's definition of a decoded value), float32 sums stay float32.

Where float32 and float64 legitimately differ (the compiled quantizer computes
p in float32) the model returns, besides its codes, the continuous code
position ``c`` and the uniform ``u`` it used, so a test can check that every
disagreement is an adjacent code with ``u`` within rounding distance of the
threshold.

Generator (dq_codec.h, "per event"): the full hash runs once per (group, event),
the group G = uint32(super-group * 16 + g) (= coordinate >> 4 while the stream
has < 2^28 groups) and each of its 16 lanes j (= coordinate & 15) derives its
32-bit uniform with one multiplication, ``lane_uniform(base, j)`` = base *
lane_mul(j) mod 2^32, lane_mul(j) = mix32(j * 0x9e3779b9 + 0x632be5ab) | 1 (odd:
a bijection of base for each j).  The value-rounding uniform is g =
lane_uniform(event_uniform(key_value, G, event), j) (``value_uniform``).  Group
scale codes are deterministic (spec 2.7): the smallest c with c * unit >= group
max, and values are normalised by c * unit.

Correlated rounding: the stratum of event e at lane j of group G is
``pi = (sigma_S(e) + shift_{G,j}) mod n`` (``stratum``): sigma_S a keyed 12-round
Feistel permutation with cycle walking, seeded per super-group S = G >> 4 (shared
by its 256 coordinates, ``perm_base``), and shift_{G,j} =
floor(lane_uniform(mix32(G ^ key_perm ^ 0xbb67ae85), j) n / 2^32) the lane's
offset, the same for every event (``lane_shift``).  The uniform is u = (pi + g /
2^32) / n.  The 16 lanes of a group are NOT independent (their uniforms are fixed
functions of one base), each lane on its own is exactly uniform.

Non-finite values follow the header: a NaN never wins a group / super-group
max (``abs_max``), t = x / scale with |t| >= 1 quantizes as |t| = 1 and a NaN t
(an inf over an inf scale) as 0, on the side of the sign of x; the statistics' mean is 0 when some |x| >
2^127 (``MEAN_ABSMAX_LIMIT``); the hierarchical BF16 unit steps one ulp down
where 255 units would exceed FLT_MAX (``unit_bf16_bits``).

Everything is vectorised over super-groups: shapes are (nsg, 16 groups, 16).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

SUPER = 256
GROUP = 16
GROUPS = 16
MASK32 = 0xFFFFFFFF
FLT_MAX = float(np.finfo(np.float32).max)
BF16 = ml_dtypes.bfloat16
BF16_MAX_BITS = 0x7F7F


# --------------------------------------------------------------------- hashing
def _u32(a) -> np.ndarray:
    """Python ints / arrays -> uint64 array holding the value mod 2^32."""
    if isinstance(a, np.ndarray):
        return a.astype(np.uint64) & MASK32
    return np.asarray(int(a) & MASK32, dtype=np.uint64)


def mix32(x) -> np.ndarray:
    """Two multiply-xorshift rounds on 32-bit words."""
    x = _u32(x)
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    x = x ^ (x >> 16)
    return x


def event_uniform(key, index, event) -> np.ndarray:
    """The full hash: a 32-bit uniform of one (index, event) under a key (dq_event_uniform;
    the codec calls it per (group, event): the value bases)."""
    inner = mix32((_u32(index) + _u32(key)) & MASK32)
    salt = (_u32(event) * 0x9E3779B9 + 0x632BE5AB) & MASK32
    return mix32(inner ^ salt)


def perm_bits_for(n: int) -> int:
    """Smallest m with 2^m >= n."""
    return max(0, (int(n) - 1).bit_length())


FEISTEL_ROUNDS = 12


def _feistel_round(h, rnd: int, v) -> np.ndarray:
    t = (((v + 1) & MASK32) * 0x9E3779B1) & MASK32
    t = t ^ ((h + rnd * 0x85EBCA77) & MASK32)
    t = t ^ (t >> 15)
    t = (t * 0x2C1B3C6D) & MASK32
    t = t ^ (t >> 12)
    t = (t * 0x297A2D39) & MASK32
    t = t ^ (t >> 15)
    return t


def _feistel(x, bits: int, h) -> np.ndarray:
    """One pass of the unbalanced Feistel network: even rounds update the low
    half from the high half, odd rounds the high half from the low half."""
    lo_bits = bits >> 1
    hi_bits = bits - lo_bits
    lo_mask = (1 << lo_bits) - 1
    hi_mask = (1 << hi_bits) - 1
    lo = x & lo_mask
    hi = x >> lo_bits
    for r in range(0, FEISTEL_ROUNDS, 2):
        lo = lo ^ (_feistel_round(h, r, hi) & lo_mask)
        hi = hi ^ (_feistel_round(h, r + 1, lo) & hi_mask)
    return (hi << lo_bits) | lo


def permute(x, n: int, bits: int, h, max_walk: int = 1 << 16) -> np.ndarray:
    """Keyed permutation of 0..n-1 (12-round Feistel on `bits` bits, cycle walking)."""
    h = _u32(h)
    x = np.broadcast_to(_u32(x), h.shape).copy()
    if n <= 1:
        return np.zeros_like(x)
    x = _feistel(x, bits, h)
    for _ in range(max_walk):
        out = x >= n
        if not out.any():
            return x
        x[out] = _feistel(x[out], bits, h[out])
    raise RuntimeError("cycle walking did not terminate")


def group_perm_seed(key_perm, group) -> np.ndarray:
    """Seed h of the Feistel permutation sigma_S shared by the 256 coordinates of the
    super-group S = group >> 4 of group G."""
    return mix32((_u32(group) >> np.uint64(4)) ^ _u32(key_perm))


def perm_base(key_perm, group, event, n: int) -> np.ndarray:
    """sigma_S(event): the Feistel image of the event for the super-group of `group`
    (dq_sg_sigma)."""
    return permute(np.uint64(event), n, perm_bits_for(n), group_perm_seed(key_perm, group))


def lane_mul(lane) -> np.ndarray:
    """Lane j's odd multiplier mix32(j * 0x9e3779b9 + 0x632be5ab) | 1 (dq_lane_mul)."""
    return mix32((_u32(lane) * 0x9E3779B9 + 0x632BE5AB) & MASK32) | np.uint64(1)


def lane_uniform(base, lane) -> np.ndarray:
    """One lane's 32-bit uniform from its group's base (dq_lane_uniform):
    base * lane_mul(lane) mod 2^32."""
    return (_u32(base) * lane_mul(lane)) & MASK32


def value_uniform(key_value, group, lane, event) -> np.ndarray:
    """The value-rounding uniform g32 of lane `lane` of group `group` for one event."""
    return lane_uniform(event_uniform(key_value, group, event), lane)


def shift_base(key_perm, group) -> np.ndarray:
    """The group's base of the per-lane cyclic offsets (the same for every event)."""
    return mix32(_u32(group) ^ _u32(key_perm) ^ 0xBB67AE85)


def lane_shift(key_perm, group, lane, n: int) -> np.ndarray:
    """The lane's cyclic offset floor(lane_uniform(shift_base, lane) n / 2^32):
    uniform on 0..n-1 up to n / 2^32."""
    return (lane_uniform(shift_base(key_perm, group), lane) * np.uint64(n)) >> np.uint64(32)


def stratum(key_perm, group, lane, event, n: int) -> np.ndarray:
    """pi = (sigma_group(event) + shift_{group,lane}) mod n (group a uint32, lane 0..15)."""
    group = _u32(group)
    if n <= 1:
        return np.zeros(np.broadcast_shapes(group.shape, np.shape(lane)), np.uint64)
    base = perm_base(key_perm, group, event, n)
    return (base + lane_shift(key_perm, group, lane, n)) % np.uint64(n)


def coord_group_lane(coord):
    """(group, lane) of 32-bit stream coordinates (valid while the group index < 2^28)."""
    coord = _u32(coord)
    return coord >> np.uint64(4), coord & np.uint64(15)


# --------------------------------------------------------------------- rounding helpers
def f32_up(v) -> np.ndarray:
    """Round non-negative float64 up to float32 (no saturation)."""
    v = np.asarray(v, dtype=np.float64)
    with np.errstate(over="ignore"):
        f = v.astype(np.float32)
    low = f.astype(np.float64) < v
    f = np.where(low, np.nextafter(f, np.float32(np.inf)), f)
    return f.astype(np.float32)


def norm2_to_f32(s) -> np.ndarray:
    """F: float64 -> float32 rounded up, saturated at FLT_MAX."""
    s = np.asarray(s, dtype=np.float64)
    out = f32_up(np.minimum(s, FLT_MAX))
    return np.where(s > FLT_MAX, np.float32(FLT_MAX), out).astype(np.float32)


def bf16_up_bits(v) -> np.ndarray:
    """Smallest BF16 >= v (v >= 0, float64), saturated at the largest finite BF16; uint16 bits."""
    v = np.asarray(v, dtype=np.float64)
    with np.errstate(over="ignore"):
        b = v.astype(BF16)
    bits = b.view(np.uint16).astype(np.uint32)
    low = b.astype(np.float64) < v
    bits = bits + low.astype(np.uint32)
    bits = np.where(bits >= 0x7F80, BF16_MAX_BITS, bits)
    return bits.astype(np.uint16)


def bf16_bits_to_f32(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint16).view(BF16).astype(np.float32)


def unit_bf16_bits(smax) -> np.ndarray:
    """BF16 unit of a super-group (bits) from its largest group max (float32, >= 0):
    the smallest BF16 >= smax / 255 (0 for smax = 0), one BF16 ulp lower where 255 times
    that would exceed FLT_MAX (there the group codes saturate at 255)."""
    smax = np.asarray(smax, np.float32)
    bits = np.where(smax > 0, bf16_up_bits(smax.astype(np.float64) / 255.0), 0).astype(np.uint16)
    over = bf16_bits_to_f32(bits).astype(np.float64) * 255.0 > FLT_MAX
    return np.where(over, bits - np.uint16(1), bits).astype(np.uint16)


def abs_max(v, axis) -> np.ndarray:
    """max |v| as the kernels take it (m = a > m ? a : m from 0): NaN never wins."""
    a = np.abs(np.asarray(v, np.float32))
    return np.where(np.isnan(a), np.float32(0), a).max(axis=axis)


# --------------------------------------------------------------------- tables
_LEVELS = None


def load_levels():
    """dynamiq_mpi.codecs.levels (the host-built tables are an input of the kernels).

    Falls back to loading the file directly when the package's __init__ cannot
    be imported (it is under concurrent development)."""
    global _LEVELS
    if _LEVELS is None:
        try:
            from dynamiq_mpi.codecs import levels as mod
        except Exception:  # pragma: no cover - only while the package is broken
            import importlib.util
            from pathlib import Path
            path = Path(__file__).resolve().parents[1] / "dynamiq_mpi" / "codecs" / "levels.py"
            spec = importlib.util.spec_from_file_location("_dq_levels_for_tests", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
        _LEVELS = mod
    return _LEVELS


@dataclass
class Model:
    width: int
    eps: float
    hierarchical: bool
    correlated: bool = False
    n_events: int = 1
    keys: tuple = (0, 0)          # (key_value, key_perm)
    mag: np.ndarray = field(default=None, repr=False)     # float32[R+1]
    level: np.ndarray = field(default=None, repr=False)   # float32[2R+1]
    scale_rule: int = 0           # group codes: 0 rounded up (spec 2.7), 1 hybrid

    def __post_init__(self):
        if self.mag is None:
            t = load_levels().build_tables(self.width, self.eps)
            self.mag = np.asarray(t.mag, np.float32)
        R = self.radius
        self.mag = np.asarray(self.mag, np.float32)
        if self.level is None:
            self.level = np.concatenate([-self.mag[:0:-1], self.mag]).astype(np.float32)
        assert self.mag.shape == (R + 1,) and self.level.shape == (2 * R + 1,)
        if hasattr(self.keys, "value"):
            self.keys = (self.keys.value, self.keys.perm)

    @property
    def radius(self) -> int:
        return (1 << (self.width - 1)) - 1

    @property
    def n(self) -> int:
        return int(self.n_events) if self.correlated else 1

    def record_bytes(self) -> int:
        cb = SUPER * self.width // 8
        return cb + GROUPS + 2 if self.hierarchical else cb + 2 * GROUPS

    def run_bytes(self, nsg: int) -> int:
        return nsg * self.record_bytes()


def pad_to_super(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32).ravel()
    nsg = -(-x.shape[0] // SUPER)
    out = np.zeros(nsg * SUPER, np.float32)
    out[: x.shape[0]] = x
    return out


# --------------------------------------------------------------------- sources / stats
def source_values(x, nsg: int, sg_base: int = 0, sg_map=None, sg_offset: int = 0, mean=None):
    """Local float32 values of stream super-groups sg_base..sg_base+nsg (DqSource semantics)."""
    x = np.asarray(x)
    if x.dtype != np.float32:
        x = x.astype(np.float32)   # bfloat16 -> float32 is exact
    s = np.arange(sg_base, sg_base + nsg, dtype=np.int64)
    rows = np.asarray(sg_map, np.int64)[s] if sg_map is not None else s - sg_offset
    k = rows[:, None] * SUPER + np.arange(SUPER)[None, :]
    valid = k < x.shape[0]
    v = np.where(valid, x[np.where(valid, k, 0)], np.float32(0)).astype(np.float32)
    if mean is not None:
        with np.errstate(over="ignore", invalid="ignore"):
            v = (v - np.asarray(mean, np.float32)[rows][:, None]).astype(np.float32)
    return v.reshape(-1)


def tree_sum256(v, dtype=np.float64) -> np.ndarray:
    """The halving tree v[i] += v[i+h], h = 128..1, row-wise, in ``dtype``
    (float64: the norm; float32: the mean, of values scaled by 2^-8)."""
    v = np.array(v, dtype=dtype).reshape(-1, SUPER)
    h = SUPER // 2
    while h >= 1:
        v[:, :h] = v[:, :h] + v[:, h: 2 * h]
        h //= 2
    return v[:, 0].copy()


MEAN_ABSMAX_LIMIT = np.float32(1.7014118e38)   # = 2^127 in float32


def stats_model(x, nsg: int, centre: bool):
    """(mean float32[nsg], F float32[nsg], non-finite count) as the spec defines them."""
    v = source_values(x, nsg).reshape(nsg, SUPER)
    with np.errstate(over="ignore", invalid="ignore"):
        if centre:
            # no centring where some |x| > FLT_MAX / 2 = 2^127: x - mean could overflow
            mu = tree_sum256(v * np.float32(2.0 ** -8), np.float32)
            mu = np.where(abs_max(v, 1) <= MEAN_ABSMAX_LIMIT, mu, np.float32(0)).astype(np.float32)
        else:
            mu = np.zeros(nsg, np.float32)
        c = (v - mu[:, None]).astype(np.float32).astype(np.float64)
        F = norm2_to_f32(tree_sum256(c * c))
    return mu, F, int(np.count_nonzero(~np.isfinite(v)))


# --------------------------------------------------------------------- packing / layout
def pack_codes(codes: np.ndarray, width: int) -> np.ndarray:
    """codes (..., 16) -> bytes (..., 2*width): code j at byte j*w/8, bit (j*w)%8."""
    per = 8 // width
    c = codes.astype(np.uint32).reshape(codes.shape[:-1] + (GROUP // per, per))
    shifts = (width * np.arange(per)).astype(np.uint32)
    return (c << shifts).sum(axis=-1).astype(np.uint8)


def unpack_codes(packed: np.ndarray, width: int) -> np.ndarray:
    per = 8 // width
    shifts = (width * np.arange(per)).astype(np.uint32)
    c = (packed.astype(np.uint32)[..., None] >> shifts) & ((1 << width) - 1)
    return c.reshape(packed.shape[:-1] + (GROUP,)).astype(np.int64)


def split_run(buf, nsg: int, width: int, hierarchical: bool):
    """SoA wire layout of a run -> (codes (nsg,16,16), meta).

    meta = (group codes uint8 (nsg,16), units uint16 (nsg,)) when hierarchical,
    else group scales uint16 (nsg,16)."""
    buf = np.frombuffer(bytes(buf), dtype=np.uint8)
    cb = nsg * SUPER * width // 8
    codes = unpack_codes(buf[:cb].reshape(nsg, GROUPS, 2 * width), width)
    rest = buf[cb:]
    if hierarchical:
        assert rest.shape[0] == nsg * (GROUPS + 2)
        gcodes = rest[: nsg * GROUPS].reshape(nsg, GROUPS)
        units = rest[nsg * GROUPS:].view("<u2").astype(np.uint16)
        return codes, (gcodes, units)
    assert rest.shape[0] == nsg * 2 * GROUPS
    return codes, rest.view("<u2").astype(np.uint16).reshape(nsg, GROUPS)


def join_run(codes, meta, width: int, hierarchical: bool) -> bytes:
    parts = [pack_codes(codes, width).ravel()]
    if hierarchical:
        gcodes, units = meta
        parts += [gcodes.astype(np.uint8).ravel(), units.astype("<u2").view(np.uint8)]
    else:
        parts += [meta.astype("<u2").ravel().view(np.uint8)]
    return np.concatenate(parts).tobytes()


# --------------------------------------------------------------------- quantizer
def uniforms(m: Model, group, lane, event):
    """u in [0, 1) (float64) of each (group, lane) for this event, plus (g32, pi)."""
    g32 = value_uniform(m.keys[0], group, lane, event)
    n = m.n
    if m.correlated and n > 1:
        pi = stratum(m.keys[1], group, lane, event, n)
    else:
        pi = np.zeros_like(g32)
    u = (pi.astype(np.float64) + g32.astype(np.float64) / 2.0 ** 32) / n
    return u, g32, pi


def quantize(m: Model, x, scale, u):
    """Value-space stochastic rounding of x / scale between adjacent levels.

    Returns (codes in [0, 2R], lower code, p).  Round toward +inf iff u < p,
    p = distance to the lower level over the gap: code = lower + [u < p]."""
    R = m.radius
    mag = m.mag.astype(np.float64)
    x = np.asarray(x, np.float64)
    scale = np.asarray(scale, np.float64)
    with np.errstate(invalid="ignore"):
        t = x / scale                        # NaN for NaN x, and for inf x over an inf scale
    a = np.abs(t)
    a = np.where(np.isnan(a), 0.0, np.minimum(a, 1.0))   # |t| >= 1 maps to 1, NaN to 0 (the header)
    k = np.searchsorted(mag[:R], a, side="right") - 1       # largest k <= R-1, mag[k] <= a
    gap = mag[k + 1] - mag[k]
    neg = x < 0                              # the side of x (= that of t unless t is NaN)
    p = np.where(neg, (mag[k + 1] - a) / gap, (a - mag[k]) / gap)
    lower = np.where(neg, R - (k + 1), R + k)
    up = u < p
    return (lower + up).astype(np.int64), lower.astype(np.int64), p


@dataclass
class Encoded:
    """Everything the model decided for one run (for diagnostics)."""
    data: bytes
    codes: np.ndarray        # (nsg, 16, 16) int
    cont: np.ndarray         # (nsg, 16, 16) continuous code position lower + p (float64)
    u: np.ndarray            # (nsg, 16, 16) uniform used (float64)
    norm_scale: np.ndarray   # (nsg, 16) float32 scale the values were normalised by
    meta: object
    lower: np.ndarray = None         # (nsg, 16, 16) code rounded to when not rounding up
    p: np.ndarray = None             # (nsg, 16, 16) probability of rounding up (float64)


def encode(m: Model, x, event: int, sg_base: int = 0) -> Encoded:
    x = pad_to_super(x).reshape(-1, GROUPS, GROUP)
    nsg = x.shape[0]
    R = m.radius
    gmax = abs_max(x, 2)                                      # float32 (nsg, 16), NaN ignored
    sg_index = np.int64(sg_base) + np.arange(nsg, dtype=np.int64)
    if m.hierarchical:
        smax = gmax.max(axis=1)
        units = unit_bf16_bits(smax)
        unit = bf16_bits_to_f32(units)                         # float32 (nsg,)
        # the smallest integer c with c * unit >= s, from exact float64 arithmetic
        # (the quotient of two floats is far from an integer or exactly one, so
        # float64's ceil is exact; the product check states the definition)
        s64, u64 = gmax.astype(np.float64), unit.astype(np.float64)[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            code = np.ceil(np.where(u64 > 0, s64 / np.where(u64 > 0, u64, 1.0), 0.0))
        code = np.where(code * u64 < s64, code + 1, code)
        code = np.minimum(code, 255.0)                          # saturation near FLT_MAX
        code = np.where((gmax > 0) & (u64 > 0), code, 0.0)
        with np.errstate(over="ignore"):                        # inf only for non-finite maxima
            norm_scale = (code * u64).astype(np.float32)         # the decoded scale, exact
        if m.scale_rule == 1:
            # hybrid (dq_scale_code_hybrid): where the rounded-up code is >= 128, floor(f)
            # or floor(f) + 1 for f = RN32(s / unit), up with probability frac(f) against
            # a 24-bit uniform of (group, event); values normalised by s itself
            gidx = (sg_index[:, None] * GROUPS + np.arange(GROUPS)[None, :]) & MASK32
            u = event_uniform(m.keys[0] ^ 0x5CA1AB1E, gidx, event)
            with np.errstate(divide="ignore", invalid="ignore"):
                f = (gmax / np.where(unit > 0, unit, np.float32(1))[:, None]).astype(np.float32)
            fl = np.floor(f)
            frac = (f - fl).astype(np.float32)
            up = (u >> 8).astype(np.float32) < frac * np.float32(16777216.0)
            hybrid = code >= 128
            code = np.where(hybrid, np.minimum(fl.astype(np.float64) + up, 255.0), code)
            norm_scale = np.where(hybrid, gmax, norm_scale).astype(np.float32)
        gcodes = code.astype(np.uint8)
        meta = (gcodes, units)
    else:
        gs = np.where(gmax > 0, bf16_up_bits(gmax.astype(np.float64)), 0).astype(np.uint16)
        meta = gs
        norm_scale = bf16_bits_to_f32(gs)
    group = ((sg_index[:, None] * GROUPS + np.arange(GROUPS)[None, :]) & MASK32)[:, :, None]
    u, _, _ = uniforms(m, group, np.arange(GROUP)[None, None, :], event)
    zero = norm_scale <= 0
    safe = np.where(zero, np.float32(1), norm_scale)[:, :, None]
    codes, lower, p = quantize(m, x, safe, u)
    codes = np.where(zero[:, :, None], R, codes)
    lower = np.where(zero[:, :, None], R, lower)
    p = np.where(zero[:, :, None], 0.0, p)
    return Encoded(join_run(codes, meta, m.width, m.hierarchical), codes, lower + p, u,
                   norm_scale.astype(np.float32), meta, lower, p)


def decode_scales(m: Model, meta) -> np.ndarray:
    if m.hierarchical:
        gcodes, units = meta
        unit = bf16_bits_to_f32(units)
        with np.errstate(over="ignore"):
            return (gcodes.astype(np.float32) * unit[:, None]).astype(np.float32)
    return bf16_bits_to_f32(meta)


def decode(m: Model, buf, nsg: int) -> np.ndarray:
    """float32 values level[code] * scale (float32 product), flat nsg*256."""
    codes, meta = split_run(buf, nsg, m.width, m.hierarchical)
    scale = decode_scales(m, meta)
    with np.errstate(over="ignore", invalid="ignore"):
        v = (m.level[codes] * scale[:, :, None]).astype(np.float32)
    return v.reshape(-1)


# --------------------------------------------------------------------- public model API
def make_model(width, eps, hierarchical, correlated=False, n_events=1, keys=(0, 0),
               scale_rule=0) -> Model:
    return Model(width, eps, bool(hierarchical), bool(correlated), int(n_events), keys,
                 scale_rule=int(scale_rule))


def compress_model(x, width, eps, hierarchical, correlated, n_events, event, keys, sg_base=0) -> bytes:
    m = make_model(width, eps, hierarchical, correlated, n_events, keys)
    return encode(m, x, event, sg_base).data


def decompress_model(buf, nsg, width, eps, hierarchical) -> np.ndarray:
    """Decoded values as float64 (each the float32 product level * scale, exactly;
    ``decode`` returns the same values as float32)."""
    return decode(make_model(width, eps, hierarchical), buf, nsg).astype(np.float64)


def dar_model(m: Model, buf, local, event: int, sg_base: int = 0) -> Encoded:
    """Fused decompress-accumulate-recompress: encode(decode(in) + local) in float32."""
    local = pad_to_super(local)
    nsg = local.shape[0] // SUPER
    with np.errstate(over="ignore", invalid="ignore"):
        s = (decode(m, buf, nsg) + local).astype(np.float32)
    return encode(m, s, event, sg_base)


def finish_model(stream, stream_of_sg, mean_sum, divisor, length, dtype):
    stream = np.asarray(stream, np.float32)
    stream_of_sg = np.asarray(stream_of_sg, np.int64)
    nsg = stream_of_sg.shape[0]
    idx = np.maximum(stream_of_sg, 0)[:, None] * SUPER + np.arange(SUPER)[None, :]
    v = np.where(stream_of_sg[:, None] >= 0,
                 stream[np.minimum(idx, max(stream.shape[0] - 1, 0))] if stream.size else 0,
                 np.float32(0)).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        v = (v + np.asarray(mean_sum, np.float32)[:, None]).astype(np.float32)
        if np.float32(divisor) != np.float32(1):
            v = (v / np.float32(divisor)).astype(np.float32)
    v = v.reshape(-1)[:length]
    return v.astype(BF16) if dtype == "bfloat16" else v
