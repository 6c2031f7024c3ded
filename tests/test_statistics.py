"""Statistical properties of the compressed all-reduce, run in one process
with the simulated transport (the same engine and codec as over MPI).

False-alarm rates are stated per test; inputs are fresh random draws whose
seed is printed on failure.
"""
import numpy as np
import pytest

import dynamiq_mpi as dq
from dynamiq_mpi.codecs.levels import build_tables
from helpers import exact_sum, fresh_seed, rank_inputs, vnmse


def errors_over_calls(xs, codec, topology, calls, first_counter=0, widths=None):
    """(calls x length) float64 errors of successive calls (fresh randomness each).
    ``widths`` (a list) receives the super-group widths of each call."""
    ref = exact_sum(xs)
    errs = np.empty((calls, ref.shape[0]))
    for t in range(calls):
        outs, reps = dq.simulate_allreduce(xs, codec=codec, topology=topology, seed=7,
                                           counter=first_counter + t, return_reports=True)
        errs[t] = outs[0].astype(np.float64) - ref
        if widths is not None:
            widths.append(np.asarray(reps[0].codec_info["supergroup_widths"]))
    return errs


# The default codec (hybrid group codes, the 16-bit class; spec 2.3 and 2.7
# since 2026-11-23) and the earlier defaults (rounded-up codes, widths up to 8).
CONFIGS = {"defaults": {}, "ceil-no16": {"scale_code": "ceil", "bf16_class": False}}


def unbiased_inputs(seed, n, length):
    """Heavy-tailed inputs with two super-groups scaled so that their largest
    value is 1e4x the largest of every other super-group on every rank (their
    norms 1e8x, far beyond the 8-to-16-bit threshold ratio 510): at 7 bits the
    default allocation sends them as raw BF16 (the 16-bit class) and the rest
    at 2, 4 or 8 bits.  (Scaling them by a fixed 1e4 was not enough: the
    per-super-group scales of ``rank_inputs`` span seven decades, and seed
    117570404 left both at 8 bits.)"""
    xs = rank_inputs(seed, n, length)
    rows = (slice(3 * 256, 4 * 256), slice(8 * 256, 9 * 256))
    rest = np.ones(length, dtype=bool)
    for r in rows:
        rest[r] = False
    peak = max(float(np.abs(x[rest]).max()) for x in xs)
    for r in rows:
        row_peak = max(float(np.abs(x[r]).max()) for x in xs)
        for x in xs:
            x[r] *= np.float32(1e4 * peak / row_peak)
    return xs


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("topology", ["ring", "butterfly"])
def test_unbiased_without_correlated_rounding(topology, config):
    """E[S^] = S for every coordinate of the coded classes (2, 4 and 8 bits).
    Over T = 400 calls (fresh randomness each):
    * R = sum_i mean_i^2 / sum_i (var_i / T) has mean 1 when unbiased; any bias b
      adds T ||b||^2 / sum var (a 1 % relative bias at 4 bits: R ~ 5).  Bound
      R < 1.35.  No lower bound: R below 1 is no sign of bias, and since the
      scale codes are deterministic below code 128 (spec 2.7) a group's largest
      value can sit just below the top level, so its 2-bit code jumps rarely but
      far: heavy-tailed errors spread R on the low side (0.6-1.1 over seeds,
      measured).
    * per super-group error sums (256 coordinates: close to normal) have
      |z| < 5: false-alarm rate ~1e-5 for the ~11 super-groups.
    Per-coordinate z-scores are not used: 2-bit codes of heavy-tailed groups
    give coordinates whose error is a rare large jump, far from normal at T = 400.
    Those jumps also push R above 1.35 now and then (1.46 for seed 3418237187,
    butterfly; 0.95 for the same inputs at T = 1600): an R over the bound is
    re-judged on 1200 more calls, where a 1 % bias would give R ~ 20, and if
    still over, on 4800 more (seed 373010030, butterfly, rounded-up codes:
    R = 1.67, 1.50, 1.01 at T = 400, 1600, 6400).
    The 16-bit class (raw BF16, every hop rounding the float32 partial sum to
    nearest even, spec 2.3) is deterministic, not unbiased: its rows must come
    back the same in every call, within the rounding bound of n hops
    (|err| <= n 2^-8 (1 + 2^-8)^n sum_r |x_r - mu_r|, plus float32 slack)."""
    seed = fresh_seed()
    n, length = 4, 256 * 12 + 37
    xs = unbiased_inputs(seed, n, length)
    codec = dq.DynamiQ(small_input=0, bits=7, correlated=False, **CONFIGS[config])
    widths = []
    errs = errors_over_calls(xs, codec, topology, 400, widths=widths)
    w = widths[0]
    assert all(np.array_equal(v, w) for v in widths)        # a function of the inputs
    coded_sg = np.isin(w, (2, 4, 8))
    raw_sg = w == 16
    if config == "defaults":
        assert raw_sg.any(), f"seed {seed}: no 16-bit row ({w})"
    else:
        assert not raw_sg.any()
    nsg = w.shape[0]
    coded = np.repeat(coded_sg, 256)[:length]

    def r_of(errs):
        e = errs[:, coded]
        return np.sum(e.mean(axis=0) ** 2) / np.sum(e.var(axis=0, ddof=1) / e.shape[0])
    ratio = r_of(errs)
    for more_calls in (1200, 4800):     # re-judged on more calls (see above)
        if ratio < 1.35:
            break
        more = errors_over_calls(xs, codec, topology, more_calls, first_counter=errs.shape[0])
        errs = np.concatenate([errs, more])
        ratio = r_of(errs)
    calls = errs.shape[0]
    assert ratio < 1.35, f"seed {seed}: R = {ratio:.3f} over {calls} calls"
    sums = np.add.reduceat(errs, np.arange(0, length, 256), axis=1)[:, coded_sg]
    z = sums.mean(axis=0) / (sums.std(axis=0, ddof=1) / np.sqrt(calls))
    assert np.max(np.abs(z)) < 5.0, f"seed {seed}: z = {np.round(z, 2)}"
    if raw_sg.any():
        raw = np.repeat(raw_sg, 256)[:length]
        assert np.all(errs[:, raw] == errs[0, raw]), f"seed {seed}: 16-bit rows vary"
        padded = np.zeros((n, nsg * 256))
        padded[:, :length] = np.stack(xs)
        rows = padded.reshape(n, nsg, 256)
        centred = np.abs(rows - rows.mean(axis=2, keepdims=True)).sum(axis=0).reshape(-1)[:length]
        exact = np.abs(exact_sum(xs))
        bound = n * 2.0 ** -8 * (1 + 2.0 ** -8) ** n * centred + 1e-5 * exact
        assert np.all(np.abs(errs[0, raw]) <= bound[raw]), f"seed {seed}"


