"""The MX baseline kernels (src_cuda/mx_kernels.cu) == the NumPy path of
dynamiq_mpi/codecs/mxfp.py, bit for bit: statistics bytes, cast-and-pack,
fused decode-add-recast, decode (plain, accumulating, onto local values), for
every element format, float32 and BF16 sources, values across the whole
float32 range (denormals, ties of the element grid, saturation, signed
zeros), extreme shared exponents and wire buffers at odd byte offsets.

Skipped (with the reason) unless dynamiq_mpi.cuda.has_cuda().
"""
import numpy as np
import pytest

from dynamiq_mpi.codecs.mxfp import BLOCK, FORMATS, element_format, pack, unpack
from dynamiq_mpi.cuda import has_cuda, why_not

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not has_cuda(), reason=f"no CUDA: {why_not() if not has_cuda() else ''}")]

if has_cuda():  # pragma: no branch
    import cupy as cp
    import ml_dtypes

    from dynamiq_mpi import _gpu

    BF16 = np.dtype(ml_dtypes.bfloat16)


def kfmt(f):
    return (f.bits, f.mbits, f.bias, f.max_normal)


def wild_values(rng, nb, f):
    """Blocks whose scales span the float32 range, with the element grid's
    values, midpoints (ties), signed zeros, denormals and saturating values."""
    x = rng.standard_normal((nb, BLOCK)).astype(np.float32)
    x *= (2.0 ** rng.integers(-140, 100, nb)).astype(np.float32)[:, None]
    grid = f.table()
    grid = grid[np.isfinite(grid)]
    mids = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)
    special = np.concatenate([grid, mids, np.float32([0.0, -0.0, 1e-45, -3e-39, 1e-38])])
    rows = rng.choice(nb, size=min(nb, 40), replace=False)
    for r in rows:                       # grid points and ties, scaled by a power of two
        x[r] = rng.choice(special, BLOCK) * np.float32(2.0 ** int(rng.integers(-20, 20)))
    x[rows[:3]] = 0.0
    x[rows[3], :5] = -0.0
    return x


def shared_bytes(x_blocks, rng):
    """Reduced statistics bytes: the blocks' own (as rank 0 would send), some
    raised (other ranks with larger maxima) and some at the extremes."""
    amax = np.abs(x_blocks).max(axis=1)
    _, k = np.frexp(amax)
    b = np.clip(k.astype(np.int32) - 1 + 127, 1, 254)
    b = np.where(amax == 0, 0, b)
    up = rng.random(b.shape[0]) < 0.3
    b[up] = np.minimum(b[up] + rng.integers(1, 30, int(up.sum())), 250)
    b[:2] = [1, 250]
    return b.astype(np.uint8)


def host_encode(f, values, X):
    return pack(np, f.encode(np, np.ldexp(values, -X[:, None])), f.bits)


def host_decode(f, wire, X, nb):
    codes = unpack(np, wire, f.bits).reshape(nb, BLOCK)
    return np.ldexp(f.table()[codes], X[:, None])


def x_of(f, reduced, headroom):
    E = reduced.astype(np.int32) - 127
    return np.where(reduced == 0, 0, E + 1 + headroom - f.emax).astype(np.int32)


