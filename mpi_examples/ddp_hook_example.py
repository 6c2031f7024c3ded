"""DDP with the DynamiQ communication hook, under mpiexec:

    mpiexec -n 2 python mpi_examples/ddp_hook_example.py          # gloo on CPU, nccl on GPU

torch.distributed is initialised from mpi4py's rank and size (DDP still needs
it to broadcast the initial parameters); the gradient buckets then go through
dynamiq_mpi's collective instead of the process group's all-reduce.
"""
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import dynamiq_mpi as dq
import dynamiq_mpi.torch as dqt


def main():
    rank, world, device = dqt.init_process_group_from_mpi()   # gloo on CPU, nccl on GPU
    torch.manual_seed(0)                                      # same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(),
                                torch.nn.Linear(1024, 10)).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    state = dqt.HookState(codec=dq.DynamiQ(bits=5), seed=0)
    ddp.register_comm_hook(state, dqt.ddp_comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

    gen = torch.Generator().manual_seed(1000 + rank)          # each rank its own data
    for step in range(5):
        x = torch.randn(64, 512, generator=gen).to(device)
        y = torch.randint(0, 10, (64,), generator=gen).to(device)
        state.measure_error = step % 2 == 0                   # vNMSE against an exact all-reduce
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()                                       # buckets go through the hook
        opt.step()
        stats = state.pop_stats()
        if rank == 0:
            vnmse = "" if stats["vnmse"] is None else f", vNMSE {stats['vnmse']:.2e}"
            paths = ", ".join(f"{n} {p}" for p, n in stats["paths"].items())
            print(f"step {step}: loss {loss.item():.4f}, {stats['buckets']} bucket(s) ({paths}), "
                  f"{stats['bits_per_coord']:.2f} bits/coordinate{vnmse}")

    # Every rank holds the same parameters, bit for bit.
    flat = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    everyone = state.comm.allgather(flat.numpy().tobytes())
    if rank == 0:
        print(f"{world} ranks, backend {torch.distributed.get_backend()}: parameters identical "
              f"on every rank: {len(set(everyone)) == 1}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
