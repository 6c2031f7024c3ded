"""CUDA-aware MPI transport: device (CuPy) buffers handed to mpi4py as they are.

No host staging.  MPI knows nothing of CUDA streams, so the host orders the
two worlds:

* a payload the GPU computed is read by MPI only after the compute stream
  (the caller's current CuPy stream) is synchronised: once per exchange that
  sends a computed payload, right before its ``Isend``;
* a forwarded payload (a buffer this transport received) was written by MPI,
  not by a kernel: its receive is completed, no stream sync is needed;
* receives are posted (``Irecv``) as soon as the engine asks, and a
  :class:`~.ops.Claim` completes one only when a kernel is about to read it,
  so the transfer of one tile overlaps the kernel of the next, as on the
  NCCL path (here the host waits where NCCL would make the stream wait);
* before the first receive of a call the stream is synchronised once too:
  a kernel of the previous call may still read a workspace buffer that this
  call receives into;
* a receive never lands on a send still in flight: the all-gather receives
  the final sum of a tile into the wire slot whose partial sum this rank sent
  in the reduce-scatter.  Causality already orders the two (the final sum
  exists only after the partial one arrived), but MPI forbids touching a
  send buffer before its request completes, so that send is completed first
  (at no cost in practice).

Every request is complete when the call ends (the engine's ``done`` mark, or
:meth:`MPICudaTransport.end_call` on the way out of a failed call), so no
buffer is in flight between calls.

``xp`` (the array module) and ``synchronize`` (waits for the compute stream)
are injectable: the CPU tests drive this class under mpiexec with NumPy
arrays and a fake stream, and compare it with the host-staged transport.
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
        """``comm``: duplicated here (collective: every rank constructs it in
        the same call), so our messages never match anybody else's.
        ``xp``: CuPy by default.  ``synchronize``: a callable that returns once
        the work enqueued so far on the compute stream is done; by default the
        current CuPy stream's ``synchronize``."""
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
        """Complete the sends in flight whose bytes overlap ``buf``; forget
        the ones already complete (keeps the list short)."""
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

    def _drain(self):
        """Complete every request of the call (the peers posted theirs)."""
        from mpi4py import MPI

        pending = [t for t in (h.token for h in self._recvs) if t is not None]
        pending += [s[0] for s in self._sends]
        if pending:
            MPI.Request.Waitall(pending)
        for h in self._recvs:
            h.token = None
        self._recvs.clear()
        self._sends.clear()
        self._fresh = True

    def _mark(self, name):
        if name == "done":
            self._drain()
        if self.profile is not None:
            # profiling serialises the phases: the kernels and the wire are done
            self.synchronize()
            self._drain()
            self.profile.mark(name)

    def end_call(self, failed: bool = False, patience: float = 30.0):
        """Called when a call ends (normally a no-op: the ``done`` mark
        drained).  After a failure the requests still posted are completed if
        the peers complete them within ``patience`` seconds (an error the
        ranks agreed on: everybody posted everything); otherwise they are
        dropped with a warning rather than hiding the error behind a hang."""
        if not self._sends and not self._recvs:
            self._fresh = True
            return
        if not failed:
            self._drain()
            return
        from mpi4py import MPI

        pending = [t for t in (h.token for h in self._recvs) if t is not None]
        pending += [s[0] for s in self._sends]
        deadline = time.monotonic() + patience
        while pending and not MPI.Request.Testall(pending):
            if time.monotonic() > deadline:
                warnings.warn(f"mpi-cuda: {len(pending)} messages of a failed call did not "
                              "complete; their buffers may still be written", RuntimeWarning)
                break
            time.sleep(1e-3)
        for h in self._recvs:
            h.token = None
        self._recvs.clear()
        self._sends.clear()
        self._fresh = True

    # -- profiling ---------------------------------------------------------------
    def start_profile(self, device=True):
        self.profile = Timeline(device)

    def free(self):
        if self.comm is not None:
            self.end_call(failed=True, patience=0.0)
            self.comm.Free()
            self.comm = None
