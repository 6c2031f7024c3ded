"""The DDP hook on CUDA tensors (with one GPU per rank torch.distributed and
our collective over NCCL; with fewer GPUs, ranks share them, torch.distributed
over gloo and our collective over host-staged MPI): the overlapped hook (worker thread, its own
stream, futures completed on the device) gives the bits of the hook running
each call itself, on every rank, with new gradients every step; NaN on one
rank reaches every rank's gradients (GradScaler's contract).  Skips without
CUDA.

Run: mpiexec -n 2 python -m pytest --with-mpi --only-mpi tests/mpi/test_torch_gpu_mpi.py
"""
import pytest
from mpi4py import MPI

comm = MPI.COMM_WORLD
if comm.size > 3:   # importing torch on CI's 2 cores at 4+ ranks costs 15 s and more
    pytest.skip("torch GPU tests run at world sizes 2..3", allow_module_level=True)
torch = pytest.importorskip("torch", exc_type=ImportError)
if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("cupy")

import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import dynamiq_mpi as dq  # noqa: E402
import dynamiq_mpi.torch as dqt  # noqa: E402

N = comm.size
LAST = N - 1


ONE_GPU_PER_RANK = comm.allreduce(torch.cuda.device_count(), op=MPI.MIN) >= N
TRANSPORT = "auto" if ONE_GPU_PER_RANK else "mpi"


@pytest.fixture(scope="module")
def device():
    if ONE_GPU_PER_RANK:
        _, _, dev = dqt.init_process_group_from_mpi()
    else:
        dqt.init_process_group_from_mpi("gloo")
        dev = torch.device("cuda", comm.rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    yield dev
    dist.destroy_process_group()


def make_net(device, width=512):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width),
                         nn.Tanh(), nn.Linear(width, 64)).to(device)


def batch(step, device, width=512):
    gen = torch.Generator().manual_seed(1000 * step + comm.rank)
    return (torch.randn(64, width, generator=gen).to(device),
            torch.randn(64, 64, generator=gen).to(device))


def train(state, device, steps=4, bad_step=None):
    """``state``: our HookState, "bf16" (torch's bf16_compress_hook) or None
    (plain DDP)."""
    model = DDP(make_net(device), device_ids=[device.index], bucket_cap_mb=0.5)
    if state == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif state is not None:
        model.register_comm_hook(state, dqt.ddp_comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    grads_finite = []
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step, device)
        if step == bad_step and comm.rank == LAST:
            x[3, 5] = float("inf")
        (model(x) - y).square().mean().backward()
        grads_finite.append(all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
        if grads_finite[-1]:
            opt.step()
    torch.cuda.synchronize(device)
    return [p.detach().cpu() for p in model.parameters()], grads_finite


def same_on_every_rank(tensors):
    blob = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)
    return all(b == blob for b in comm.allgather(blob))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fuse_mb", [0, 1.5], ids=["bucket-alone", "fused"])
def test_overlapped_hook_on_cuda_gives_the_in_hook_bits(device, fuse_mb):
    """Buckets alone, or fused in groups of about two (0.5 MB buckets)."""
    codec = dq.DynamiQ(bits=5, small_input=0)
    inline = dqt.HookState(codec=codec, seed=7, path="compressed", overlap=False,
                           transport=TRANSPORT, fuse_mb=fuse_mb)
    overlapped = dqt.HookState(codec=codec, seed=7, path="compressed",   # CUDA: overlapped
                               transport=TRANSPORT, fuse_mb=fuse_mb)
    a, _ = train(inline, device)
    b, _ = train(overlapped, device)
    assert device in overlapped._workers and not inline._workers
    assert inline.counter == overlapped.counter
    calls, buckets = overlapped.pop_stats()["calls"], inline.pop_stats()["buckets"]
    assert (calls == buckets) if fuse_mb == 0 else (1 < calls < buckets), (calls, buckets)
    assert all(torch.equal(x, y) for x, y in zip(a, b)), "the overlapped hook changed bits"
    assert same_on_every_rank(b)
    overlapped.close()


@pytest.mark.mpi(min_size=2)
def test_overlapped_hook_on_cuda_spreads_inf_to_every_rank(device):
    state = dqt.HookState(codec=dq.DynamiQ(bits=5, small_input=0), path="compressed",
                          transport=TRANSPORT)
    params, finite = train(state, device, steps=3, bad_step=1)
    assert finite == [True, False, True], finite
    assert all(f == finite for f in comm.allgather(finite))
    assert same_on_every_rank(params)
    state.close()


@pytest.mark.mpi(min_size=2)
def test_fused_exact_hook_on_cuda_is_plain_ddp(device):
    """Fused groups on the worker's stream (copied in, reduced, copied back,
    each future with its own bucket): with the Exact codec the parameters
    of plain DDP, to float32 rounding."""
    plain, _ = train(None, device)
    state = dqt.HookState(codec=dq.Exact(), path="compressed", transport=TRANSPORT,
                          fuse_mb=1.5)
    fused, _ = train(state, device)
    assert 1 < state.counter
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert same_on_every_rank(fused)
    state.close()


@pytest.mark.mpi(min_size=2)
def test_native_path_on_cuda_is_torchs_bf16_hook(device):
    if not ONE_GPU_PER_RANK:
        pytest.skip("torch's BF16 hook needs NCCL (one GPU a rank)")
    theirs, _ = train("bf16", device)
    state = dqt.HookState(path="native")
    ours, _ = train(state, device)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert list(state.pop_stats()["paths"]) == ["native"]


@pytest.mark.mpi(min_size=2)
def test_auto_path_on_cuda_decides_by_steps_alike_on_every_rank(device):
    state = dqt.HookState(path="auto", transport=TRANSPORT, auto_rounds=1)
    params, _ = train(state, device, steps=state.auto_steps + 2)
    (key, (choice, why)), = state.path_decisions().items()
    assert key == "step" and "whole steps" in why
    assert all(c == (choice, why) for c in comm.allgather((choice, why)))
    assert same_on_every_rank(params)
    state.close()


@pytest.mark.mpi(min_size=2)
def test_register_comm_hook_gate_on_cuda_decides_alike_and_no_hook_is_plain_ddp(device):
    """register_comm_hook with path="auto" times the group's all-reduce of a
    bucket on the device (every rank gets the slowest rank's time); where it
    leaves DDP without a hook, training is plain DDP's, bit for bit."""
    import warnings

    from dynamiq_mpi.torch import hook_gate
    model = DDP(make_net(device), device_ids=[device.index], bucket_cap_mb=0.5)
    group = model.process_group
    nbytes, dtype, dev = hook_gate.bucket_probe(model)
    assert (nbytes, dtype, dev) == (int(0.5 * 2 ** 20), torch.float32, device)
    seconds = hook_gate.group_allreduce_seconds(group, nbytes, dtype, dev)
    assert 0 < seconds < 10 and all(s == seconds for s in comm.allgather(seconds))
    state = dqt.HookState(path="auto", transport=TRANSPORT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dqt.register_comm_hook(model, state)
    decided = state.path_decisions().get("step")
    assert all(d == decided for d in comm.allgather(decided))
    hooked = model._get_ddp_logging_data().get("comm_hook") or None
    if decided is None:
        assert hooked == "ddp_comm_hook"
    else:
        assert decided[0] == "ddp" and hooked is None
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(3):
            opt.zero_grad()
            x, y = batch(step, device)
            (model(x) - y).square().mean().backward()
            opt.step()
        plain, _ = train(None, device, steps=3)
        assert all(torch.equal(a.detach().cpu(), b) for a, b in zip(model.parameters(), plain))
    state.close()
