"""Steady compressed calls over NCCL replayed as CUDA graphs
(``Collective(graphs=True)``, graphs.py): a call with ``out=`` repeated with
the same buffers is run eagerly, captured on its second occurrence and
replayed after; every result equals the eager collective's for the same
counter, bit for bit, on every rank, with new data (and new norms) each call;
a rank whose call differs makes every rank raise.

Needs one GPU per rank (NCCL): skipped otherwise.  (The graph mechanics on one
GPU, all ranks simulated on one stream: tests/gpu/test_graphs_gpu.py.)
"""
import numpy as np
import pytest
from mpi4py import MPI

import dynamiq_mpi as dq
from helpers import BF16, digest, rank_inputs, shared_seed

comm = MPI.COMM_WORLD
N = comm.size


def _nccl_ok():
    if not dq.has_cuda():
        return False
    import cupy
    return comm.allreduce(cupy.cuda.runtime.getDeviceCount(), op=MPI.MIN) >= N


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _nccl_ok(), reason="NCCL needs one GPU per rank")]


@pytest.fixture(scope="module")
def cp():
    import cupy
    cupy.cuda.Device(comm.rank).use()
    return cupy


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_graph_replays_equal_eager_calls(cp, dtype):
    seed = shared_seed(comm)
    codec = dq.DynamiQ(small_input=0)
    graphs = dq.Collective(comm, graphs=True, path="compressed")
    eager = dq.Collective(comm, graphs=False, path="compressed")
    length = 256 * 5000 + 3
    x = cp.zeros(length, dtype=dtype)
    out = cp.zeros_like(x)
    for call in range(6):
        xs = rank_inputs(seed + call, N, length, dtype=np.float32)
        host = (xs[comm.rank] * np.float32(10.0 ** (call - 3))).astype(dtype)
        host[256 * call:256 * (call + 2)] = 0
        x.set(host)
        got = graphs.allreduce(x, codec=codec, seed=seed % 1000, out=out)
        want = eager.allreduce(cp.asarray(host), codec=codec, seed=seed % 1000)
        assert got is out
        assert digest(cp.asnumpy(out)) == digest(cp.asnumpy(want)), (seed, call)
        assert len(set(comm.allgather(digest(cp.asnumpy(out))))) == 1
    stats = graphs.graph_stats()
    assert stats == {"captured": 1, "replays": 5, "failed": []}, stats
    graphs.free()
    eager.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_reduce_scatter_graph_takes_fresh_buffers_and_equals_eager_calls(cp, dtype):
    """A staged reduce-scatter graph: every call hands new input and output
    buffers (as FSDP2 does); one graph serves them all, bit for bit the
    eager call of the same counter."""
    seed = shared_seed(comm)
    codec = dq.DynamiQ(small_input=0)
    graphs = dq.Collective(comm, graphs=True)
    eager = dq.Collective(comm, graphs=False)
    length = N * (256 * 2000 + 5)
    for call in range(5):
        xs = rank_inputs(seed + call, N, length, dtype=np.float32)
        host = (xs[comm.rank] * np.float32(10.0 ** (call - 2))).astype(dtype)
        x = cp.asarray(host)
        out = cp.full(length // N, 7, dtype=dtype)
        got = graphs.reduce_scatter(x, codec=codec, op="mean", seed=seed % 1000, out=out)
        want = eager.reduce_scatter(cp.asarray(host), codec=codec, op="mean", seed=seed % 1000)
        assert got is out
        assert digest(cp.asnumpy(out)) == digest(cp.asnumpy(want)), (seed, call)
        assert cp.array_equal(x, cp.asarray(host))          # the input is left as it was
        del x, out
    stats = graphs.graph_stats()
    assert stats == {"captured": 1, "replays": 4, "failed": []}, stats
    graphs.free()
    eager.free()


def _five_reduce_scatters_against_eager(cp, agree_replays):
    """Five reduce-scatters of fresh buffers through a graphs collective,
    each bit for bit the eager collective's; returns both collectives."""
    seed = shared_seed(comm)
    codec = dq.DynamiQ(small_input=0)
    coll = dq.Collective(comm, graphs=True, agree_replays=agree_replays)
    eager = dq.Collective(comm, graphs=False)
    length = N * (256 * 1000 + 3)
    for call in range(5):
        host = rank_inputs(seed + call, N, length, dtype=np.float32)[comm.rank]
        out = cp.empty(length // N, dtype=np.float32)
        coll.reduce_scatter(cp.asarray(host), codec=codec, op="sum", seed=7, out=out)
        want = eager.reduce_scatter(cp.asarray(host), codec=codec, op="sum", seed=7)
        assert digest(cp.asnumpy(out)) == digest(cp.asnumpy(want)), (seed, call)
    return coll, eager


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("agree_replays", [True, False])
def test_replays_agree_again_only_when_asked(cp, monkeypatch, agree_replays):
    """agree_replays=False: the digest is exchanged when the graph is
    captured, not on its replays; the bits are the same either way."""
    from dynamiq_mpi.call import graphs as graph_calls
    exchanges = []
    agree = graph_calls.SteadyCompressed.agree
    monkeypatch.setattr(graph_calls.SteadyCompressed, "agree",
                        lambda self, *a: exchanges.append(1) or agree(self, *a))
    coll, eager = _five_reduce_scatters_against_eager(cp, agree_replays)
    assert coll.graph_stats() == {"captured": 1, "replays": 4, "failed": []}
    assert len(exchanges) == (4 if agree_replays else 1)    # calls 2-5, or the capture alone
    with pytest.raises(TypeError, match="agree_replays"):
        dq.Collective(comm, agree_replays="no")
    coll.free()
    eager.free()


@pytest.mark.mpi(min_size=2)
def test_a_capture_failing_on_one_rank_runs_eagerly_beside_peers_replays(cp, monkeypatch):
    """agree_replays=False: where the graph fails on the last rank only, that
    rank runs the call eagerly without a digest from then on while its peers
    replay theirs: no hang, the bits of the eager collective."""
    from dynamiq_mpi.call import graphs as graph_calls
    if comm.rank == N - 1:
        def fail(self, body, stream):
            raise RuntimeError("capture refused on this rank (test)")
        monkeypatch.setattr(graph_calls.CallGraph, "capture", fail)
    coll, eager = _five_reduce_scatters_against_eager(cp, False)
    stats = coll.graph_stats()
    if comm.rank == N - 1:
        assert stats["captured"] == 0 and len(stats["failed"]) == 1, stats
    else:
        assert stats == {"captured": 1, "replays": 4, "failed": []}, stats
    coll.free()
    eager.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("winner", ["compressed", "native"])
def test_auto_times_compressed_calls_as_graph_replays(cp, winner):
    """path="auto" on quiet device calls: the class's compressed calls are
    captured while it measures, and timed as replays (as they run once
    decided), bit for bit the eager call of the same counter; a class that
    decides native frees its graph.  The margin forces the winner."""
    from dynamiq_mpi.call.paths import measuring_calls
    seed = shared_seed(comm)
    codec = dq.DynamiQ(small_input=0)
    auto = dq.Collective(comm, graphs=True, path="auto")
    auto._runner.planner.paths.margin = 0.0 if winner == "compressed" else 1e9
    eager = dq.Collective(comm, graphs=False, path="compressed")
    measuring = measuring_calls(True)
    length = 256 * 5000 + 3
    x = cp.zeros(length, dtype=np.float32)
    out = cp.zeros_like(x)
    for call in range(measuring + 3):
        host = rank_inputs(seed + call, N, length, dtype=np.float32)[comm.rank]
        x.set(host)
        auto.allreduce(x, codec=codec, seed=seed % 1000, out=out)
        want = eager.allreduce(cp.asarray(host), codec=codec, seed=seed % 1000)
        compressed = call % 2 == 0 if call < measuring else winner == "compressed"
        if compressed:
            assert digest(cp.asnumpy(out)) == digest(cp.asnumpy(want)), (seed, call)
        assert len(set(comm.allgather(digest(cp.asnumpy(out))))) == 1
        stats = auto.graph_stats()
        if call == 2:           # the class's second compressed call: captured
            assert stats == {"captured": 1, "replays": 1, "failed": []}, stats
    (path, why), = auto.path_decisions().values()
    assert path == winner and "measured" in why
    assert auto.graph_stats() == ({"captured": 1, "replays": measuring // 2 - 1 + 3, "failed": []}
                                  if winner == "compressed" else
                                  {"captured": 0, "replays": 0, "failed": []})
    auto.free()
    eager.free()


@pytest.mark.mpi(min_size=2)
def test_a_rank_that_differs_makes_every_rank_raise(cp):
    coll = dq.Collective(comm, graphs=True, path="compressed")
    x = cp.asarray(rank_inputs(shared_seed(comm), N, 256 * 3000)[comm.rank])
    out = cp.empty_like(x)
    for _ in range(3):                         # eager, captured, replayed
        coll.allreduce(x, codec=dq.DynamiQ(small_input=0), out=out)
    assert coll.graph_stats()["captured"] == 1
    bits = 4.0 if comm.rank == N - 1 else 5.0
    with pytest.raises(dq.InputMismatchError):
        coll.allreduce(x, codec=dq.DynamiQ(small_input=0, bits=bits), out=out)
    coll.free()


@pytest.mark.mpi(min_size=2)
def test_a_collective_dropped_with_its_graph_is_collected_without_a_hang(cp):
    """A Collective left to the garbage collector (never freed) while its
    captured call holds its NCCL communicator: the graph goes first, so
    dropping the communicator returns (ncclCommDestroy waits for every graph
    that holds it), on each rank at its own moment; later calls still work."""
    import faulthandler
    import gc
    import sys
    import weakref
    x = cp.asarray(rank_inputs(shared_seed(comm), N, 256 * 3000)[comm.rank])
    out = cp.empty_like(x)
    coll = dq.Collective(comm, graphs=True, path="compressed", transport="nccl")
    for _ in range(3):                         # eager, captured, replayed
        coll.allreduce(x, codec=dq.DynamiQ(small_input=0), out=out)
    assert coll.graph_stats()["captured"] == 1
    cp.cuda.get_current_stream().synchronize()
    faulthandler.dump_traceback_later(60, exit=True, file=sys.__stderr__)   # a hang fails the job
    try:
        dropped = weakref.ref(coll)
        del coll
        if comm.rank == 0:                     # the ranks collect at different moments
            gc.collect()
        comm.Barrier()
        if comm.rank != 0:
            gc.collect()
        comm.Barrier()
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert dropped() is None, gc.get_referrers(dropped())
    again = dq.Collective(comm, graphs=True, path="compressed", transport="nccl")
    want = np.sum(np.asarray(comm.allgather(cp.asnumpy(x)), dtype=np.float64), axis=0)
    got = cp.asnumpy(again.allreduce(x, codec=dq.Exact())).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    again.free()
