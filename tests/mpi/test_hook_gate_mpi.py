"""register_comm_hook's gate (CPU, gloo): with path="auto", a link whose
all-reduce of a bucket is faster than a Python hook's own cost gets no hook
(DDP stays plain DDP, bit for bit), alike on every rank; a slower link, an
explicit path or an ungated device gets the hook; the probe is the slowest
rank's, scaled beyond its bytes; the choice travels with a checkpoint.

The gate applies to CUDA models; these tests open it to CPU ones and set the
hook's cost to force either side.

Run: mpiexec -n 2 python -m pytest --with-mpi --only-mpi tests/mpi/test_hook_gate_mpi.py
"""
import pickle
import types
import warnings

import pytest
from mpi4py import MPI

comm = MPI.COMM_WORLD
N = comm.size
if N > 3:
    pytest.skip("torch adapter tests run at world sizes 2..3", allow_module_level=True)

torch = pytest.importorskip("torch", exc_type=ImportError)
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import dynamiq_mpi as dq  # noqa: E402
import dynamiq_mpi.torch as dqt  # noqa: E402
from dynamiq_mpi.torch import hook_gate  # noqa: E402
from helpers import gloo_process_group  # noqa: E402

pytestmark = pytest.mark.max_size(3)


@pytest.fixture(scope="module", autouse=True)
def process_group():
    with gloo_process_group():
        yield


@pytest.fixture
def cpu_gated(monkeypatch):
    """The gate opened to CPU models; returns a setter of the hook's cost."""
    monkeypatch.setattr(hook_gate, "GATED_DEVICES", ("cpu",))
    return lambda seconds: monkeypatch.setattr(hook_gate, "HOOK_HOST_COST_S", seconds)


def make_ddp(seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 8))
    return DDP(net, bucket_cap_mb=0.004)


def train(model, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + comm.rank)
        x, y = torch.randn(32, 16, generator=gen), torch.randn(32, 8, generator=gen)
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def hook_name(model):
    return model._get_ddp_logging_data().get("comm_hook") or None


def no_probe(*args, **kwargs):
    raise AssertionError("the gate probed the link")


@pytest.mark.mpi(min_size=2)
def test_a_link_faster_than_a_hook_leaves_ddp_alone(cpu_gated):
    cpu_gated(1e3)                      # any all-reduce is faster than this hook cost
    state = dqt.HookState(codec=dq.DynamiQ(bits=5, small_input=0), path="auto")
    model = make_ddp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert dqt.register_comm_hook(model, state) is state
    mine = [w for w in caught if "no hook registered" in str(w.message)]
    assert len(mine) == (1 if comm.rank == 0 else 0), [str(w.message) for w in caught]
    assert hook_name(model) is None
    (key, (choice, why)), = state.path_decisions().items()
    assert key == "step" and choice == "ddp" and "no hook can pay" in why
    assert all(d == (choice, why) for d in comm.allgather((choice, why)))
    assert state.auto_steps == 0
    ours = train(model)
    plain = train(make_ddp())
    assert all(torch.equal(a, b) for a, b in zip(ours, plain))    # plain DDP, bit for bit
    assert state.pop_stats()["calls"] == 0


@pytest.mark.mpi(min_size=2)
def test_the_no_hook_choice_travels_with_a_checkpoint(cpu_gated, monkeypatch):
    cpu_gated(1e3)
    state = dqt.HookState(codec=dq.DynamiQ(bits=5), path="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dqt.register_comm_hook(make_ddp(), state)
    restored = pickle.loads(pickle.dumps(state))
    assert restored.path_decisions() == state.path_decisions()
    monkeypatch.setattr(hook_gate, "group_allreduce_seconds", no_probe)
    model = make_ddp()
    dqt.register_comm_hook(model, restored)
    assert hook_name(model) is None
    restored.comm = dist.new_group(list(range(N)))      # re-attached: the choice stays
    assert restored.path_decisions() == state.path_decisions()
    forced = pickle.loads(pickle.dumps(state))
    forced.path = "compressed"                  # an explicit path registers the hook
    model = make_ddp()
    dqt.register_comm_hook(model, forced)
    assert hook_name(model) == "ddp_comm_hook"
    forced.close()


@pytest.mark.mpi(min_size=2)
def test_a_link_slower_than_a_hook_gets_the_hook(cpu_gated):
    cpu_gated(0.0)                      # no all-reduce is faster than this
    state = dqt.HookState(codec=dq.DynamiQ(bits=5, small_input=0), path="auto", auto_rounds=1)
    model = make_ddp()
    dqt.register_comm_hook(model, state)
    assert hook_name(model) == "ddp_comm_hook"
    assert state.path_decisions() == {} and state.auto_steps > 0
    train(model, steps=2)
    stats = state.pop_stats()
    assert stats["buckets"] > 0 and 0 < stats["host_s"] < 60
    state.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path, gated", [("compressed", True), ("native", True),
                                         ("plain", True), ("auto", False)],
                         ids=["compressed", "native", "plain", "auto-on-cpu-by-default"])
def test_explicit_paths_and_cpu_models_are_never_gated(cpu_gated, monkeypatch, path, gated):
    if gated:
        cpu_gated(1e3)
    else:
        monkeypatch.setattr(hook_gate, "GATED_DEVICES", ("cuda",))     # the default
    monkeypatch.setattr(hook_gate, "group_allreduce_seconds", no_probe)
    state = dqt.HookState(codec=dq.DynamiQ(bits=5), path=path)
    model = make_ddp()
    dqt.register_comm_hook(model, state)
    assert hook_name(model) == "ddp_comm_hook" and state.path_decisions().get("step") is None
    state.close()


@pytest.mark.mpi(min_size=2)
def test_the_probe_is_the_slowest_ranks_median_scaled_by_the_bytes(monkeypatch):
    """Rank r's clock advances (r + 1) ms a reading, so each of its calls
    takes (r + 1) ms; probed at 1 KiB, a 4 KiB bucket is 4x that, and every
    rank gets the slowest rank's."""
    clock = [0.0]

    def fake_clock():
        clock[0] += (comm.rank + 1) * 1e-3
        return clock[0]
    monkeypatch.setattr(hook_gate, "time", types.SimpleNamespace(perf_counter=fake_clock))
    monkeypatch.setattr(hook_gate, "PROBE_MAX_BYTES", 1024)
    seconds = hook_gate.group_allreduce_seconds(None, 4096, torch.float32, torch.device("cpu"))
    assert seconds == pytest.approx(4 * N * 1e-3, rel=1e-12)
    assert all(s == seconds for s in comm.allgather(seconds))


@pytest.mark.mpi(min_size=2)
def test_the_bucket_probed_is_ddps_cap_at_most_the_gradients():
    model = make_ddp()
    nbytes, dtype, device = hook_gate.bucket_probe(model)
    total = sum(p.numel() * 4 for p in model.parameters())
    assert (dtype, device.type) == (torch.float32, "cpu")
    assert nbytes == min(model.bucket_bytes_cap, total) == int(0.004 * 2 ** 20)
    big = DDP(nn.Linear(4, 4))                  # DDP's default 25 MB cap, 80 bytes of gradients
    assert hook_gate.bucket_probe(big)[0] == 4 * (16 + 4)
