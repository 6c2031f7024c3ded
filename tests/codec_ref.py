"""The shared pieces of the codec reference tests (test_codec_reference.py,
test_codec_stats_reference.py, test_codec_generator.py,
test_codec_unbiased.py): the compiled CPU codec loaded, the session seed,
parameter blobs, the input kinds, the code checks against the NumPy model
(tests/reference_model.py) and the distribution tests' tail functions."""
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


# ============================================================================= distribution tails
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


# ============================================================================= unbiasedness inputs
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
