"""DDP with the DynamiQ communication hook, launched the way torch jobs are:

    torchrun --nproc_per_node 2 mpi_examples/torchrun_ddp.py        # gloo on CPU, nccl on GPU

No mpi4py, no mpiexec: the hook runs over torch.distributed's own process
group (the torch control plane), which ``dqt.register_comm_hook`` takes from
the DDP model.  The same script under ``mpiexec -n 2`` (after
``dqt.init_process_group_from_mpi()``) gives the same bits.
"""
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import dynamiq_mpi as dq
import dynamiq_mpi.torch as dqt


def main(steps: int = 5):
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)                                      # same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(),
                                torch.nn.Linear(1024, 10)).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    state = dqt.register_comm_hook(ddp, dqt.HookState(codec=dq.DynamiQ(bits=5), seed=0))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

    gen = torch.Generator().manual_seed(1000 + rank)          # each rank its own data
    for step in range(steps):
        x = torch.randn(64, 512, generator=gen).to(device)
        y = torch.randint(0, 10, (64,), generator=gen).to(device)
        state.measure_error = True                            # vNMSE against an exact all-reduce
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()                                       # buckets go through the hook
        opt.step()
        stats = state.pop_stats()
        if rank == 0:    # path="auto" times plain, BF16 and compressed steps, then keeps one
            paths = ", ".join(f"{n} {p}" for p, n in stats["paths"].items())
            print(f"step {step}: loss {loss.item():.4f}, {stats['buckets']} bucket(s) ({paths}), "
                  f"{stats['bits_per_coord']:.2f} bits/coordinate, vNMSE {stats['vnmse']:.2e}")

    flat = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather_object(everyone, flat)
    if rank == 0:
        same = all(torch.equal(e, everyone[0]) for e in everyone)
        print(f"{world} ranks over the {state.collective.control_plane} control plane "
              f"({backend}): parameters identical on every rank: {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
