"""The compiled statistics pass against the NumPy model: means and norms in
the header's summation order, non-finite counts, no centring beyond FLT_MAX/2.
Serial; the session seed is in every message (tests/codec_ref.py)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.codec_ref import *  # noqa: F401,F403  (the shared pieces: K, M, LV, params, ...)


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
                # a float32 tree of 8 levels over values scaled by 2^-8: each
                # level rounds its partial sums (<= 2^-24 relative), and a
                # denormal lost below 2^-149 in the scaling
                bound = ulp + 8 * 2.0 ** -24 * sum_abs + 256 * 2.0 ** -149
                assert np.all(err <= bound), f"{what}: mean off beyond the tree's bound {TAG}"


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
