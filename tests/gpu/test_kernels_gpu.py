"""CUDA kernels == CPU codec, bit for bit (spec section 4).

Every GPU operation is run on random inputs and compared with the CPU twin
(``dynamiq_mpi._cpu``, the semantic reference) byte for byte / bit for bit:
widths 2/4/8, hierarchical and per-group scales, independent and correlated
rounding (several n_events and events), float32 and BF16 sources through a
super-group map and per-row means, lengths that are not multiples of 256, zero
groups and super-groups, denormals, huge values, values near FLT_MAX whose
partial sums overflow, -0.0, and wire buffers at odd byte offsets (runs are
concatenated in one message).  The BF16 and exact
baseline kernels are checked against their NumPy definitions.

Skipped (with the reason) unless dynamiq_mpi.cuda.has_cuda().
"""
import zlib

import numpy as np
import pytest

from dynamiq_mpi.cuda import has_cuda, why_not

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not has_cuda(), reason=f"no CUDA: {why_not() if not has_cuda() else ''}")]

if has_cuda():  # pragma: no branch
    import cupy as cp
    import ml_dtypes

    from dynamiq_mpi import _cpu
    from dynamiq_mpi import _gpu
    from dynamiq_mpi.codecs.levels import build_tables

    BF16 = np.dtype(ml_dtypes.bfloat16)

SUPER = 256
DEFAULT_EPS = {2: 0.27, 4: 0.20, 8: 0.08}


# ------------------------------------------------------------------ inputs

