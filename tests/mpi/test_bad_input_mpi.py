"""Bad input on one rank: every rank raises the same clear error, none hangs,
and nothing is written into the caller's array."""
import numpy as np
import pytest
from mpi4py import MPI

import dynamiq_mpi as dq
from helpers import BF16, rank_inputs

comm = MPI.COMM_WORLD
N = comm.size
LAST = N - 1


def inputs(length=1000):
    return rank_inputs(12345, N, length)[comm.rank].copy()


def raises_everywhere(exc, fn, match):
    with pytest.raises(exc, match=match) as info:
        fn()
    messages = comm.allgather(str(info.value))
    assert len(set(messages)) == 1, messages
    return info


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("topology", ["ring", "butterfly"])
def test_non_finite_on_one_rank(bad, topology):
    if topology == "butterfly" and N & (N - 1):
        pytest.skip("butterfly needs a power-of-two world")
    x = inputs()
    if comm.rank == LAST:
        x[517] = bad
    before = x.copy()
    raises_everywhere(dq.NonFiniteInputError,
                      lambda: dq.allreduce(x, codec=dq.DynamiQ(small_input=0, bits=5), topology=topology,
                                           nonfinite="raise"),
                      "NaN or Inf")
    assert np.array_equal(x, before, equal_nan=True)
    # the communicator still works afterwards
    out = dq.allreduce(inputs(), codec=dq.Exact())
    assert np.all(np.isfinite(out))


@pytest.mark.mpi(min_size=2)
def test_length_differs_on_one_rank():
    x = inputs(1000 if comm.rank != LAST else 999)
    raises_everywhere(dq.InputMismatchError, lambda: dq.allreduce(x), "disagree on length")


@pytest.mark.mpi(min_size=2)
def test_dtype_differs_on_one_rank():
    x = inputs()
    if comm.rank == LAST:
        x = x.astype(BF16)
    raises_everywhere(dq.InputMismatchError, lambda: dq.allreduce(x), "disagree on dtype")


@pytest.mark.mpi(min_size=2)
def test_unsupported_dtype_on_one_rank():
    x = inputs()
    if comm.rank == LAST:
        x = x.astype(np.int32)
    raises_everywhere(dq.InvalidInputError, lambda: dq.allreduce(x),
                      f"rank {LAST}: TypeError: unsupported dtype int32")


@pytest.mark.mpi(min_size=2)
def test_codec_differs_on_one_rank():
    x = inputs()
    codec = dq.DynamiQ(small_input=0, bits=5 if comm.rank != LAST else 6)
    raises_everywhere(dq.InputMismatchError, lambda: dq.allreduce(x, codec=codec),
                      "disagree on codec")


@pytest.mark.mpi(min_size=2)
def test_topology_differs_on_one_rank():
    x = inputs()
    topo = "ring" if comm.rank != LAST else "butterfly"
    exc = dq.InvalidInputError if N & (N - 1) else dq.InputMismatchError
    raises_everywhere(exc, lambda: dq.allreduce(x, topology=topo), "topology|butterfly")


@pytest.mark.mpi(min_size=2)
def test_all_gather_schedule_differs_on_one_rank(monkeypatch):
    # $DYNAMIQ_GATHER is read when a Collective is made: set on one rank only
    monkeypatch.setenv("DYNAMIQ_GATHER", "doubling" if comm.rank == LAST else "ring")
    coll = dq.Collective(comm, path="compressed")
    raises_everywhere(dq.InputMismatchError,
                      lambda: coll.allreduce(inputs(), codec=dq.DynamiQ(small_input=0)),
                      "disagree on gather")
    monkeypatch.setenv("DYNAMIQ_GATHER", "sideways")
    with pytest.raises(ValueError, match="gather must be one of"):
        dq.Collective(comm)
    coll.free()


@pytest.mark.mpi(min_size=3)
def test_butterfly_at_unsupported_size():
    if N & (N - 1) == 0:
        pytest.skip("butterfly works at this size")
    x = inputs()
    raises_everywhere(dq.InvalidInputError, lambda: dq.allreduce(x, topology="butterfly"),
                      "power-of-two")


@pytest.mark.mpi(min_size=2)
def test_non_contiguous_on_one_rank():
    x = np.repeat(inputs(), 2)
    if comm.rank == LAST:
        x = x[::2]
    else:
        x = x[:1000].copy()
    raises_everywhere(dq.InvalidInputError, lambda: dq.allreduce(x), "C-contiguous")


@pytest.mark.mpi(min_size=2)
def test_overflowing_sum():
    x = np.full(512, np.float32(3.0e38), dtype=np.float32)
    raises_everywhere(dq.SumOverflowError, lambda: dq.allreduce(x, codec=dq.DynamiQ(small_input=0),
                                                                nonfinite="raise"),
                      "float32 range")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path", ["native", "auto"])
@pytest.mark.parametrize("out_is_x", [False, True])
def test_non_finite_raises_on_the_native_path(path, out_is_x):
    """nonfinite="raise" holds whichever path runs the call (path="auto"
    measures both paths on its first calls: each must raise)."""
    coll = dq.Collective(path=path, nonfinite="raise")
    try:
        for call in range(6):
            x = inputs()
            if comm.rank == LAST and call % 2 == 0:
                x[3] = np.nan
            before = x.copy()
            out = x if out_is_x else None
            if call % 2 == 0:
                raises_everywhere(dq.NonFiniteInputError, lambda: coll.allreduce(x, out=out),
                                  "NaN or Inf")
                assert np.array_equal(x, before, equal_nan=True)   # nothing written
            else:
                res, rep = coll.allreduce(x, out=out, return_report=True)
                assert np.isfinite(res).all() and not rep.nonfinite
    finally:
        coll.free()


@pytest.mark.mpi(min_size=2)
def test_overflowing_sum_on_the_native_path():
    x = np.full(512, np.float32(3.0e38), dtype=np.float32)
    raises_everywhere(dq.SumOverflowError,
                      lambda: dq.allreduce(x, path="native", nonfinite="raise"), "range")