@pytest.mark.parametrize("config", list(CONFIGS))
def test_correlated_rounding_bias_is_small_and_error_lower(config):
    """Correlated rounding is not exactly unbiased (spec section 1: ||bias||^2
    ~0.1-0.2 % of the MSE in a reference simulation).  Bound stated here:
    ||mean error||^2 <= 2 % of the mean squared error (the estimate itself
    carries ~1/T = 0.5 % of noise at T = 200), and the error is at least 15 %
    lower than with independent rounding (measured: ~35 %)."""
    seed = fresh_seed()
    xs = rank_inputs(seed, 8, 256 * 8, kind="normal")
    cfg = dict(small_input=0, bits=9, fixed_width=4, **CONFIGS[config])
    on = errors_over_calls(xs, dq.DynamiQ(**cfg), "ring", 200)
    off = errors_over_calls(xs, dq.DynamiQ(correlated=False, **cfg), "ring", 200)
    mse_on = np.mean(np.sum(on ** 2, axis=1))
    mse_off = np.mean(np.sum(off ** 2, axis=1))
    bias2 = np.sum(on.mean(axis=0) ** 2)
    assert bias2 <= 0.02 * mse_on, f"seed {seed}: bias^2/MSE = {bias2 / mse_on:.4f}"
    assert mse_on < 0.85 * mse_off, f"seed {seed}: {mse_on:.4g} vs {mse_off:.4g}"


@pytest.mark.parametrize("topology", ["ring", "butterfly"])
def test_default_codec_bias_bound_with_correlated_rounding(topology):
    """The default codec (variable widths 2/4/8/16, hybrid group codes,
    correlated rounding on) on the inputs of the unbiasedness test: over the
    coded classes ||mean error||^2 <= 2 % of the MSE (T = 200: ~0.5 % of it
    is the estimate's own noise), as spec section 1 bounds it."""
    seed = fresh_seed()
    n, length = 8, 256 * 12 + 37
    xs = unbiased_inputs(seed, n, length)
    widths = []
    on = errors_over_calls(xs, dq.DynamiQ(small_input=0, bits=7), topology, 200, widths=widths)
    coded = np.repeat(np.isin(widths[0], (2, 4, 8)), 256)[:length]
    e = on[:, coded]
    mse = np.mean(np.sum(e ** 2, axis=1))
    bias2 = np.sum(e.mean(axis=0) ** 2)
    assert bias2 <= 0.02 * mse, f"seed {seed}: bias^2/MSE = {bias2 / mse:.4f}"


