"""The compiled CPU codec (dynamiq_mpi._cpu) against the independent NumPy model
(tests/reference_model.py).  Serial, no MPI.

Every test draws fresh random inputs.  The run's seed is printed in every
assertion message; rerun with ``DQ_TEST_SEED=<seed>`` to reproduce a failure.

Where the compiled quantizer and the model may legitimately differ
-----------------------------------------------------------------
The kernel computes the rounding probability p in float32 (t = x * (1/s),
a - mag[k], times a float32 1/gap, times n, minus pi, truncated to an integer
threshold); the model uses float64.  A code may therefore differ only where the
uniform u falls between the two thresholds.  With ``c`` the model's continuous
code position (code = floor(c) + [u < frac(c)]), a disagreement implies
``dist(c - u, Z) <= |c32 - c64|``, and we bound

    |c32 - c64| <= tol = (2^-19 * a + 2^-148) / gap_min + 2^-20

(a = |x| / s <= 1, gap_min the smallest level gap next to a; 2^-19 allows eight
float32 roundings of a, 2^-20 the float32 arithmetic on p, n p and the
threshold).  The test requires of every differing code: the two codes are
adjacent levels and the model's uniform was within ``tol`` of its threshold;
and of the count: <= sum(2 tol) + 6 sqrt(sum(2 tol)) + 3.  (In practice 0 to a
few of the ~1.5e6 codes of a run differ.)  Group scale codes, BF16 units and
BF16 group scales must be identical: they are deterministic (spec 2.7), the
smallest code c with c * unit >= group max, which exact arithmetic decides.
"""
from __future__ import annotations

import glob
import math
import os
import secrets
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from tests import reference_model as M

ROOT = Path(__file__).resolve().parents[1]
SEED = int(os.environ.get("DQ_TEST_SEED", secrets.randbits(48)))
TAG = f"[reproduce with DQ_TEST_SEED={SEED}]"
FLT_MAX = np.float32(np.finfo(np.float32).max)
DEFAULT_EPS = {2: 0.27, 4: 0.20, 8: 0.08}
WIDTHS = (2, 4, 8)
CORR = [(False, 1), (True, 1), (True, 2), (True, 3), (True, 5), (True, 8)]


# ----------------------------------------------------------------------------- extension
def _load_kernels():
    so = glob.glob(str(ROOT / "dynamiq_mpi" / "_cpu*.so"))
    if not so:
        pytest.skip("dynamiq_mpi._cpu is not built: .venv/bin/python setup.py build_ext --inplace",
                    allow_module_level=True)
    sources = [ROOT / "src_cuda" / f for f in ("dq_codec.h", "dq_api.h", "dq_cpu.cpp")]
    sources.append(ROOT / "pyx" / "_cpu.pyx")
    newest = max(p.stat().st_mtime for p in sources if p.exists())
    if os.path.getmtime(so[0]) < newest:
        warnings.warn("dynamiq_mpi/_cpu*.so is older than its sources; rebuild with "
                      "`.venv/bin/python setup.py build_ext --inplace`")
    try:
        from dynamiq_mpi import _cpu
    except Exception:  # the package __init__ is under development: load the .so alone
        import importlib.util
        spec = importlib.util.spec_from_file_location("dynamiq_mpi._cpu", so[0])
        _cpu = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_cpu)
    return _cpu


def _load_py(name, relpath):
    try:
        import importlib
        return importlib.import_module(name)
    except Exception:  # the package __init__ is under development: load the file alone
        import importlib.util
        spec = importlib.util.spec_from_file_location("_dq_test_" + name.replace(".", "_"),
                                                      ROOT / relpath)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


K = _load_kernels()
LV = M.load_levels()


def rng_for(*ids):
    """A generator for one test (case), derived from the session seed."""
    words = [SEED & 0xFFFFFFFF, SEED >> 32]
    for i in ids:
        words.append(int(i) if isinstance(i, (int, np.integer)) else
                     int.from_bytes(str(i).encode()[:8].ljust(8, b"\0"), "little"))
    return np.random.default_rng(words)


def rand_keys(rng):
    return tuple(int(k) for k in rng.integers(0, 2 ** 32, 2, dtype=np.uint64))


def params(width, eps, hierarchical, correlated=False, n_events=1, keys=(0, 0), perm_bits=None,
           scale_rule=0):
    t = LV.build_tables(width, eps)
    n = int(n_events) if correlated else 1
    bits = M.perm_bits_for(n) if perm_bits is None else perm_bits
    blob = K.make_params(width, bool(hierarchical), bool(correlated), n, bits, *keys,
                         t.mag, t.inv_gap, t.level, t.lut, scale_rule)
    return np.frombuffer(blob, dtype=np.uint8)


def k_compress(P, src, nsg, sg_base, event, width, hier):
    out = np.zeros(K.run_bytes(nsg, width, hier), np.uint8)
    K.compress(P, src, nsg, sg_base, event, out)
    return out


def k_decompress(P, buf, nsg, acc=None):
    out = np.zeros(nsg * M.SUPER, np.float32) if acc is None else acc.copy()
    K.decompress(P, buf, nsg, out, acc is not None)
    return out


def bits_equal(a, b):
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


# ----------------------------------------------------------------------------- inputs
KINDS = ["t", "t", "t", "groupscales", "zero_sg", "zero_groups", "denormal", "mixed_denormal",
         "huge", "constant", "spike", "levels"]


def make_input(rng, nsg=None, width=4, eps=0.2):
    """Heavy-tailed float32 test data, one 'kind' per super-group; length not a
    multiple of 256 (the tail of the last super-group is padding)."""
    nsg = int(rng.integers(24, 72)) if nsg is None else nsg
    x = np.zeros((nsg, M.SUPER), np.float64)
    kinds = rng.choice(KINDS, size=nsg)
    every = rng.permutation(sorted(set(KINDS)))[:nsg]      # every kind at least once
    kinds[: every.size] = every
    mag = LV.build_tables(width, eps).mag.astype(np.float64)
    for s, kind in enumerate(kinds):
        t = rng.standard_t(df=rng.choice([1.2, 2.0, 4.0]), size=M.SUPER)
        scale = 10.0 ** rng.uniform(-6, 6)
        if kind == "t":
            x[s] = t * scale
        elif kind == "groupscales":           # group scales spanning 1e-30 .. 1e30
            x[s] = t * np.repeat(10.0 ** rng.uniform(-30, 30, M.GROUPS), M.GROUP)
        elif kind == "zero_sg":
            x[s] = 0.0
            x[s, rng.random(M.SUPER) < 0.5] = -0.0
        elif kind == "zero_groups":
            x[s] = t * scale
            dead = rng.random(M.GROUPS) < 0.5
            x[s].reshape(M.GROUPS, M.GROUP)[dead] = 0.0
        elif kind == "denormal":               # k * 2^-149
            x[s] = rng.integers(-(2 ** 20), 2 ** 20, M.SUPER) * 2.0 ** -149
            x[s, 0] = 2.0 ** -149
        elif kind == "mixed_denormal":
            x[s] = rng.integers(-(2 ** 10), 2 ** 10, M.SUPER) * 2.0 ** -149
            x[s, : M.GROUP] = t[: M.GROUP] * 1e-30
        elif kind == "huge":
            x[s] = rng.uniform(-1, 1, M.SUPER) * 1e38
            x[s, int(rng.integers(M.SUPER))] = rng.choice([-1e38, 1e38])
        elif kind == "constant":
            x[s] = rng.choice([-1, 1]) * scale
        elif kind == "spike":
            x[s, int(rng.integers(M.SUPER))] = t[0] * scale
        elif kind == "levels":                  # exactly on levels, power-of-two scales
            r = rng.integers(-(len(mag) - 1), len(mag), M.SUPER)
            e = int(rng.integers(-60, 60))
            x[s] = np.sign(r) * mag[np.abs(r)] * 2.0 ** e
            x[s].reshape(M.GROUPS, M.GROUP)[:, 0] = 2.0 ** e           # group max: a = mag[k]
    x = np.clip(x, -1e38, 1e38).astype(np.float32).ravel()
    length = nsg * M.SUPER - int(rng.integers(1, M.SUPER))
    return x[:length].copy(), kinds


