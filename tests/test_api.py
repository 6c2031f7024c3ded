"""The public API in one process (world size 1 and the simulated transport)."""
import numpy as np
import pytest
from mpi4py import MPI

import dynamiq_mpi as dq
from helpers import BF16, digest, exact_sum, fresh_seed, rank_inputs, vnmse

CODECS = [dq.Exact(), dq.BF16(), dq.DynamiQ(small_input=0, bits=5), dq.DynamiQ(small_input=0, bits=3)]


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_single_rank_returns_the_input_exactly(codec, dtype):
    x = rank_inputs(fresh_seed(), 1, 1000, dtype=dtype)[0].reshape(10, 100)
    for topology in ("ring", "butterfly"):
        out = dq.allreduce(x, codec=codec, topology=topology, comm=MPI.COMM_SELF)
        assert out is not x and out.dtype == x.dtype and out.shape == x.shape
        assert digest(out) == digest(x)


def test_report_counts_every_byte():
    xs = rank_inputs(fresh_seed(), 4, 256 * 1000)
    outs, reps = dq.simulate_allreduce(xs, codec=dq.DynamiQ(small_input=0, bits=5), return_reports=True)
    r = reps[0]
    # every rank sends the same amount in ring (equal-byte chunks, +- one super-group)
    assert sum(rep.bytes_sent for rep in reps) == r.wire_bytes_total
    assert 4.95 <= r.bits_per_coord <= 5.0
    w = r.codec_info["widths"]
    assert sum(w.values()) == 1000
    assert r.stats_bytes_total == 2 * 3 * 4 * (2 * 1000 + 2)
    d = r.as_dict()
    assert d["bits_per_coord"] == r.bits_per_coord and d["world_size"] == 4


def test_successive_calls_draw_fresh_randomness_and_seed_reproduces():
    xs = rank_inputs(fresh_seed(), 2, 4096)
    codec = dq.DynamiQ(small_input=0)
    a = dq.simulate_allreduce(xs, codec=codec, seed=1, counter=0)[0]
    b = dq.simulate_allreduce(xs, codec=codec, seed=1, counter=1)[0]
    c = dq.simulate_allreduce(xs, codec=codec, seed=1, counter=0)[0]
    d = dq.simulate_allreduce(xs, codec=codec, seed=2, counter=0)[0]
    assert digest(a) == digest(c)
    assert digest(a) != digest(b) and digest(a) != digest(d)


def test_codec_configuration_errors():
    with pytest.raises(ValueError, match="smallest achievable budget 2.8125"):
        dq.DynamiQ(small_input=0, bits=2.5)
    dq.DynamiQ(small_input=0, bits=2.8125)
    with pytest.raises(ValueError, match="fixed_width"):
        dq.DynamiQ(small_input=0, fixed_width=3)
    with pytest.raises(ValueError, match="eps"):
        dq.DynamiQ(small_input=0, eps=(0.2, 0.2, 1.5))
    with pytest.raises(ValueError, match="smallest achievable budget 3.25"):
        dq.DynamiQ(small_input=0, bits=3, hierarchical=False)


def test_bad_input_in_simulation():
    xs = rank_inputs(fresh_seed(), 2, 300)
    with pytest.raises(dq.InputMismatchError, match="disagree on length"):
        dq.simulate_allreduce([xs[0], xs[1][:299]])
    with pytest.raises(dq.InvalidInputError, match="unsupported dtype int32"):
        dq.simulate_allreduce([xs[0], xs[1].astype(np.int32)])
    with pytest.raises(dq.InputMismatchError, match="disagree on dtype"):
        dq.simulate_allreduce([xs[0], xs[1].astype(np.float64)])
    with pytest.raises(dq.InvalidInputError, match="op must be one of"):
        dq.simulate_allreduce(xs, op="max")
    with pytest.raises(dq.InvalidInputError, match="unsupported array type list"):
        dq.simulate_allreduce([list(xs[0]), xs[1]])
    with pytest.raises(dq.InvalidInputError, match="codec must be"):
        dq.simulate_allreduce(xs, codec="dynamiq")


@pytest.mark.parametrize("switch", ["uniform", "hierarchical", "correlated", "centring",
                                    "zero_class", "variable_width"])
def test_every_switch_runs_and_stays_identical(switch):
    default = dq.DynamiQ(small_input=0, bits=5)
    flipped = dq.DynamiQ(small_input=0, bits=5, **{switch: not getattr(default, switch)})
    xs = rank_inputs(fresh_seed(), 3, 256 * 64 + 5)
    for x in xs:
        x[:512] = 0
    outs, reps = dq.simulate_allreduce(xs, codec=flipped, return_reports=True)
    assert len({digest(o) for o in outs}) == 1
    assert reps[0].bits_per_coord <= 5.0
    assert vnmse(outs[0], exact_sum(xs)) < 0.2


def test_mean_op_and_bf16_output():
    xs = rank_inputs(fresh_seed(), 4, 1000, dtype=BF16)
    outs = dq.simulate_allreduce(xs, codec=dq.Exact(), op="mean")
    assert outs[0].dtype == BF16
    np.testing.assert_allclose(outs[0].astype(np.float64), exact_sum(xs) / 4, rtol=1e-2,
                               atol=1e-6)


