"""Whole compressed calls replayed as CUDA graphs (graphs.CallGraph), on one
GPU: every rank of a simulated call runs on one stream, captured once and
replayed with new data, new norms (so a new allocation: zero super-groups
come and go) and new generator keys every call.  Each replay must equal the
CPU path's call with the same seed and counter, bit for bit, on every rank:
a stale plan, key or buffer would show.  (The Collective's graphs over NCCL
need a GPU per rank: tests/mpi/test_graphs_gpu_mpi.py.)

Skipped (with the reason) unless dynamiq_mpi.cuda.has_cuda().
"""
import numpy as np
import pytest

import dynamiq_mpi as dq
from dynamiq_mpi.cuda import has_cuda, why_not

from ..helpers import fresh_seed, rank_inputs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not has_cuda(), reason=f"no CUDA: {why_not() if not has_cuda() else ''}")]

if has_cuda():  # pragma: no branch
    import cupy as cp
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)


def _inputs(rng, seed, n, length, dtype):
    xs = rank_inputs(seed, n, length)
    scale = np.float32(10.0 ** rng.uniform(-3, 3))       # new norms every call
    zero = int(rng.integers(0, max(1, length // 256 - 2)))
    for x in xs:
        x *= scale
        x[zero * 256:(zero + 2) * 256] = 0                 # the 0-bit class moves
    return [x.astype(BF16) if dtype == "bfloat16" else x for x in xs]


@pytest.mark.parametrize("n,topology", [(2, "ring"), (3, "ring"), (4, "butterfly")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replays_equal_the_cpu_call_after_call(n, topology, dtype):
    from dynamiq_mpi.call.engine import CallSpec, rank_program
    from dynamiq_mpi.call.graphs import CallGraph
    from dynamiq_mpi.rng import call_keys
    from dynamiq_mpi.transports.simulate import SimulatedTransport
    from dynamiq_mpi.call.workspace import Workspace
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    length = 256 * 2000 + 7
    codec = dq.DynamiQ(small_input=0)
    graph = CallGraph()
    first = _inputs(rng, seed, n, length, dtype)
    xs = [cp.asarray(x) for x in first]
    outs = [cp.zeros_like(x) for x in xs]
    spaces = [graph.workspace] + [Workspace() for _ in range(n - 1)]
    spec = CallSpec(codec, topology, "mean", seed, 0, tile_bytes=300_000, layout="fixed",
                    keys_at=graph.keys_at)

    def body():
        results = SimulatedTransport(n).run([
            rank_program(r, n, xs[r], spec, outs[r], spaces[r], detailed_report=False)
            for r in range(n)])
        assert all(rep.sync_free for _, rep in results)
        return results

    stream = cp.cuda.Stream(non_blocking=True)
    view = np.uint16 if dtype == "bfloat16" else np.uint32
    with stream:
        graph.capture(body, stream)
        data = first
        for counter in range(5):
            if counter:
                data = _inputs(rng, seed + counter, n, length, dtype)
                for x, host in zip(xs, data):
                    x.set(host, stream=stream)
            graph.launch(call_keys(seed, counter), stream)
            stream.synchronize()
            want = dq.simulate_allreduce(data, codec=codec, topology=topology, op="mean",
                                         seed=seed, counter=counter, layout="exact")
            for r in range(n):
                assert np.array_equal(outs[r].get().view(view), want[r].view(view)), \
                    (seed, counter, r)
    assert graph.replays == 5
    graph.free()


def test_a_host_read_fails_the_capture_cleanly():
    """A call that reads the device on the host (the exact layout reads its
    plan back) cannot be captured: the capture raises, the stream is left
    usable, and the same call then runs eagerly."""
    from dynamiq_mpi.call.engine import CallSpec, rank_program
    from dynamiq_mpi.call.graphs import CallGraph
    from dynamiq_mpi.transports.simulate import SimulatedTransport
    xs = [cp.asarray(x) for x in rank_inputs(fresh_seed(), 2, 256 * 100)]
    outs = [cp.zeros_like(x) for x in xs]
    spec = CallSpec(dq.DynamiQ(small_input=0), "ring", "sum", 0, 0, layout="exact")
    graph = CallGraph()

    def body():
        return SimulatedTransport(2).run([rank_program(r, 2, xs[r], spec, outs[r])
                                          for r in range(2)])
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        with pytest.raises(Exception):
            graph.capture(body, stream)
        assert not stream.is_capturing()
        body()
        stream.synchronize()
    graph.free()
    assert np.array_equal(outs[0].get(), outs[1].get()) and bool((outs[0] != 0).any())
