"""Host-staged MPI transport over mpi4py.

NumPy buffers go to MPI as they are.  Device (CuPy) buffers are staged through
pinned host buffers that are reused across calls (see ``dynamiq_mpi.cuda``);
the CUDA stream is synchronised before a buffer reaches MPI.
"""
from __future__ import annotations

import numpy as np

from .ops import AllgatherObject, Exchange, drive

_TAG = 0x5D17


class MPITransport:
    name = "mpi"

    def __init__(self, comm):
        # A private duplicate: our point-to-point traffic never matches the
        # caller's messages on the same communicator.
        self.comm = comm.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self._stager = None

    def _execute(self, request):
        from mpi4py import MPI

        if isinstance(request, AllgatherObject):
            return self.comm.allgather(request.value)
        if isinstance(request, Exchange):
            payload = request.payload
            on_device = not isinstance(payload, np.ndarray)
            if on_device:
                if self._stager is None:
                    from .staging import HostStager
                    self._stager = HostStager()
                send_host = self._stager.to_host(payload)          # synchronises the stream
                recv_host = self._stager.recv_buffer(request.recv_nbytes)
            else:
                send_host = payload
                recv_host = np.empty(request.recv_nbytes, dtype=np.uint8)
            self.comm.Sendrecv([send_host, MPI.BYTE], request.dest, _TAG,
                               [recv_host, MPI.BYTE], request.source, _TAG)
            if on_device:
                return self._stager.to_device(recv_host)
            return recv_host
        raise RuntimeError(f"unknown request {request!r}")

    def run(self, program):
        return drive(program, self._execute)

    def free(self):
        if self.comm is not None:
            self.comm.Free()
            self.comm = None
