"""THC and OmniReduce over real MPI ranks (run under mpiexec at several sizes):
every rank's output equals the in-process simulation bit for bit, the
reports agree, and bad input raises the same error everywhere."""
import numpy as np
import pytest
from mpi4py import MPI

import dynamiq_mpi as dq
from dynamiq_mpi.codecs.omnireduce import OmniReduce
from dynamiq_mpi.codecs.thc import THC
from helpers import assert_identical_everywhere, exact_sum, rank_inputs, shared_seed, vnmse

comm = MPI.COMM_WORLD
N = comm.size
TOPOLOGIES = ["ring"] + (["butterfly"] if N & (N - 1) == 0 else [])
CODECS = [THC(), THC(agg_bits=12, max_block_log2=12), OmniReduce(0.5), OmniReduce(0.25)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("length", [5003, 70_000])
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: "-".join(map(str, c.signature())))
def test_identical_on_every_rank_and_equal_to_simulation(codec, topology, length):
    seed = shared_seed(comm)
    xs = rank_inputs(seed, N, length)
    x = xs[comm.rank].copy()
    out, rep = dq.allreduce(x, codec=codec, topology=topology, seed=seed % 1000,
                            return_report=True)
    assert np.array_equal(x, xs[comm.rank]), "the input was modified"
    assert out.dtype == np.float32 and out.shape == x.shape
    assert_identical_everywhere(comm, out)
    sims, sim_reps = dq.simulate_allreduce(xs, codec=codec, topology=topology, seed=seed % 1000,
                                           counter=rep.call_counter, return_reports=True)
    assert np.array_equal(out.view(np.uint32), sims[comm.rank].view(np.uint32)), f"seed {seed}"
    ours, sim = rep, sim_reps[comm.rank]
    assert (ours.wire_bytes_total, ours.stats_bytes_total, ours.bytes_sent) == \
        (sim.wire_bytes_total, sim.stats_bytes_total, sim.bytes_sent)
    assert sum(comm.allgather(rep.bytes_sent)) == rep.wire_bytes_total
    assert vnmse(out, exact_sum(xs)) < 1.0


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
            dq.allreduce(x, codec=codec, topology=topology)
        assert len(set(comm.allgather(str(info.value)))) == 1
    assert np.array_equal(x, before, equal_nan=True)
    out = dq.allreduce(rank_inputs(1, N, 3000)[comm.rank], codec=codec)   # still usable
    assert np.all(np.isfinite(out))
