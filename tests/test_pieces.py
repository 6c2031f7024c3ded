"""One compiled call per tile (``encode_pieces``, ``decompress_pieces``,
``decompress_out_pieces``) does exactly what a call per width-homogeneous
piece does, the raw BF16 pieces of the 16-bit class (width 16) included, and
refuses pieces outside its buffers.  CPU kernels here;
tests/gpu/test_pieces_gpu.py checks the GPU's against these."""
import numpy as np
import pytest

from dynamiq_mpi import _cpu
from dynamiq_mpi.backend import BFLOAT16 as BF16, bf16_to_float32, float32_to_bf16
from dynamiq_mpi.codecs.levels import build_tables

SUPER = 256
EPS = {2: 0.27, 4: 0.20, 8: 0.08}


def params_by_width(rng, n_events=3):
    keys = [int(k) for k in rng.integers(0, 2 ** 32, 2, dtype=np.uint64)]
    out = {}
    for w in (2, 4, 8):
        t = build_tables(w, EPS[w])
        out[w] = np.frombuffer(_cpu.make_params(w, True, True, n_events, 2, *keys, t.mag,
                                                t.inv_gap, t.level, t.lut, 0), dtype=np.uint8)
    return out


def tile_pieces(counts, first=0):
    """Pieces (w, s0, cnt, off, nb) of a tile holding counts[w] super-groups
    of each width in turn, from stream super-group `first`."""
    pieces, s0, off = [], first, 0
    for w, cnt in counts:
        nb = cnt * 2 * SUPER if w == 16 else int(_cpu.run_bytes(cnt, w, True))
        pieces.append((w, s0, cnt, off, nb))
        s0, off = s0 + cnt, off + nb
    return pieces, off


