"""The host transport ("mpi"): payload by the control plane's point-to-point,
device buffers staged through reused pinned host buffers (:class:`HostStager`).
Every exchange completes before its answer, so a :class:`Claim` returns at once.
"""
from __future__ import annotations

import sys

import numpy as np

from ..control import as_plane
from .base import Timeline, Transport
from .ops import Received


class HostTransport(Transport):
    """Payload through host memory over a control plane's point-to-point."""
    name = "mpi"

    def __init__(self, comm):
        """``comm``: a control plane, mpi4py communicator or torch group (duplicated)."""
        self.plane = self.agreement = as_plane(comm).dup()
        self.rank, self.size = self.plane.rank, self.plane.size
        self._stager = None
        self.profile = None      # a Timeline while profiling

    @property
    def comm(self):
        """The mpi4py communicator of the MPI plane (None on the torch plane)."""
        return self.plane.mpi_comm if self.plane is not None else None

    def _exchange(self, req):
        send, recv = req.send, req.recv
        if type(send) is Received:                    # (a forwarded payload)
            send = send.buffer
        if send is not None and not isinstance(send, np.ndarray):     # a device payload
            if self._stager is None:
                self._stager = HostStager()
            send = self._stager.to_host(send)         # synchronises the stream
        on_device = recv is not None and not isinstance(recv, np.ndarray)
        recv_host = self._stager.recv_buffer(recv.nbytes) if on_device else recv
        if send is not None or recv_host is not None:
            self.plane.sendrecv(send, req.dest, recv_host, req.source)
        if recv is None:
            return None
        if on_device:
            self._stager.to_device(recv_host, recv)
        return Received(recv)

    def _claim(self, handle):
        return handle.buffer          # every exchange completed before its answer

    def _native_allreduce(self, send, recv):
        self.plane.allreduce_sum(send, recv)
        return recv

    def _mark(self, name):
        if self.profile is not None:
            if self.profile.device:      # device kernels are asynchronous
                sys.modules["cupy"].cuda.get_current_stream().synchronize()
            self.profile.mark(name)

    def start_profile(self, device=False):
        self.profile = Timeline(device)

    def free(self):
        if self.plane is not None:
            self.plane.free()
            self.plane = None


class HostStager:
    """Pinned host buffers for device payloads, grown on demand and reused; the
    stream is synchronised before a buffer goes to MPI and after the copy back."""

    def __init__(self):
        self._buffers = {}

    def _buffer(self, which: str, nbytes: int) -> np.ndarray:
        import cupy
        mem, view = self._buffers.get(which, (None, None))
        if view is None or view.nbytes < nbytes:
            size = max(nbytes, 1 << 20, 0 if view is None else 2 * view.nbytes)
            mem = cupy.cuda.alloc_pinned_memory(size)
            view = np.frombuffer(mem, dtype=np.uint8, count=size)
            self._buffers[which] = (mem, view)
        return view[:nbytes]

    def to_host(self, device_array) -> np.ndarray:
        import cupy
        host = self._buffer("send", int(device_array.nbytes))
        stream = cupy.cuda.get_current_stream()
        device_array.get(stream=stream, out=host)
        stream.synchronize()
        return host

    def recv_buffer(self, nbytes: int) -> np.ndarray:
        return self._buffer("recv", nbytes)

    def to_device(self, host: np.ndarray, device_array) -> None:
        """Copy ``host`` into ``device_array`` (same byte size) and wait for it."""
        import cupy
        stream = cupy.cuda.get_current_stream()
        device_array.set(host.view(device_array.dtype).reshape(device_array.shape), stream=stream)
        stream.synchronize()


MPITransport = HostTransport      # the name of earlier versions
