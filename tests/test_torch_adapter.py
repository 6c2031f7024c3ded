"""The torch adapter in one process (world size 1) and the pure helpers of
mpi_examples/train_lm.py.  Skipped where torch is not installed, except the
check that the package itself never imports torch."""
import math
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from helpers import load_example  # noqa: E402


def test_importing_the_package_does_not_import_torch():
    code = ("import sys, dynamiq_mpi; "
            "sys.exit(1 if 'torch' in sys.modules or 'transformers' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


torch = pytest.importorskip("torch", exc_type=ImportError)   # missing or unusable

import dynamiq_mpi as dq  # noqa: E402
import dynamiq_mpi.torch as dqt  # noqa: E402


class FakeBucket:
    """What ddp_comm_hook uses of torch.distributed.GradBucket."""

    def __init__(self, buffer, last=True):
        self._buffer, self._last = buffer, last

    def buffer(self):
        return self._buffer

    def is_last(self):
        return self._last

    def index(self):
        return 0


def _t(n, dtype=torch.float32, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(n)).to(dtype)


# --------------------------------------------------------------------- arrays
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64],
                         ids=str)
def test_tensor_as_array_is_a_zero_copy_view(dtype):
    t = _t(1000, dtype)
    a = dqt.tensor_as_array(t)
    assert a.__array_interface__["data"][0] == t.data_ptr()
    assert a.shape == (1000,) and a.dtype.itemsize == t.element_size()
    assert np.array_equal(np.asarray(a, dtype=np.float64), t.double().numpy())
    a[7] = 3.0                                   # writes land in the tensor
    assert float(t[7]) == 3.0
    if dtype == torch.bfloat16:
        assert str(a.dtype) == "bfloat16"
        assert np.array_equal(a.view(np.int16), t.view(torch.int16).numpy())


def test_tensor_as_array_refuses_non_contiguous():
    with pytest.raises(ValueError, match="contiguous"):
        dqt.tensor_as_array(torch.zeros(4, 6).t())


# --------------------------------------------------------------------- state
def test_state_pickles_configuration_and_counter_but_no_comm():
    state = dqt.HookState(codec=dq.DynamiQ(bits=4), seed=7, topology="butterfly")
    state.counter = 41
    state.iteration = 3
    blob = pickle.dumps(state)
    assert b"mpi4py" not in blob
    back = pickle.loads(blob)
    assert back.codec == dq.DynamiQ(bits=4)
    assert (back.seed, back.topology, back.transport) == (7, "butterfly", "auto")
    assert (back.counter, back.iteration) == (41, 3)
    assert back._comm is None and back._collective is None and back.last_report is None


@pytest.mark.parametrize("make", [dqt.HookState, dqt.ReduceScatter], ids=lambda m: m.__name__)
def test_collective_options_reach_the_collective_and_the_pickle(make):
    given = dict(hierarchy="nodes", node_size=1, links="intra=400GB/s,inter=25GB/s,nics=8",
                 rail_budget="even", graphs=False, lanes=2)
    state = make(**given)
    assert state.collective_options() == given
    back = pickle.loads(pickle.dumps(state))
    assert back.collective_options() == given
    coll = back.collective
    assert (coll.hierarchy, coll.node_size, coll.rail_budget, coll.graphs, coll.lanes) == \
        ("nodes", 1, "even", False, 2)
    assert coll.links == (400e9, 25e9, 8)
    assert make().collective_options() == {}     # the collective's defaults


@pytest.mark.parametrize("bad, error", [
    (dict(hierarchy="rings"), "hierarchy must be one of"),
    (dict(node_size=0), "node_size must be a positive integer"),
    (dict(links="fast"), "links 'fast'"),
    (dict(rail_budget="half"), "rail_budget must be one of"),
    (dict(lanes=0), "lanes must be a positive integer or 'auto'"),
    (dict(lanes="many"), "lanes must be a positive integer or 'auto'"),
    (dict(graphs="yes"), "graphs must be True or False")])
def test_collective_options_are_checked_when_the_state_is_made(bad, error):
    for make in (dqt.HookState, dqt.ReduceScatter):
        with pytest.raises((ValueError, TypeError), match=error):
            make(**bad)


def test_state_of_an_earlier_version_unpickles_with_the_collectives_defaults():
    state = dqt.HookState()
    old = state.__getstate__()
    for name in ("hierarchy", "node_size", "links", "rail_budget", "graphs", "lanes"):
        del old[name]
    back = dqt.HookState.__new__(dqt.HookState)
    back.__setstate__(old)
    assert back.collective_options() == {}


