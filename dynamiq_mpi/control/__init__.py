"""Control planes (docs/design.md, "Control planes"): everything of a call
but device payload, over an mpi4py communicator (:class:`~.mpi.MPIPlane`) or
a torch.distributed group (:class:`~.torch_group.TorchPlane`).  mpi4py is
imported only for the MPI plane, torch only for the torch plane.
"""
from __future__ import annotations

import sys

from ..errors import InvalidInputError
from ..settings import environment


class ControlPlane:
    """What each plane provides: ``name`` ("mpi" or "torch"), ``rank``, ``size``,
    the methods below (objects: small picklable values; arrays: fixed-size
    NumPy; payload: host arrays, either side may be None; ``dup``: a private
    plane, collective); ``thread_safe``: a worker thread may call it;
    ``mpi_comm``: the mpi4py communicator or None."""

    name = "?"
    rank = 0
    size = 1
    thread_safe = True
    mpi_comm = None

    def allgather(self, value) -> list:
        raise NotImplementedError

    def bcast(self, value, root: int = 0):
        raise NotImplementedError

    def allgather_array(self, mine, everyone) -> None:
        raise NotImplementedError

    def allreduce_max(self, mine, out) -> None:
        raise NotImplementedError

    def sendrecv(self, send, dest, recv, source) -> None:
        raise NotImplementedError

    def allreduce_sum(self, send, recv) -> None:
        raise NotImplementedError

    def barrier(self) -> None:
        self.allgather(None)

    def dup(self) -> "ControlPlane":
        raise NotImplementedError

    def split(self, color: int, key: int) -> "ControlPlane":
        """A private plane of the ranks that pass the same ``color``, ranked
        by ``key`` (collective over this plane, as ``MPI_Comm_split``)."""
        raise NotImplementedError

    def node_name(self) -> str:
        raise NotImplementedError

    def free(self) -> None:
        pass


def is_torch_group(obj) -> bool:
    """A torch.distributed ProcessGroup (checked without importing torch)."""
    torch_dist = sys.modules.get("torch.distributed")
    if torch_dist is None:
        return False
    pg = getattr(torch_dist, "ProcessGroup", None)
    return pg is not None and isinstance(obj, pg)


def as_plane(comm=None) -> ControlPlane:
    """The control plane of ``comm``, not duplicated (the caller dups it where needed)."""
    if comm is None:
        comm = default_comm()
    if isinstance(comm, ControlPlane):
        return comm
    if is_torch_group(comm):
        from .torch_group import TorchPlane
        return TorchPlane(comm)
    if hasattr(comm, "Get_size") and hasattr(comm, "Dup"):
        from .mpi import MPIPlane
        return MPIPlane(comm)
    raise TypeError(f"comm must be an mpi4py communicator, a torch.distributed process group "
                    f"or None, got {type(comm).__name__}")


# Variables in which launchers say how many processes they started.
_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")
_OTHER_SIZE_VARS = ("WORLD_SIZE", "SLURM_NTASKS", "SLURM_NPROCS")


def _env_size(names, environ) -> tuple:
    """(size, variable) of the first variable saying more than one process."""
    for name in names:
        value = environ.get(name, "").strip()
        if value.isdigit() and int(value) > 1:
            return int(value), name
    return 1, None


def _torch_initialised() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def default_comm(environ=None):
    """The communicator a collective takes when given none: ``MPI.COMM_WORLD``
    where an MPI launcher started several ranks; else an initialised
    torch.distributed's default group; else, where the environment says
    several processes, :class:`InvalidInputError` naming what to do (never
    a silent world of one); else ``MPI.COMM_WORLD`` of size 1."""
    env = environment() if environ is None else environ
    mpi_size, mpi_var = _env_size(_MPI_SIZE_VARS, env)
    mpi_mod = sys.modules.get("mpi4py.MPI")
    if mpi_mod is not None and mpi_mod.Is_initialized() and not mpi_mod.Is_finalized():
        mpi_size = max(mpi_size, mpi_mod.COMM_WORLD.Get_size())
    if mpi_size > 1:
        MPI = _mpi4py()
        if MPI.COMM_WORLD.Get_size() > 1:
            return MPI.COMM_WORLD
        # a singleton under a launcher of several: mismatched mpiexec and mpi4py
        raise InvalidInputError(
            f"dynamiq_mpi: the MPI launcher started {mpi_size} processes ({mpi_var}="
            f"{env.get(mpi_var)}) but mpi4py's MPI.COMM_WORLD has one rank: mpiexec and the "
            "MPI library mpi4py loaded do not belong together (use the mpiexec of that MPI)")
    if _torch_initialised():
        return sys.modules["torch.distributed"].group.WORLD
    size, var = _env_size(_OTHER_SIZE_VARS, env)
    if size > 1:
        raise InvalidInputError(
            f"dynamiq_mpi: this job has {size} processes ({var}={env.get(var)}) but no "
            "communicator spans them: call torch.distributed.init_process_group(...) before "
            "the first collective (torchrun, Lightning, mp.spawn), pass comm= (an mpi4py "
            "communicator or a torch.distributed process group), or start the job with "
            "mpiexec; refusing to all-reduce over a world of one")
    return _mpi4py().COMM_WORLD


def _mpi4py():
    """mpi4py's MPI module, or an ImportError saying what to do (mpi4py is optional)."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(
            "dynamiq_mpi: the MPI control plane (mpiexec, or a single process without "
            "torch.distributed) needs mpi4py: pip install 'dynamiq-mpi[mpi]', or on a cluster "
            "MPICC=$(which mpicc) pip install --no-binary mpi4py mpi4py for its own MPI. "
            "Under torchrun, call torch.distributed.init_process_group() first or pass "
            "comm= (a torch.distributed process group).") from exc
    return MPI
