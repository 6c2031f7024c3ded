"""PyTorch Lightning with its own launcher and the DynamiQ DDP hook:

    python mpi_examples/lightning_ddp.py                      # 2 GPUs (nccl), or 2 CPU processes (gloo)
    python mpi_examples/lightning_ddp.py --no-hook            # plain DDP, to compare

On GPUs the hook goes to Lightning's own strategy,
``DDPStrategy(ddp_comm_hook=dqt.ddp_comm_hook, ddp_comm_state=state)``.
That strategy registers hooks on CUDA devices only, so on the CPU a callback
registers it on the wrapped model when training starts (``RegisterHook``
below); either way the hook runs over Lightning's process group.
``--out DIR`` writes each rank's final parameters (tests/test_examples.py
compares them).
"""
import argparse
import os

import numpy as np
import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
except ImportError:                     # the GPU image ships pytorch_lightning only
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy

import dynamiq_mpi as dq
import dynamiq_mpi.torch as dqt


class RegisterHook(pl.Callback):
    """Register the DynamiQ hook on Lightning's DDP model at the start of training."""

    def __init__(self, state: dqt.HookState):
        self.state = state

    def on_train_start(self, trainer, pl_module):
        dqt.register_comm_hook(trainer.strategy.model, self.state)


def strategy_and_callbacks(state, cuda: bool):
    """(accelerator, strategy, callbacks) that put the hook in: Lightning's
    strategy on CUDA, the callback elsewhere."""
    if cuda:
        strategy = DDPStrategy(ddp_comm_hook=dqt.ddp_comm_hook, ddp_comm_state=state)
        return "gpu", strategy, []
    return "cpu", "ddp", [RegisterHook(state)]


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(),
                                       torch.nn.Linear(256, 8))

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def data(n=512):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 64, generator=g)
    y = torch.tanh(x[:, :8] * 2.0) + 0.1 * torch.randn(n, 8, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--no-hook", action="store_true", help="plain DDP (torch's all-reduce)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--out", default=None, help="write each rank's parameters here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model = Regression()
    initial = torch.cat([q.detach().reshape(-1) for q in model.parameters()]).clone()
    state = dqt.HookState(codec=dq.DynamiQ(bits=5, small_input=0), path="compressed")
    accelerator, strategy, callbacks = strategy_and_callbacks(state, torch.cuda.is_available())
    if args.no_hook:
        strategy, callbacks = "ddp", []
    trainer = pl.Trainer(accelerator=accelerator, devices=args.devices, strategy=strategy,
                         max_steps=args.steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks)
    trainer.fit(model, data())
    final = torch.cat([q.detach().reshape(-1).cpu() for q in model.parameters()])
    rank = trainer.global_rank
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        np.savez(os.path.join(args.out, f"rank{rank}.npz"), params=final.numpy(),
                 initial=initial.numpy())
    if rank == 0:
        how = "plain DDP" if args.no_hook else (
            f"DynamiQ hook over the {state.collective.control_plane} control plane, "
            f"{state.pop_stats()['bits_per_coord']:.2f} bits/coordinate")
        print(f"Lightning, {trainer.world_size} {accelerator.upper()} processes, {how}: moved "
              f"{float((final - initial).norm()):.4f} from the initial parameters")


if __name__ == "__main__":
    main()
