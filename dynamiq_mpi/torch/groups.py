"""Which ranks a PyTorch adapter reduces over: torch.distributed groups
and mpi4py communicators side by side, and ``init_process_group_from_mpi``
(torch.distributed inside an mpiexec job)."""
from __future__ import annotations

import socket

import torch

from .. import is_torch_group
from ..errors import InvalidInputError
from ..settings import environment


def _native_group(comm) -> tuple:
    """(usable, group; None: the default) for torch.distributed's collectives over ``comm``."""
    if is_torch_group(comm):
        return True, comm
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return False, None
    from mpi4py import MPI
    return (dist.get_world_size() == comm.Get_size()
            and MPI.Comm.Compare(comm, MPI.COMM_WORLD) in (MPI.IDENT, MPI.CONGRUENT)), None


def _group_ranks(comm) -> list:
    """The global ranks of a torch group, or of an mpi4py communicator in
    ``MPI.COMM_WORLD`` (the torch rank of a job set up from MPI)."""
    if is_torch_group(comm):
        return list(torch.distributed.get_process_group_ranks(comm))
    from mpi4py import MPI
    return list(comm.Get_group().Translate_ranks(list(range(comm.Get_size())),
                                                 MPI.COMM_WORLD.Get_group()))


def _adopt_group(state, group, who, what="the group given"):
    """Give a state without a communicator ``group`` (a group of the whole
    job leaves it the launcher's default); raise when it has other ranks."""
    if state._comm is None:
        if _group_ranks(group) != list(range(torch.distributed.get_world_size())):
            state.comm = group
    elif state._comm is not group:
        mine, theirs = _group_ranks(state._comm), _group_ranks(group)
        if mine != theirs:
            raise InvalidInputError(
                f"dynamiq_mpi.torch.{who}: the state reduces over ranks {mine} but {what} "
                f"holds ranks {theirs}: make the state with process_group= that group (or "
                "none: it is filled in)")


def init_process_group_from_mpi(backend: str | None = None, comm=None, timeout=None):
    """Initialise ``torch.distributed`` from mpi4py's rank and size (nothing if
    it already is): ``backend`` "nccl" with CUDA (each rank takes its node
    rank's GPU), else "gloo"; rank 0's TCP store (``MASTER_ADDR`` /
    ``MASTER_PORT`` if set, else a free port) broadcast over MPI.  Returns
    ``(rank, world_size, device)``."""
    import datetime

    from mpi4py import MPI
    dist = torch.distributed
    comm = MPI.COMM_WORLD if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cpu")
    if backend == "nccl":
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        local_rank = node.Get_rank()
        node.Free()
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), device

    names = comm.allgather(MPI.Get_processor_name())
    host = environment().get("MASTER_ADDR") or (
        "127.0.0.1" if len(set(names)) == 1 else socket.gethostname())
    port = int(environment().get("MASTER_PORT", "0"))
    timeout = timeout or datetime.timedelta(minutes=5)
    store, error = None, None
    if rank == 0:
        try:
            # Port 0: the store binds a free port itself, so no other process can take it.
            store = dist.TCPStore(host, port, size, is_master=True, timeout=timeout,
                                  wait_for_workers=False)
            port = store.port
        except Exception as exc:  # tell the others instead of leaving them waiting
            error = f"{type(exc).__name__}: {exc}"
    host, port, error = comm.bcast((host, port, error), root=0)
    if error is not None:
        raise RuntimeError(f"init_process_group_from_mpi: rank 0 could not open the "
                           f"TCP store: {error}")
    if rank != 0:
        store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
    kwargs = dict(store=store, rank=rank, world_size=size, timeout=timeout)
    if backend == "nccl":
        kwargs["device_id"] = device
    dist.init_process_group(backend, **kwargs)
    return rank, size, device
