"""The workspace hands out reused views and filled constants (host side)."""
import numpy as np
import pytest

from dynamiq_mpi.codecs.base import StreamLayout, tile_stream
from dynamiq_mpi.call.workspace import FRESH, Workspace


def test_take_reuses_views_until_the_buffer_grows():
    ws = Workspace()
    a = ws.take(np, "buf", 100, np.float32)
    a[:] = 7
    assert ws.take(np, "buf", 100, np.float32) is a
    smaller = ws.take(np, "buf", 10, np.float32)          # same buffer, another view
    assert smaller.shape == (10,) and np.all(smaller == 7)
    bigger = ws.take(np, "buf", 1000, np.float32)          # grows: a new buffer
    assert bigger.shape == (1000,)
    again = ws.take(np, "buf", 100, np.float32)
    assert again is not a and np.shares_memory(again, bigger)
    assert ws.take(np, "buf", 100, np.int32).dtype == np.int32


@pytest.mark.parametrize("fill", ["zeros", "arange"])
def test_constants_are_filled_once_and_again_after_growth(fill):
    ws = Workspace()
    expect = (lambda n: np.zeros(n)) if fill == "zeros" else (lambda n: np.arange(n))
    c = ws.constant(np, "c", 50, np.int64, fill)
    assert np.array_equal(c, expect(50))
    shorter = ws.constant(np, "c", 20, np.int64, fill)
    assert np.array_equal(shorter, expect(20))
    longer = ws.constant(np, "c", 5000, np.int64, fill)    # grows: filled again
    assert np.array_equal(longer, expect(5000))
    assert np.array_equal(ws.constant(np, "c", 5000, np.int64, fill), expect(5000))
    other = "arange" if fill == "zeros" else "zeros"       # a different fill is written
    assert np.array_equal(ws.constant(np, "c", 30, np.int64, other),
                          np.arange(30) if other == "arange" else np.zeros(30))
    with pytest.raises(ValueError, match="unknown fill"):
        ws.constant(np, "d", 3, np.int64, "ones")
    assert np.array_equal(FRESH.constant(np, "c", 4, np.int64, "arange"), np.arange(4))


def test_tilings_are_kept_per_runs():
    a = tile_stream(StreamLayout([(100, 146), (7, 274)]), 4, 4096)
    b = tile_stream(StreamLayout([(100, 146), (7, 274)]), 4, 4096)
    c = tile_stream(StreamLayout([(100, 146), (8, 274)]), 4, 4096)
    assert a is b and c is not a
    assert sum(a.nbytes) == 100 * 146 + 7 * 274 and sum(c.nbytes) == 100 * 146 + 8 * 274