@pytest.fixture
def tile():
    rng = np.random.default_rng()
    first = int(rng.integers(0, 5))
    counts = [(2, int(rng.integers(1, 6))), (4, int(rng.integers(0, 4))), (8, int(rng.integers(1, 5)))]
    pieces, nbytes = tile_pieces(counts, first)
    rows = first + sum(c for _, c in counts)
    x = (rng.standard_normal(rows * SUPER) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
    order = rng.permutation(rows).astype(np.int64)
    mean = rng.standard_normal(rows).astype(np.float32)
    return rng, params_by_width(rng), pieces, nbytes, _cpu.Source(x, order, 0, mean)


def test_encode_pieces_is_a_call_per_piece(tile):
    rng, params, pieces, nbytes, src = tile
    whole = np.zeros(nbytes, np.uint8)
    _cpu.encode_pieces(params, src, pieces, 1, whole)
    each = np.zeros(nbytes, np.uint8)
    for w, s0, cnt, off, nb in pieces:
        _cpu.compress(params[w], src, cnt, s0, 1, each[off:off + nb])
    assert np.array_equal(whole, each) and whole.any()
    # dar: decode the received bytes, add the local values, re-encode
    got = np.zeros(nbytes, np.uint8)
    _cpu.encode_pieces(params, src, pieces, 2, got, whole)
    want = np.zeros(nbytes, np.uint8)
    for w, s0, cnt, off, nb in pieces:
        _cpu.dar(params[w], whole[off:off + nb], src, cnt, s0, 2, want[off:off + nb])
    assert np.array_equal(got, want) and not np.array_equal(got, whole)


@pytest.mark.parametrize("accumulate", [False, True])
def test_decompress_pieces_is_a_call_per_piece(tile, accumulate):
    rng, params, pieces, nbytes, src = tile
    wire = np.zeros(nbytes, np.uint8)
    _cpu.encode_pieces(params, src, pieces, 0, wire)
    first = pieces[0][1]
    rows = sum(p[2] for p in pieces)
    start = rng.standard_normal(rows * SUPER).astype(np.float32)
    got = start.copy()
    _cpu.decompress_pieces(params, wire, pieces, got, accumulate, first)
    want = start.copy()
    for w, s0, cnt, off, nb in pieces:
        r = (s0 - first) * SUPER
        _cpu.decompress(params[w], wire[off:off + nb], cnt, want[r:r + cnt * SUPER], accumulate)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert not np.array_equal(got, start)


def test_pieces_outside_the_buffers_are_refused(tile):
    rng, params, pieces, nbytes, src = tile
    w, s0, cnt, off, nb = pieces[-1]
    out = np.zeros(nbytes, np.uint8)
    with pytest.raises(ValueError, match="outside"):
        _cpu.encode_pieces(params, src, pieces[:-1] + [(w, s0, cnt, off + 1, nb)], 0, out)
    with pytest.raises(ValueError, match="wire bytes"):
        _cpu.encode_pieces(params, src, [(w, s0, cnt + 1, 0, nb)], 0, out)
    with pytest.raises(ValueError, match="outside"):
        _cpu.encode_pieces(params, src, pieces, 0, out, out[:nbytes - 1])
    short = np.zeros((s0 + cnt - pieces[0][1]) * SUPER - 1, np.float32)
    with pytest.raises(ValueError, match="outside"):
        _cpu.decompress_pieces(params, out, pieces, short, False, pieces[0][1])
    with pytest.raises(ValueError, match="event"):
        _cpu.encode_pieces(params, src, pieces, 3, out)


def raw_tile(rng, first=2, counts=((2, 3), (16, 2), (4, 2), (16, 3), (8, 2))):
    """A tile with coded and raw BF16 (width 16) pieces; the local values read
    through a permutation and centred, as the codec's source does."""
    pieces, nbytes = tile_pieces(list(counts), first)
    rows = first + sum(c for _, c in counts)
    length = rows * SUPER - 77                    # a partial last input row
    x = (rng.standard_normal(length) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
    x[:5] = -0.0
    order = rng.permutation(rows).astype(np.int64)
    mean = rng.standard_normal(rows).astype(np.float32)
    mean[order[first + 3:first + 5]] = 0          # -0.0 - 0 stays -0.0 in a raw row
    return pieces, nbytes, rows, x, order, mean


def local_rows(x, order, mean, s0, cnt):
    """float32 centred local values of stream super-groups s0 .. s0 + cnt."""
    rows = order.shape[0]
    padded = np.zeros(rows * SUPER, np.float32)
    padded[:x.shape[0]] = x
    r = order[s0:s0 + cnt]
    return (padded.reshape(rows, SUPER)[r] - mean[r][:, None]).reshape(-1)


def test_raw_pieces_are_bf16_of_the_float32_values():
    """Width 16: compress = bf16_rne(local), dar = bf16_rne(float(in) + local)
    (float32 sum), decompress (+)= float(in); coded pieces around them as a
    call per piece."""
    rng = np.random.default_rng()
    pieces, nbytes, rows, x, order, mean = raw_tile(rng)
    params = params_by_width(rng)
    src = _cpu.Source(x, order, 0, mean)
    wire = np.zeros(nbytes, np.uint8)
    _cpu.encode_pieces(params, src, pieces, 1, wire)
    received = rng.integers(0, 256, nbytes, dtype=np.uint8)
    for w, s0, cnt, off, nb in pieces:                 # finite BF16 values in the raw pieces
        if w == 16:
            received[off:off + nb] = float32_to_bf16(
                rng.standard_normal(cnt * SUPER).astype(np.float32)).view(np.uint8)
        else:
            _cpu.compress(params[w], src, cnt, s0, 0, received[off:off + nb])
    dar = np.zeros(nbytes, np.uint8)
    _cpu.encode_pieces(params, src, pieces, 2, dar, received)
    first = pieces[0][1]
    for w, s0, cnt, off, nb in pieces:
        if w != 16:
            want = np.zeros(nb, np.uint8)
            _cpu.compress(params[w], src, cnt, s0, 1, want)
            assert np.array_equal(wire[off:off + nb], want)
            continue
        v = local_rows(x, order, mean, s0, cnt)
        got = wire[off:off + nb].view(np.uint16)
        assert np.array_equal(got, float32_to_bf16(v).view(np.uint16))
        signed_zero = (v == 0) & np.signbit(v)
        assert np.array_equal(np.signbit(bf16_to_float32(got[signed_zero])), np.ones(signed_zero.sum(), bool))
        rin = bf16_to_float32(received[off:off + nb].view(BF16))
        assert np.array_equal(dar[off:off + nb].view(np.uint16),
                              float32_to_bf16(rin + v).view(np.uint16))
    for accumulate in (False, True):
        start = rng.standard_normal((rows - first) * SUPER).astype(np.float32)
        got = start.copy()
        _cpu.decompress_pieces(params, dar, pieces, got, accumulate, first)
        want = start.copy()
        for w, s0, cnt, off, nb in pieces:
            r = (s0 - first) * SUPER
            if w == 16:
                dec = bf16_to_float32(dar[off:off + nb].view(BF16))
                want[r:r + cnt * SUPER] = want[r:r + cnt * SUPER] + dec if accumulate else dec
            else:
                _cpu.decompress(params[w], dar[off:off + nb], cnt, want[r:r + cnt * SUPER], accumulate)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("divisor", [1.0, 3.0])
def test_decompress_out_pieces_equals_decompress_then_finish(out_dtype, divisor):
    """Decoding a tile straight into the caller's layout (coded and raw
    pieces) writes the bits that decompress into the stream + finish write;
    finish(None) then fills only the rows absent from the stream."""
    import ml_dtypes
    rng = np.random.default_rng()
    first = 0
    pieces, nbytes, rows, x, order, mean = raw_tile(rng, first)
    params = params_by_width(rng)
    wire = np.zeros(nbytes, np.uint8)
    _cpu.encode_pieces(params, _cpu.Source(x, order, 0, mean), pieces, 0, wire)
    extra = 3                                     # input rows absent from the stream (0-bit class)
    nsg = rows + extra
    full_order = rng.permutation(nsg).astype(np.int64)   # input row of each stream super-group
    stream_of_sg = np.full(nsg, -1, np.int64)
    stream_of_sg[full_order[:rows]] = np.arange(rows)
    mean_sum = rng.standard_normal(nsg).astype(np.float32)
    length = nsg * SUPER - 100
    dt = np.float32 if out_dtype == "float32" else np.dtype(ml_dtypes.bfloat16)
    stream = np.zeros(rows * SUPER, np.float32)
    _cpu.decompress_pieces(params, wire, pieces, stream, False, 0)
    want = np.zeros(length, dt)
    _cpu.finish(stream, stream_of_sg, mean_sum, divisor, want)
    got = np.full(length, np.nan, dt)
    _cpu.decompress_out_pieces(params, wire, pieces, full_order, mean_sum, divisor, got)
    _cpu.finish(None, stream_of_sg, mean_sum, divisor, got)
    view = np.uint16 if out_dtype == "bfloat16" else np.uint32
    assert np.array_equal(got.view(view), want.view(view))
    with pytest.raises(ValueError, match="order map"):
        _cpu.decompress_out_pieces(params, wire, pieces, full_order[:rows - 1], mean_sum, 1.0, got)
    with pytest.raises(ValueError, match="wire bytes"):
        w, s0, cnt, off, nb = next(p for p in pieces if p[0] == 16)
        _cpu.decompress_out_pieces(params, wire, [(16, s0, cnt + 1, off, nb)], full_order,
                                   mean_sum, 1.0, got)


@pytest.mark.parametrize("topology", ["ring", "butterfly"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_into_output_is_bit_identical(monkeypatch, topology, dtype):
    """The plan's decode straight into the caller's buffer (the default, the
    16-bit class included) gives the bits of the two-pass path
    (DYNAMIQ_DECODE_INTO_OUTPUT=0), sum and mean, on inputs with 0-bit, coded
    and 16-bit super-groups."""
    import ml_dtypes
    import dynamiq_mpi as dq
    rng = np.random.default_rng()
    n, nsg = 4, 40
    length = nsg * SUPER - 33
    xs = []
    for r in range(n):
        x = (rng.standard_normal(length) * np.repeat(10.0 ** rng.uniform(-3, 2, nsg), SUPER)[:length])
        x[5 * SUPER:9 * SUPER] = 0                # zero on every rank: the 0-bit class
        x[20 * SUPER:22 * SUPER] *= 1e4           # outliers: the 16-bit class
        xs.append(x.astype(np.float32) if dtype == "float32" else x.astype(ml_dtypes.bfloat16))
    codec = dq.DynamiQ(bits=7, small_input=0)
    calls = []
    real = _cpu.decompress_out_pieces
    monkeypatch.setattr(_cpu, "decompress_out_pieces",
                        lambda *a: calls.append([p[0] for p in a[2]]) or real(*a))
    for op in ("sum", "mean"):
        monkeypatch.delenv("DYNAMIQ_DECODE_INTO_OUTPUT", raising=False)
        calls.clear()
        outs, reps = dq.simulate_allreduce(xs, codec=codec, topology=topology, op=op, seed=3,
                                           return_reports=True)
        assert any(16 in widths for widths in calls)      # raw pieces decoded into the output
        widths = reps[0].codec_info["widths"]
        assert widths[0] >= 4 and widths[16] >= 1, widths
        monkeypatch.setenv("DYNAMIQ_DECODE_INTO_OUTPUT", "0")
        two_pass = dq.simulate_allreduce(xs, codec=codec, topology=topology, op=op, seed=3)
        for a, b in zip(outs, two_pass):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
