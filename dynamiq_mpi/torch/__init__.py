"""PyTorch adapter: a DDP communication hook and a gradient all-reduce for
hand-written loops (``ddp``), FSDP2's reduce-scatter (``fsdp``), the
worker thread that lets the DDP hook return at once (``overlap``), HSDP's
compressed replicate all-reduce (``hsdp``), and which
ranks they reduce over (``groups``: torch groups, MPI communicators).

    import dynamiq_mpi as dq
    import dynamiq_mpi.torch as dqt

    torch.distributed.init_process_group(...)   # or, under mpiexec: dqt.init_process_group_from_mpi()
    dqt.register_comm_hook(ddp, dqt.HookState(codec=dq.DynamiQ(bits=5)))

torch is imported only by this subpackage: ``import dynamiq_mpi`` never
imports it.
"""
from .ddp import (HookState, allreduce_gradients, ddp_comm_hook, init_process_group_from_mpi,
                  register_comm_hook, tensor_as_array)
from .fsdp import ReduceScatter
from .hsdp import HSDP

__all__ = ["HookState", "ddp_comm_hook", "register_comm_hook", "allreduce_gradients",
           "init_process_group_from_mpi", "tensor_as_array", "ReduceScatter", "HSDP"]
