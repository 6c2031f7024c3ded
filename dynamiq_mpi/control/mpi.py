"""The MPI control plane: an mpi4py communicator."""
from __future__ import annotations

from mpi4py import MPI

from . import ControlPlane

_TAG = 0x5D17


class MPIPlane(ControlPlane):
    name = "mpi"

    def __init__(self, comm):
        self.mpi_comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._owned = False

    @property
    def thread_safe(self) -> bool:
        # calls from the DDP hook's worker and from the hook's thread
        return MPI.Query_thread() >= MPI.THREAD_MULTIPLE

    def allgather(self, value) -> list:
        return self.mpi_comm.allgather(value)

    def bcast(self, value, root: int = 0):
        return self.mpi_comm.bcast(value, root=root)

    def allgather_array(self, mine, everyone) -> None:
        self.mpi_comm.Allgather(mine, everyone)

    def allreduce_max(self, mine, out) -> None:
        self.mpi_comm.Allreduce(mine, out, op=MPI.MAX)

    def sendrecv(self, send, dest, recv, source) -> None:
        if send is not None and recv is not None:
            self.mpi_comm.Sendrecv([send, MPI.BYTE], dest, _TAG, [recv, MPI.BYTE], source, _TAG)
        elif send is not None:
            self.mpi_comm.Send([send, MPI.BYTE], dest, _TAG)
        elif recv is not None:
            self.mpi_comm.Recv([recv, MPI.BYTE], source, _TAG)

    def allreduce_sum(self, send, recv) -> None:
        # out=x arrives as two views of one memory: MPI forbids aliased buffers
        same = send is recv or (send.__array_interface__["data"][0]
                                == recv.__array_interface__["data"][0])
        self.mpi_comm.Allreduce(MPI.IN_PLACE if same else send, recv, op=MPI.SUM)

    def barrier(self) -> None:
        self.mpi_comm.Barrier()

    def node_name(self) -> str:
        return MPI.Get_processor_name()

    def dup(self) -> "MPIPlane":
        # a private duplicate: our traffic never matches the caller's messages
        return _owned(self.mpi_comm.Dup())

    def split(self, color: int, key: int) -> "MPIPlane":
        return _owned(self.mpi_comm.Split(int(color), int(key)))

    def shared_memory_leader(self) -> int:
        """This node's lowest rank of the plane (``MPI_Comm_split_type(SHARED)``; collective)."""
        local = self.mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        try:
            return local.allreduce(self.rank, op=MPI.MIN)
        finally:
            local.Free()

    def free(self) -> None:
        if self._owned and self.mpi_comm is not None:
            self.mpi_comm.Free()
            self.mpi_comm = None


def _owned(comm) -> MPIPlane:
    """A plane that frees ``comm`` with it."""
    plane = MPIPlane(comm)
    plane._owned = True
    return plane
