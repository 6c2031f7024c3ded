"""One compiled call per tile (``encode_pieces``, ``decompress_pieces``) does
exactly what a call per width-homogeneous piece does, and refuses pieces
outside its buffers.  CPU kernels here; tests/gpu/test_pieces_gpu.py checks
the GPU's against these."""
import numpy as np
import pytest

from dynamiq_mpi import _cpu
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
        nb = int(_cpu.run_bytes(cnt, w, True))
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
