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

import numpy as np
import pytest

from tests.codec_ref import *  # noqa: F401,F403  (the shared pieces: K, M, LV, params, ...)


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
    """dq_quantize clamps |t| to [0, 1] like a saturating multiply: NaN (and inf over an inf
    scale) quantize as a = 0, the zero code R (since 2026-11-25; +1 before); NaN never wins
    a group max.  First in a subprocess (a regression would segfault), then in-process
    against the model, decoded values included (bitwise, NaN where the model has NaN).
    Decoded values are finite where the quantized super-group holds no +-inf (NaN inputs
    code 0 of a finite scale), and with
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
    assert np.all(codes[scaled] == m.radius), f"{case}: NaN not coded 0 (the zero code R) {TAG}"


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

    for n in list(range(1, 18)) + [1000, 2 ** 20 + 1, 2 ** 24, 2 ** 30]:
        bits = M.perm_bits_for(n)
        assert bits == (n - 1).bit_length()
        mk(n, bits, correlated=n <= 2 ** 24)   # correlated rounding: at most 2^24 events
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
