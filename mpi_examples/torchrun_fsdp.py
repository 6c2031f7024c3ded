"""FSDP2 with DynamiQ's compressed gradient reduce-scatter, under torchrun:

    torchrun --nproc_per_node 2 mpi_examples/torchrun_fsdp.py       # gloo on CPU, nccl on GPU

``dqt.ReduceScatter`` reduces over the group FSDP calls it with (HSDP's
shard group too); parameters are all-gathered by FSDP, uncompressed.
"""
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import dynamiq_mpi as dq
import dynamiq_mpi.torch as dqt


def main(steps: int = 5):
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(),
                                torch.nn.Linear(1024, 10)).to(device)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    rs = dqt.ReduceScatter(codec=dq.DynamiQ(bits=5), reports=True)
    for module in model.modules():          # every FSDP module has its own param group
        if hasattr(module, "set_custom_reduce_scatter"):
            module.set_custom_reduce_scatter(rs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(steps):
        x = torch.randn(64, 512, generator=gen).to(device)
        y = torch.randint(0, 10, (64,), generator=gen).to(device)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        stats = rs.pop_stats()
        if rank == 0:
            paths = ", ".join(f"{n} {p}" for p, n in stats["paths"].items())
            print(f"step {step}: loss {loss.item():.4f}, {stats['calls']} reduce-scatter(s) "
                  f"({paths}), {stats['bits_per_coord']:.2f} bits/coordinate")
    if rank == 0:
        print(f"FSDP2 over the {rs.collective.control_plane} control plane, "
              f"{dist.get_world_size()} ranks ({backend})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
