"""The codec's random generator: call keys and domains, the keyed Feistel
permutation of correlated rounding (equal to the model, a permutation,
uniform marginals, the pair law, the joint support) and the per-element lane
uniforms (one function of the group base, uniform, independent across
events).  Serial; the session seed is in every message (tests/codec_ref.py)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.codec_ref import *  # noqa: F401,F403  (the shared pieces: K, M, LV, params, ...)
from tests.codec_ref import _load_py


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


def test_chi2_sf_sanity():
    assert abs(chi2_sf(3.841458820694124, 1) - 0.05) < 1e-9
    assert abs(chi2_sf(23.92812697687947, 1) - 1e-6) < 1e-12
    assert abs(chi2_sf(18.307038053275146, 10) - 0.05) < 1e-9
    assert abs(chi2_sf(124.342, 100) - 0.05) < 1e-4


# ============================================================================= permutation
# Correlated rounding (dq_codec.h, "per event"): the stratum of event e at lane j of group
# G (coordinate c = 16 G + j) is pi_c(e) = (sigma_S(e) + shift_{G,j}) mod n, sigma_S a keyed
# 12-round Feistel permutation (cycle walking) shared by the 256 coordinates of the
# super-group S = G >> 4, shift_{G,j} = floor(lane_uniform(b_G, j) n / 2^32) the lane's
# offset, b_G = mix32(G ^ key_perm ^ 0xbb67ae85) one 32-bit base per group, the same for
# every event (each lane's offset is uniform up to n / 2^32: lane_uniform(., j) is a
# bijection).  What is claimed, and tested below on the compiled kernel:
#   * pi_c is a permutation of 0..n-1 and equals the model's on every coordinate of MODEL_SG super-groups;
#   * the 256 coordinates of a super-group share sigma_S, the 16 lanes of a group one
#     offset base (their offsets differ);
#   * the marginal law of each pi_c(e) is uniform, so one correlated quantization is
#     unbiased (chi-square per (n, event) and direct bias tests, n = 2..9);
#   * the joint law is close to, but not exactly, uniform over the n! permutations.  It
#     is tested for what holds: every ordered pair (pi(i), pi(j)) = (a, b), a != b,
#     occurs, with a frequency within a factor PAIR_FACTOR[n] (1.1 to 1.3) of uniform
#     1 / (n (n - 1)), and (n <= 6) every one of the n! permutations occurs.
# The lanes of one group are not independent of each other (their offsets and value
# uniforms are fixed functions of one base each: see test_lane_uniforms_*), and the
# coordinates of a super-group share sigma_S; the marginal tests pool all coordinates
# (a shared sigma_S only rotates the offsets of its 256 coordinates), the pair and
# permutation laws are laws of sigma_S, so their samples are the PROBE_SG super-groups.
# Since the offset is uniform and shared by all events, P(pi(i) = a, pi(j) = b) =
# P(sigma(j) - sigma(i) = b - a mod n) / n: the pair law is that of the Feistel
# differences over the super-group seeds.  Measured on the model (which equals the kernel
# on the coordinates it checks, test_permutation_matches_model_...) over 2^21 seeds, the
# ratio of a pair's probability to uniform lies in
#     n = 2: [1, 1]  3: [0.999, 1.001]  4: [0.997, 1.002]  5: [0.980, 1.019]
#     6: [0.972, 1.024]  7: [0.972, 1.031]  8: [0.961, 1.077]  9: [0.995, 1.007]
# and that of a whole permutation (class up to rotation) in
#     n = 4: [1.00, 1.00]  5: [0.97, 1.03]  6: [0.94, 1.07]  7: [0.84, 1.22]
#     8: [0.56, 2.67]  9: [0.27, 1.98] (n = 9: ~50 samples per class, +-14 % noise).
# (The 6-round network per group used before 2026-11-25 gave pairs in [0.71, 1.59] and
# permutations in [0.12, 7.9] at n = 8.)
PROBE_SG = 8192           # 8192 super-groups (each one Feistel permutation) = 2^21 coordinates per n
MODEL_SG = 2048           # of them, those whose every coordinate is checked against the model
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
    # the model's stratum (Feistel of the group + the lane's offset) on the coordinates of
    # MODEL_SG of the super-groups (the model costs more than the kernel's readback)
    check = slice(0, MODEL_SG * M.SUPER)
    for e in range(n):
        mp = M.stratum(keys[1], group[check], lane[check], e, n).astype(np.int64)
        bad = np.flatnonzero(mp != pis[check, e])[:5]
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
def test_super_group_shares_the_feistel_permutation(n):
    """pi_c(e) - pi_c(0) mod n = sigma_S(e) - sigma_S(0) is the same for the 256 coordinates
    of a super-group (read from the kernel alone), the per-coordinate remainder pi_c(e) -
    sigma_S(e) mod n does not depend on the event and is the lane's offset
    floor(lane_uniform(b_G, j) n / 2^32) of its group's one offset base b_G, the offsets
    do differ between the lanes of a group, and the Feistel part does differ between
    super-groups (n >= 3: for n = 2 the only relative pattern is (0, 1))."""
    pis, coord, keys = compiled_pi(n)
    S = pis.shape[0] // M.SUPER
    p = pis.reshape(S, M.SUPER, n)
    rel = (p - p[:, :, :1]) % n
    bad = np.flatnonzero(np.any(rel != rel[:, :1, :], axis=(1, 2)))[:5]
    assert bad.size == 0, f"n={n}: super-groups {bad} do not share one permutation {TAG}"
    groups = coord.reshape(S, M.SUPER)[:, 0] >> np.uint64(4)
    sigma = np.stack([M.perm_base(keys[1], groups, e, n).astype(np.int64) for e in range(n)], axis=1)
    assert np.all(np.sort(sigma, axis=1) == np.arange(n)[None, :]), TAG
    off = (p - sigma[:, None, :]) % n
    assert np.all(off == off[:, :, :1]), f"n={n}: offset depends on the event {TAG}"
    group, lane = M.coord_group_lane(coord)
    assert np.array_equal(off[:, :, 0].ravel(), M.lane_shift(keys[1], group, lane, n).astype(np.int64)), TAG
    # one base per group, yet not one offset per group: with independent lanes all 16
    # would agree in a fraction n^-15 of the groups (3e-5 for n = 2)
    og = off[:, :, 0].reshape(-1, M.GROUP)
    same = np.mean(np.all(og == og[:, :1], axis=1))
    assert same < 1e-3, f"n={n}: the 16 lanes share one offset in {same:.2%} of the groups {TAG}"
    if n >= 3:
        patterns = np.unique(rel[:, 0, :], axis=0).shape[0]
        assert patterns == math.factorial(n - 1) or patterns >= 64, \
            f"n={n}: only {patterns} relative patterns over {S} super-groups {TAG}"


# Each (n, event) marginal is tested at false-alarm rate 1e-6 (the family of 44 tests:
# < 5e-5).  Against a uniform pi the statistic is chi-square with n - 1 degrees of
# freedom (the super-groups are independent; the counts of one super-group's 256
# coordinates are not multinomial, but their variance is within 5 % of it, measured on
# the model over 2^14 super-groups for every (n, stratum), which moves a 1e-6 tail by
# well under a factor 2); a cell off by 1.5 % of 1/n is detected.
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
# Measured on the model's 2^21-coordinate sample (8192 super-groups, as the kernel's),
# 6 seeds, smallest / largest ratio over all cells of all event pairs, mean +- sd:
#   n=2 [1.000+-0.000, 1.000+-0.000]   n=3 [0.991+-0.003, 1.008+-0.003]
#   n=4 [0.969+-0.011, 1.032+-0.011]   n=5 [0.955+-0.004, 1.047+-0.007]
#   n=6 [0.940+-0.012, 1.066+-0.011]   n=7 [0.912+-0.014, 1.084+-0.012]
#   n=8 [0.905+-0.013, 1.115+-0.017]   n=9 [0.912+-0.007, 1.089+-0.010]
# (sample extremes sit outside the true ones above); every bound is >= 7 sd away.
PAIR_FACTOR = {2: 1.1, 3: 1.1, 4: 1.15, 5: 1.15, 6: 1.2, 7: 1.25, 8: 1.3, 9: 1.2}


@pytest.mark.parametrize("n", range(2, 10))
def test_permutation_pair_law(n):
    """The pair (pi(i), pi(j)), i != j, of one coordinate: never equal, and every ordered
    pair (a, b) of distinct strata occurs, with a frequency within a factor PAIR_FACTOR[n]
    of the uniform 1 / (n (n - 1)) (n = 8 is the loosest: 1.3)."""
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
    the measured ratios above).  The least likely permutation class of n = 6 (ratio 0.94,
    one of 120 up to rotation) is expected in ~64 of the 8192 super-groups (and in each
    of its 6 rotations through the offsets), so a miss has probability ~e^-64."""
    pis, _, _ = compiled_pi(n)
    ids = np.zeros(pis.shape[0], np.int64)
    for e in range(n):
        ids = ids * n + pis[:, e]
    seen = np.unique(ids).size
    assert seen == math.factorial(n), f"n={n}: {seen} of {math.factorial(n)} permutations occur {TAG}"


