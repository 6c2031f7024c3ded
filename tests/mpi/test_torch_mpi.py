"""The torch adapter under mpiexec (CPU, gloo): DDP with our hook against plain
DDP and a float64 oracle, ranks staying identical, the bucket rebuild, state
pickling, errors raised on every rank, the plain-loop all-reduce, and a few
steps of mpi_examples/train_lm.py run inside this MPI job.

Run: mpiexec -n 2 python -m pytest --with-mpi --only-mpi tests/mpi/test_torch_mpi.py
"""
import json
import os
import pickle
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

comm = MPI.COMM_WORLD
N = comm.size
MAX_WORLD = 3
if N > MAX_WORLD:
    # Importing torch (and the torch._dynamo that DDP pulls in) on 4+ ranks
    # sharing CI's 2 cores costs 15 s and more; sizes 2 and 3 cover the logic.
    pytest.skip(f"torch adapter tests run at world sizes 2..{MAX_WORLD}",
                allow_module_level=True)

torch = pytest.importorskip("torch", exc_type=ImportError)   # missing or unusable
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import dynamiq_mpi as dq  # noqa: E402
import dynamiq_mpi.torch as dqt  # noqa: E402

from helpers import gloo_process_group, load_example, shared_seed  # noqa: E402

# The same at every world size above 4: not run again at 6 and 8 ranks (CI time).
pytestmark = pytest.mark.max_size(4)
LAST = N - 1


def dynamiq5():
    # small_input=0: compress even the small buckets of these test models
    # (by default the core sends inputs below 64Ki elements as BF16).
    return dq.DynamiQ(bits=5, small_input=0)


@pytest.fixture(scope="module", autouse=True)
def process_group():
    with gloo_process_group():
        assert dist.get_world_size() == N and dist.get_rank() == comm.rank
        yield


