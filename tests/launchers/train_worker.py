"""One rank of a small data-parallel training job, started by any launcher.

    torchrun --nproc_per_node N tests/launchers/train_worker.py --mode ddp --out DIR
    mpiexec -n N python tests/launchers/train_worker.py --mode ddp --out DIR
    python tests/launchers/train_worker.py --spawn N --mode ddp --out DIR   (mp.spawn, tcp://)

Modes: ``ddp`` (the DDP hook), ``fsdp`` (FSDP2 with the compressed
reduce-scatter), ``fsdp_bf16`` (FSDP2 with BF16 parameters: its own
reduce-scatter against ours), ``subgroups`` (4 ranks: DDP over {0, 1} and {2, 3}),
``allreduce`` (``dq.allreduce`` on raw arrays with the default communicator),
``gpu_allreduce`` (the same on CuPy arrays, against the CPU's bits),
``hsdp`` (4 ranks as 2 replicas x 2 shards, dqt.HSDP's compressed replicate
all-reduce),
``nogroup`` (a Collective made before ``init_process_group``: must raise).
Each rank writes DIR/rank{R}.npz: the final parameters and checks (the first
step's gradient against an exact float64 mean over the rank's group, computed
separately through torch.distributed).  The pytest side (tests/test_launchers.py)
compares ranks and launchers.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import dynamiq_mpi as dq
import dynamiq_mpi.torch as dqt

STEPS = 3


def started_by_mpi() -> bool:
    return any(int(os.environ.get(v, "1") or 1) > 1
               for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"))


def init(args, spawn_rank=None):
    if spawn_rank is not None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                                rank=spawn_rank, world_size=args.spawn,
                                timeout=datetime.timedelta(seconds=120))
    elif started_by_mpi():
        dqt.init_process_group_from_mpi("gloo")
    else:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=args.timeout))
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def make_model():
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(37, 64), nn.Tanh(), nn.Linear(64, 67), nn.Tanh(),
                         nn.Linear(67, 5))


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 37, generator=g), torch.randn(16, 5, generator=g)


def exact_mean_grads(model, rank, group):
    """The group's mean gradient of step 0, in float64, by torch.distributed."""
    ref = make_model()
    ref.load_state_dict(model.state_dict())
    x, y = batch(0, rank)
    nn.functional.mse_loss(ref(x), y).backward()
    flat = torch.cat([p.grad.reshape(-1) for p in ref.parameters()]).double()
    dist.all_reduce(flat, group=group)
    return flat / dist.get_world_size(group)


def vnmse(got, exact):
    return float(((got.double() - exact) ** 2).sum() / (exact ** 2).sum())


def train_ddp(args, rank, group):
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
    exact = exact_mean_grads(model, rank, group)
    state = dqt.HookState(codec=dq.DynamiQ(bits=5, small_input=0), path="compressed", seed=7)
    dqt.register_comm_hook(ddp, state)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    err = None
    for step in range(STEPS):
        x, y = batch(step, rank)
        nn.functional.mse_loss(ddp(x), y).backward()
        if step == 0:
            err = vnmse(torch.cat([p.grad.reshape(-1) for p in model.parameters()]), exact)
        opt.step()
        opt.zero_grad()
    return model, {"vnmse_step0": err, "control_plane": state.collective.control_plane,
                   "hook_size": state.plane.size}


