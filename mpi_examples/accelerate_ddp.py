"""Hugging Face Accelerate with the DynamiQ DDP hook, under torchrun or ``accelerate launch``:

    torchrun --nproc_per_node 2 mpi_examples/accelerate_ddp.py      # GPUs (nccl), or CPU (gloo)

``accelerator.prepare`` wraps the model in DDP; the hook is registered on the
prepared model.  (Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)``
takes only its built-in hooks: a callable given there is not registered.)
"""
import argparse

import torch
from accelerate import Accelerator
from torch.nn.parallel import DistributedDataParallel

import dynamiq_mpi as dq
import dynamiq_mpi.torch as dqt


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args(argv)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)                                      # same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                torch.nn.Linear(512, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(512, 256, generator=g),
                                          torch.randint(0, 10, (512,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    if not isinstance(model, DistributedDataParallel):
        raise RuntimeError("accelerate did not wrap the model in DDP: launch several processes")
    state = dqt.register_comm_hook(model, dqt.HookState(codec=dq.DynamiQ(bits=5)))

    paths = {}
    for step, (x, y) in zip(range(args.steps), loader):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)                            # buckets go through the hook
        opt.step()
        opt.zero_grad()
        for path, n in state.pop_stats()["paths"].items():
            paths[path] = paths.get(path, 0) + n
        accelerator.print(f"step {step}: loss {loss.item():.4f}")

    flat = torch.cat([q.detach().reshape(-1) for q in accelerator.unwrap_model(model).parameters()])
    everyone = accelerator.gather(flat[None]).cpu()
    accelerator.print(f"Accelerate, {accelerator.num_processes} processes over the "
                      f"{state.collective.control_plane} control plane, buckets through the "
                      f"DynamiQ hook: {paths}")
    accelerator.print(f"parameters identical on every rank: "
                      f"{all(torch.equal(row, everyone[0]) for row in everyone)}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