def ring_error_bound(xs, codec, widths):
    """Expected squared error bound of a ring all-reduce (independent rounding).

    Event k of a chunk quantizes the partial sum P_k of k+1 ranks.  For a group
    of 16 with max |P_k| = m, width w (largest normalised level gap g_w) and a
    BF16 unit u <= (1 + 2^-7) max_group_max / 255, the decoded group scale is
    the smallest multiple of u covering m (spec 2.7: deterministic), so it is
    below m + u, and stochastic rounding of each value normalised by it costs
    <= g_w^2 (m + u)^2 / 4; the scale itself adds no noise.  Errors of successive events are martingale
    differences, so their variances add.  We use the exact partial sums (the
    real ones also carry the earlier errors: a 1.5x slack covers that) and the
    worst starting rank over the n possible chunk positions.
    """
    n = len(xs)
    tables = codec.tables()
    gap = {w: float(np.max(np.diff(tables[w].mag.astype(np.float64)))) for w in (2, 4, 8)}
    length = xs[0].shape[0]
    nsg = -(-length // 256)
    padded = np.zeros((n, nsg * 256))
    padded[:, :length] = np.stack(xs)
    centred = padded.reshape(n, nsg, 256)
    centred = centred - centred.mean(axis=2, keepdims=True)
    g2 = np.array([gap.get(int(w), 0.0) ** 2 for w in widths])[:, None]   # per super-group
    live = (widths > 0)[:, None]
    worst = np.zeros(nsg)
    for start in range(n):
        total = np.zeros(nsg)
        partial = np.zeros((nsg, 256))
        for k in range(n):
            partial = partial + centred[(start + k) % n]
            gmax = np.abs(partial).reshape(nsg, 16, 16).max(axis=2)
            unit = (1 + 2.0 ** -7) * gmax.max(axis=1, keepdims=True) / 255
            per_group = 16 * g2 * (gmax + unit) ** 2 / 4
            total += np.where(live, per_group, 0.0).sum(axis=1)
        worst = np.maximum(worst, total)
    return 1.5 * worst.sum()


@pytest.mark.parametrize("correlated", [False, True])
def test_vnmse_at_5_bits_within_derived_bound(correlated):
    seed = fresh_seed()
    xs = rank_inputs(seed, 8, 256 * 512 + 100)
    ref = exact_sum(xs)
    codec = dq.DynamiQ(small_input=0, bits=5, correlated=correlated)
    errs, bounds = [], []
    for t in range(3):
        outs, reps = dq.simulate_allreduce(xs, codec=codec, seed=seed % 997, counter=t,
                                           return_reports=True)
        errs.append(vnmse(outs[0], ref))
        bounds.append(ring_error_bound(xs, codec, reps[0].codec_info["supergroup_widths"])
                      / np.sum(ref ** 2))
    assert 0 < np.mean(errs) <= np.mean(bounds), f"seed {seed}: {errs} vs bound {bounds}"
    three = vnmse(dq.simulate_allreduce(xs, codec=dq.DynamiQ(small_input=0, bits=3), seed=1)[0], ref)
    assert np.mean(errs) < three, f"seed {seed}: 5 bits {np.mean(errs)} vs 3 bits {three}"


def test_error_falls_with_bits():
    seed = fresh_seed()
    xs = rank_inputs(seed, 4, 256 * 256)
    ref = exact_sum(xs)
    errs = [vnmse(dq.simulate_allreduce(xs, codec=dq.DynamiQ(small_input=0, bits=b), seed=3)[0], ref)
            for b in (3, 4, 5, 6, 8)]
    assert all(a > b for a, b in zip(errs, errs[1:])), f"seed {seed}: {errs}"


def test_level_tables_match_the_paper_artifact():
    # the artifact's CUDA table for 4 bits, eps = 0.18 (paper-notes 3.3)
    mag = build_tables(4, 0.18).mag
    np.testing.assert_allclose(mag, [0, 0.1174, 0.2424, 0.3755, 0.5173, 0.6682, 0.8289, 1.0],
                               atol=1e-4)
    assert np.all(build_tables(8, 0.0).mag * 127 == np.arange(128))
