"""CUDA-aware MPI transport: device buffers handed to mpi4py as they are, the
host ordering MPI and the streams (docs/cuda_aware_mpi.md); nothing is in
flight between calls.  ``xp`` and ``synchronize`` are injectable (the CPU
tests run it on NumPy arrays).
"""
from __future__ import annotations

import time
import warnings

from .base import Timeline, Transport
from .ops import Received

_TAG = 0x5D18


def _address(array) -> int:
    """Address of an array's first byte (CuPy, or NumPy in the CPU tests)."""
    data = array.data
    return data.ptr if hasattr(data, "ptr") else array.ctypes.data


class MPICudaTransport(Transport):
    name = "mpi-cuda"

    def __init__(self, comm, xp=None, synchronize=None):
        """``comm``: duplicated here (collective).  ``xp``: CuPy by default.
        ``synchronize``: returns once the compute stream's work is done
        (default: the current CuPy stream's)."""
        if xp is None:
            import cupy as xp
        if synchronize is None:
            def synchronize(xp=xp):
                xp.cuda.get_current_stream().synchronize()
        self.xp = xp
        self.synchronize = synchronize
        from ..control.mpi import MPIPlane
        self.comm = comm.Dup()
        self.agreement = MPIPlane(self.comm)
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.profile = None
        self._sends = []          # (request, buffer, first byte, end): in flight
        self._recvs = []          # Received handles not yet completed
        self._fresh = True        # no exchange yet in this call

    # -- requests --------------------------------------------------------------
    def _check(self, array):
        if not isinstance(array, self.xp.ndarray):
            raise TypeError(f"transport 'mpi-cuda' got a {type(array).__module__}."
                            f"{type(array).__name__} buffer, not a {self.xp.__name__} array")
        return array

    def _exchange(self, req):
        from mpi4py import MPI

        send = req.send
        computed = send is not None and not isinstance(send, Received)
        if computed or self._fresh:
            self.synchronize()
        self._fresh = False
        handle = None
        if req.recv is not None:
            buf = self._check(req.recv)
            token = None
            if buf.nbytes:          # sender and receiver skip an empty message alike
                self._settle_sends_under(buf)
                token = self.comm.Irecv([buf, MPI.BYTE], req.source, _TAG)
            handle = Received(buf, token)
            self._recvs.append(handle)
        if send is not None:
            if isinstance(send, Received):
                self._complete(send)          # MPI wrote it: wait for that, not the GPU
                buf = send.buffer
            else:
                buf = self._check(send)
            if buf.nbytes:
                lo = _address(buf)
                self._sends.append((self.comm.Isend([buf, MPI.BYTE], req.dest, _TAG), buf,
                                    lo, lo + buf.nbytes))
        return handle

    def _settle_sends_under(self, buf):
        """Complete the sends in flight overlapping ``buf``; forget completed ones."""
        lo = _address(buf)
        hi = lo + buf.nbytes
        keep = []
        for entry in self._sends:
            request, _, a, b = entry
            if a < hi and lo < b:
                request.Wait()
            elif not request.Test():
                keep.append(entry)
        self._sends = keep

    def _complete(self, handle):
        if handle.token is not None:
            handle.token.Wait()
            handle.token = None

    def _claim(self, handle):
        self._complete(handle)
        return handle.buffer

    def _pending(self):
        recvs = [h.token for h in self._recvs if h.token is not None]
        return recvs + [s[0] for s in self._sends]

    def _forget(self):
        for h in self._recvs:
            h.token = None
        self._recvs.clear()
        self._sends.clear()
        self._fresh = True

    def _drain(self):
        """Complete every request of the call (the peers posted theirs)."""
        from mpi4py import MPI
        pending = self._pending()
        if pending:
            MPI.Request.Waitall(pending)
        self._forget()

    def _mark(self, name):
        if name == "done":
            self._drain()
        if self.profile is not None:
            # profiling serialises the phases: the kernels and the wire are done
            self.synchronize()
            self._drain()
            self.profile.mark(name)

    def end_call(self, failed: bool = False, patience: float = 30.0):
        """When a call ends; after a failure the requests still posted are
        completed within ``patience`` seconds, else dropped with a warning
        rather than hiding the error behind a hang."""
        if not self._sends and not self._recvs:
            self._fresh = True
            return
        if not failed:
            self._drain()
            return
        from mpi4py import MPI
        pending = self._pending()
        deadline = time.monotonic() + patience
        while pending and not MPI.Request.Testall(pending):
            if time.monotonic() > deadline:
                warnings.warn(f"mpi-cuda: {len(pending)} messages of a failed call did not "
                              "complete; their buffers may still be written", RuntimeWarning)
                break
            time.sleep(1e-3)
        self._forget()

    # -- profiling ---------------------------------------------------------------
    def start_profile(self, device=True):
        self.profile = Timeline(device)

    def free(self):
        if self.comm is not None:
            self.end_call(failed=True, patience=0.0)
            self.comm.Free()
            self.comm = None