def _train_sharded(model, rank, exact, state):
    """STEPS steps of a model FSDP2 has sharded: (full parameters, the first
    step's full-gradient vNMSE against ``exact``)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    err = None
    for step in range(STEPS):
        x, y = batch(step, rank)
        nn.functional.mse_loss(model(x), y).backward()
        if step == 0:
            full = torch.cat([p.grad.full_tensor().reshape(-1) for p in model.parameters()])
            err = vnmse(full, exact)
        opt.step()
        opt.zero_grad()
    params = make_model()
    params.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
    return params, {"vnmse_step0": err, "control_plane": state.collective.control_plane,
                    "hook_size": state.plane.size}


def _shard(model, mesh=None, **fsdp_kw):
    """FSDP2 over each linear layer, then the model."""
    from torch.distributed.fsdp import fully_shard
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh, **fsdp_kw)
    fully_shard(model, mesh=mesh, **fsdp_kw)


def _use_reduce_scatter(model, rs):
    """``rs`` as the reduce-scatter of every module FSDP2 sharded."""
    for m in model.modules():
        if hasattr(m, "set_custom_reduce_scatter"):
            m.set_custom_reduce_scatter(rs)


def train_fsdp(args, rank, group):
    model = make_model()
    exact = exact_mean_grads(model, rank, group)
    # the default codec: FSDP2's reduce-scatters here are 2-3k elements, which
    # DynamiQ sends as BF16 (small_input); forced 5-bit codes on such tiny
    # per-rank chunks err far more (the ranks' values cancel)
    rs = dqt.ReduceScatter(codec=dq.DynamiQ(bits=5), path="compressed", seed=7)
    _shard(model)
    _use_reduce_scatter(model, rs)
    return _train_sharded(model, rank, exact, rs)


def run_fsdp_bf16(args, rank):
    """FSDP2 as LLM jobs run it, MixedPrecisionPolicy(param_dtype=bfloat16,
    reduce_dtype=float32 or bfloat16): FSDP2's own reduce-scatter, ours
    with the Exact codec and ours with the defaults, from the same model and
    batches; the final full parameters of each."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    out = {"init": torch.cat([v.reshape(-1) for v in make_model().state_dict().values()]).numpy()}
    for name, reduce_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        for who, rs in (("own", None), ("exact", dqt.ReduceScatter(codec=dq.Exact(),
                                                                    path="compressed")),
                        ("defaults", dqt.ReduceScatter())):
            model = make_model()
            _shard(model, mp_policy=mp)
            if rs is not None:
                _use_reduce_scatter(model, rs)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            for step in range(STEPS):
                x, y = batch(step, rank)
                nn.functional.mse_loss(model(x).float(), y).backward()
                opt.step()
                opt.zero_grad()
            out[f"{who}_{name}"] = torch.cat([v.full_tensor().reshape(-1).float() for v in
                                              model.state_dict().values()]).numpy()
    return out, {"control_plane": "torch" if not started_by_mpi() else "mpi"}


def train_hsdp(args, rank, group):
    """2 replicas x 2 shards: FSDP2 over the shard mesh, the replicate
    all-reduce compressed by dqt.HSDP; the first step's full gradient
    against the exact mean over all four ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2),
                            mesh_dim_names=("replicate", "shard"))
    model = make_model()
    exact = exact_mean_grads(model, rank, None)
    # the default DynamiQ: these shards (170-2178 elements) go as BF16 (small_input)
    codec = dq.Exact() if args.codec == "exact" else dq.DynamiQ(bits=5)
    hsdp = dqt.HSDP(mesh, codec=codec, path="compressed", seed=7)
    _shard(model, hsdp.shard_mesh)
    hooks = hsdp.attach(model)
    # the shard group's reduce-scatter through dqt.ReduceScatter too: it must
    # take the group FSDP2 calls it with (HSDP's shard group, not the world)
    rs = dqt.ReduceScatter(codec=codec, path="compressed", seed=11)
    _use_reduce_scatter(model, rs)
    params, info = _train_sharded(model, rank, exact, hsdp)
    return params, dict(info, hooks=hooks, rs_size=rs.plane.size,
                        rs_plane=rs.collective.control_plane)


def run_allreduce(args, rank):
    """dq.allreduce with no comm=: the launcher's default communicator."""
    rng = np.random.default_rng(99 + rank)
    x = rng.standard_normal(1000).astype(np.float32)
    out, rep = dq.allreduce(x, codec=dq.DynamiQ(bits=5), path="compressed",
                            return_report=True, seed=3)
    everyone = [np.empty(1000, np.float32) for _ in range(dist.get_world_size())]
    ts = [torch.from_numpy(e) for e in everyone]
    dist.all_gather(ts, torch.from_numpy(x))
    exact = np.sum([e.astype(np.float64) for e in everyone], axis=0)
    err = float(np.sum((out - exact) ** 2) / np.sum(exact ** 2))
    return out, {"vnmse": err, "control_plane": rep.control_plane,
                 "world_size": rep.world_size, "mpi_imported": "mpi4py.MPI" in sys.modules}


def run_gpu_allreduce(args, rank):
    """CuPy arrays under torchrun (ranks may share the GPU: device payload
    staged through host memory over gloo): the same bits as the NumPy
    (CPU) call on the same data, and no MPI anywhere in the process."""
    import cupy
    local = int(os.environ.get("LOCAL_RANK", rank))
    cupy.cuda.Device(local % cupy.cuda.runtime.getDeviceCount()).use()
    rng = np.random.default_rng(77 + rank)
    x = (rng.standard_t(3, 1 << 16) * 10.0 ** rng.uniform(-3, 2)).astype(np.float32)
    coll = dq.Collective(path="compressed")
    outs = {}
    for where, arr in (("gpu", cupy.asarray(x)), ("cpu", x)):
        coll.counter = 3
        out, rep = coll.allreduce(arr, codec=dq.DynamiQ(bits=5, small_input=0), seed=5,
                                  return_report=True)
        outs[where] = out.get() if where == "gpu" else out
    return outs["gpu"], {"same_as_cpu": bool(np.array_equal(outs["gpu"], outs["cpu"])),
                         "control_plane": rep.control_plane, "transport": rep.transport,
                         "mpi_imported": "mpi4py.MPI" in sys.modules}