def test_large_world_in_simulation():
    xs = rank_inputs(fresh_seed(), 64, 256 * 32, kind="normal")
    errs = {}
    for topo in ("ring", "butterfly"):
        outs = dq.simulate_allreduce(xs, codec=dq.DynamiQ(small_input=0, bits=9), topology=topo)
        assert len({digest(o) for o in outs}) == 1
        errs[topo] = vnmse(outs[0], exact_sum(xs))
    # 64 quantizations per coordinate on the ring, 7 on the butterfly
    assert errs["butterfly"] < errs["ring"] / 3 < 0.01 / 3, errs


def test_auto_lanes_rule():
    """lanes="auto": 4 lanes of >= 4 MiB slices only where NCCL links the ranks
    through shared memory (one host, point-to-point disabled, shared memory
    not); one lane on NVLink, sockets and between hosts."""
    from dynamiq_mpi.transports.nccl import (MIN_LANE_BYTES, SHM_LANE_BYTES, SHM_LANES,
                                             auto_lanes, link_record)

    def rec(host="a", p2p=False, shm=False):
        return {"host": host, "p2p_disabled": p2p, "shm_disabled": shm}

    assert auto_lanes([rec(p2p=True), rec(p2p=True)])[:2] == (SHM_LANES, SHM_LANE_BYTES)
    assert "shared-memory" in auto_lanes([rec(p2p=True)] * 3)[2]
    for records in ([rec(), rec()],                                   # NVLink / default
                    [rec(p2p=True, shm=True)] * 2,                     # sockets
                    [rec(p2p=True), rec(p2p=True, shm=True)],          # ranks disagree
                    [rec(p2p=True), rec(p2p=False)],
                    [rec("a", p2p=True), rec("b", p2p=True)],          # two hosts
                    [rec(p2p=True)]):                                  # one rank
        assert auto_lanes(records) == (1, MIN_LANE_BYTES, "1 lane"), records
    # the environment's spellings
    assert link_record({"NCCL_P2P_DISABLE": "1"})["p2p_disabled"]
    assert not link_record({"NCCL_P2P_DISABLE": "0"})["p2p_disabled"]
    assert not link_record({})["shm_disabled"]
    assert link_record({"NCCL_SHM_DISABLE": "yes"})["shm_disabled"]


@pytest.mark.parametrize("bad", [0, -2, "two", 1.5j])
def test_bad_lanes_are_refused(bad):
    with pytest.raises(ValueError, match="lanes"):
        dq.Collective(MPI.COMM_SELF, lanes=bad)


def test_lanes_default_from_environment(monkeypatch):
    monkeypatch.setenv("DYNAMIQ_NCCL_LANES", "3")
    assert dq.Collective(MPI.COMM_SELF).lanes == 3
    monkeypatch.delenv("DYNAMIQ_NCCL_LANES")
    assert dq.Collective(MPI.COMM_SELF).lanes == "auto"
    assert dq.Collective(MPI.COMM_SELF, lanes="2").lanes == 2
    monkeypatch.setenv("DYNAMIQ_NCCL_LANE_BYTES", "4096")
    assert dq.Collective(MPI.COMM_SELF).lane_bytes == 4096
    for bad in ("0", "-5", "4M", ""):
        monkeypatch.setenv("DYNAMIQ_NCCL_LANE_BYTES", bad)
        with pytest.raises(ValueError, match="DYNAMIQ_NCCL_LANE_BYTES"):
            dq.Collective(MPI.COMM_SELF)


def test_ranks_sharing_a_gpu_are_named_and_distinct_gpus_pass():
    """NCCL refuses two ranks on one GPU: the collective stages through MPI
    instead (transport='auto') or raises (transport='nccl'), from this list."""
    from dynamiq_mpi.transports.nccl import describe_sharing
    assert describe_sharing([("a", "0000:01"), ("a", "0000:02"), ("b", "0000:01")]) == ""
    assert describe_sharing([("a", "0000:01"), ("a", "0000:01"), ("b", "0000:01"),
                             ("a", "0000:02"), ("b", "0000:01")]) == (
        "ranks [0, 1] share GPU 0000:01 on a; ranks [2, 4] share GPU 0000:01 on b")


def test_device_routes_reach_their_transports(monkeypatch):
    """The planner's transport (call/planner.py) and the runtime's device
    routes (call/runtime.py), on the CPU: NCCL chosen for ranks that share a
    GPU stages through host memory under "auto" and is an error when asked
    by name; CUDA-aware MPI needs the MPI plane.  (Their import paths run
    here; the routes themselves run on the GPU.)"""
    from types import SimpleNamespace

    from dynamiq_mpi.transports import nccl
    coll = dq.Collective(MPI.COMM_SELF)
    rt, planner = coll._runtime, coll._runner.planner
    monkeypatch.setattr(nccl, "ranks_sharing_a_gpu", lambda plane, dev: "ranks [0, 1] share GPU 0")
    x = SimpleNamespace(device=SimpleNamespace(id=0))
    metas = [{"backend": "gpu", "can": {"nccl": True, "mpi_cuda": False}}]
    name, why = planner.transport("auto", metas, x, explain=True)
    assert name == "mpi" and "staged through host memory" in why
    assert rt.route(name, x) is rt.host
    planner.gpu_sharing.clear()
    with pytest.raises(dq.InvalidInputError, match="NCCL needs one GPU per rank"):
        planner.transport("nccl", metas, x)
    assert rt.route("mpi", x) is rt.host
    rt.plane.mpi_comm, comm = None, rt.plane.mpi_comm
    with pytest.raises(dq.InvalidInputError, match="needs the MPI control plane"):
        rt.route("mpi-cuda", x)
    rt.plane.mpi_comm = comm
    coll.free()


