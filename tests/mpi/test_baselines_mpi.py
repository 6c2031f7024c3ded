"""THC and OmniReduce over real MPI ranks (run under mpiexec at several sizes):
THC's result does not depend on the topology, and bad input raises the same
error everywhere.  (Every rank equal to the in-process simulation, bit for
bit, with the same accounting: test_allreduce_mpi.py, for every codec.)"""
import numpy as np
import pytest
from mpi4py import MPI

import dynamiq_mpi as dq
from dynamiq_mpi.codecs.omnireduce import OmniReduce
from dynamiq_mpi.codecs.thc import THC
from helpers import rank_inputs, shared_seed

comm = MPI.COMM_WORLD
N = comm.size
TOPOLOGIES = ["ring"] + (["butterfly"] if N & (N - 1) == 0 else [])


@pytest.mark.mpi(min_size=2)
def test_thc_result_does_not_depend_on_the_topology():
    if N & (N - 1):
        pytest.skip("butterfly needs a power-of-two world")
    seed = shared_seed(comm)
    x = rank_inputs(seed, N, 20_000)[comm.rank]
    col = dq.Collective(comm)
    col.counter = 4
    ring = col.allreduce(x, codec=THC(), topology="ring", seed=3)
    col.counter = 4
    fly = col.allreduce(x, codec=THC(), topology="butterfly", seed=3, tile_bytes=1000)
    col.free()
    assert np.array_equal(ring.view(np.uint32), fly.view(np.uint32)), f"seed {seed}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec", [THC(), OmniReduce()], ids=lambda c: c.name)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_on_one_rank_raises_everywhere(codec, bad):
    x = rank_inputs(12345, N, 3000)[comm.rank].copy()
    if comm.rank == N - 1:
        x[2999] = bad
    before = x.copy()
    for topology in TOPOLOGIES:
        with pytest.raises(dq.NonFiniteInputError, match="NaN or Inf") as info:
            dq.allreduce(x, codec=codec, topology=topology, nonfinite="raise")
        assert len(set(comm.allgather(str(info.value)))) == 1
    assert np.array_equal(x, before, equal_nan=True)
    out = dq.allreduce(rank_inputs(1, N, 3000)[comm.rank], codec=codec)   # still usable
    assert np.all(np.isfinite(out))
