"""The planner's path="auto" measurement where steady compressed calls replay
as CUDA graphs (call/planner.py), driven on the CPU: a stand-in for device
arrays, the runner's part played by the test (engine calls report, graph
calls replay), one rank.  What must hold on every rank alike: the class's
compressed calls after the first are graph replays and are timed, every
timed call counts, a class that decides native frees the graphs it
captured, one that decides compressed keeps replaying them untimed, and
only device classes over NCCL take the extra untimed call.  (On GPUs, the
same with real captures: tests/mpi/test_graphs_gpu_mpi.py.)
"""
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

import dynamiq_mpi as dq
from dynamiq_mpi.call import planner as planner_mod
from dynamiq_mpi.call.paths import measuring_calls
from dynamiq_mpi.call.planner import CallPlanner


class DeviceLike(np.ndarray):
    """Taken for a device array by its module's name."""


DeviceLike.__module__ = "cupy._stand_in"


@pytest.fixture
def device_calls(monkeypatch):
    from dynamiq_mpi.transports import nccl
    monkeypatch.setattr(nccl, "nccl_status", lambda: (True, ""))
    monkeypatch.setattr(planner_mod, "call_graph_key",
                        lambda x, out, call, collective="allreduce": ("graph", id(x), id(out)))


def call_args(counter, transport="auto"):
    return dict(path="auto", codec=dq.DynamiQ(small_input=0), topology="ring", op="sum",
                seed=0, transport=transport, tile_bytes=None, nonfinite="propagate",
                counter=counter)


def run(planner, x, out, counter, seconds, transport="auto"):
    """One call as the runner carries it out: (route, path, timed); the
    engine's calls report and are remembered, as the runner's are."""
    plan = planner.plan_allreduce(x, out, call_args(counter, transport), "flat", False, False)
    if plan.route == "graph":
        if plan.timed:
            planner.record_replay(plan, seconds[plan.path])
        return plan.route, "compressed", plan.timed
    report = SimpleNamespace(path=plan.path, path_reason="", nonfinite=False, sync_free=True,
                             transport="nccl", codec_info={"wire": "bfloat16"}, bits_per_coord=5.0)
    if plan.timed:
        planner.record_path(plan, seconds[plan.path], report)
    planner.remember(plan, report, {"counter": counter, "length": x.size}, None, None)
    return plan.route, plan.path, plan.timed


@pytest.mark.parametrize("winner", ["compressed", "native"])
def test_a_measuring_class_times_replays_and_frees_its_graphs_when_native_wins(device_calls,
                                                                             winner):
    planner = CallPlanner(MPI.COMM_SELF, 2, graphs=True)
    x = np.zeros(1 << 12, dtype=np.float32).view(DeviceLike)
    out = np.zeros_like(x)
    seconds = {"compressed": 1.0 if winner == "compressed" else 3.0, "native": 2.0}
    measuring = measuring_calls(True)
    seen = [run(planner, x, out, i, seconds) for i in range(measuring + 2)]
    want = [("engine", "compressed", True), ("engine", "native", True)]
    want += [("graph", "compressed", True), ("engine", "native", True)] * (measuring // 2 - 1)
    want += ([("graph", "compressed", False)] * 2 if winner == "compressed"
             else [("engine", "native", False), ("steady", "native", False)])
    assert seen == want
    (path, why), = planner.path_decisions().values()
    assert path == winner and "measured compressed" in why
    entries = list(planner.graphs.values())
    if winner == "compressed":
        assert len(entries) == 1 and entries[0].measuring is None
    else:
        assert entries == []            # freed at the decision


def test_only_device_classes_over_nccl_take_the_extra_untimed_call(device_calls):
    planner = CallPlanner(MPI.COMM_SELF, 2, graphs=True)
    seconds = {"compressed": 1.0, "native": 2.0}
    host = np.zeros(1 << 12, dtype=np.float32)
    device = np.zeros(1 << 12, dtype=np.float32).view(DeviceLike)
    for x, transport, calls in ((host, "auto", measuring_calls(False)),
                                (device, "nccl", measuring_calls(True))):
        out = np.zeros_like(x)
        timed = [run(planner, x, out, i, seconds, transport)[2] for i in range(calls + 1)]
        assert timed == [True] * calls + [False], (type(x).__name__, transport)
    off = CallPlanner(MPI.COMM_SELF, 2, graphs=False)
    x = np.zeros(1 << 12, dtype=np.float32).view(DeviceLike)
    calls = measuring_calls(False)
    timed = [run(off, x, np.zeros_like(x), i, seconds)[2] for i in range(calls + 1)]
    assert timed == [True] * calls + [False]


def test_inputs_the_codec_sends_as_bf16_go_native_unmeasured_on_device(device_calls):
    planner = CallPlanner(MPI.COMM_SELF, 2, graphs=True)
    for x, want in ((np.zeros(1 << 12, dtype=np.float32).view(DeviceLike), "native"),
                    (np.zeros(1 << 12, dtype=np.float32), None)):     # host: measured
        call = dict(call_args(0), codec=dq.DynamiQ())    # small_input 2^21: BF16 below
        plan = planner.plan_allreduce(x, np.zeros_like(x), call, "flat", False, False)
        if want is None:
            assert plan.timed
        else:
            assert (plan.path, plan.timed) == (want, False) and "same bytes" in plan.why


def test_steady_keys_follow_the_codecs_signature_through_pickling():
    """A codec carried across processes (a pickled hook state) keys by its
    signature: never another codec's steady plan."""
    import pickle
    from dynamiq_mpi.call.native import steady_key
    x = np.zeros(1 << 10, dtype=np.float32)
    keys = [steady_key(x, None, dict(call_args(0), codec=c)) for c in
            (dq.Exact(), pickle.loads(pickle.dumps(dq.DynamiQ(bits=6))), dq.DynamiQ(bits=6),
             pickle.loads(pickle.dumps(dq.Exact())))]
    assert keys[0] != keys[1] and keys[1] == keys[2] and keys[3] == keys[0]
