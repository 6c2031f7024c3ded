"""Control planes: what a collective needs of its ranks besides payload.

Rank and size, the per-call agreement, NCCL unique ids, path decisions,
errors raised on every rank - and, for host arrays, the point-to-point
messages and the native all-reduce - run over one of two control planes
behind one small interface (:class:`ControlPlane`):

* :class:`~.mpi.MPIPlane` over an mpi4py communicator (jobs started by
  ``mpirun`` / ``srun`` with PMI);
* :class:`~.torch_group.TorchPlane` over a ``torch.distributed`` process
  group (torchrun, Lightning, ``mp.spawn``, any job that called
  ``init_process_group``): a private gloo group of the same ranks carries
  control messages and host payload.

:func:`as_plane` takes what a user passes as ``comm=`` (an mpi4py
communicator, a torch process group, a plane, or None for the launcher's
default: :func:`default_comm`).  mpi4py is imported only where the MPI
plane is used, so a torchrun job never calls ``MPI_Init``; torch only where
the torch plane is.
"""
from __future__ import annotations

import sys

from ..errors import InvalidInputError
from ..settings import environment


class ControlPlane:
    """The interface (documentation of what each plane provides).

    ``name`` ("mpi" or "torch"), ``rank``, ``size``; object collectives
    :meth:`allgather` / :meth:`bcast` (small picklable values); fixed-size
    NumPy collectives :meth:`allgather_array` and :meth:`allreduce_max`;
    host payload :meth:`sendrecv` (either side may be None) and
    :meth:`allreduce_sum` (the native path of host arrays); :meth:`dup` (a
    private plane of the same ranks: collective), :meth:`split` (planes of
    subsets: nodes, rails) and :meth:`free`; :meth:`node_name` (the host).
    ``thread_safe``: calls from a worker thread are allowed.
    ``mpi_comm``: the mpi4py communicator, or None on the torch plane."""

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

    def describe(self) -> str:
        return f"{self.name} plane, rank {self.rank} of {self.size}"


def is_torch_group(obj) -> bool:
    """A torch.distributed ProcessGroup (checked without importing torch)."""
    torch_dist = sys.modules.get("torch.distributed")
    if torch_dist is None:
        return False
    pg = getattr(torch_dist, "ProcessGroup", None)
    return pg is not None and isinstance(obj, pg)


def as_plane(comm=None) -> ControlPlane:
    """The control plane of ``comm`` (not duplicated: the caller dups it when
    it needs a private one)."""
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


# Environment variables that launchers set, by launcher: the number of
# processes they started.
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
    """The communicator a collective takes when given none, decided once per
    collective:

    1. a job started by an MPI launcher with more than one rank (or mpi4py
       already initialised with more than one): ``MPI.COMM_WORLD``;
    2. else, if ``torch.distributed`` is initialised: its default group;
    3. else, if the environment says the job has several processes
       (``WORLD_SIZE`` > 1, Slurm's task count, an MPI world of one while
       another launcher's variables say more): :class:`InvalidInputError`
       naming what to do - never a silent world of one;
    4. else (one process): ``MPI.COMM_WORLD`` of size 1.
    """
    env = environment() if environ is None else environ
    mpi_size, mpi_var = _env_size(_MPI_SIZE_VARS, env)
    mpi_mod = sys.modules.get("mpi4py.MPI")
    if mpi_mod is not None and mpi_mod.Is_initialized() and not mpi_mod.Is_finalized():
        mpi_size = max(mpi_size, mpi_mod.COMM_WORLD.Get_size())
    if mpi_size > 1:
        MPI = _mpi4py()
        if MPI.COMM_WORLD.Get_size() > 1:
            return MPI.COMM_WORLD
        # a launcher said several ranks but MPI started a singleton: a
        # mismatched mpiexec and mpi4py (e.g. Open MPI's launcher, MPICH's library)
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
    """mpi4py's MPI module, or an ImportError saying what needs it and what
    to do (mpi4py is optional: a torch.distributed job never needs it)."""
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
