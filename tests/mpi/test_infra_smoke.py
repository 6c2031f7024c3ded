"""Smoke test of the MPI test infrastructure itself (mpiexec + mpi4py + pytest-mpi).

Every rank sends a random NumPy array to its right-hand neighbour around a ring
and receives the left-hand neighbour's array.  The arrays are random for each run,
but every rank can regenerate exactly what its neighbour sent from a seed that
rank 0 broadcasts, so the check is exact (bit for bit) and done on every rank.
"""
import numpy as np
import pytest


def _payload(seed, rank, n):
    """The arrays `rank` sends in this run: float32, float64 and int64 values."""
    rng = np.random.default_rng([seed, rank])
    return (
        rng.standard_normal(n, dtype=np.float32),
        rng.standard_normal(n // 3 + 1),
        rng.integers(-(2**62), 2**62, size=n // 7 + 5, dtype=np.int64),
    )


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n", [1, 4099, 1 << 18])
def test_ring_sendrecv_exact(n):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % size, (rank - 1) % size

    seed = comm.bcast(
        int(np.random.SeedSequence().entropy % (1 << 63)) if rank == 0 else None, root=0
    )

    mine = _payload(seed, rank, n)
    expected = _payload(seed, left, n)
    received = [np.empty_like(a) for a in mine]
    for tag, (send, recv) in enumerate(zip(mine, received)):
        comm.Sendrecv(send, dest=right, sendtag=tag, recvbuf=recv, source=left, recvtag=tag)

    # Compare the raw bytes: exact, and NaN-safe should the payload ever contain NaN.
    ok = all(
        r.dtype == e.dtype and r.shape == e.shape and r.tobytes() == e.tobytes()
        for r, e in zip(received, expected)
    )
    # Every rank learns every other rank's verdict before asserting, so no rank
    # leaves this test while another is still inside a collective.
    verdicts = comm.allgather(ok)
    assert ok, f"rank {rank}: data received from rank {left} differs from what it sent"
    bad = [r for r, v in enumerate(verdicts) if not v]
    assert not bad, f"rank {rank}: ranks {bad} received wrong data"