class Net(nn.Module):
    """Layers declared in an order different from their use, so DDP's bucket
    rebuild after the first iteration (gradient-ready order) changes the
    buckets."""

    def __init__(self, width=48):
        super().__init__()
        self.out = nn.Linear(width, 8)
        self.inp = nn.Linear(16, width)
        self.mid = nn.Linear(width, width)

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def make_net(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return Net().to(dtype)


def batch(step, rank=None, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1000 * step + (comm.rank if rank is None else rank))
    return torch.randn(32, 16, generator=gen).to(dtype), torch.randn(32, 8, generator=gen)


def loss_of(model, x, y):
    return (model(x).float() - y).square().mean()


def oracle_mean(tensors):
    """float64 mean over the ranks of each tensor, and of its |values|."""
    local = [t.detach().double().numpy().ravel() for t in tensors]
    every = comm.allgather(local)
    mean = [np.mean([e[i] for e in every], axis=0) for i in range(len(local))]
    mabs = [np.mean([np.abs(e[i]) for e in every], axis=0) for i in range(len(local))]
    return mean, mabs


def assert_same_on_every_rank(tensors, what):
    blob = b"".join(t.detach().contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)
    blobs = comm.allgather(blob)
    assert all(b == blobs[0] for b in blobs), f"{what} differ between ranks"


# ULP of the result's dtype, and the hook's dtypes (float16 needs it in the core)
EPS = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
DTYPES = [torch.float32, torch.bfloat16,
          pytest.param(torch.float16, id="float16 (core: float16 input)")]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_exact_codec_hook_matches_ddp(dtype):
    """With dq.Exact() the hook's averaged gradients equal plain DDP's and the
    float64 mean of the ranks' gradients, to rounding of the dtype."""
    x, y = batch(0, dtype=dtype)
    plain = DDP(make_net(dtype))
    loss_of(plain, x, y).backward()
    hooked = DDP(make_net(dtype), bucket_cap_mb=0.004)
    state = dqt.HookState(codec=dq.Exact())
    hooked.register_comm_hook(state, dqt.ddp_comm_hook)
    loss_of(hooked, x, y).backward()
    local = make_net(dtype)                       # this rank's own, unreduced gradients
    loss_of(local, x, y).backward()

    mean, mabs = oracle_mean([p.grad for p in local.parameters()])
    tol_scale = 4 * N * EPS[dtype]
    for p_h, p_d, m, a, (name, _) in zip(hooked.parameters(), plain.parameters(), mean, mabs,
                                         local.named_parameters()):
        for got, who in ((p_h.grad, "hook"), (p_d.grad, "plain DDP")):
            err = np.abs(got.double().numpy().ravel() - m)
            bound = tol_scale * a + 1e-30
            assert np.all(err <= bound), (f"{who}: {name} off the float64 mean by "
                                          f"{np.max(err / bound):.2f}x the bound")
    assert state.pop_stats()["calls"] >= 1
    assert_same_on_every_rank([p.grad for p in hooked.parameters()], "gradients")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fuse_mb", [0, 1.0], ids=["bucket-alone", "fused"])
def test_dynamiq_training_keeps_ranks_identical_and_survives_rebuild(fuse_mb):
    """Several SGD steps with DynamiQ(bits=5): parameters are bit-identical
    on every rank after every step, including across DDP's bucket rebuild
    (checked to have happened); the error against an exact all-reduce is
    small.  One compressed call a bucket with ``fuse_mb=0``; one a step when
    the step's buckets fit in ``fuse_mb``."""
    model = DDP(make_net(), bucket_cap_mb=0.004)
    state = dqt.HookState(codec=dynamiq5(), seed=3, fuse_mb=fuse_mb)
    layouts = {}

    def recording_hook(st, bucket):
        layouts.setdefault(st.iteration, []).append(bucket.buffer().numel())
        return dqt.ddp_comm_hook(st, bucket)

    model.register_comm_hook(state, recording_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(4):
        state.measure_error = step == 3
        x, y = batch(step)
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
        assert_same_on_every_rank(list(model.parameters()), f"parameters after step {step}")
    stats = state.pop_stats()
    assert state.iteration == 4
    assert layouts[0] != layouts[1], f"no bucket rebuild happened: {layouts}"
    assert layouts[1] == layouts[2] == layouts[3]
    calls = sum(len(v) for v in layouts.values()) if fuse_mb == 0 else len(layouts)
    assert state.counter == calls
    buckets = sum(len(v) for v in layouts.values())
    assert stats["buckets"] == buckets and stats["paths"] == {"compressed": buckets}
    # A sanity bound only: these buckets are small and dense (measured ~0.005-0.06).
    assert 0 < stats["vnmse"] < 0.2, str(stats)
    assert state.last_report.bits_per_coord <= 5.5


@pytest.mark.mpi(min_size=2)
def test_state_pickles_without_comm_and_continues_the_generator():
    state = dqt.HookState(codec=dq.DynamiQ(bits=4, small_input=0), seed=11, topology="ring")
    x = torch.from_numpy(np.random.default_rng([5, comm.rank]).standard_normal(5000)
                         .astype(np.float32))
    for _ in range(3):
        state.allreduce_(x.clone())
    state.iteration = 7
    blob = pickle.dumps(state)
    assert b"mpi4py" not in blob                  # no communicator inside
    restored = pickle.loads(blob)
    assert restored._comm is None and restored._collective is None
    assert (restored.counter, restored.iteration, restored.seed) == (3, 7, 11)
    assert restored.codec == state.codec and restored.topology == "ring"

    # Same counter, same data -> the same random draws, bit for bit; the
    # restored state attaches to COMM_WORLD on first use.
    a = state.allreduce_(x.clone())
    b = restored.allreduce_(x.clone())
    assert torch.equal(a, b)
    assert restored.comm is MPI.COMM_WORLD
    assert state.counter == restored.counter == 4

    # Or to a communicator given explicitly, keeping the counter.
    other = pickle.loads(blob)
    dup = comm.Dup()
    try:
        other.comm = dup
        c = other.allreduce_(x.clone())
        assert torch.equal(a, c) and other.counter == 4
        # A counter re-attached mid-life carries over too.
        other.comm = comm
        assert other.counter == 4
    finally:
        dup.Free()


@pytest.mark.mpi(min_size=2)
def test_restored_state_drives_a_new_ddp():
    """A checkpointed state registered on a rebuilt DDP keeps training with
    the ranks in lockstep."""
    model = DDP(make_net(), bucket_cap_mb=0.004)
    state = dqt.HookState(codec=dynamiq5())
    model.register_comm_hook(state, dqt.ddp_comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(2):
        opt.zero_grad()
        loss_of(model, *batch(step)).backward()
        opt.step()
    ckpt = pickle.dumps({"model": model.module.state_dict(), "hook": state})
    loaded = pickle.loads(ckpt)
    net = make_net(seed=99)
    net.load_state_dict(loaded["model"])
    model2 = DDP(net, bucket_cap_mb=0.004)
    model2.register_comm_hook(loaded["hook"], dqt.ddp_comm_hook)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.05)
    for step in range(2, 4):
        opt2.zero_grad()
        loss_of(model2, *batch(step)).backward()
        opt2.step()
        assert_same_on_every_rank(list(model2.parameters()), f"parameters after step {step}")
    assert loaded["hook"].iteration == 4
    assert loaded["hook"].counter > state.counter


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("overlap", [False, True], ids=["in-hook", "overlapped"])
@pytest.mark.parametrize("small_input", [0, 1 << 16], ids=["compressed", "small-as-bf16"])
def test_nan_gradient_on_one_rank_raises_on_every_rank_when_asked(small_input, overlap):
    model = DDP(make_net(), bucket_cap_mb=0.004)
    state = dqt.HookState(codec=dq.DynamiQ(bits=5, small_input=small_input), nonfinite="raise",
                          overlap=overlap)
    model.register_comm_hook(state, dqt.ddp_comm_hook)
    x, y = batch(0)
    if comm.rank == LAST:
        x[3, 5] = float("nan")
    with pytest.raises(Exception) as info:
        loss_of(model, x, y).backward()
    messages = comm.allgather(f"{type(info.value).__name__}: {info.value}")
    assert all(m == messages[0] for m in messages), messages
    assert isinstance(info.value, dq.NonFiniteInputError), messages[0]
    assert "NaN or Inf" in messages[0]
    state.close()


def _train_steps(state, steps=4, bucket_cap_mb=0.004):
    model = DDP(make_net(), bucket_cap_mb=bucket_cap_mb)
    model.register_comm_hook(state, dqt.ddp_comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, *batch(step)).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fuse_mb", [0, 0.012], ids=["bucket-alone", "fused"])
def test_overlapped_hook_gives_the_in_hook_bits(fuse_mb):
    """The hook's worker thread (futures returned at once, buckets run in
    DDP's order) changes no bit: the same parameters as the hook running
    each call itself, the same counter, identical on every rank; with
    buckets alone or fused."""
    inline = dqt.HookState(codec=dynamiq5(), seed=5, overlap=False, path="compressed",
                           fuse_mb=fuse_mb)
    overlapped = dqt.HookState(codec=dynamiq5(), seed=5, overlap=True, path="compressed",
                               fuse_mb=fuse_mb)
    a = _train_steps(inline)
    b = _train_steps(overlapped)
    assert overlapped._workers, "the overlapped hook did not use its worker"
    assert inline.counter == overlapped.counter >= 4
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert_same_on_every_rank(b, "parameters of the overlapped hook")
    assert overlapped.pop_stats()["calls"] == inline.pop_stats()["calls"]
    overlapped.close()


@pytest.mark.mpi(min_size=2)
def test_overlapped_bucket_disagreement_is_raised_by_every_rank_future():
    """A rank whose bucket differs makes every rank's future raise the same
    InputMismatchError (no hang), and the next call works."""
    state = dqt.HookState(codec=dynamiq5(), overlap=True, path="compressed")
    buf = torch.ones(300 + (comm.rank == LAST))
    fut = state.bucket_future(buf)
    with pytest.raises(Exception) as info:
        fut.wait()
    messages = comm.allgather(str(info.value))
    assert "disagree on length" in messages[0], messages[0]
    assert all(m == messages[0] for m in messages), messages
    assert isinstance(state._workers[buf.device].take_error(), dq.InputMismatchError)
    good = torch.full((300,), float(comm.rank + 1))
    state.bucket_future(good).wait()
    torch.testing.assert_close(good, torch.full((300,), (N + 1) / 2), rtol=1e-2, atol=0)
    state.close()


def _train_with_scaler(state, steps=6, bad=(1, 3, 4)):
    """A few steps under torch.amp.GradScaler; on the steps in ``bad`` the last
    rank's batch holds an Inf, so its gradients overflow.  Returns the model,
    the scale after each step and which steps left the parameters unchanged."""
    model = DDP(make_net(), bucket_cap_mb=0.004)
    if state is not None:
        model.register_comm_hook(state, dqt.ddp_comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=1000)
    scales, skipped = [], []
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step)
        if step in bad and comm.rank == LAST:
            x[3, 5] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(loss_of(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
    return model, scales, skipped


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec", [dq.Exact(), dynamiq5(), dq.DynamiQ(bits=5)],
                         ids=["exact", "dynamiq", "dynamiq-small-as-bf16"])
def test_grad_scaler_skips_overflowing_steps_as_plain_ddp_does(codec):
    plain, scales0, skipped0 = _train_with_scaler(None)
    hooked, scales1, skipped1 = _train_with_scaler(dqt.HookState(codec=codec, path="compressed",
                                                                 overlap=True))
    assert skipped0 == [False, True, False, True, True, False], skipped0
    assert skipped1 == skipped0 and scales1 == scales0, (skipped1, scales1, scales0)
    assert scales0[-1] == 2.0 ** 12 / 8
    params = list(hooked.parameters())
    assert all(torch.isfinite(p).all() for p in params)
    assert_same_on_every_rank(params, "parameters after the overflowing steps")
    if isinstance(codec, dq.Exact):
        for a, b in zip(params, plain.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.mpi(min_size=2)
def test_hook_plain_path_is_plain_ddp():
    plain, _, _ = _train_with_scaler(None, steps=3, bad=(1,))
    state = dqt.HookState(codec=dynamiq5(), path="plain")
    hooked, _, skipped = _train_with_scaler(state, steps=3, bad=(1,))
    assert skipped == [False, True, False]
    assert state.last_report is None            # the compressed collective never ran
    for a, b in zip(hooked.parameters(), plain.parameters()):
        # DDP scales by 1/n inside its reducer, the hook divides: equal up to
        # one rounding (bit for bit at n = 2)
        if N == 2:
            assert torch.equal(a, b)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _bf16_hook(state, bucket):
    """torch's bf16_compress_hook (its name checks for NCCL: gloo carries BF16 too)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    return default_hooks.bf16_compress_hook(None, bucket)


@pytest.mark.mpi(min_size=2)
def test_hook_native_path_is_torchs_bf16_hook():
    """path="native" sends float32 buckets as BF16 through the group's own
    all-reduce: the parameters of torch's bf16_compress_hook, bit for bit,
    with 16 bits a coordinate reported and the error measured."""
    torch_model = DDP(make_net(), bucket_cap_mb=0.004)
    torch_model.register_comm_hook(None, _bf16_hook)
    state = dqt.HookState(codec=dynamiq5(), path="native")
    ours = DDP(make_net(), bucket_cap_mb=0.004)
    dqt.register_comm_hook(ours, state)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (torch_model, ours)]
    for step in range(3):
        state.measure_error = step == 2
        for m, opt in zip((torch_model, ours), opts):
            opt.zero_grad()
            loss_of(m, *batch(step)).backward()
            opt.step()
    for a, b in zip(ours.parameters(), torch_model.parameters()):
        assert torch.equal(a, b)
    stats = state.pop_stats()
    assert stats["bits_per_coord"] == 16 and set(stats["paths"]) == {"native"}
    assert 0 < stats["vnmse"] < 1e-4, stats
    assert state.last_report is None


def _auto_schedule_steps(rounds):
    return 1 + 2 * 3 * (1 + rounds)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("overlap", [False, True], ids=["in-hook", "overlapped"])
def test_hook_auto_path_measures_whole_steps_then_agrees_on_every_rank(overlap):
    """path="auto" runs each path for whole steps (the same path on every
    rank at every step, every path timed in each round), then keeps one,
    alike on every rank, and the ranks' parameters stay identical."""
    rounds = 1
    state = dqt.HookState(codec=dynamiq5(), path="auto", overlap=overlap, auto_rounds=rounds)
    model = DDP(make_net(), bucket_cap_mb=0.004)
    dqt.register_comm_hook(model, state)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    steps = _auto_schedule_steps(rounds)
    seen = []
    for step in range(steps + 2):
        opt.zero_grad()
        loss_of(model, *batch(step)).backward()
        opt.step()
        paths = state.pop_stats()["paths"]
        assert len(paths) == 1, paths           # one path a whole step
        seen.append(next(iter(paths)))
        assert state.path_decisions() == {} or step >= steps - 1
    assert seen[0] == "native" and sorted(set(seen[:steps])) == ["compressed", "native", "plain"]
    (key, (choice, why)), = state.path_decisions().items()
    assert key == "step" and choice in ("plain", "native", "compressed")
    assert "whole steps" in why and "plain" in why and "compressed" in why
    assert state.collective.path_decisions()["step"] == (choice, why)   # the planner's
    assert seen[steps:] == [choice, choice]
    assert all(other == (seen, choice, why) for other in comm.allgather((seen, choice, why)))
    assert_same_on_every_rank(list(model.parameters()), "parameters under path='auto'")
    state.close()


@pytest.mark.mpi(min_size=2)
def test_fused_groups_follow_the_bucket_sizes_and_give_the_exact_mean():
    """Compressed calls over fused buckets: with the Exact codec the
    gradients equal plain DDP's; a group starts once it holds ``fuse_mb``
    (a bucket as large runs alone), so the calls a step are a function of
    the bucket sizes alone."""
    def make():
        torch.manual_seed(7)
        return nn.Sequential(*[nn.Sequential(nn.Linear(24, 24), nn.Tanh()) for _ in range(8)],
                             nn.Linear(24, 8))
    x = torch.randn(16, 24, generator=torch.Generator().manual_seed(comm.rank))
    y = torch.randn(16, 8, generator=torch.Generator().manual_seed(100 + comm.rank))
    plain = DDP(make(), bucket_cap_mb=0.002)
    state = dqt.HookState(codec=dq.Exact(), path="compressed", fuse_mb=0.006)
    ours = DDP(make(), bucket_cap_mb=0.002)
    sizes = []

    def recording_hook(st, bucket):
        sizes.append(bucket.buffer().numel())
        return dqt.ddp_comm_hook(st, bucket)
    ours.register_comm_hook(state, recording_hook)
    for step in range(3):      # step 0: DDP's first bucket holds everything
        sizes.clear()
        before = state.counter
        for m in (plain, ours):
            m.zero_grad()
            loss_of(m, x, y).backward()
        cap = int(0.006 * 2 ** 20) // 4
        expected, open_ = 0, 0
        for n in sizes:
            if open_ and n >= cap:
                expected, open_ = expected + 1, 0
            open_ += n
            if open_ >= cap:
                expected, open_ = expected + 1, 0
        expected += open_ > 0
        assert step == 0 or 1 < expected < len(sizes), sizes
        assert state.counter - before == expected
        for a, b in zip(ours.parameters(), plain.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
    assert_same_on_every_rank([p.grad for p in ours.parameters()], "fused gradients")


def _grads(rank, shapes_dtypes, seed=0):
    """Parameters with given-shape gradients, the same shapes on every rank."""
    params = []
    for i, (shape, dtype) in enumerate(shapes_dtypes):
        p = nn.Parameter(torch.zeros(shape, dtype=dtype))
        if dtype is not None:
            g = np.random.default_rng([seed, i, rank]).standard_normal(shape)
            p.grad = torch.from_numpy(g).to(dtype)
        params.append(p)
    return params


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtypes", [
    (torch.float32, torch.bfloat16),
    pytest.param((torch.float32, torch.bfloat16, torch.float16), id="with-float16 (core)"),
], ids=str)
def test_allreduce_gradients_coalesces_into_buckets(dtypes):
    specs = []
    for dt in dtypes:
        specs += [((64, 33), dt), ((7,), dt), ((300,), dt), ((5, 2), dt)]
    params = _grads(comm.rank, specs)
    params.insert(2, nn.Parameter(torch.zeros(9)))        # no gradient: skipped
    # a non-contiguous gradient goes through the flat bucket and comes back
    params[0].grad = params[0].grad.t().contiguous().t()
    assert not params[0].grad.is_contiguous()
    before = [p.grad.clone() if p.grad is not None else None for p in params]
    state = dqt.HookState(codec=dq.Exact())
    cap_mb = 6000 / 2 ** 20                               # splits the float32 group
    n_buckets = dqt.allreduce_gradients(params, state, bucket_cap_mb=cap_mb)
    assert state.counter == n_buckets                     # one call per bucket
    assert len(dtypes) < n_buckets < len(specs)
    with_grad = [(p, b) for p, b in zip(params, before) if b is not None]
    mean, mabs = oracle_mean([b for _, b in with_grad])
    for (p, _), m, a in zip(with_grad, mean, mabs):
        err = np.abs(p.grad.double().numpy().ravel() - m)
        assert np.all(err <= 4 * N * EPS[p.grad.dtype] * a + 1e-30), p.grad.dtype
    assert params[2].grad is None
    assert_same_on_every_rank([p.grad for p, _ in with_grad], "gradients")


@pytest.mark.mpi(min_size=2)
def test_allreduce_gradients_rank_disagreement_raises_everywhere():
    specs = [((10,), torch.float32), ((20,), torch.float32)]
    params = _grads(comm.rank, specs)
    if comm.rank == LAST:
        params[1].grad = None
    with pytest.raises(dq.InputMismatchError) as info:
        dqt.allreduce_gradients(params, dqt.HookState(codec=dq.Exact()))
    messages = comm.allgather(str(info.value))
    assert all(m == messages[0] for m in messages)
    assert "disagree" in messages[0]


def _train_lm():
    return load_example("train_lm")


@pytest.mark.mpi(min_size=2)
def test_train_lm_tiny_runs_in_this_job():
    """A few steps of the training example, as part of this MPI job, for a
    compressed codec and the BF16 baseline: same data and initial loss, the
    ranks agree on the validation loss, the JSON is written."""
    if N != 2:
        pytest.skip("run at world size 2 only (transformers is slow to import on 2 cores)")
    pytest.importorskip("transformers")
    mod = _train_lm()
    folder = comm.bcast(tempfile.mkdtemp(prefix="train_lm_") if comm.rank == 0 else None)
    runs = {}
    for codec in ("dynamiq:5:small_input=0", "bf16"):
        path = os.path.join(folder, codec.replace(":", "") + ".json")
        runs[codec] = mod.main(["--tiny", "--steps", "3", "--codec", codec, "--no-progress",
                                "--probe-every", "1", "--json", path])
        s = runs[codec]["summary"]
        finals = comm.allgather(s["final_val_loss"])
        assert len(set(finals)) == 1 and np.isfinite(finals[0])
        if comm.rank == 0:
            import json
            with open(path) as f:
                saved = json.load(f)
            assert [r["step"] for r in saved["steps"]] == [0, 1, 2]
            assert saved["summary"]["final_val_loss"] == s["final_val_loss"]
            assert saved["corpus"]["files_val"] > 0 and saved["corpus"]["bytes_train"] > 10 ** 6
    # same initial model and batch: the first loss (before any communication) agrees
    assert runs["dynamiq:5:small_input=0"]["steps"][0]["loss"] == runs["bf16"]["steps"][0]["loss"]
    # the compute-only probes between steps leave training unchanged
    unprobed = mod.main(["--tiny", "--steps", "3", "--codec", "dynamiq:5:small_input=0", "--no-progress",
                         "--probe-every", "0"])
    assert [s["loss"] for s in unprobed["steps"]] == [s["loss"] for s in runs["dynamiq:5:small_input=0"]["steps"]]
    assert unprobed["evals"] == runs["dynamiq:5:small_input=0"]["evals"]
    assert len(runs["dynamiq:5:small_input=0"]["probe_ms"]) == 3 and unprobed["probe_ms"] == []
    dq_run = runs["dynamiq:5:small_input=0"]
    assert all(0 < v["vnmse"] < 0.2 for v in dq_run["vnmse"]), dq_run["vnmse"]
    assert 4 < dq_run["summary"]["bits_per_coord"] <= 5.5


@pytest.mark.mpi(min_size=2)
def test_ddp_bench_tiny_runs_in_this_job():
    """mpi_examples/ddp_bench.py on a tiny model: every mode runs, the ranks
    agree, the hook's path choice is listed, the JSON is written."""
    mod = load_example("ddp_bench")
    folder = comm.bcast(tempfile.mkdtemp(prefix="ddp_bench_") if comm.rank == 0 else None)
    path = os.path.join(folder, "ddp.json")
    rows = mod.main(["--params", "200K", "--width", "128", "--bucket-mb", "0.1", "--steps", "2",
                     "--warmup", "4", "--json", path])
    assert [r["mode"] for r in rows] == list(mod.MODES)
    assert all(r["step_ms"] > 0 and np.isfinite(r["loss"]) for r in rows)
    auto = next(r for r in rows if r["mode"] == "dynamiq")
    assert list(auto["paths"]) == ["step"] and "whole steps" in auto["paths"]["step"]
    comm.Barrier()
    with open(path) as f:
        assert json.load(f)["meta"]["ranks"] == N
    extra = mod.main(["--params", "200K", "--width", "128", "--bucket-mb", "0.1", "--steps", "1",
                      "--warmup", "2", "--modes", ",".join(mod.EXTRA_MODES)])
    assert [r["mode"] for r in extra] == list(mod.EXTRA_MODES)
    assert all(r["step_ms"] > 0 and np.isfinite(r["loss"]) for r in extra)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("overlap", [False, True], ids=["in-hook", "overlapped"])
def test_a_skipped_last_bucket_still_ends_the_step(overlap):
    """DDP(skip_all_reduce_unused_params=True) never hands over a bucket of
    unused parameters: when that is the last bucket the open fused group
    starts, and the step ends, with the backward pass (no hang)."""
    import inspect
    if "skip_all_reduce_unused_params" not in inspect.signature(DDP).parameters:
        pytest.skip("this torch's DDP has no skip_all_reduce_unused_params")

    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.unused = nn.Linear(4, 4)         # registered first: the last bucket at step 0
            self.net = make_net()

        def forward(self, x):
            return self.net(x)

    torch.manual_seed(0)
    model = DDP(Unused(), find_unused_parameters=True, skip_all_reduce_unused_params=True)
    state = dqt.HookState(codec=dynamiq5(), path="compressed", overlap=overlap)
    dqt.register_comm_hook(model, state)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(3):
        opt.zero_grad()
        loss_of(model, *batch(step)).backward()
        opt.step()
    assert state.iteration == 3
    assert_same_on_every_rank(list(model.parameters()), "parameters with a skipped bucket")
    state.close()


@pytest.mark.mpi(min_size=2)
def test_a_resumed_state_keeps_the_auto_choice():
    """path="auto"'s choice travels with the checkpoint: the resumed hook
    runs the chosen path from its first step, measuring nothing again."""
    state = dqt.HookState(codec=dynamiq5(), path="auto", auto_rounds=1)
    _train_steps(state, steps=_auto_schedule_steps(1))
    (choice, why), = state.path_decisions().values()
    restored = pickle.loads(pickle.dumps(state))
    assert restored.auto_steps == 0 and restored.path_decisions() == {"step": (choice, why)}
    model = DDP(make_net(), bucket_cap_mb=0.004)
    dqt.register_comm_hook(model, restored)
    loss_of(model, *batch(0)).backward()
    assert list(restored.pop_stats()["paths"]) == [choice]
    state.close()
    restored.close()


@pytest.mark.mpi(min_size=2)
def test_plain_path_outside_ddp_and_bad_fuse_mb():
    """allreduce_gradients with path="plain": the collective's uncompressed
    float32 ring (the float64 mean to float32 rounding); a bucket given
    alone ends no step; fuse_mb must be finite."""
    state = dqt.HookState(codec=dynamiq5(), path="plain")
    t = torch.randn(5000, generator=torch.Generator().manual_seed(comm.rank))
    want = np.mean(comm.allgather(t.double().numpy()), axis=0)
    state.allreduce_(t)
    np.testing.assert_allclose(t.numpy(), want, rtol=1e-5, atol=1e-6)
    alone = dqt.HookState(codec=dynamiq5(), path="auto")
    alone.bucket_future(torch.ones(4096)).wait()
    assert alone.iteration == 0 and alone.path_decisions() == {}
    alone.close()
    with pytest.raises(ValueError, match="fuse_mb"):
        dqt.HookState(fuse_mb=float("inf"))


@pytest.mark.mpi(min_size=2)
def test_free_releases_the_collective_and_a_later_call_continues_the_counter():
    """HookState.free(): the collective (and with it its communicators) goes,
    on every rank; the next call makes a new one that continues the counter,
    so it draws the randomness the unfreed state would have drawn."""
    kept = dqt.HookState(codec=dq.DynamiQ(bits=4), comm=comm, path="compressed", seed=3)
    freed = dqt.HookState(codec=dq.DynamiQ(bits=4), comm=comm, path="compressed", seed=3)
    rng = np.random.default_rng(shared_seed(comm) + comm.rank)
    for call in range(3):
        x = torch.from_numpy(rng.standard_normal(5000).astype(np.float32))
        a, b = x.clone(), x.clone()
        kept.allreduce_(a)
        freed.allreduce_(b)
        assert torch.equal(a, b), call
        if call == 1:
            freed.free()
            assert freed._collective is None and freed.counter == kept.counter
    kept.free()
    freed.free()


@pytest.mark.mpi(min_size=2)
def test_quiet_hook_counts_the_bits_its_reporting_twin_reports():
    """A HookState asking for no report (the default) still counts its wire
    bits (Collective.last_bits_per_coord): the same as a reporting state's
    for the same calls, and the native path's float32 width."""
    x = torch.from_numpy(np.random.default_rng(shared_seed(comm) + comm.rank)
                         .standard_normal(256 * 300).astype(np.float32))
    stats = {}
    for reports in (True, False):
        state = dqt.HookState(dq.DynamiQ(small_input=0), comm=comm, path="compressed",
                              reports=reports)
        for _ in range(2):
            state.allreduce_(x.clone())
        stats[reports] = state.pop_stats()
        state.free()
    assert 4.9 < stats[True]["bits_per_coord"] == stats[False]["bits_per_coord"] <= 5.0
    native = dqt.HookState(comm=comm, path="plain", reports=False)
    native.allreduce_(x.clone())
    assert native.pop_stats()["bits_per_coord"] == 32.0
    native.free()