def test_the_planner_resolves_the_path_the_engine_runs(monkeypatch):
    """A native path asked for is resolved once the transport is known
    (call/planner.py): the transport's own all-reduce with its wire dtype,
    or the compressed program and the reason where that transport has none
    for the call's arrays (host-staged device arrays, CUDA-aware MPI)."""
    from types import SimpleNamespace

    from dynamiq_mpi.call.planner import resolve_path
    from dynamiq_mpi.transports import nccl
    from dynamiq_mpi.transports.ops import Route, Routed

    def asks(path, backend, dtype="float32", codec=dq.DynamiQ()):
        return Route("auto", path, codec, backend, dtype)
    assert resolve_path("mpi", asks("native", "cpu")) == Routed("mpi", "native", "float32")
    assert resolve_path("mpi", asks("native", "cpu", "float64")).wire == "float64"
    assert resolve_path("nccl", asks("native", "gpu")) == Routed("nccl", "native", "bfloat16")
    assert resolve_path("nccl", asks("native", "gpu", codec=dq.Exact())).wire == "float32"
    assert resolve_path("mpi-cuda", asks("native", "gpu")) == Routed(
        "mpi-cuda", "compressed", "", "no native all-reduce on mpi-cuda for gpu arrays")
    assert resolve_path("mpi", asks("compressed", "cpu")) == Routed("mpi")
    coll = dq.Collective(MPI.COMM_SELF)
    monkeypatch.setattr(nccl, "ranks_sharing_a_gpu", lambda plane, dev: "ranks [0, 1] share GPU 0")
    x = SimpleNamespace(device=SimpleNamespace(id=0))
    metas = [{"backend": "gpu", "can": {"nccl": True, "mpi_cuda": False}}]
    routed, why = coll._runner.planner.route(asks("native", "gpu"), metas, x, explain=True)
    assert routed == Routed("mpi", reason="no native all-reduce on mpi for gpu arrays")
    assert "staged through host memory" in why
    coll.free()


def test_ranks_asking_different_reduce_scatter_budgets_raise_on_every_rank():
    """The block budget ("per-chunk" or "global") is in the agreement: ranks
    that differ raise before any payload moves, instead of exchanging
    messages of different sizes."""
    from dynamiq_mpi.call.engine_rs import rank_program_rs
    from dynamiq_mpi.call.phases import CallSpec
    from dynamiq_mpi.call.workspace import FRESH
    from dynamiq_mpi.transports.simulate import SimulatedTransport
    n, m = 2, 256 * 40
    xs = rank_inputs(fresh_seed(), n, n * m)
    spec = CallSpec(dq.DynamiQ(small_input=0), "ring", "sum", 0, 0, "auto", 1 << 16)
    programs = [rank_program_rs(r, n, xs[r], spec, None, FRESH, False, budget)
                for r, budget in enumerate(("per-chunk", "global"))]
    with pytest.raises(dq.InputMismatchError, match="budget"):
        SimulatedTransport(n).run(programs)


def test_a_graphs_handles_are_destroyed_once_executables_first_on_their_device():
    """call/graphs.py's handles (what a CallGraph's finalizer destroys, on
    whatever thread collects it): executables, then the graph, on the
    graph's device, the caller's device restored; a second destroy does
    nothing.  (A fake CUDA runtime: the real one is tested on GPUs.)"""
    from dynamiq_mpi.call.graphs import _GraphHandles

    class Runtime:
        def __init__(self, device):
            self.device, self.calls = device, []

        def getDevice(self):
            return self.device

        def setDevice(self, d):
            self.calls.append(("set", d))
            self.device = d

        def graphExecDestroy(self, e):
            self.calls.append(("exec", e))

        def graphDestroy(self, g):
            self.calls.append(("graph", g))

    handles = _GraphHandles(1)
    handles.graph, handles.execs = 7, [3, 4]
    rt = Runtime(0)
    handles.destroy(rt)
    assert rt.calls == [("set", 1), ("exec", 3), ("exec", 4), ("graph", 7), ("set", 0)]
    handles.destroy(rt)
    assert len(rt.calls) == 5 and rt.device == 0
    same = _GraphHandles(2)
    same.graph, same.execs = 9, [5]
    rt = Runtime(2)
    same.destroy(rt)
    assert rt.calls == [("exec", 5), ("graph", 9)]       # no device switch