def run_stall(args, rank):
    """Calls of dq.allreduce in a row; at the third the last rank stalls
    (sleeps past the group's timeout, then leaves without calling) or, with
    ``--die``, exits at once.  Each survivor records the exception it got and
    how long its call took."""
    last = dist.get_world_size() - 1
    x = np.arange(1 << 12, dtype=np.float32) * (rank + 1)
    if args.device == "cuda":               # device arrays: the payload goes over NCCL
        import cupy
        cupy.cuda.Device(int(os.environ.get("LOCAL_RANK", rank))).use()
        x = cupy.asarray(x)
    for call in range(5):
        if call == 2 and rank == last:
            if args.die:
                os._exit(3)
            time.sleep(args.timeout + 3)
            return {"stalled": True}
        t0 = time.perf_counter()
        try:
            dq.allreduce(x, codec=dq.DynamiQ(bits=5, small_input=0), seed=call)
        except Exception as exc:            # the survivors' clear error
            return {"call": call, "error": type(exc).__name__, "message": str(exc),
                    "seconds": time.perf_counter() - t0}
    return {"error": None}


def main_rank(args, spawn_rank=None):
    if args.mode == "nogroup":
        try:
            dq.Collective()
        except dq.InvalidInputError as exc:
            message = str(exc)
        else:
            message = ""
        rank = int(os.environ.get("RANK", "0"))
        np.savez(os.path.join(args.out, f"rank{rank}.npz"), message=np.array(message))
        return
    init(args, spawn_rank)
    rank = dist.get_rank()
    group, color = None, 0
    if args.mode == "subgroups":
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        color = rank // 2
        group = groups[color]
    if args.mode == "stall":
        info = run_stall(args, rank)
        np.savez(os.path.join(args.out, f"rank{rank}.npz"), info=np.array(json.dumps(info)))
        os._exit(0)                         # the group is broken: no orderly teardown
    if args.mode == "fsdp_bf16":
        arrays, info = run_fsdp_bf16(args, rank)
        np.savez(os.path.join(args.out, f"rank{rank}.npz"), info=np.array(json.dumps(info)),
                 **arrays)
        dist.destroy_process_group()
        return
    if args.mode in ("allreduce", "gpu_allreduce"):
        run = run_allreduce if args.mode == "allreduce" else run_gpu_allreduce
        flat, info = run(args, rank)
    else:
        train = {"fsdp": train_fsdp, "hsdp": train_hsdp}.get(args.mode, train_ddp)
        model, info = train(args, rank, group)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    info["color"] = color
    np.savez(os.path.join(args.out, f"rank{rank}.npz"), params=flat,
             info=np.array(json.dumps(info)))
    dist.destroy_process_group()


def _spawned(rank, args):
    main_rank(args, spawn_rank=rank)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--timeout", type=float, default=120, help="the group's timeout (s)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="stall mode: NumPy arrays over gloo, or CuPy arrays over NCCL")
    p.add_argument("--die", action="store_true", help="stall mode: the last rank exits instead")
    p.add_argument("--mode", choices=["ddp", "fsdp", "fsdp_bf16", "stall", "hsdp", "subgroups",
                                      "allreduce",
                                      "gpu_allreduce", "nogroup"], default="ddp")
    p.add_argument("--codec", choices=["dynamiq", "exact"], default="dynamiq")
    p.add_argument("--out", required=True)
    p.add_argument("--spawn", type=int, default=0, help="start N processes by mp.spawn")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.spawn:
        import torch.multiprocessing as mp
        mp.spawn(_spawned, args=(args,), nprocs=args.spawn, join=True)
    else:
        main_rank(args)


if __name__ == "__main__":
    main()
    # Results are on disk.  Skip the interpreter's teardown: under a loaded
    # machine a process that held gloo groups and MPI aborted there about
    # once in a few hundred runs ("terminate called without an active
    # exception", in torch's or MPI's exit handlers, after every result was
    # written), which would fail the launcher instead of a check.
    # (Open MPI's launcher wants MPI_Finalize from every process that
    # initialised MPI: done here, since the teardown that would is skipped.)
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