# ============================================================================= lane uniforms
# The generator (dq_codec.h, "per event") hashes once per (group, event): the value-rounding
# uniform of lane j of group G is g = lane_uniform(b, j) = b * lane_mul(j) (mod 2^32),
# lane_mul(j) = mix32(j * 0x9e3779b9 + 0x632be5ab) | 1 (odd), of ONE base b =
# event_uniform(key_value, G, event).  What that gives, and what it does not, read back
# from the compiled kernel:
#   * NOT independent within a group: the 16 lanes' uniforms are a fixed function of b
#     (knowing one lane's uniform determines the 15 others).  Pairs of lanes are close to
#     independent at the resolution a rounding decision sees: the 16 x 16 histogram of the
#     top 4 bits of two lanes, worst of the 120 pairs, chi-square 314 over 2^20 bases and
#     304 over 2^22 (df 255; the largest of 120 independent draws is ~330), measured on
#     the model.  (The multiply-xorshift lanes before 2026-11-25 reached 1.4e5 over 2^20.)
#     This changes neither unbiasedness nor the expected squared error (per-coordinate
#     quantities), only how rounding errors of the lanes of one group co-vary;
#   * each lane on its own is exactly uniform over groups (b -> b * lane_mul(j) is a
#     bijection of a uniform base): chi-square per (lane, event);
#   * across the events of one coordinate the bases are independent hashes, so the
#     uniforms are independent: correlation ~0 and the joint histogram of two events is
#     uniform, per lane;
#   * so each single event's rounding is unbiased: the binomial tests of
#     test_single_quantization_unbiased (every coordinate, 2000 keys) and
#     test_correlated_single_event_unbiased (every event, n = 2..9) below.
LANE_EVENTS = 4           # events read back per coordinate
LANE_BITS = 12            # top bits of each uniform read back
LANE_SG = 1024            # 1024 super-groups = 16384 groups (one value base each)
_G_CACHE = []