def gradient_like(rng, length, special=True):
    """float32 values with per-super-group scales over many decades, zero groups
    and super-groups, denormals, huge values and signed zeros."""
    nsg = -(-length // SUPER)
    x = rng.standard_normal(nsg * SUPER).astype(np.float32)
    scale = (10.0 ** rng.uniform(-6, 6, nsg)).astype(np.float32)
    x = (x.reshape(nsg, SUPER) * scale[:, None]).reshape(-1)
    if special and nsg:
        g = x.reshape(-1, 16)
        ng = g.shape[0]
        pick = lambda frac: rng.random(ng) < frac  # noqa: E731
        g[pick(0.05)] = 0.0                                              # zero groups
        g[pick(0.02)] = -0.0                                             # negative zeros
        den = pick(0.03)
        g[den] = (rng.standard_normal((int(den.sum()), 16)) * 1e-40).astype(np.float32)  # denormals
        tiny = pick(0.02)
        g[tiny] = (rng.standard_normal((int(tiny.sum()), 16)) * 1e-36).astype(np.float32)
        huge = pick(0.02)
        g[huge] = (rng.standard_normal((int(huge.sum()), 16)) * 1e36).astype(np.float32)
        single = pick(0.03)                                              # one non-zero value
        g[single] = 0.0
        g[single, rng.integers(0, 16)] = 3.0
        s = x.reshape(nsg, SUPER)
        s[rng.random(nsg) < 0.05] = 0.0                                  # zero super-groups
        x[rng.random(x.shape[0]) < 0.01] = -0.0
    return x[:length].copy()


def make_params(rng, width, hierarchical, correlated, n_events, eps=None, scale_rule=0):
    t = build_tables(width, DEFAULT_EPS[width] if eps is None else eps)
    n = n_events if correlated else 1
    perm_bits = max(0, (n - 1).bit_length())
    keys = [int(k) for k in rng.integers(0, 2 ** 32, 2, dtype=np.uint64)]
    blob = _cpu.make_params(width, hierarchical, correlated, n, perm_bits, *keys,
                            t.mag, t.inv_gap, t.level, t.lut, scale_rule)
    assert blob == _gpu.make_params(width, hierarchical, correlated, n, perm_bits, *keys,
                                    t.mag, t.inv_gap, t.level, t.lut, scale_rule)
    return np.frombuffer(blob, dtype=np.uint8)


def as_dtype(x, dtype):
    return x.astype(BF16) if dtype == "bfloat16" else x.astype(np.float32)


def sources(rng, x_np, use_map, use_mean, nrows, layout=None):
    """(cpu Source, gpu Source, (sg_map or None), sg_offset) for the same data;
    `layout` = (sg_map, sg_offset) of an earlier call to reuse."""
    mean = (rng.standard_normal(nrows) * 0.5).astype(np.float32) if use_mean else None
    if layout is not None:
        sg_map, offset = layout
    elif use_map:
        sg_map = rng.permutation(nrows).astype(np.int64)
        offset = 0
    else:
        sg_map = None
        offset = int(rng.integers(0, 1000))
    cpu = _cpu.Source(x_np, sg_map, offset, mean)
    gpu = _gpu.Source(cp.asarray(x_np), None if sg_map is None else cp.asarray(sg_map), offset,
                      None if mean is None else cp.asarray(mean))
    return cpu, gpu, sg_map, offset


def wire_slice(nbytes, offset):
    """A CuPy uint8 buffer of nbytes starting `offset` bytes into a larger one."""
    big = cp.full(nbytes + offset + 32, 0xA5, dtype=cp.uint8)   # poisoned
    return big[offset:offset + nbytes]


def same_floats(a, b):
    """Bit-identical float32 arrays, except that a NaN need only be NaN on both
    sides: x86 produces its default NaN (0xFFC00000) where CUDA produces the
    canonical 0x7FFFFFFF; NaN payloads carry no information."""
    a = np.asarray(a, np.float32); b = np.asarray(b, np.float32)
    na, nb = np.isnan(a), np.isnan(b)
    return (a.shape == b.shape and np.array_equal(na, nb)
            and np.array_equal(a[~na].view(np.uint32), b[~nb].view(np.uint32)))


def describe_mismatch(a, b, nsg, width, hierarchical):
    a = np.asarray(a); b = np.asarray(b)
    bad = np.flatnonzero(a != b)
    if bad.size == 0:
        return "equal"
    i = int(bad[0])
    code_bytes = nsg * 32 * width
    where = "codes"
    if i >= code_bytes:
        j = i - code_bytes
        if hierarchical:
            where = "group codes" if j < nsg * 16 else "units"
        else:
            where = "group BF16 scales"
    else:
        s, r = divmod(i, 32 * width)
        where = f"codes of super-group {s}, group {r // (2 * width)}, byte {r % (2 * width)}"
    return (f"{bad.size} of {a.size} bytes differ; first at byte {i} ({where}): "
            f"gpu {a[i]:#04x} cpu {b[i]:#04x}")


# ------------------------------------------------------------------ DynamiQ codec

CONFIGS = [
    # width, hierarchical, correlated, n_events
    (2, True, False, 1), (4, True, False, 1), (8, True, False, 1),
    (2, False, False, 1), (4, False, False, 1), (8, False, False, 1),
    (2, True, True, 8), (4, True, True, 2), (4, True, True, 3), (4, True, True, 8),
    (8, True, True, 5), (4, False, True, 16), (8, False, True, 7), (2, True, True, 6),
]


@pytest.mark.parametrize("width,hierarchical,correlated,n_events", CONFIGS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scale_rule", [0, 1], ids=["ceil", "hybrid"])
def test_compress_decompress_dar_match_cpu(width, hierarchical, correlated, n_events, dtype,
                                           scale_rule):
    if scale_rule and not hierarchical:
        pytest.skip("the hybrid group codes are hierarchical scales")
    seed = zlib.crc32(repr((width, hierarchical, correlated, n_events, dtype, scale_rule)).encode())
    rng = np.random.default_rng(seed)
    for trial, (length, use_map, use_mean, offset) in enumerate(
            [(300 * 256 + 77, True, True, 0), (1000, False, False, 1), (256 * 3, True, False, 6),
             (5 * 256 + 1, False, True, 2), (64 * 256, True, True, 13)]):
        P = make_params(rng, width, hierarchical, correlated, n_events, scale_rule=scale_rule)
        x = as_dtype(gradient_like(rng, length), dtype)
        nrows = -(-length // SUPER)
        csrc, gsrc, sg_map, sg_offset = sources(rng, x, use_map, use_mean, nrows)
        # a run: nsg stream super-groups from sg_base
        nsg = int(rng.integers(1, nrows + 1)) if trial % 2 else nrows
        first_row = int(rng.integers(0, nrows - nsg + 1))
        sg_base = first_row + (0 if use_map else sg_offset)
        event = int(rng.integers(0, n_events)) if correlated else int(rng.integers(0, 100))
        nbytes = _cpu.run_bytes(nsg, width, hierarchical)
        assert nbytes == _gpu.run_bytes(nsg, width, hierarchical)

        # compress
        ref = np.zeros(nbytes, np.uint8)
        _cpu.compress(P, csrc, nsg, sg_base, event, ref)
        got = wire_slice(nbytes, offset)
        _gpu.compress(P, gsrc, nsg, sg_base, event, got)
        g = got.get()
        assert np.array_equal(g, ref), "compress: " + describe_mismatch(g, ref, nsg, width, hierarchical)

        # decompress, overwrite and accumulate (output at a 4-byte offset too)
        for acc in (False, True):
            base = rng.standard_normal(nsg * SUPER).astype(np.float32)
            cpu_out = base.copy()
            _cpu.decompress(P, ref, nsg, cpu_out, acc)
            big = cp.asarray(np.concatenate([np.full(offset % 4, 7, np.float32), base]))
            gpu_out = big[offset % 4:]
            _gpu.decompress(P, got, nsg, gpu_out, acc)
            assert np.array_equal(gpu_out.get().view(np.uint32), cpu_out.view(np.uint32)), \
                f"decompress(accumulate={acc}) differs"

        # fused decompress-accumulate-recompress on another rank's message
        y = as_dtype(gradient_like(rng, length), dtype)
        ysrc_c, ysrc_g, _, _ = sources(rng, y, use_map, use_mean, nrows, (sg_map, sg_offset))
        inp = np.zeros(nbytes, np.uint8)
        ev2 = (event + 1) % n_events if correlated else event + 1
        _cpu.compress(P, ysrc_c, nsg, sg_base, ev2, inp)
        ref2 = np.zeros(nbytes, np.uint8)
        _cpu.dar(P, inp, csrc, nsg, sg_base, event, ref2)
        ginp = wire_slice(nbytes, (offset + 3) % 16)
        ginp.set(inp)
        gout = wire_slice(nbytes, offset)
        _gpu.dar(P, ginp, gsrc, nsg, sg_base, event, gout)
        g2 = gout.get()
        assert np.array_equal(g2, ref2), "dar: " + describe_mismatch(g2, ref2, nsg, width, hierarchical)
        # in place (in is out)
        _gpu.dar(P, ginp, gsrc, nsg, sg_base, event, ginp)
        g3 = ginp.get()
        assert np.array_equal(g3, ref2), "dar in place: " + describe_mismatch(g3, ref2, nsg, width,
                                                                             hierarchical)


@pytest.mark.parametrize("width,correlated", [(4, False), (4, True), (2, True), (8, False)])
@pytest.mark.parametrize("hierarchical", [True, False])
def test_overflowing_sums_match_cpu(width, correlated, hierarchical):
    """Values near FLT_MAX: partial sums overflow to inf (NaN after normalising),
    units saturate one BF16 step below FLT_MAX / 255; still the CPU's bytes."""
    rng = np.random.default_rng(width * 10 + correlated + 100 * hierarchical)
    nsg = 40
    big = lambda: (np.where(rng.random(nsg * SUPER) < 0.5, -1.0, 1.0)  # noqa: E731
                   * rng.uniform(1.0e38, 3.4e38, nsg * SUPER)).astype(np.float32)
    x, y = big(), big()
    x[: 10 * SUPER] = gradient_like(rng, 10 * SUPER)        # some ordinary super-groups too
    P = make_params(rng, width, hierarchical, correlated, 3)
    csrc, gsrc, sg_map, off = sources(rng, x, True, False, nsg)
    ysrc_c, ysrc_g, _, _ = sources(rng, y, True, False, nsg, (sg_map, off))
    nbytes = _cpu.run_bytes(nsg, width, hierarchical)
    inp = np.zeros(nbytes, np.uint8)
    _cpu.compress(P, ysrc_c, nsg, 0, 1, inp)
    g_inp = cp.zeros(nbytes, cp.uint8)
    _gpu.compress(P, ysrc_g, nsg, 0, 1, g_inp)
    assert np.array_equal(g_inp.get(), inp), describe_mismatch(g_inp.get(), inp, nsg, width, hierarchical)
    ref = np.zeros(nbytes, np.uint8)
    _cpu.dar(P, inp, csrc, nsg, 0, 2, ref)
    got = cp.zeros(nbytes, cp.uint8)
    _gpu.dar(P, g_inp, gsrc, nsg, 0, 2, got)
    assert np.array_equal(got.get(), ref), describe_mismatch(got.get(), ref, nsg, width, hierarchical)
    out_c = np.zeros(nsg * SUPER, np.float32)
    _cpu.decompress(P, ref, nsg, out_c, False)
    out_g = cp.zeros(nsg * SUPER, cp.float32)
    _gpu.decompress(P, got, nsg, out_g, False)
    assert same_floats(out_g.get(), out_c)                  # inf * 0 -> NaN: payloads differ
    m_c, f_c, b_c = _cpu.stats(x, nsg, True)                # means fall back to 0 here
    m_g, f_g, b_g = _gpu.stats(cp.asarray(x), nsg, True)
    assert np.array_equal(m_g.get().view(np.uint32), m_c.view(np.uint32))
    assert np.array_equal(f_g.get().view(np.uint32), f_c.view(np.uint32))


@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("correlated", [False, True])
@pytest.mark.parametrize("scale_rule", [0, 1], ids=["ceil", "hybrid"])
def test_scale_code_boundaries_match_cpu(width, correlated, scale_rule):
    """Group maxima on, just above and just below multiples of the unit, also
    with subnormal units (tests/helpers.scale_boundary_input): the GPU's
    scale codes (spec 2.7's rounded-up code, and the hybrid's stochastic one
    from code 128 up), values and fused step equal the CPU's."""
    from helpers import scale_boundary_input
    rng = np.random.default_rng(7 * width + correlated + 100 * scale_rule)
    nsg = 96
    x, expect = scale_boundary_input(rng, nsg)
    y, _ = scale_boundary_input(rng, nsg)
    P = make_params(rng, width, True, correlated, 4, scale_rule=scale_rule)
    csrc, gsrc, sg_map, off = sources(rng, x, True, False, nsg)
    ysrc_c, ysrc_g, _, _ = sources(rng, y, True, False, nsg, (sg_map, off))
    nbytes = _cpu.run_bytes(nsg, width, True)
    ref = np.zeros(nbytes, np.uint8)
    _cpu.compress(P, ysrc_c, nsg, 0, 1, ref)
    got = cp.zeros(nbytes, cp.uint8)
    _gpu.compress(P, ysrc_g, nsg, 0, 1, got)
    assert np.array_equal(got.get(), ref), describe_mismatch(got.get(), ref, nsg, width, True)
    ref2 = np.zeros(nbytes, np.uint8)
    _cpu.dar(P, ref, csrc, nsg, 0, 2, ref2)
    got2 = cp.zeros(nbytes, cp.uint8)
    _gpu.dar(P, got, gsrc, nsg, 0, 2, got2)
    assert np.array_equal(got2.get(), ref2), describe_mismatch(got2.get(), ref2, nsg, width, True)


def test_event_out_of_range_is_refused():
    rng = np.random.default_rng(1)
    P = make_params(rng, 4, True, True, 3)
    src = _gpu.Source(cp.zeros(256, cp.float32))
    with pytest.raises(ValueError, match="event"):
        _gpu.compress(P, src, 1, 0, 3, cp.zeros(_gpu.run_bytes(1, 4, True), cp.uint8))


@pytest.mark.parametrize("variant", [2, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_occupancy_variants_are_exact(variant, dtype):
    """The timing-study builds for more resident blocks compute the same bytes."""
    rng = np.random.default_rng(variant)
    P = make_params(rng, 4, True, False, 1)
    x = as_dtype(gradient_like(rng, 200 * 256 + 5), dtype)
    csrc, gsrc, _, _ = sources(rng, x, True, True, 201)
    nbytes = _cpu.run_bytes(201, 4, True)
    ref = np.zeros(nbytes, np.uint8)
    _cpu.compress(P, csrc, 201, 0, 1, ref)
    ref2 = np.zeros(nbytes, np.uint8)
    _cpu.dar(P, ref, csrc, 201, 0, 2, ref2)
    got = cp.zeros(nbytes, cp.uint8)
    got2 = cp.zeros(nbytes, cp.uint8)
    _gpu.set_variant(variant)
    try:
        _gpu.compress(P, gsrc, 201, 0, 1, got)
        _gpu.dar(P, got, gsrc, 201, 0, 2, got2)
    finally:
        _gpu.set_variant(0)
    assert np.array_equal(got.get(), ref)
    assert np.array_equal(got2.get(), ref2)


@pytest.mark.parametrize("n_events", [3, 8])
@pytest.mark.parametrize("width", [2, 4, 8])
def test_many_steps_per_warp_are_exact(width, n_events):
    """One block (8 warps, _gpu.set_encode_grid) over 700 super-groups: each warp takes
    ~44 grid-stride steps, so the correlated encoders' permutations, batched over 16
    steps (k_encode), cross two batch boundaries and end on a partial batch; the
    stream index crosses 2^28 (the permutation's super-group index is taken mod 2^28,
    group >> 4).  Compress and the fused step equal the CPU's bytes, with the one-block
    grid and with the resident one."""
    rng = np.random.default_rng([width, n_events, 20261125])
    P = make_params(rng, width, True, True, n_events, scale_rule=1)
    nsg = 700
    sg_base = (1 << 28) - 300
    x = as_dtype(gradient_like(rng, nsg * SUPER - 3), "bfloat16")
    csrc, gsrc, _, _ = sources(rng, x, False, True, nsg, layout=(None, sg_base))
    nbytes = _cpu.run_bytes(nsg, width, True)
    event = n_events - 1
    ref = np.zeros(nbytes, np.uint8)
    _cpu.compress(P, csrc, nsg, sg_base, event, ref)
    ref2 = np.zeros(nbytes, np.uint8)
    _cpu.dar(P, ref, csrc, nsg, sg_base, (event + 1) % n_events, ref2)
    for blocks in (1, 0):
        got = cp.zeros(nbytes, cp.uint8)
        got2 = cp.zeros(nbytes, cp.uint8)
        _gpu.set_encode_grid(blocks)
        try:
            _gpu.compress(P, gsrc, nsg, sg_base, event, got)
            _gpu.dar(P, got, gsrc, nsg, sg_base, (event + 1) % n_events, got2)
        finally:
            _gpu.set_encode_grid(0)
        assert np.array_equal(got.get(), ref), f"compress, {blocks or 'resident'} block(s)"
        assert np.array_equal(got2.get(), ref2), f"fused step, {blocks or 'resident'} block(s)"


@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("eps", [0.0, 0.05, 0.3, 0.6])
def test_other_level_spacings(width, eps):
    """Uniform and strongly non-uniform levels (the 8-bit search takes several
    steps when levels crowd near zero)."""
    rng = np.random.default_rng(width * 100 + int(eps * 100))
    try:
        P = make_params(rng, width, True, True, 4, eps=eps)
    except ValueError:
        pytest.skip(f"eps={eps} collapses {width}-bit levels in float32")
    x = gradient_like(rng, 100 * 256)
    csrc, gsrc, _, _ = sources(rng, x, True, True, 100)
    nbytes = _cpu.run_bytes(100, width, True)
    ref = np.zeros(nbytes, np.uint8)
    _cpu.compress(P, csrc, 100, 0, 3, ref)
    got = cp.zeros(nbytes, cp.uint8)
    _gpu.compress(P, gsrc, 100, 0, 3, got)
    assert np.array_equal(got.get(), ref), describe_mismatch(got.get(), ref, 100, width, True)


@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("hierarchical", [True, False])
def test_decompress_arbitrary_codes(width, hierarchical):
    """Every code value (including the never-sent 2^b - 1) decodes identically."""
    rng = np.random.default_rng(width + 10 * hierarchical)
    P = make_params(rng, width, hierarchical, False, 1)
    nsg = 77
    nbytes = _cpu.run_bytes(nsg, width, hierarchical)
    msg = rng.integers(0, 256, nbytes, dtype=np.uint8)
    meta = msg[nsg * 32 * width:]
    # sane scales: finite positive BF16 units / group scales
    if hierarchical:
        units = (rng.uniform(1e-3, 1e3, nsg).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        meta[nsg * 16:] = units.view(np.uint8)
    else:
        sc = (rng.uniform(1e-3, 1e3, nsg * 16).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        meta[:] = sc.view(np.uint8)
    out_c = np.zeros(nsg * SUPER, np.float32)
    _cpu.decompress(P, msg, nsg, out_c, False)
    out_g = cp.zeros(nsg * SUPER, cp.float32)
    _gpu.decompress(P, cp.asarray(msg), nsg, out_g, False)
    assert np.array_equal(out_g.get().view(np.uint32), out_c.view(np.uint32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("centre", [True, False])
def test_stats_match_cpu(dtype, centre):
    """The statistics kernel: tails, odd super-group counts (half a pair), a
    padded super-group, grid-stride loops (more pairs than resident warps) and
    buffers not 16-byte aligned (a view one element in) give the CPU's bits."""
    rng = np.random.default_rng(1 + centre)
    for length, skew in ((1, 0), (255, 0), (256, 0), (257, 0), (1000 * 256 + 3, 0),
                         (3 * 256, 1), (777 * 256 + 100, 1), (40001 * 256 + 5, 0)):
        x = as_dtype(gradient_like(rng, length), dtype)
        nsg = -(-length // SUPER) + (1 if length == 257 else 0)   # one padded super-group more
        m_c, f_c, bad_c = _cpu.stats(x, nsg, centre)
        gx = cp.asarray(x)
        if skew:                                   # the same values one element into a buffer
            buf = cp.asarray(np.zeros(length + skew, dtype=x.dtype))
            buf[skew:] = gx
            gx = buf[skew:]
            assert gx.data.ptr % 16
        m_g, f_g, bad_g = _gpu.stats(gx, nsg, centre)
        assert np.array_equal(m_g.get().view(np.uint32), m_c.view(np.uint32)), (length, skew)
        assert np.array_equal(f_g.get().view(np.uint32), f_c.view(np.uint32)), (length, skew)
        assert int(bad_g) == bad_c == 0
    # non-finite inputs: same count, NaN/Inf in the same places
    x = gradient_like(rng, 51 * 256)
    x[[5, 700, 701, 9000, 51 * 256 - 1]] = [np.nan, np.inf, -np.inf, np.nan, np.inf]
    x = as_dtype(x, dtype)
    m_c, f_c, bad_c = _cpu.stats(x, 51, centre)
    m_g, f_g, bad_g = _gpu.stats(cp.asarray(x), 51, centre)
    assert int(bad_g) == bad_c == 5
    for g, c in ((m_g.get(), m_c), (f_g.get(), f_c)):
        fin = np.isfinite(c)
        assert np.array_equal(np.isfinite(g), fin) and np.array_equal(np.isnan(g), np.isnan(c))
        assert np.array_equal(g[fin].view(np.uint32), c[fin].view(np.uint32))
    # finite inputs whose centred values overflow (the kernel counts entries
    # only where a super-group's sum is not finite): no non-finite entries
    x = gradient_like(rng, 4 * 256)
    x[256:356], x[356:512] = 3.0e38, -3.0e38
    x = as_dtype(x, dtype)
    m_c, f_c, bad_c = _cpu.stats(x, 4, centre)
    m_g, f_g, bad_g = _gpu.stats(cp.asarray(x), 4, centre)
    assert int(bad_g) == bad_c == 0
    assert np.array_equal(f_g.get().view(np.uint32), f_c.view(np.uint32))
    assert f_c[1] == np.finfo(np.float32).max            # saturated, as spec'd


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("divisor", [1.0, 3.0, 8.0])
def test_finish_matches_cpu(dtype, divisor):
    rng = np.random.default_rng(int(divisor) + (dtype == "float32"))
    for length in (1, 300, 256 * 40 + 17):
        nsg = -(-length // SUPER)
        nstream = int(rng.integers(0, nsg + 1))
        order = rng.permutation(nsg)[:nstream]
        stream_of_sg = np.full(nsg, -1, np.int64)
        stream_of_sg[order] = np.arange(nstream)
        stream = gradient_like(rng, nstream * SUPER)
        mean_sum = (rng.standard_normal(nsg) * 3).astype(np.float32)
        out_c = np.zeros(length, np.float32 if dtype == "float32" else BF16)
        _cpu.finish(stream, stream_of_sg, mean_sum, divisor, out_c)
        out_g = cp.zeros(length + 1, out_c.dtype)[1:]      # misaligned destination
        _gpu.finish(cp.asarray(stream), cp.asarray(stream_of_sg), cp.asarray(mean_sum), divisor, out_g)
        assert np.array_equal(out_g.get().view(np.uint8), out_c.view(np.uint8))


# ------------------------------------------------------------------ baselines

def _local_numpy(x, sg_map, offset, mean, nsg, sg_base=0):
    """The stream values a Source yields (float32), for the NumPy definitions."""
    nrows = -(-x.shape[0] // SUPER)
    pad = np.zeros(nrows * SUPER, np.float32)
    pad[:x.shape[0]] = x.astype(np.float32)
    pad = pad.reshape(nrows, SUPER)
    rows = np.arange(sg_base, sg_base + nsg)
    rows = sg_map[rows] if sg_map is not None else rows - offset
    vals = pad[rows]
    if mean is not None:
        vals = vals - mean[rows][:, None]
    return vals.reshape(-1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("use_map,use_mean", [(False, False), (True, True)])
def test_bf16_and_exact_baselines(dtype, use_map, use_mean):
    rng = np.random.default_rng(7 + use_map)
    length = 97 * 256 + 5
    nsg = -(-length // SUPER)
    x = as_dtype(gradient_like(rng, length, special=False), dtype)
    mean = (rng.standard_normal(nsg) * 0.5).astype(np.float32) if use_mean else None
    sg_map = rng.permutation(nsg).astype(np.int64) if use_map else None
    gsrc = _gpu.Source(cp.asarray(x), None if sg_map is None else cp.asarray(sg_map), 0,
                       None if mean is None else cp.asarray(mean))
    local = _local_numpy(x, sg_map, 0, mean, nsg)
    n = nsg * SUPER

    out = cp.zeros(n, cp.uint16)
    _gpu.bf16_compress(gsrc, nsg, out)
    assert np.array_equal(out.get(), local.astype(BF16).view(np.uint16))

    inp = (rng.standard_normal(n) * 10).astype(BF16)
    acc = rng.standard_normal(n).astype(np.float32)
    for accumulate in (False, True):
        o = cp.asarray(acc)
        _gpu.bf16_decompress(cp.asarray(inp.view(np.uint16)), o, accumulate)
        want = (acc + inp.astype(np.float32)) if accumulate else inp.astype(np.float32)
        assert np.array_equal(o.get().view(np.uint32), want.view(np.uint32))

    o = cp.zeros(n, cp.uint16)
    _gpu.bf16_dar(cp.asarray(inp.view(np.uint16)), gsrc, nsg, o)
    want = (inp.astype(np.float32) + local).astype(BF16).view(np.uint16)
    assert np.array_equal(o.get(), want)

    o = cp.zeros(n + 1, cp.float32)[1:]                   # misaligned
    _gpu.exact_compress(gsrc, nsg, o)
    assert np.array_equal(o.get().view(np.uint32), local.view(np.uint32))

    fin = rng.standard_normal(n).astype(np.float32)
    for accumulate in (False, True):
        o = cp.asarray(acc)
        _gpu.exact_decompress(cp.asarray(fin), o, accumulate)
        want = (acc + fin) if accumulate else fin
        assert np.array_equal(o.get().view(np.uint32), want.view(np.uint32))

    o = cp.zeros(n, cp.float32)
    _gpu.exact_dar(cp.asarray(fin), gsrc, nsg, o)
    assert np.array_equal(o.get().view(np.uint32), (fin + local).view(np.uint32))


def test_odd_lengths_elementwise():
    rng = np.random.default_rng(3)
    for n in (1, 7, 9, 1001):
        inp = rng.standard_normal(n).astype(BF16)
        o = cp.zeros(n, cp.float32)
        _gpu.bf16_decompress(cp.asarray(inp), o, False)
        assert np.array_equal(o.get(), inp.astype(np.float32))


# ------------------------------------------------------------------ API behaviour

def test_errors_are_clear():
    rng = np.random.default_rng(0)
    P = make_params(rng, 4, True, False, 1)
    x = cp.zeros(512, cp.float32)
    src = _gpu.Source(x)
    with pytest.raises(ValueError, match="wire bytes"):
        _gpu.compress(P, src, 2, 0, 0, cp.zeros(10, cp.uint8))
    with pytest.raises(TypeError, match="CuPy"):
        _gpu.compress(P, src, 2, 0, 0, np.zeros(_gpu.run_bytes(2, 4, True), np.uint8))
    bad = bytearray(P.tobytes())
    bad[0] = 3   # width 3: refused by the kernels' parameter check
    with pytest.raises(RuntimeError, match="CUDA error"):
        _gpu.compress(bytes(bad), src, 2, 0, 0, cp.zeros(_gpu.run_bytes(2, 3, True), cp.uint8))


def test_runs_on_current_stream():
    rng = np.random.default_rng(5)
    P = make_params(rng, 4, True, True, 4)
    x = gradient_like(rng, 64 * 256)
    csrc = _cpu.Source(x)
    ref = np.zeros(_cpu.run_bytes(64, 4, True), np.uint8)
    _cpu.compress(P, csrc, 64, 0, 1, ref)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        gx = cp.asarray(x)
        out = cp.zeros(ref.size, cp.uint8)
        _gpu.compress(P, _gpu.Source(gx), 64, 0, 1, out)
        got = out.get(stream=s)
    s.synchronize()
    assert np.array_equal(got, ref)