def test_state_counter_follows_calls_and_survives_reattach():
    from mpi4py import MPI
    state = dqt.HookState(codec=dq.Exact())
    x = _t(300)
    state.allreduce_(x)
    state.allreduce_(x)
    assert state.counter == 2 and state.comm is MPI.COMM_WORLD
    state.comm = MPI.COMM_SELF                   # a new collective, same counter
    assert state.counter == 2
    state.allreduce_(x)
    assert state.counter == 3
    assert pickle.loads(pickle.dumps(state)).counter == 3


def test_hook_writes_the_mean_into_the_bucket_and_returns_a_done_future():
    x = _t(3000)
    before = x.clone()
    state = dqt.HookState(codec=dq.Exact())
    fut = dqt.ddp_comm_hook(state, FakeBucket(x, last=True))
    assert fut.done() and fut.value() is x       # the bucket itself, no copy
    assert torch.equal(x, before)                # one rank: the mean is the input
    assert state.iteration == 1 and state.last_report is not None
    dqt.ddp_comm_hook(state, FakeBucket(x, last=False))
    assert state.iteration == 1                  # advances on the last bucket only


def test_hook_dynamiq_single_rank_error_is_measured():
    x = _t(1 << 14, seed=3)
    before = x.clone().double()
    state = dqt.HookState(codec=dq.DynamiQ(bits=5))
    state.measure_error = True
    state.timing = True
    dqt.ddp_comm_hook(state, FakeBucket(x))
    stats = state.pop_stats()
    expect = float(((x.double() - before) ** 2).sum() / (before ** 2).sum())
    assert stats["calls"] == 1 and stats["coords"] == x.numel()
    assert stats["vnmse"] == pytest.approx(expect, rel=1e-12)
    assert 0 <= stats["vnmse"] < 0.05             # one rank may send nothing: exact
    assert stats["comm_s"] > 0
    assert state.pop_stats()["calls"] == 0       # popped


# --------------------------------------------------------------------- plain loops
def test_allreduce_gradients_buckets_by_dtype_and_cap():
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dt)) for n, dt in
              [(1000, torch.float32), (10, torch.bfloat16), (2000, torch.float32),
               (500, torch.float32), (20, torch.bfloat16), (30, torch.float32)]]
    for i, p in enumerate(params):
        p.grad = _t(p.numel(), p.dtype, seed=i)
    params[3].grad = None
    expected = [p.grad.clone() if p.grad is not None else None for p in params]
    state = dqt.HookState(codec=dq.Exact())
    # float32: 1000 | 2000 | 30 at a cap of 8 KB (a tensor above the cap is a
    # bucket of its own); bfloat16: one bucket
    n = dqt.allreduce_gradients(params, state, bucket_cap_mb=8000 / 2 ** 20)
    assert n == 4 and state.counter == 4
    for p, e in zip(params, expected):
        assert (p.grad is None) if e is None else torch.equal(p.grad, e)


def test_allreduce_gradients_refuses_sparse():
    p = torch.nn.Parameter(torch.zeros(5))
    p.grad = torch.zeros(5).to_sparse()
    with pytest.raises(TypeError, match="sparse"):
        dqt.allreduce_gradients([p], dqt.HookState())


def test_ddp_with_the_hook_at_world_size_one():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    if dist.is_initialized():
        pytest.skip("torch.distributed already initialised in this process")
    dqt.init_process_group_from_mpi("gloo")
    try:
        torch.manual_seed(0)
        ref = torch.nn.Linear(8, 3)
        ddp = DDP(torch.nn.Linear(8, 3))
        ddp.module.load_state_dict(ref.state_dict())
        state = dqt.HookState(codec=dq.Exact())
        ddp.register_comm_hook(state, dqt.ddp_comm_hook)
        x = torch.randn(5, 8)
        ddp(x).square().sum().backward()
        ref(x).square().sum().backward()
        for a, b in zip(ddp.parameters(), ref.parameters()):
            assert torch.equal(a.grad, b.grad)
        assert state.iteration == 1
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------- train_lm helpers
@pytest.fixture(scope="module")
def train_lm():
    return load_example("train_lm")


def test_corpus_is_fixed_and_split_by_file(train_lm):
    files = train_lm.CORPUS_FILES
    assert files == sorted(set(files)) and len(files) > 200
    train, val, info = train_lm.load_corpus()
    assert info["missing"] == [], "a listed stdlib file is missing on this Python"
    assert info["files_val"] == len(files) // 10
    assert info["files_train"] + info["files_val"] == len(files)
    assert len(train) > 5 * 10 ** 6 and len(val) > 3 * 10 ** 5
    assert train_lm.load_corpus()[2]["sha256"] == info["sha256"]