# ----------------------------------------------------------------------------- code checks
def code_tolerance(m, x, norm_scale):
    """Per-element bound on |c32 - c64| (see the module docstring)."""
    R = m.radius
    mag = m.mag.astype(np.float64)
    gaps = np.diff(mag)
    xs = M.pad_to_super(x).reshape(-1, M.GROUPS, M.GROUP).astype(np.float64)
    s = norm_scale.astype(np.float64)[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(s > 0, np.abs(xs) / s, 0.0)
    a = np.where(a < 1.0, a, 1.0)            # the kernel's clamp: NaN and |t| >= 1 give 1
    k = np.searchsorted(mag[:R], a, side="right") - 1
    gmin = np.minimum(np.minimum(gaps[np.maximum(k - 1, 0)], gaps[k]),
                      gaps[np.minimum(k + 1, R - 1)])
    return (2.0 ** -19 * a + 2.0 ** -148) / gmin + 2.0 ** -20


def check_codes(m, enc, got_codes, x, what):
    diff = got_codes.astype(np.int64) - enc.codes
    bad = diff != 0
    nbad = int(bad.sum())
    if not nbad:
        return 0
    tol = code_tolerance(m, x, enc.norm_scale)
    v = enc.cont - enc.u
    dist = np.abs(v - np.round(v))
    idx = np.argwhere(bad)[:5].tolist()
    assert np.all(np.abs(diff[bad]) == 1), f"{what}: non-adjacent code mismatch at {idx} {TAG}"
    assert np.all(dist[bad] <= tol[bad]), (
        f"{what}: code mismatch not explained by float32 rounding at {idx}: "
        f"dist={dist[bad][:5]}, tol={tol[bad][:5]} {TAG}")
    budget = float(np.sum(2 * tol))
    assert nbad <= budget + 6 * math.sqrt(budget) + 3, f"{what}: {nbad} mismatches > bound {budget} {TAG}"
    return nbad


def check_meta(m, got_meta, enc, what):
    if m.hierarchical:
        assert np.array_equal(got_meta[1], enc.meta[1]), f"{what}: BF16 units differ {TAG}"
        g = np.argwhere(got_meta[0] != enc.meta[0])[:5].tolist()
        assert not g, f"{what}: group scale codes differ at {g} {TAG}"
    else:
        g = np.argwhere(got_meta != enc.meta)[:5].tolist()
        assert not g, f"{what}: BF16 group scales differ at {g} {TAG}"


# ============================================================================= tables
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("eps", ["zero", "default"])
def test_level_tables_follow_spec(width, eps):
    e = 0.0 if eps == "zero" else DEFAULT_EPS[width]
    t = LV.build_tables(width, e)
    R = (1 << (width - 1)) - 1
    r = np.arange(R + 1, dtype=np.float64)
    g = 1 + 2 * e * e
    f = r / R if e == 0 else (g ** r - 1) / (g ** R - 1)
    assert t.mag.dtype == np.float32 and t.mag.shape == (R + 1,)
    assert np.allclose(t.mag.astype(np.float64), f, rtol=2 ** -23, atol=2 ** -40)
    assert t.mag[0] == 0 and t.mag[R] == 1 and np.all(np.diff(t.mag) > 0)
    assert np.array_equal(t.level, np.concatenate([-t.mag[:0:-1], t.mag]))
    gaps = np.diff(t.mag.astype(np.float64))
    assert np.allclose(t.inv_gap.astype(np.float64), 1 / gaps, rtol=2 ** -23)
    cells = np.arange(4096) / 4096.0
    lut = t.lut.astype(np.int64)
    assert np.all(lut <= R - 1) and np.all(t.mag[lut] <= cells)
    assert np.all((lut == R - 1) | (t.mag[np.minimum(lut + 1, R)] > cells))


# ============================================================================= hash / keys
def test_generator_domains_and_call_keys_differ():
    R = _load_py("dynamiq_mpi.rng", "dynamiq_mpi/rng.py")  # noqa: N806
    seed = int(rng_for("keys").integers(2 ** 63))
    ks = [R.call_keys(seed, c) for c in range(64)]
    flat = [k for kk in ks for k in (kk.value, kk.perm)]
    assert len(set(flat)) == len(flat), TAG
    assert all(0 <= k < 2 ** 32 for k in flat)
    # the full hash is a pure function of (key, index, event) (the codec's index: a group);
    # events and indices decorrelate (the lanes of a group: test_lane_uniforms_*)
    rng = rng_for("uniform")
    key = int(rng.integers(2 ** 32))
    coords = np.arange(1 << 16, dtype=np.uint64)
    u = [M.event_uniform(key, coords, e).astype(np.float64) / 2 ** 32 for e in range(4)]
    for e in range(4):
        assert abs(u[e].mean() - 0.5) < 5 * math.sqrt(1 / 12 / u[e].size), TAG
        hist = np.bincount((u[e] * 16).astype(int), minlength=16)
        assert chi2_sf(float(((hist - hist.mean()) ** 2 / hist.mean()).sum()), 15) > 1e-6, TAG
    assert abs(np.corrcoef(u[0], u[1])[0, 1]) < 5 / math.sqrt(u[0].size), TAG


# ============================================================================= compress
@pytest.mark.parametrize("hier,scale_rule", [(True, 0), (False, 0), (True, 1)],
                         ids=["hier", "bf16scale", "hier-hybrid"])
@pytest.mark.parametrize("eps", ["zero", "default"])
@pytest.mark.parametrize("width", WIDTHS)
def test_compress_matches_model(width, eps, hier, scale_rule):
    e = 0.0 if eps == "zero" else DEFAULT_EPS[width]
    rng = rng_for("compress", width, eps, hier, scale_rule)
    total = mism = 0
    for correlated, n in CORR:
        x, kinds = make_input(rng, width=width, eps=e)
        nsg = -(-x.size // M.SUPER)
        if rng.random() < 0.3:
            x = x.astype(ml_dtypes.bfloat16)
        keys = rand_keys(rng)
        event = int(rng.integers(n))
        # 2^24 + 5: the 32-bit group index sg * 16 + g is no longer the 32-bit coordinate
        # sg * 256 + i shifted right by 4; 2^28 - 3: the group index wraps past 2^32
        sg_base = int(rng.choice([0, rng.integers(1, 1000), 2 ** 24 - 3, 2 ** 24 + 5, 2 ** 28 - 3,
                                  2 ** 40 + 7]))
        what = f"w={width} eps={e} hier={hier} corr={correlated} n={n} ev={event} base={sg_base}"
        P = params(width, e, hier, correlated, n, keys, scale_rule=scale_rule)
        got = k_compress(P, K.Source(x, sg_offset=sg_base), nsg, sg_base, event, width, hier)
        assert got.size == M.Model(width, e, hier).run_bytes(nsg)
        m = M.make_model(width, e, hier, correlated, n, keys, scale_rule)
        xs = M.source_values(x, nsg, sg_base, sg_offset=sg_base)
        enc = M.encode(m, xs, event, sg_base)
        codes, meta = M.split_run(got, nsg, width, hier)
        check_meta(m, meta, enc, what)
        mism += check_codes(m, enc, codes, xs, what)
        total += codes.size
        # all-zero groups and super-groups: the zero code, zero scale
        gz = np.abs(xs.reshape(nsg, M.GROUPS, M.GROUP)).max(axis=2) == 0
        assert np.all(codes[gz] == m.radius), f"{what}: zero group not coded R {TAG}"
        dec = k_decompress(P, got, nsg)
        assert np.all(dec.reshape(nsg, M.GROUPS, M.GROUP)[gz] == 0), TAG
        # the model's bytes, whenever its codes agree, are the compiled bytes
        if not np.any(codes != enc.codes):
            assert got.tobytes() == enc.data, f"{what}: bytes differ {TAG}"
        if correlated and n == 1:   # correlated with one event is independent rounding
            P0 = params(width, e, hier, False, 1, keys, scale_rule=scale_rule)
            got0 = k_compress(P0, K.Source(x, sg_offset=sg_base), nsg, sg_base, event, width, hier)
            assert np.array_equal(got0, got), TAG
    assert mism <= 1e-3 * total, f"{mism}/{total} code mismatches {TAG}"


def test_compress_reads_sources_like_the_model():
    """DqSource: sg_map gather, sg_offset, centring by the row's mean, BF16 input,
    zero beyond `length`."""
    rng = rng_for("source")
    for width, hier in [(2, True), (4, False), (8, True)]:
        x, _ = make_input(rng, nsg=40)
        if rng.random() < 0.5:
            x = x.astype(ml_dtypes.bfloat16)
        nrows = -(-x.size // M.SUPER)
        mean, _, _ = M.stats_model(x, nrows, True)
        sg_base = int(rng.integers(0, 9))
        nsg = nrows
        sg_map = np.concatenate([rng.integers(0, nrows, sg_base), rng.permutation(nrows)])
        keys = rand_keys(rng)
        P = params(width, DEFAULT_EPS[width], hier, True, 3, keys)
        got = k_compress(P, K.Source(x, sg_map, 0, mean), nsg, sg_base, 1, width, hier)
        vals = M.source_values(x, nsg, sg_base, sg_map=sg_map, mean=mean)
        ref = k_compress(P, K.Source(vals, sg_offset=sg_base), nsg, sg_base, 1, width, hier)
        assert np.array_equal(got, ref), f"w={width}: Source gather/centring differs {TAG}"


# ============================================================================= decompress
@pytest.mark.parametrize("hier", [True, False], ids=["hier", "bf16scale"])
@pytest.mark.parametrize("width", WIDTHS)
def test_decompress_and_accumulate_exact(width, hier):
    rng = rng_for("decompress", width, hier)
    for eps in (0.0, DEFAULT_EPS[width]):
        x, _ = make_input(rng, width=width, eps=eps)
        nsg = -(-x.size // M.SUPER)
        keys = rand_keys(rng)
        P = params(width, eps, hier, True, 5, keys)
        buf = k_compress(P, K.Source(x), nsg, 0, 2, width, hier)
        m = M.make_model(width, eps, hier, True, 5, keys)
        dec = k_decompress(P, buf, nsg)
        ref = M.decode(m, buf, nsg)
        assert bits_equal(dec, ref), f"w={width} hier={hier} eps={eps}: decode differs {TAG}"
        assert np.all(np.isfinite(dec)), TAG
        # accumulate: out + decode in float32, exactly
        acc, _ = make_input(rng, nsg=nsg)
        acc = M.pad_to_super(acc)[: nsg * M.SUPER]
        got = k_decompress(P, buf, nsg, acc=acc)
        assert bits_equal(got, (acc + ref).astype(np.float32)), f"accumulate differs {TAG}"


@pytest.mark.parametrize("hier", [True, False], ids=["hier", "bf16scale"])
@pytest.mark.parametrize("width", WIDTHS)
def test_packed_layout_by_hand(width, hier):
    """Spec 2.9 / dq_api.h: codes[nsg*32w] | group codes[nsg*16] | units[nsg] (BF16 LE), or
    codes | BF16 group scales[nsg*16]; code j of a group at byte j*w/8, bit (j*w)%8."""
    rng = rng_for("layout", width, hier)
    eps = DEFAULT_EPS[width]
    x, _ = make_input(rng, width=width, eps=eps)
    nsg = -(-x.size // M.SUPER)
    P = params(width, eps, hier, False, 1, rand_keys(rng))
    buf = k_compress(P, K.Source(x), nsg, 0, 0, width, hier)
    rec = 16 * (2 * width + 1) + 2 if hier else 32 * width + 32
    assert buf.size == nsg * rec, TAG
    dec = k_decompress(P, buf, nsg)
    level = LV.build_tables(width, eps).level
    R = (1 << (width - 1)) - 1
    cb = nsg * 32 * width
    for _ in range(64):
        s, g, j = int(rng.integers(nsg)), int(rng.integers(16)), int(rng.integers(16))
        byte = buf[s * 32 * width + g * 2 * width + (j * width) // 8]
        code = (int(byte) >> ((j * width) % 8)) & ((1 << width) - 1)
        assert code <= 2 * R, TAG
        if hier:
            gcode = int(buf[cb + s * 16 + g])
            ub = int(buf[cb + nsg * 16 + 2 * s]) | int(buf[cb + nsg * 16 + 2 * s + 1]) << 8
            unit = np.array([ub], np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)[0]
            scale = np.float32(gcode) * unit
        else:
            o = cb + 2 * (s * 16 + g)
            sb = int(buf[o]) | int(buf[o + 1]) << 8
            scale = np.array([sb], np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)[0]
        val = np.float32(level[code] * scale)
        assert bits_equal([val], [dec[s * 256 + g * 16 + j]]), f"(s,g,j)={(s, g, j)} {TAG}"
    # the code 2^b - 1 is never sent
    codes, _ = M.split_run(buf, nsg, width, hier)
    assert codes.max() <= 2 * R, TAG


# ============================================================================= fused step
@pytest.mark.parametrize("hier", [True, False], ids=["hier", "bf16scale"])
@pytest.mark.parametrize("width", WIDTHS)
def test_dar_is_decompress_plus_compress(width, hier):
    rng = rng_for("dar", width, hier)
    for correlated, n in [(False, 1), (True, 2), (True, 5), (True, 8)]:
        eps = float(rng.choice([0.0, DEFAULT_EPS[width]]))
        x, _ = make_input(rng, width=width, eps=eps)
        nrows = -(-x.size // M.SUPER)
        y, _ = make_input(rng, nsg=nrows, width=width, eps=eps)
        if rng.random() < 0.3:
            x = x.astype(ml_dtypes.bfloat16)
        keys = rand_keys(rng)
        event = int(rng.integers(n))
        mean = M.stats_model(x, nrows, True)[0] if rng.random() < 0.5 else None
        sg_map = rng.permutation(nrows)
        nsg = nrows
        what = f"w={width} hier={hier} eps={eps} n={n} ev={event}"
        P = params(width, eps, hier, correlated, n, keys)
        # an incoming message: another rank's compressed values, another event
        Pin = params(width, eps, hier, correlated, n, rand_keys(rng))
        inc = k_compress(Pin, K.Source(y), nsg, 0, (event + 1) % n, width, hier)
        local = K.Source(x, sg_map, 0, mean)
        out = np.zeros_like(inc)
        K.dar(P, inc, local, nsg, 0, event, out)
        # compiled decompress, float32 sum, compiled compress: the same bytes
        vals = M.source_values(x, nsg, 0, sg_map=sg_map, mean=mean)
        total = (k_decompress(P, inc, nsg) + vals).astype(np.float32)
        ref = k_compress(P, K.Source(total), nsg, 0, event, width, hier)
        assert np.array_equal(out, ref), f"{what}: dar != compress(decode + local) {TAG}"
        # and the model's fused step
        m = M.make_model(width, eps, hier, correlated, n, keys)
        enc = M.dar_model(m, inc, vals, event)
        codes, meta = M.split_run(out, nsg, width, hier)
        check_meta(m, meta, enc, what)
        check_codes(m, enc, codes, total, what)


# ============================================================================= statistics
def test_stats_match_model():
    rng = rng_for("stats")
    for trial in range(6):
        x, kinds = make_input(rng)
        nsg = -(-x.size // M.SUPER)
        # saturation and underflow cases
        x[:256] = np.where(np.arange(256) % 2, 1e38, -1e38).astype(np.float32)
        x[256:512] = 0
        x[256 + int(rng.integers(256))] = np.float32(2.0 ** -133)   # denormal, exact in BF16
        # |x| > 2^127 somewhere: no centring (mean 0); |x| <= 2^127: centred, still finite
        big = np.float32(rng.uniform(1.75e38, 3.38e38))      # > 2^127 in BF16 too
        x[512:768] = np.where(rng.random(256) < 0.5, big, -big) * rng.uniform(0.4, 1, 256).astype(np.float32)
        x[512 + int(rng.integers(256))] = big
        x[768:1024] = -np.float32(2.0 ** 127)
        x[768 + int(rng.integers(256))] = np.float32(2.0 ** 127)
        if trial % 2:
            x = x.astype(ml_dtypes.bfloat16)
        for centre in (True, False):
            what = f"trial={trial} centre={centre} dtype={x.dtype}"
            mu, F, bad = K.stats(x, nsg, centre)
            mu_m, F_m, bad_m = M.stats_model(x, nsg, centre)
            assert bad == bad_m == 0, TAG
            assert bits_equal(mu, mu_m), f"{what}: means differ {TAG}"
            assert bits_equal(F, F_m), f"{what}: F differs {TAG}"
            v = M.source_values(x, nsg).reshape(nsg, 256)
            c = (v - mu[:, None]).astype(np.float32).astype(np.float64)
            nonzero = np.any(c != 0, axis=1)
            assert np.all(F[nonzero] > 0), f"{what}: F == 0 for a non-zero super-group {TAG}"
            assert np.all(F[~nonzero] == 0), TAG
            assert np.all(np.isfinite(F)), f"{what}: F not finite for finite input {TAG}"
            assert F[0] == FLT_MAX, TAG
            assert F[1] == np.float32(2.0 ** -149), TAG
            assert F[2] == FLT_MAX and mu[2] == 0, TAG
            assert F[3] == FLT_MAX and (mu[3] == np.float32(-2.0 ** 127 * 254 / 256) or not centre), TAG
            tree = M.tree_sum256(c * c)
            for s in range(nsg):   # rounded up, tightly (of the fixed-order float64 sum)
                exact = math.fsum((c[s] * c[s]).tolist())
                assert abs(tree[s] - exact) <= 1e-13 * exact, TAG
                if tree[s] <= float(FLT_MAX):
                    assert float(F[s]) >= tree[s], f"{what}: F rounded down at {s} {TAG}"
                    below = np.nextafter(F[s], np.float32(0))
                    assert float(below) < tree[s] or F[s] == 0, f"{what}: F not tight at {s} {TAG}"
            if centre:
                exact_mu = np.array([math.fsum(r.tolist()) / 256 for r in v.astype(np.float64)])
                centred = np.abs(v).max(axis=1) <= 2.0 ** 127
                assert np.all(mu[~centred] == 0), TAG
                exact_mu[~centred] = 0
                err = np.abs(mu.astype(np.float64) - exact_mu)
                ulp = np.spacing(np.abs(mu)).astype(np.float64)
                sum_abs = np.abs(v.astype(np.float64)).sum(axis=1) / 256
                assert np.all(err <= ulp + 2.0 ** -45 * sum_abs), f"{what}: mean off by > 1 ulp {TAG}"


def test_stats_count_nonfinite():
    rng = rng_for("stats-nonfinite")
    x, _ = make_input(rng, nsg=8)
    nsg = -(-x.size // M.SUPER)
    a, b, c = rng.choice(nsg - 1, 3, replace=False)          # the last super-group is short
    off = rng.choice(256, 3, replace=False)
    x[a * 256 + off[:2]] = np.nan                             # NaN only: mean NaN
    x[b * 256 + off[:2]] = [np.inf, -np.inf]                  # +-inf (|x| > 2^127): mean 0
    x[c * 256 + off] = [np.nan, -np.inf, np.nan]              # both: mean 0
    mu, F, bad = K.stats(x, nsg, True)
    mu_m, F_m, bad_m = M.stats_model(x, nsg, True)
    assert bad == bad_m == 7, TAG
    assert np.array_equal(np.isnan(mu), np.isnan(mu_m)) and np.array_equal(np.isnan(F), np.isnan(F_m))
    ok = ~np.isnan(mu_m)
    assert bits_equal(mu[ok], mu_m[ok]), TAG
    ok = ~np.isnan(F_m)
    assert bits_equal(F[ok], F_m[ok]), TAG
    assert np.isnan(mu[a]) and mu[b] == 0 and mu[c] == 0, f"means {mu[[a, b, c]]} {TAG}"
    assert np.isnan(F[a]) and F[b] == FLT_MAX and np.isnan(F[c]), TAG
    assert np.all(np.isfinite(np.delete(mu, [a, b, c]))), TAG


# ============================================================================= permutation
def chi2_sf(x, df):
    """Survival function of the chi-square distribution (regularised upper gamma)."""
    a, x = df / 2.0, x / 2.0
    if x <= 0:
        return 1.0
    lg = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = s = 1.0 / a
        ap = a
        for _ in range(10000):
            ap += 1
            term *= x / ap
            s += term
            if abs(term) < abs(s) * 1e-16:
                break
        return max(0.0, 1.0 - s * math.exp(lg))
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-16:
            break
    return math.exp(lg) * h


def test_chi2_sf_sanity():
    assert abs(chi2_sf(3.841458820694124, 1) - 0.05) < 1e-9
    assert abs(chi2_sf(23.92812697687947, 1) - 1e-6) < 1e-12
    assert abs(chi2_sf(18.307038053275146, 10) - 0.05) < 1e-9
    assert abs(chi2_sf(124.342, 100) - 0.05) < 1e-4


# Correlated rounding (dq_codec.h, "per event"): the stratum of event e at lane j of group
# G (coordinate c = 16 G + j) is pi_c(e) = (sigma_G(e) + shift_{G,j}) mod n, sigma_G a keyed
# 6-round Feistel permutation (cycle walking) shared by the 16 lanes of the group,
# shift_{G,j} = floor(lane_uniform(b_G, j) n / 2^32) the lane's offset, b_G = mix32(G ^
# key_perm ^ 0xbb67ae85) one 32-bit base per group, the same for every event (each lane's
# offset is uniform up to n / 2^32: lane_uniform(., j) is a bijection).  What is claimed,
# and tested below on the compiled kernel:
#   * pi_c is a permutation of 0..n-1 and equals the model's on every probed coordinate;
#   * the 16 lanes of a group share sigma_G and one offset base (their offsets differ);
#   * the marginal law of each pi_c(e) is uniform, so one correlated quantization is
#     unbiased (chi-square per (n, event) and direct bias tests, n = 2..9);
#   * the joint law is NOT uniform over the n! permutations.  It is tested only for
#     what holds: every ordered pair (pi(i), pi(j)) = (a, b), a != b, occurs, with a
#     frequency within a factor PAIR_FACTOR[n] (1.1 to 2) of uniform 1 / (n (n - 1)),
#     and (n <= 6) every one of the n! permutations occurs.
# The lanes of one group are not independent of each other (their offsets and value
# uniforms are fixed functions of one base each: see test_lane_uniforms_*); the tests
# below pool the 16 lanes of 16384 groups, and the per-group counts they sum have a
# variance within 1.5 % of the independent-lanes value (measured on the model, 2^18
# groups, every (n, event, stratum)), so their chi-square / binomial statistics hold.
# Since the offset is uniform and shared by all events, P(pi(i) = a, pi(j) = b) =
# P(sigma(j) - sigma(i) = b - a mod n) / n: the pair law is that of the Feistel
# differences over the group seeds.  Measured on the model (which equals the kernel on
# every probed coordinate, test_permutation_matches_model_...) over 2^22 groups, the
# ratio of a pair's probability to uniform lies in
#     n = 2: [1, 1]  3: [0.9996, 1.0004]  4: [0.938, 1.032]  5: [0.898, 1.102]
#     6: [0.926, 1.077]  7: [0.799, 1.243]  8: [0.709, 1.587]  9: [0.953, 1.089]
# (n = 8, a 1 + 2 bit Feistel without cycle walking, is the worst), and that of a whole
# permutation in
#     n = 4: [0.94, 1.03]  5: [0.85, 1.15]  6: [0.76, 1.32]  7: [0.48, 2.31]
#     8: [0.12, 7.9]  9: [0.33, 2.8] (n = 9: ~100 samples per class, +-10 % noise).
PROBE_SG = 1024           # 1024 * 256 = 262144 probed coordinates (16384 groups) per n
_PI_CACHE = {}


def compiled_pi(n):
    """pi(event) of the compiled kernel at every coordinate of PROBE_SG super-groups,
    read back through the rounding decisions.

    Width 2, uniform levels, per-group BF16 scale 1 (one "anchor" entry of every group
    is 1.0; it rounds up whatever pi is).  A probe value x = fl32(j/n) gives p = j/n
    and threshold n p - pi = j - pi exactly, so the kernel rounds up iff pi(event) < j:
    a per-coordinate binary search over j reads pi in ceil(log2 n) compress calls.  Two
    passes, anchors at entry 0 and at entry 15, cover all 16 entries of every group (the
    14 read twice must agree).  Returns (pis (N, n) int64, coords (N,) uint64, keys)."""
    if n in _PI_CACHE:
        return _PI_CACHE[n]
    rng = rng_for("perm", n)
    keys = rand_keys(rng)
    sg_base = int(rng.integers(0, 2 ** 20))
    P = params(2, 0.0, False, True, n, keys)
    N = PROBE_SG * M.SUPER
    coord = (sg_base * M.SUPER + np.arange(N)).astype(np.uint64)
    probe = np.array([j / n for j in range(n)], np.float32)
    assert np.all(np.float32(n) * probe == np.arange(n, dtype=np.float32))   # exact probes
    pos = np.arange(N) % M.GROUP
    pis = np.full((N, n), -1, np.int64)
    for anchor in (0, 15):
        probed = pos != anchor
        for event in range(n):
            lo = np.zeros(N, np.int64)
            hi = np.full(N, n - 1, np.int64)
            while np.any(lo < hi):
                active = lo < hi
                mid = (lo + hi + 1) // 2
                x = np.where(active, probe[mid], np.float32(0)).astype(np.float32)
                x[~probed] = 1.0
                buf = k_compress(P, K.Source(x, sg_offset=sg_base), PROBE_SG, sg_base, event, 2, False)
                codes, _ = M.split_run(buf, PROBE_SG, 2, False)
                c = codes.ravel()
                assert np.all((c == 1) | (c == 2)) and np.all(c[~probed] == 2), TAG
                up = c == 2                                   # pi < mid
                hi = np.where(active & up, mid - 1, hi)
                lo = np.where(active & ~up, mid, lo)
            seen = probed & (pis[:, event] >= 0)
            assert np.array_equal(pis[seen, event], lo[seen]), f"n={n}: readbacks disagree {TAG}"
            pis[probed, event] = lo[probed]
    assert np.all(pis >= 0)
    _PI_CACHE[n] = (pis, coord, keys)
    return _PI_CACHE[n]


@pytest.mark.parametrize("n", range(1, 10))
def test_permutation_matches_model_and_is_a_permutation(n):
    pis, coord, keys = compiled_pi(n)
    group, lane = M.coord_group_lane(coord)          # coord < 2^32: group = sg * 16 + g exactly
    # the model's stratum (Feistel of the group + the lane's offset) on every coordinate
    for e in range(n):
        mp = M.stratum(keys[1], group, lane, e, n).astype(np.int64)
        bad = np.flatnonzero(mp != pis[:, e])[:5]
        assert bad.size == 0, f"n={n} event={e}: model pi != kernel pi at coords {coord[bad]} {TAG}"
    # a permutation of 0..n-1 per coordinate
    assert np.all(np.sort(pis, axis=1) == np.arange(n)[None, :]), f"n={n} {TAG}"
    # the stratified uniforms of the n events of one coordinate fall in distinct strata
    m = M.make_model(2, 0.0, False, True, n, keys)
    sub = slice(0, 4096)
    us = np.stack([M.uniforms(m, group[sub], lane[sub], e)[0] for e in range(n)], axis=1)
    assert np.all((us >= 0) & (us < 1)), TAG
    strata = np.floor(us * n).astype(np.int64)
    assert np.array_equal(strata, pis[sub]), TAG


@pytest.mark.parametrize("n", range(2, 10))
def test_group_shares_the_feistel_permutation(n):
    """pi_c(e) - pi_c(0) mod n = sigma_G(e) - sigma_G(0) is the same for the 16 coordinates
    of a group (read from the kernel alone), the per-coordinate remainder pi_c(e) -
    sigma_G(e) mod n does not depend on the event and is the lane's offset
    floor(lane_uniform(b_G, j) n / 2^32) of the group's one offset base b_G, the offsets
    do differ between the lanes of a group, and the Feistel part does differ between
    groups (n >= 3: for n = 2 the only relative pattern is (0, 1))."""
    pis, coord, keys = compiled_pi(n)
    G = pis.shape[0] // M.GROUP
    p = pis.reshape(G, M.GROUP, n)
    rel = (p - p[:, :, :1]) % n
    bad = np.flatnonzero(np.any(rel != rel[:, :1, :], axis=(1, 2)))[:5]
    assert bad.size == 0, f"n={n}: groups {bad} do not share one permutation {TAG}"
    groups = coord.reshape(G, M.GROUP)[:, 0] >> np.uint64(4)
    sigma = np.stack([M.perm_base(keys[1], groups, e, n).astype(np.int64) for e in range(n)], axis=1)
    assert np.all(np.sort(sigma, axis=1) == np.arange(n)[None, :]), TAG
    off = (p - sigma[:, None, :]) % n
    assert np.all(off == off[:, :, :1]), f"n={n}: offset depends on the event {TAG}"
    group, lane = M.coord_group_lane(coord)
    assert np.array_equal(off[:, :, 0].ravel(), M.lane_shift(keys[1], group, lane, n).astype(np.int64)), TAG
    # one base per group, yet not one offset per group: with independent lanes all 16 would
    # agree in a fraction n^-15 of the groups (3e-5 for n = 2); measured on the model over
    # 2^20 groups: 1.3e-4 for n = 2 (the lanes are dependent), 6e-6 for n = 3, 0 for n = 9
    same = np.mean(np.all(off[:, :, 0] == off[:, :1, 0], axis=1))
    assert same < 1e-3, f"n={n}: the 16 lanes share one offset in {same:.2%} of the groups {TAG}"
    if n >= 3:
        patterns = np.unique(rel[:, 0, :], axis=0).shape[0]
        assert patterns == math.factorial(n - 1) or patterns >= 64, \
            f"n={n}: only {patterns} relative patterns over {G} groups {TAG}"


# Each (n, event) marginal is tested at false-alarm rate 1e-6 (the family of 44 tests:
# < 5e-5).  Against a uniform pi the statistic is chi-square with n - 1 degrees of
# freedom (the groups are independent; the counts of one group's 16 lanes are not
# multinomial, but their variance is within 1.5 % of it, see above, which moves a 1e-6
# tail by well under a factor 2); a cell off by 3 % of 1/n is detected.
@pytest.mark.parametrize("n", range(2, 10))
def test_permutation_marginals_uniform(n):
    pis, _, _ = compiled_pi(n)
    N = pis.shape[0]
    worst = []
    for e in range(n):
        cnt = np.bincount(pis[:, e], minlength=n)
        stat = float(((cnt - N / n) ** 2 / (N / n)).sum())
        worst.append((chi2_sf(stat, n - 1), e, stat, (cnt * n / N).round(4).tolist()))
    p, e, stat, rel = min(worst)
    assert p > 1e-6, (f"n={n}: pi({e}) not uniform (chi2={stat:.1f}, df={n - 1}, p-value {p:.2e}, "
                      f"counts/expected {rel}) {TAG}")


# Factor of uniform within which every pair frequency must lie (ratio in [1/f, f]).
# Measured on the kernel's 262144-coordinate sample (16384 groups; counts vary by group),
# 15 seeds, smallest / largest ratio over all cells of all event pairs, mean +- sd
# (with the per-(group, event) generator; the per-coordinate one gave the same within 0.01):
#   n=2 [0.998+-0.001, 1.002+-0.001]   n=3 [0.989+-0.006, 1.012+-0.006]
#   n=4 [0.932+-0.010, 1.052+-0.010]   n=5 [0.879+-0.010, 1.125+-0.009]
#   n=6 [0.900+-0.013, 1.111+-0.011]   n=7 [0.766+-0.010, 1.276+-0.015]
#   n=8 [0.657+-0.010, 1.655+-0.021]   n=9 [0.890+-0.013, 1.142+-0.015]
# (sample extremes sit a little outside the true ones above); every bound is >= 7 sd away.
PAIR_FACTOR = {2: 1.1, 3: 1.1, 4: 1.25, 5: 1.25, 6: 1.25, 7: 1.5, 8: 2.0, 9: 1.25}


@pytest.mark.parametrize("n", range(2, 10))
def test_permutation_pair_law(n):
    """The pair (pi(i), pi(j)), i != j, of one coordinate: never equal, and every ordered
    pair (a, b) of distinct strata occurs, with a frequency within a factor PAIR_FACTOR[n]
    of the uniform 1 / (n (n - 1)) (n = 8 is the loosest: 2)."""
    pis, _, _ = compiled_pi(n)
    N = pis.shape[0]
    exp = N / (n * (n - 1))
    lo, hi = np.inf, 0.0
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            t = np.bincount(pis[:, i] * n + pis[:, j], minlength=n * n).reshape(n, n)
            assert np.all(np.diag(t) == 0), f"n={n}: pi({i}) == pi({j}) on some coordinate {TAG}"
            r = t[~np.eye(n, dtype=bool)] / exp
            assert np.all(r > 0), f"n={n}: a pair of strata never occurs for events ({i}, {j}) {TAG}"
            lo, hi = min(lo, r.min()), max(hi, r.max())
    f = PAIR_FACTOR[n]
    assert 1 / f <= lo and hi <= f, \
        f"n={n}: pair frequency / uniform in [{lo:.3f}, {hi:.3f}], beyond a factor {f} {TAG}"


@pytest.mark.parametrize("n", range(2, 7))
def test_permutation_joint_support(n):
    """Every one of the n! permutations occurs (n <= 6): the Feistel part plus the offset
    is not a mere cyclic shift.  Uniformity over the n! permutations is NOT claimed (see
    the measured ratios above).  The least likely permutation class of n = 6 (ratio 0.76)
    is expected in ~100 of the 16384 groups, so a miss has probability ~e^-100."""
    pis, _, _ = compiled_pi(n)
    ids = np.zeros(pis.shape[0], np.int64)
    for e in range(n):
        ids = ids * n + pis[:, e]
    seen = np.unique(ids).size
    assert seen == math.factorial(n), f"n={n}: {seen} of {math.factorial(n)} permutations occur {TAG}"


# ============================================================================= lane uniforms
# The generator (dq_codec.h, "per event") hashes once per (group, event): the value-rounding
# uniform of lane j of group G is g = lane_uniform(b, j) = t ^ (t >> 16), t = (b ^ j *
# 0x9e3779b9) * 0x85ebca6b (mod 2^32), of ONE base b = event_uniform(key_value, G, event).
# What that gives, and what it does not, read back from the compiled kernel:
#   * NOT independent within a group: the 16 lanes' uniforms are a fixed function of b
#     (knowing one lane's uniform determines the 15 others).  Their linear correlation is
#     small (|corr| <= 0.011 over all lane pairs, measured on the model over 2^20 bases)
#     but the joint law of a pair is far from the product: the 16 x 16 histogram of the
#     top 4 bits of lanes (9, 14) has cells from 0.43x to 1.60x uniform (chi-square
#     ~1.4e5 over 2^20 groups, df 255; 44 of the 120 lane pairs are beyond p = 1e-6).
#     This changes neither unbiasedness nor the expected squared error (per-coordinate
#     quantities), only how rounding errors of the lanes of one group co-vary.
#   * each lane on its own is exactly uniform over groups (lane_uniform(., j) is a
#     bijection of a uniform base): chi-square per (lane, event);
#   * across the events of one coordinate the bases are independent hashes, so the
#     uniforms are independent: correlation ~0 and the joint histogram of two events is
#     uniform, per lane;
#   * so each single event's rounding is unbiased: the binomial tests of
#     test_single_quantization_unbiased (every coordinate, 2000 keys) and
#     test_correlated_single_event_unbiased (every event, n = 2..9) below.
LANE_EVENTS = 4           # events read back per coordinate
LANE_BITS = 12            # top bits of each uniform read back
_G_CACHE = []


def compiled_value_uniforms():
    """The top LANE_BITS bits of the value-rounding uniform g32 the compiled kernel draws at
    every coordinate of PROBE_SG super-groups, for events 0..LANE_EVENTS-1 (independent
    rounding), read back through the rounding decisions.

    Width 2, uniform levels, per-group BF16 scale 1 (an anchor entry 1.0 per group, as in
    compiled_pi): x = m / 2^12 gives p = x and the threshold m 2^20 exactly, so the kernel
    rounds up iff g32 >> 20 < m; a binary search over m reads g32 >> 20 in 12 calls.
    Returns (q (N, LANE_EVENTS) int64, group (N,), lane (N,), keys)."""
    if _G_CACHE:
        return _G_CACHE[0]
    rng = rng_for("lane-uniforms")
    keys = rand_keys(rng)
    sg_base = int(rng.integers(0, 2 ** 20))
    P = params(2, 0.0, False, False, 1, keys)
    N = PROBE_SG * M.SUPER
    group, lane = M.coord_group_lane((sg_base * M.SUPER + np.arange(N)).astype(np.uint64))
    top = 1 << LANE_BITS
    q = np.full((N, LANE_EVENTS), -1, np.int64)
    pos = np.arange(N) % M.GROUP
    for anchor in (0, 15):
        probed = pos != anchor
        for event in range(LANE_EVENTS):
            lo = np.zeros(N, np.int64)
            hi = np.full(N, top - 1, np.int64)
            for _ in range(LANE_BITS):                    # a full binary tree: no early ends
                mid = (lo + hi + 1) // 2
                x = (mid / top).astype(np.float32)
                x[~probed] = 1.0
                buf = k_compress(P, K.Source(x, sg_offset=sg_base), PROBE_SG, sg_base, event, 2, False)
                c = M.split_run(buf, PROBE_SG, 2, False)[0].ravel()
                assert np.all((c == 1) | (c == 2)) and np.all(c[~probed] == 2), TAG
                up = c == 2                                   # g32 >> 20 < mid
                hi = np.where(up, mid - 1, hi)
                lo = np.where(up, lo, mid)
            assert np.array_equal(lo, hi), TAG
            seen = probed & (q[:, event] >= 0)
            assert np.array_equal(q[seen, event], lo[seen]), f"event {event}: readbacks disagree {TAG}"
            q[probed, event] = lo[probed]
    assert np.all(q >= 0)
    _G_CACHE.append((q, group, lane, keys))
    return _G_CACHE[0]


def test_lane_uniforms_are_one_function_of_the_group_base():
    """The kernel's value uniforms are lane_uniform(b_G, j) of one base per (group, event)
    (equal to the model's on every probed coordinate, top 12 bits), hence NOT independent
    within a group: documented by the joint histogram of the top 4 bits of the most
    dependent lane pair over 16384 groups (measured: lanes (9, 14), chi-square 2400 to 2550
    against df 255, as the 2^20-group measurement above predicts; asserted: beyond 1000,
    a p-value below 1e-100).  If this
    fails the lane mixing has changed: update the header's comment, the model and the
    comment above."""
    q, group, lane, keys = compiled_value_uniforms()
    for e in range(LANE_EVENTS):
        mq = (M.value_uniform(keys[0], group, lane, e) >> np.uint64(32 - LANE_BITS)).astype(np.int64)
        bad = np.flatnonzero(mq != q[:, e])[:5]
        assert bad.size == 0, f"event {e}: kernel uniform != lane_uniform(base, lane) at {bad} {TAG}"
    # one lane determines the other 15: lane_uniform(., 0) inverts (x ^ x >> 16 is an
    # involution, 0x85ebca6b is odd), so the full uniform of lane 0 (the model's, equal to the
    # kernel's) gives back b, and b reproduces the kernel's uniforms of all 16 lanes
    inv = pow(0x85EBCA6B, -1, 2 ** 32)
    g0 = M.value_uniform(keys[0], group[::M.GROUP], 0, 0)
    b = ((g0 ^ (g0 >> np.uint64(16))) * np.uint64(inv)) & np.uint64(M.MASK32)
    assert np.array_equal(b, M.event_uniform(keys[0], group[::M.GROUP], 0)), TAG
    again = M.lane_uniform(np.repeat(b, M.GROUP), lane) >> np.uint64(32 - LANE_BITS)
    assert np.array_equal(again.astype(np.int64), q[:, 0]), TAG
    G = q.shape[0] // M.GROUP
    top4 = (q[:, 0] >> (LANE_BITS - 4)).reshape(G, M.GROUP)
    worst = (0.0, None)
    for j in range(M.GROUP):
        for k in range(j + 1, M.GROUP):
            h = np.bincount(top4[:, j] * 16 + top4[:, k], minlength=256)
            stat = float(((h - G / 256) ** 2 / (G / 256)).sum())
            worst = max(worst, (stat, (j, k)))
    print(f"lane pair chi-square: largest {worst[0]:.0f} at lanes {worst[1]}")
    assert worst[0] > 1000, (f"lanes of a group look independent now (largest pair chi-square "
                             f"{worst[0]:.0f} at lanes {worst[1]}, df 255): update the docs {TAG}")


def test_lane_uniforms_marginally_uniform():
    """(a) Each lane's uniform, over 16384 groups (independent bases), is uniform: chi-square
    of its top 6 bits (64 cells, 256 expected per cell) for every (lane, event), each at
    false-alarm rate 1e-6 (64 tests: < 1e-4 per run)."""
    q, _, _, _ = compiled_value_uniforms()
    G = q.shape[0] // M.GROUP
    worst = (1.0, None, 0.0)
    for e in range(LANE_EVENTS):
        cells = (q[:, e] >> (LANE_BITS - 6)).reshape(G, M.GROUP)
        for j in range(M.GROUP):
            h = np.bincount(cells[:, j], minlength=64)
            stat = float(((h - G / 64) ** 2 / (G / 64)).sum())
            worst = min(worst, (chi2_sf(stat, 63), (j, e), stat))
    assert worst[0] > 1e-6, f"(lane, event) {worst[1]}: chi-square {worst[2]:.1f}, df 63, p {worst[0]:.1e} {TAG}"


def test_lane_uniforms_independent_across_events():
    """(b) Across the events of one coordinate the uniforms are independent: the correlation
    of the uniforms of two events over all 262144 coordinates is within 6 / sqrt(N) of 0
    (pooling the lanes of a group adds only their squared correlations, <= 1.2e-4, to the
    variance), and per lane the 16 x 16 joint histogram of the top 4 bits of two events over
    16384 groups is uniform (chi-square, df 255, each at false-alarm rate 1e-6: 96 tests)."""
    q, _, _, _ = compiled_value_uniforms()
    N = q.shape[0]
    G = N // M.GROUP
    u = (q + 0.5) / (1 << LANE_BITS)
    worst = (1.0, None, 0.0)
    for e in range(LANE_EVENTS):
        for f in range(e + 1, LANE_EVENTS):
            r = float(np.corrcoef(u[:, e], u[:, f])[0, 1])
            assert abs(r) < 6 / math.sqrt(N), f"events ({e}, {f}): correlation {r:.5f} {TAG}"
            a = (q[:, e] >> (LANE_BITS - 4)).reshape(G, M.GROUP)
            b = (q[:, f] >> (LANE_BITS - 4)).reshape(G, M.GROUP)
            for j in range(M.GROUP):
                h = np.bincount(a[:, j] * 16 + b[:, j], minlength=256)
                stat = float(((h - G / 256) ** 2 / (G / 256)).sum())
                worst = min(worst, (chi2_sf(stat, 255), (j, e, f), stat))
    assert worst[0] > 1e-6, (f"(lane, event, event) {worst[1]}: joint chi-square {worst[2]:.1f}, "
                             f"df 255, p {worst[0]:.1e} {TAG}")


# ============================================================================= unbiasedness
def unbiased_input(rng, width, eps):
    x, _ = make_input(rng, nsg=3, width=width, eps=eps)
    x = M.pad_to_super(x)[: 2 * 256]
    # super-group 0: moderate group scales (group codes mostly >= 3), super-group 1: any kind
    x[:256] = (rng.standard_t(2.0, 256) * np.repeat(10.0 ** rng.uniform(-1, 1, 16), 16)).astype(np.float32)
    x[16:32] = 0                      # an all-zero group
    return x


def binom_two_sided(k, n, p, tol=0.0):
    """Exact two-sided binomial p-values (doubled smaller tail) for counts k of n trials,
    the success probability known to within +-tol: P(X <= k | p - tol), P(X >= k | p + tol)."""
    k = np.asarray(k, np.int64).ravel()
    p = np.asarray(p, np.float64).ravel()
    tol = np.broadcast_to(np.asarray(tol, np.float64).ravel(), p.shape)
    kk = np.arange(n + 1)
    logc = np.array([math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) for i in kk])

    def pmf(q):
        q = np.clip(q, 1e-300, 1 - 1e-16)
        return np.exp(logc[None, :] + kk[None, :] * np.log(q)[:, None]
                      + (n - kk)[None, :] * np.log1p(-q)[:, None])

    rows = np.arange(k.size)
    lower = np.cumsum(pmf(p - tol), axis=1)[rows, k]
    upper = np.cumsum(pmf(p + tol)[:, ::-1], axis=1)[:, ::-1][rows, k]
    return np.minimum(1.0, 2 * np.minimum(lower, upper))


@pytest.mark.parametrize("hier", [True, False], ids=["hier", "bf16scale"])
@pytest.mark.parametrize("width", WIDTHS)
def test_single_quantization_unbiased(width, hier):
    """E[decode(compress(x))] = x over call keys (independent rounding).

    A decoded value is L * S: L in {level[lo], level[lo+1]} (value rounding, up with
    probability pL = the spec's p) and S the decoded group scale, deterministic (spec
    2.7): hierarchical, S = C * unit with C the smallest integer such that
    C * unit >= group max; otherwise the group max rounded up to BF16.  Checked:
      1. the model's probabilities are unbiased: E[L] = x / S within 1e-13 of a
         level gap (float64 cancellation), S >= group max and (hierarchical) S - unit
         < group max: the code is the smallest that covers the group;
      2. exact binomial tests of the kernel's up-counts of every coordinate against
         pL, false alarm 1e-9 each (< 4e-6 per run), and the kernel's group codes
         equal the model's in every call; pL
         is known to within the float32 tolerance of the module docstring (the kernel
         maps a group's max to 1 - 2^-24 when 1/s rounds down, so p = 0 becomes ~4e-6);
      3. the mean of the decoded values is within 6 standard errors (from the model's
         variance) of E[L] E[S], on every coordinate where each random draw has >= 50
         expected outcomes of both kinds over the calls, or none (there the normal tail
         is accurate; the rest is covered by 2.).  6, not 5: ~1800 coordinates are
         tested per run, at 5 SE one run in a thousand would fail by chance."""
    rng = rng_for("unbiased", width, hier)
    eps = DEFAULT_EPS[width]
    x = unbiased_input(rng, width, eps)
    nsg = 2
    n_calls = 2000
    m = M.make_model(width, eps, hier)
    ref = M.encode(m, x, 0)                       # uniform-independent parts of the model
    lo = ref.lower.reshape(-1)
    pL = ref.p.reshape(-1)
    lvl = m.level.astype(np.float64)
    l0, l1 = lvl[lo], lvl[np.minimum(lo + 1, 2 * m.radius)]
    s0 = s1 = np.repeat(ref.norm_scale.astype(np.float64).reshape(-1), 16)
    pS = np.zeros(512)
    EL = l0 + pL * (l1 - l0)
    ES = s0 + pS * (s1 - s0)
    xd = x.astype(np.float64)
    gmax = np.repeat(np.abs(xd.reshape(-1, 16)).max(axis=1), 16)            # 1.
    nscale = np.repeat(ref.norm_scale.astype(np.float64).reshape(-1), 16)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(nscale > 0, xd / nscale, 0.0)
    bad = np.flatnonzero(np.abs(EL - t) > 1e-13 * (l1 - l0) + 1e-300)
    assert bad.size == 0, f"E[level] != x/scale at {bad[:5]} {TAG}"
    assert np.all(ES >= gmax), TAG
    if hier:
        unit = np.repeat(M.bf16_bits_to_f32(ref.meta[1]).astype(np.float64), 256)
        bad = np.flatnonzero((gmax > 0) & (ES - unit >= gmax))
        assert bad.size == 0, f"group code above the smallest covering one at {bad[:5]} {TAG}"
    VarX = ((1 - pL) * l0 ** 2 + pL * l1 ** 2) * ((1 - pS) * s0 ** 2 + pS * s1 ** 2) - (EL * ES) ** 2

    acc = np.zeros(512)
    ups = np.zeros(512, np.int64)
    for _ in range(n_calls):
        P = params(width, eps, hier, False, 1, rand_keys(rng))
        buf = k_compress(P, K.Source(x), nsg, 0, 0, width, hier)
        acc += k_decompress(P, buf, nsg)
        codes, meta = M.split_run(buf, nsg, width, hier)
        codes = codes.reshape(-1)
        assert np.all((codes == lo) | (codes == lo + 1)), TAG
        ups += codes == lo + 1
        if hier:
            assert np.array_equal(meta[0], ref.meta[0]), f"group codes depend on the keys {TAG}"
    tolL = code_tolerance(m, x, ref.norm_scale).reshape(-1)
    pv = binom_two_sided(ups, n_calls, pL, tolL)                            # 2.
    bad = np.flatnonzero(pv < 1e-9)
    assert bad.size == 0, f"value rounding: coords {bad[:5]} up {ups[bad[:5]]}/{n_calls}, p={pL[bad[:5]]} {TAG}"
    mean = acc / n_calls                                                   # 3.
    se = np.sqrt(np.maximum(VarX, 0) / n_calls)

    def well(p):
        return np.minimum(p, 1 - p) * n_calls >= 50

    # the scale is deterministic (pS = 0); pL = 0 or 1 may be ~1e-6 in the kernel (see 2.), those coordinates are left to 2.
    ok = well(pL) & (well(pS) | (pS == 0))
    assert ok.sum() >= 64, f"too few well-conditioned coordinates ({ok.sum()}) {TAG}"
    expect = EL * ES
    slack = 6 * se + 1e-6 * np.abs(expect) + 1e-44
    bad = np.flatnonzero(ok & (np.abs(mean - expect) > slack))
    assert bad.size == 0, (f"biased at {bad[:5].tolist()}: x={xd[bad[:5]]}, E={expect[bad[:5]]}, "
                           f"mean={mean[bad[:5]]}, se={se[bad[:5]]} {TAG}")
    assert np.all(mean[16:32] == 0), TAG


@pytest.mark.parametrize("n", range(2, 10))
def test_correlated_single_event_unbiased(n):
    """One correlated event is unbiased: pi(event) is uniform over coordinates (keys), so
    u = (pi + g)/n is U[0,1).  Every event of n = 2..9.  Values at the stratum mid-points
    p = (j+1/2)/n (the worst place for a skewed stratum law), width 2 / uniform levels /
    scale 1, so decode = 1[rounded up]; each (event, p) at 6 standard errors over 16 keys x
    48000 coordinates (284 z-scores in all: a false alarm has probability ~6e-7).  The hits
    pool the lanes of each group, which are not independent (test_lane_uniforms_*); the
    binomial standard error still holds: over 15 seeds (4260 z-scores) the z-scores had
    mean 0.007, sd 0.995, largest |z| 3.46."""
    rng = rng_for("corr-bias", n)
    nsg = 200
    n_keys = 16
    x = np.zeros((nsg, 16, 16), np.float32)
    x[:, :, 0] = 1.0
    ps = ((np.arange(n) + 0.5) / n).astype(np.float32)
    pidx = np.arange(15 * 16 * nsg) % n
    x[:, :, 1:] = ps[pidx.reshape(nsg, 16, 15)]
    x = x.ravel()
    which = np.arange(x.size).reshape(nsg, 16, 16)[:, :, 1:].ravel()
    tries = n_keys * np.bincount(pidx, minlength=n)
    se = np.sqrt(ps * (1 - ps) / tries)
    for event in range(n):
        hits = np.zeros(n)
        for _ in range(n_keys):
            P = params(2, 0.0, False, True, n, rand_keys(rng))
            base = int(rng.integers(1 << 20))
            d = k_decompress(P, k_compress(P, K.Source(x, sg_offset=base), nsg, base, event, 2, False), nsg)
            hits += np.bincount(pidx, weights=d[which] == 1.0, minlength=n)
        z = (hits / tries - ps) / se
        assert np.all(np.abs(z) < 6), \
            f"n={n} event={event}: P(up) {(hits / tries).round(4)} vs p {ps.round(4)} (z {z.round(1)}) {TAG}"


# ============================================================================= finish
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_finish(dtype):
    rng = rng_for("finish", dtype)
    for _ in range(4):
        nsg = int(rng.integers(3, 40))
        nstream = int(rng.integers(1, nsg + 1))
        stream_of_sg = np.full(nsg, -1, np.int64)
        stream_of_sg[rng.permutation(nsg)[:nstream]] = rng.permutation(nstream)
        stream, _ = make_input(rng, nsg=nstream)
        stream = M.pad_to_super(stream)[: nstream * 256] * np.float32(0.5)
        stream[rng.integers(stream.size)] = np.float32(3.3999e38)   # rounds to inf in BF16
        mean_sum = (rng.standard_normal(nsg) * 10.0 ** rng.uniform(-5, 5, nsg)).astype(np.float32)
        mean_sum[rng.random(nsg) < 0.3] = 0
        mean_sum[rng.random(nsg) < 0.1] = -0.0
        divisor = np.float32(rng.choice([1.0, 2.0, 3.0, 7.0]))
        length = nsg * 256 - int(rng.integers(0, 256))
        dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
        big = np.zeros(length + 300, dt)
        sentinel = np.array(rng.standard_normal(big.size), dt)
        big[:] = sentinel
        out = big[:length]
        K.finish(stream, stream_of_sg, mean_sum, float(divisor), out)
        ref32 = M.finish_model(stream, stream_of_sg, mean_sum, divisor, length, "float32")
        if dtype == "float32":
            assert bits_equal(out, ref32), TAG
        else:
            ref = ref32.astype(ml_dtypes.bfloat16)        # round to nearest even
            assert np.array_equal(out.view(np.uint16), ref.view(np.uint16)), TAG
        assert np.array_equal(big[length:].view(np.uint8), sentinel[length:].view(np.uint8)), \
            f"finish wrote beyond length {TAG}"


def test_finish_bf16_rounding_edges():
    """Ties, the overflow boundary, denormals, NaN and inf against ml_dtypes."""
    rng = rng_for("finish-edges")
    b = rng.integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32)
    b[:64] = (b[:64] & 0xFFFF0000) | 0x8000          # exact ties
    b[64:128] = (b[64:128] & 0x807F0000) | 0x00008000  # denormal ties
    v = b.view(np.float32).copy()
    v[128:136] = [np.inf, -np.inf, np.nan, 3.3895314e38, 3.3961775e38, FLT_MAX, -FLT_MAX, -0.0]
    nsg = v.size // 256
    out = np.empty(v.size, ml_dtypes.bfloat16)
    # mean_sum = -0.0 leaves every value (-0.0 included) unchanged
    K.finish(v, np.arange(nsg, dtype=np.int64), np.full(nsg, -0.0, np.float32), 1.0, out)
    with np.errstate(invalid="ignore"):
        ref = v.astype(ml_dtypes.bfloat16)
    fin = ~np.isnan(v)
    assert np.array_equal(out.view(np.uint16)[fin], ref.view(np.uint16)[fin]), TAG
    assert np.all(np.isnan(out.astype(np.float32)[~fin])), TAG


# ============================================================================= fixed defects (regressions)
def _subprocess(setup, body, timeout):
    env = dict(os.environ, PYTHONPATH=str(ROOT), DQ_TEST_SEED=str(SEED))
    script = ("import numpy as np\nfrom tests.test_codec_reference import *\n"
              + setup + "\n" + textwrap.dedent(body))
    try:
        r = subprocess.run([sys.executable, "-c", script], env=env, timeout=timeout, cwd=str(ROOT),
                           capture_output=True, text=True)
        return r.returncode, r.stdout[-2000:] + r.stderr[-2000:]
    except subprocess.TimeoutExpired:
        return "timeout", ""


NONFINITE_CASES = ["nan", "nan_hier", "inf_hier", "inf_bf16", "centred_overflow", "dar_overflow"]


def nonfinite_run(case):
    """Compress (or the fused step) of a non-finite / overflowing input; NaN and inf used to
    reach (int)(NaN * 4096) in dq_quantize (UB, lut[] read out of bounds, segfault).
    Returns (model, stream values the kernel quantized, kernel bytes, event)."""
    rng = rng_for("nonfinite", case)
    nsg, width, n, event = 4, 4, 3, 1
    x = (rng.standard_normal(nsg * 256) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
    hier = case in ("nan_hier", "inf_hier", "centred_overflow", "dar_overflow")
    mean = None
    if case.startswith("nan"):
        x[rng.choice(x.size, 40, replace=False)] = np.nan
        x[256 + 32: 256 + 48] = np.nan                     # an all-NaN group (scale 0: zero codes)
    elif case.startswith("inf"):
        x[rng.choice(x.size, 40, replace=False)] = np.float32(rng.choice([-np.inf, np.inf], 40))
        x[256 + 32: 256 + 48] = np.inf
    elif case == "centred_overflow":
        # finite input, |x| > 2^127: no centring (mean 0), so x - mean stays finite
        x[:256] = -3.4e38
        x[0] = 3.4e38
    keys = rand_keys(rng)
    P = params(width, 0.2, hier, True, n, keys)
    m = M.make_model(width, 0.2, hier, True, n, keys)
    if case == "centred_overflow":
        mean = K.stats(x, nsg, True)[0]
        assert mean[0] == 0, f"no centring expected for |x| > 2^127, got mean {mean[0]} {TAG}"
    src = K.Source(x, None, 0, mean)
    if case != "dar_overflow":
        return m, P, M.source_values(x, nsg, mean=mean), k_compress(P, src, nsg, 0, event, width, hier), event
    # an incoming partial sum near FLT_MAX plus a local one: the float32 sum overflows to inf
    y = np.full(nsg * 256, 3.0e38, np.float32) * np.where(rng.random(nsg * 256) < 0.5, 1, -1).astype(np.float32)
    inc = k_compress(P, K.Source(y), nsg, 0, 0, width, hier)
    x = (y * np.float32(rng.random(y.size) < 0.5)).astype(np.float32)
    out = np.zeros_like(inc)
    K.dar(P, inc, K.Source(x), nsg, 0, event, out)
    with np.errstate(over="ignore"):
        total = (k_decompress(P, inc, nsg) + x).astype(np.float32)
    assert np.any(np.isinf(total)), TAG
    return m, P, total, out, event


@pytest.mark.parametrize("case", NONFINITE_CASES)
def test_non_finite_values_compress_like_the_model(case):
    """dq_quantize clamps with !(a < 1): NaN (and inf over an inf scale) quantize as |t| = 1
    on the positive side; NaN never wins a group max.  First in a subprocess (a
    regression would segfault), then in-process against the model, decoded values
    included (bitwise, NaN where the model has NaN).  Decoded values are finite where the
    quantized super-group holds no +-inf (NaN inputs code +1 of a finite scale), and with
    per-group BF16 scales everywhere (they saturate at the largest finite BF16).

    Hierarchical super-groups holding +-inf do NOT decode finite, and this test records
    that: the unit of max = inf saturates at BF16 0x7F7F and steps down to 0x7F7E
    (3.38e38), so the inf group's code 255 decodes to scale inf: its inf entries to inf,
    its finite entries (code R, level 0) to NaN; the other groups of that super-group
    get codes 0..2 of that unit (their values are lost).  Only that super-group."""
    rc, out = _subprocess("", f"nonfinite_run({case!r}); print('done')", timeout=120)
    assert rc == 0 and "done" in out, f"{case}: exit status {rc} {out} {TAG}"
    m, P, vals, buf, event = nonfinite_run(case)
    nsg = vals.size // 256
    enc = M.encode(m, vals, event)
    codes, meta = M.split_run(buf, nsg, m.width, m.hierarchical)
    check_meta(m, meta, enc, case)
    check_codes(m, enc, codes, vals, case)
    dec = k_decompress(P, buf, nsg)
    ref = M.decode(m, buf, nsg)
    assert np.array_equal(np.isnan(dec), np.isnan(ref)), f"{case}: NaN decoded values differ {TAG}"
    ok = ~np.isnan(ref)
    assert bits_equal(dec[ok], ref[ok]), f"{case}: decoded values differ {TAG}"
    has_inf = np.repeat(np.isinf(vals).reshape(nsg, 256).any(axis=1), 256)
    finite_expected = ~has_inf if m.hierarchical else np.ones(dec.size, bool)
    assert np.all(np.isfinite(dec[finite_expected])), f"{case}: non-finite decoded values {TAG}"
    if case in ("inf_hier", "dar_overflow"):
        assert has_inf.any() and not np.all(np.isfinite(dec[has_inf])), \
            f"{case}: hierarchical +-inf now decodes finite: update this test's docstring {TAG}"
    nan = np.isnan(vals).reshape(codes.shape)
    scaled = nan & (np.abs(M.decode_scales(m, meta))[:, :, None] > 0)
    assert np.all(codes[scaled] == 2 * m.radius), f"{case}: NaN not coded +1 {TAG}"


def test_stats_never_centre_beyond_flt_max_half():
    """mean = 0 exactly when some |x| > 2^127 (x - mean cannot overflow then); at |x| = 2^127
    the mean is still taken and the centred values stay finite."""
    b = np.float32(2.0 ** 127)
    x = np.full((4, 256), -b, np.float32)
    x[0, 0] = b                                            # mean -0.99 * 2^127: x0 - mean < 2^128
    x[1] = np.where(np.arange(256) % 2, b, -b)
    x[1, 7] = np.nextafter(b, np.float32(np.inf))          # just above: no centring
    x[2, 9] = -np.inf                                      # non-finite: no centring either
    x[3, :] = FLT_MAX
    x = x.ravel()
    mu, F, bad = K.stats(x, 4, True)
    mu_m, F_m, bad_m = M.stats_model(x, 4, True)
    assert bad == bad_m == 1 and bits_equal(mu, mu_m) and bits_equal(F, F_m), TAG
    assert mu[0] != 0 and mu[1] == 0 and mu[2] == 0 and mu[3] == 0, f"means {mu} {TAG}"
    c = (x.reshape(4, 256) - mu[:, None]).astype(np.float32)
    assert np.all(np.isfinite(c[[0, 1, 3]])), TAG
    assert np.all(F[[0, 1, 3]] == FLT_MAX), TAG
    src = K.Source(x, None, 0, mu)          # and the centred source compresses (hierarchical)
    P = params(4, 0.2, True, True, 2, (5, 6))
    buf = k_compress(P, src, 4, 0, 1, 4, True)
    assert np.all(np.isfinite(k_decompress(P, buf, 4).reshape(4, 256)[[0, 1, 3]])), TAG


def test_out_of_range_event_raises():
    """Correlated compress / dar with event >= n_events raise ValueError (they used to
    cycle-walk forever in dq_permute: run in a subprocess with a timeout)."""
    rc, out = _subprocess("", """
        x = np.ones(256 * 4, np.float32)
        for n in (1, 2, 3, 5, 8, 9):
            P = params(4, 0.2, False, True, n, (1, 2))
            buf = np.zeros(K.run_bytes(4, 4, False), np.uint8)
            K.compress(P, K.Source(x), 4, 0, n - 1, buf)               # the last valid event
            for ev in (n, n + 1, 1 << M.perm_bits_for(n), 2 ** 32 - 1):
                for call in ("compress", "dar"):
                    try:
                        if call == "compress":
                            K.compress(P, K.Source(x), 4, 0, ev, np.zeros_like(buf))
                        else:
                            K.dar(P, buf, K.Source(x), 4, 0, ev, np.zeros_like(buf))
                    except ValueError:
                        continue
                    raise SystemExit(f"{call} n={n} event={ev}: no ValueError")
        print("done")
    """, timeout=60)
    assert rc == 0 and "done" in out, f"exit status {rc}: {out} {TAG}"
    # uncorrelated rounding has no stratum: any event is valid there
    x = np.ones(256, np.float32)
    P = params(4, 0.2, False, False, 1, (1, 2))
    k_compress(P, K.Source(x), 1, 0, 7, 4, False)


def test_make_params_validates_events_and_perm_bits():
    t = LV.build_tables(4, 0.2)

    def mk(n, bits, correlated=True):
        return K.make_params(4, False, correlated, n, bits, 1, 2, t.mag, t.inv_gap, t.level, t.lut)

    for n in list(range(1, 18)) + [1000, 2 ** 20 + 1, 2 ** 30]:
        bits = M.perm_bits_for(n)
        assert bits == (n - 1).bit_length()
        mk(n, bits)
        for wrong in {bits - 1, bits + 1, 31} - {bits}:
            if wrong < 0:
                continue
            with pytest.raises(ValueError):
                mk(n, wrong)
    for n in (0, 2 ** 30 + 1, 2 ** 31, 2 ** 32 - 1):
        with pytest.raises(ValueError):
            mk(n, max(0, (n - 1).bit_length()) if n else 0)
    with pytest.raises(ValueError):
        mk(0, 0, correlated=False)


def test_group_scale_codes_are_the_smallest_covering_code():
    """Spec 2.7: the group code is the smallest c with c * unit >= group max,
    deterministic, and values are normalised by the decoded c * unit.  Inputs
    put group maxima on k * unit, just above it (the quotient rounds down onto
    k: the code must be k + 1) and just below it, at every width, with random
    keys; codes equal the hand-derived ones and the model's bytes."""
    from helpers import scale_boundary_input     # (not at the top: subprocess tests import this file)
    rng = rng_for("scale-codes")
    nsg = 64
    x, expect = scale_boundary_input(rng, nsg)
    assert (expect != 255).sum() > 100, TAG
    for width in WIDTHS:
        eps = DEFAULT_EPS[width]
        for trial in range(2):
            keys = rand_keys(rng)
            P = params(width, eps, True, False, 1, keys)
            buf = k_compress(P, K.Source(x), nsg, 0, trial, width, True)
            codes, meta = M.split_run(buf, nsg, width, True)
            bad = np.argwhere(meta[0] != expect)[:5].tolist()
            assert not bad, f"width {width}: group codes differ from the smallest covering one at {bad} {TAG}"
            enc = M.encode(M.make_model(width, eps, True, False, 1, keys), x, trial)
            check_meta(M.make_model(width, eps, True), meta, enc, "scale boundary")
            check_codes(M.make_model(width, eps, True), enc, codes, x, "scale boundary")
            unit = M.bf16_bits_to_f32(meta[1]).astype(np.float64)
            decoded = meta[0] * unit[:, None]
            gmax = np.abs(x.astype(np.float64)).reshape(nsg, 16, 16).max(axis=2)
            assert np.all(decoded >= gmax) and np.all(decoded - unit[:, None] < gmax), TAG
            # the group's largest value is normalised to |t| <= 1: its code never saturates
            # beyond the top level (decoded magnitude <= decoded scale)
            dec = k_decompress(P, buf, nsg).reshape(nsg, 16, 16)
            assert np.all(np.abs(dec).max(axis=2) <= decoded.astype(np.float32)), TAG


def test_hierarchical_unit_near_flt_max():
    """dq_unit_bf16: within ~0.4 % of FLT_MAX the unit steps one BF16 ulp down so that
    255 * unit is finite; the top group's code saturates at 255 there, its decoded scale
    255 * unit within 2^-7 (one BF16 ulp) below the group max.  Group maxima: FLT_MAX and
    random values in the top 1.5 % of the float32 range, other groups at random fractions."""
    rng = rng_for("flt-max")
    top = int(FLT_MAX.view(np.uint32))
    s = (top - np.concatenate([[0, 1], rng.integers(0, 2 ** 18, 1022)])).astype(np.uint32).view(np.float32)
    nsg = s.size
    frac = rng.uniform(-1, 1, (nsg, 256)) * 10.0 ** rng.uniform(-6, -3, (nsg, 1))
    g = rng.integers(0, 16, nsg)
    frac.reshape(nsg, 16, 16)[np.arange(nsg), (g + 1) % 16] *= 250        # a group at ~s/4
    x = (frac * s[:, None].astype(np.float64)).astype(np.float32)
    x[np.arange(nsg), g * 16 + rng.integers(0, 16, nsg)] = s * np.where(rng.random(nsg) < 0.5, 1, -1)
    x = x.ravel()
    keys = rand_keys(rng)
    m = M.make_model(4, 0.2, True, False, 1, keys)
    P = params(4, 0.2, True, False, 1, keys)
    buf = k_compress(P, K.Source(x), nsg, 0, 0, 4, True)
    enc = M.encode(m, x, 0)
    codes, meta = M.split_run(buf, nsg, 4, True)
    check_meta(m, meta, enc, "near FLT_MAX")
    check_codes(m, enc, codes, x, "near FLT_MAX")
    unit = M.bf16_bits_to_f32(meta[1]).astype(np.float64)
    assert np.all(255 * unit <= float(FLT_MAX)), TAG
    dec = k_decompress(P, buf, nsg)
    assert np.all(np.isfinite(dec)), f"finite input decoded to non-finite values {TAG}"
    stepped = M.bf16_bits_to_f32(M.bf16_up_bits(s.astype(np.float64) / 255)).astype(np.float64) * 255 \
        > float(FLT_MAX)
    assert stepped.any() and (~stepped).any(), TAG                       # both sides covered
    gtop = meta[0][np.arange(nsg), g]
    assert np.all(gtop[stepped] == 255), TAG
    sc = 255 * unit[stepped]
    assert np.all((sc < s[stepped]) & (sc >= s[stepped] * (1 - 2.0 ** -7))), TAG
    assert np.all(unit[~stepped] * 255 >= s[~stepped]), TAG              # unbiased codes below
