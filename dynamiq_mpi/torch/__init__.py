"""PyTorch adapter (docs/training.md): the DDP hook and a gradient all-reduce
(``ddp``), FSDP2's reduce-scatter (``fsdp``), HSDP (``hsdp``).

    import dynamiq_mpi as dq
    import dynamiq_mpi.torch as dqt

    torch.distributed.init_process_group(...)   # or, under mpiexec: dqt.init_process_group_from_mpi()
    dqt.register_comm_hook(ddp, dqt.HookState(codec=dq.DynamiQ(bits=5)))

``import dynamiq_mpi`` never imports torch.
"""
from .ddp import (HookState, allreduce_gradients, ddp_comm_hook, init_process_group_from_mpi,
                  register_comm_hook, tensor_as_array)
from .fsdp import ReduceScatter
from .hsdp import HSDP

__all__ = ["HookState", "ddp_comm_hook", "register_comm_hook", "allreduce_gradients",
           "init_process_group_from_mpi", "tensor_as_array", "ReduceScatter", "HSDP"]