def test_resolve_codec(train_lm):
    assert train_lm.resolve_codec("fp32") == "fp32"
    assert train_lm.resolve_codec("bf16") == "bf16"
    assert train_lm.resolve_codec("dynamiq:4") == dq.DynamiQ(bits=4)
    assert train_lm.resolve_codec("exact") == dq.Exact()
    assert train_lm.resolve_codec("dynamiq:5:small_input=0") == dq.DynamiQ(bits=5, small_input=0)
    assert train_lm.resolve_codec("dq-bf16") == dq.BF16()
    for bad, msg in [("nope", "unknown codec"), ("exact:3", "too many"),
                     ("dynamiq:5:colour=2", "colour")]:
        with pytest.raises((ValueError, TypeError), match=msg):
            train_lm.resolve_codec(bad)


def test_batches_depend_on_seed_and_step_only(train_lm):
    args = train_lm.parse_args(["--tiny", "--seed", "5"])
    data = torch.arange(10000) % 251
    a = train_lm.batch_for(3, 0, 2, data.to(torch.uint8), args, torch)
    b = train_lm.batch_for(3, 1, 2, data.to(torch.uint8), args, torch)
    assert a.shape == (args.batch, args.seq_len + 1)
    assert torch.equal(a, train_lm.batch_for(3, 0, 2, data.to(torch.uint8), args, torch))
    assert not torch.equal(a, b)                 # ranks get different windows
    # rank r's share of a 2-rank batch is a slice of the same global batch
    one = dict(vars(args), batch=2 * args.batch)
    whole = train_lm.batch_for(3, 0, 1, data.to(torch.uint8), type(args)(**one), torch)
    assert torch.equal(torch.cat([a, b]), whole)


def test_lr_schedule(train_lm):
    args = train_lm.parse_args(["--steps", "100", "--warmup", "10", "--lr", "1.0"])
    lrs = [train_lm.lr_at(s, args) for s in range(100)]
    assert lrs[9] == pytest.approx(1.0) and lrs[0] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(0.1, abs=0.01) and math.isfinite(sum(lrs))


def test_plot_runs(train_lm, tmp_path):
    pytest.importorskip("matplotlib")
    run = {"config": {"codec": "bf16", "seed": 0, "n_params": 1e6, "world_size": 2,
                      "device": "cpu"},
           "steps": [{"step": i, "loss": 5.0 - 0.01 * i} for i in range(100)],
           "evals": [{"step": 50, "val_loss": 4.6}, {"step": 100, "val_loss": 4.1}]}
    import json
    path = tmp_path / "runs.json"
    path.write_text(json.dumps({"runs": [run, dict(run, config=dict(run["config"], seed=1))]}))
    train_lm.plot_runs([str(path), run], str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").stat().st_size > 1000


def test_fused_groups_are_the_hooks_calls():
    """dqt's fused_groups (the study tools' view of the rule) makes the groups
    the hook makes: one compressed call per group, the same count."""
    from dynamiq_mpi.torch.ddp_buckets import fused_groups
    sizes = [3000, 5000, 1000, 20000, 700, 700, 9000, 100]
    state = dqt.HookState(codec=dq.Exact(), path="compressed", fuse_mb=8000 * 4 / 2 ** 20)
    futures = [dqt.ddp_comm_hook(state, FakeBucket(_t(n, seed=i), last=i == len(sizes) - 1))
               for i, n in enumerate(sizes)]
    assert all(f.done() for f in futures)
    assert state.counter == len(fused_groups(sizes, 8000)) == 6


def test_premul_sum_factor_read_where_torch_shows_it_only_to_pickling():
    """FSDP's PREMUL_SUM(f): the factor comes from ``op.factor`` or, where a
    torch build lacks that attribute, from the op's pickled state; an op that
    gives neither is refused rather than summed unscaled."""
    import torch.distributed as dist
    from dynamiq_mpi.torch.fsdp import _op_of

    class PicklingOnly:
        op = dist.ReduceOp.PREMUL_SUM

        def __getstate__(self):
            return (dist.ReduceOp.PREMUL_SUM, 0.125)

    class Bare:
        op = dist.ReduceOp.PREMUL_SUM

        def __getstate__(self):
            return None

    factor = float(np.random.default_rng().uniform(0.01, 1.0))
    assert _op_of(dist._make_nccl_premul_sum(factor)) == ("sum", factor)
    assert _op_of(PicklingOnly()) == ("sum", 0.125)
    assert _op_of(dist.ReduceOp.AVG) == ("mean", None)
    with pytest.raises(NotImplementedError, match="PREMUL_SUM op without its factor"):
        _op_of(Bare())