def compiled_value_uniforms():
    """The top LANE_BITS bits of the value-rounding uniform g32 the compiled kernel draws at
    every coordinate of LANE_SG super-groups, for events 0..LANE_EVENTS-1 (independent
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
    N = LANE_SG * M.SUPER
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
                buf = k_compress(P, K.Source(x, sg_offset=sg_base), LANE_SG, sg_base, event, 2, False)
                c = M.split_run(buf, LANE_SG, 2, False)[0].ravel()
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
    within a group (one lane's uniform gives back b), yet no pair of lanes shows a
    dependence at the top 4 bits over 16384 groups: the worst of the 120 pairs' 16 x 16
    histograms has a chi-square p-value above 1e-6 (df 255; false alarm < 1.2e-4)."""
    q, group, lane, keys = compiled_value_uniforms()
    for e in range(LANE_EVENTS):
        mq = (M.value_uniform(keys[0], group, lane, e) >> np.uint64(32 - LANE_BITS)).astype(np.int64)
        bad = np.flatnonzero(mq != q[:, e])[:5]
        assert bad.size == 0, f"event {e}: kernel uniform != lane_uniform(base, lane) at {bad} {TAG}"
    # one lane determines the other 15: lane 0's multiplier is odd, so the full uniform of
    # lane 0 (the model's, equal to the kernel's) gives back b, and b reproduces the
    # kernel's uniforms of all 16 lanes
    inv = pow(int(M.lane_mul(0)), -1, 2 ** 32)
    g0 = M.value_uniform(keys[0], group[::M.GROUP], 0, 0)
    b = (g0 * np.uint64(inv)) & np.uint64(M.MASK32)
    assert np.array_equal(b, M.event_uniform(keys[0], group[::M.GROUP], 0)), TAG
    again = M.lane_uniform(np.repeat(b, M.GROUP), lane) >> np.uint64(32 - LANE_BITS)
    assert np.array_equal(again.astype(np.int64), q[:, 0]), TAG
    G = q.shape[0] // M.GROUP
    top4 = (q[:, 0] >> (LANE_BITS - 4)).reshape(G, M.GROUP)
    worst = (1.0, None, 0.0)
    for j in range(M.GROUP):
        for k in range(j + 1, M.GROUP):
            h = np.bincount(top4[:, j] * 16 + top4[:, k], minlength=256)
            stat = float(((h - G / 256) ** 2 / (G / 256)).sum())
            worst = min(worst, (chi2_sf(stat, 255), (j, k), stat))
    print(f"lane pair chi-square: largest {worst[2]:.0f} at lanes {worst[1]}")
    assert worst[0] > 1e-6, (f"lanes {worst[1]} of a group depend on each other: chi-square "
                             f"{worst[2]:.0f}, df 255, p {worst[0]:.1e} {TAG}")


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


def test_correlated_rounding_refuses_more_than_2_24_events():
    """The header compares n p - pi in float32 (exact while pi < 2^24) and the GPU's
    one-step kernels compare the same quantity as 64-bit integers: both agree only up
    to 2^24 events, so make_params (shared by the CPU and the GPU) refuses more with
    correlated rounding, and takes them without it."""
    assert params(4, 0.2, True, True, 1 << 24).size > 0
    with pytest.raises(ValueError, match=r"at most 2\^24 events"):
        params(4, 0.2, True, True, (1 << 24) + 1)
    t = LV.build_tables(4, 0.2)          # without correlated rounding n_events is not limited so
    n = (1 << 24) + 1
    assert len(K.make_params(4, True, False, n, M.perm_bits_for(n), 1, 2, t.mag, t.inv_gap,
                             t.level, t.lut, 0)) > 0