def offset_array(host, offset):
    """A CuPy copy of a uint8 host array starting `offset` bytes into a buffer."""
    buf = cp.zeros(host.size + offset, cp.uint8)
    view = buf[offset:]
    view[...] = cp.asarray(host)
    return view


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stats_encode_dar_decode_match_numpy(fmt, dtype):
    f = element_format(fmt)
    rng = np.random.default_rng(abs(hash((fmt, dtype))) % 2**32)
    nb = 301
    length = nb * BLOCK - 13                        # a partial last block
    blocks = wild_values(rng, nb, f)
    x = blocks.reshape(-1)[:length]
    if dtype == "bfloat16":
        x = x.astype(BF16)
    local = np.zeros(nb * BLOCK, np.float32)
    local[:length] = x.astype(np.float32)
    local = local.reshape(nb, BLOCK)
    gx = cp.asarray(x)
    src = _gpu.Source(gx)

    # statistics bytes
    st = cp.zeros(nb, cp.uint8)
    _gpu.mx_stats(src, nb, st)
    amax = np.abs(local).max(axis=1)
    _, k = np.frexp(amax)
    want = np.where(amax == 0, 0, np.clip(k.astype(np.int32) - 1 + 127, 1, 254))
    assert np.array_equal(st.get(), want.astype(np.uint8))

    for headroom in (1, 3, 13):
        reduced = shared_bytes(local, rng)
        X = x_of(f, reduced, headroom)
        gred = cp.asarray(reduced)
        nbytes = nb * 4 * f.bits
        # a tile of blocks [b0, b1) read from the source at element b0 * 32
        for b0, b1, off in ((0, nb, 0), (7, 200, 3), (1, 2, 5)):
            n = b1 - b0
            out = offset_array(np.zeros(n * 4 * f.bits, np.uint8), off)
            _gpu.mx_encode(kfmt(f), gred[b0:b1], headroom, src, b0 * BLOCK, None, n, out)
            want = host_encode(f, local[b0:b1], X[b0:b1])
            assert np.array_equal(out.get(), want), (fmt, headroom, b0)

        # fused decode-add-recast of received bytes: fresh codes of other data
        other = wild_values(rng, nb, f) * np.float32(0.5)
        payload = host_encode(f, other, X)
        dec = host_decode(f, payload, X, nb)
        for off in (0, 1, 2):
            gin = offset_array(payload, off)
            out = offset_array(np.zeros(nbytes, np.uint8), off)
            _gpu.mx_encode(kfmt(f), gred, headroom, src, 0, gin, nb, out)
            with np.errstate(over="ignore"):
                want = host_encode(f, local + dec, X)
            assert np.array_equal(out.get(), want), (fmt, headroom, off)
            _gpu.mx_encode(kfmt(f), gred, headroom, src, 0, gin, nb, gin)     # in place
            assert np.array_equal(gin.get(), want)

        # the same from a float32 accumulator instead of the source
        acc = (rng.standard_normal(nb * BLOCK) * 3).astype(np.float32)
        out = cp.zeros(nbytes, cp.uint8)
        _gpu.mx_encode(kfmt(f), gred, headroom, _gpu.Source(cp.asarray(acc)), 0,
                       cp.asarray(payload), nb, out)
        with np.errstate(over="ignore"):
            want = host_encode(f, acc.reshape(nb, BLOCK) + dec, X)
        assert np.array_equal(out.get(), want)

        # decode: plain, accumulating, onto the local values of blocks [b0, b1)
        gp = cp.asarray(payload)
        o = cp.asarray(acc)
        _gpu.mx_decode(kfmt(f), gred, headroom, gp, nb, o, False)
        assert np.array_equal(o.get().view(np.uint32), dec.reshape(-1).view(np.uint32))
        o = cp.asarray(acc)
        _gpu.mx_decode(kfmt(f), gred, headroom, gp, nb, o, True)
        with np.errstate(over="ignore"):
            want = (acc.reshape(nb, BLOCK) + dec).reshape(-1)
        assert np.array_equal(o.get().view(np.uint32), want.view(np.uint32))
        b0, b1 = 5, 77
        part = host_encode(f, other[b0:b1], X[b0:b1])
        o = cp.zeros((b1 - b0) * BLOCK, cp.float32)
        _gpu.mx_decode(kfmt(f), gred[b0:b1], headroom, offset_array(part, 1), b1 - b0, o,
                       False, src, b0 * BLOCK)
        with np.errstate(over="ignore"):
            want = (local[b0:b1] + host_decode(f, part, X[b0:b1], b1 - b0)).reshape(-1)
        assert np.array_equal(o.get().view(np.uint32), want.view(np.uint32))


def test_stats_bytes_flag_non_finite_and_denormal_blocks():
    x = np.zeros(6 * BLOCK, np.float32)
    x[BLOCK + 3] = np.nan
    x[2 * BLOCK + 31] = -np.inf
    x[3 * BLOCK + 1] = 1e-44                       # only a denormal: byte 1
    x[4 * BLOCK + 9] = -np.finfo(np.float32).max   # byte 254
    x[5 * BLOCK:] = 1.5                            # byte 127
    st = cp.zeros(6, cp.uint8)
    _gpu.mx_stats(_gpu.Source(cp.asarray(x)), 6, st)
    assert st.get().tolist() == [0, 255, 255, 1, 254, 127]


def test_bad_arguments_are_refused():
    f = element_format("e4m3")
    src = _gpu.Source(cp.zeros(64, cp.float32))
    red = cp.zeros(2, cp.uint8)
    with pytest.raises(ValueError, match="expected 64 elements"):
        _gpu.mx_encode(kfmt(f), red, 1, src, 0, None, 2, cp.zeros(63, cp.uint8))
    with pytest.raises(RuntimeError, match="mx_encode"):
        _gpu.mx_encode((5, 1, 1, 6.0), red, 1, src, 0, None, 2, cp.zeros(40, cp.uint8))
    with pytest.raises(RuntimeError, match="mx_decode"):
        _gpu.mx_decode(kfmt(f), red, 1, cp.zeros(64, cp.uint8), 2, cp.zeros(64, cp.float32),
                       False, src, 4)             # elem_base not a multiple of 8
