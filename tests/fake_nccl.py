"""Stand-ins for ``cupy`` and ``cupy.cuda.nccl`` that let the NCCL transport
run on host memory under mpiexec, so CI (no GPU) exercises its logic: the
cut of a message over lanes, grouped sends and receives, forwarding of
received buffers, claims.  Streams and events are no-ops (everything is
complete when ``groupEnd`` returns); point-to-point goes over one MPI
duplicate per fake communicator, matched in posting order like NCCL.
"""
from __future__ import annotations

import ctypes
import itertools
from types import SimpleNamespace

import ml_dtypes
import numpy as np
from mpi4py import MPI


class _Stream:
    _ids = itertools.count(1)

    def __init__(self, non_blocking=False):
        self.ptr = next(self._ids)

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass


class _Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.recorded = False

    def record(self, stream=None):
        self.recorded = True


class _Device:
    def __init__(self, device_id=0):
        self.id = device_id

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _memcpy(dst, src, nbytes, kind, stream):
    ctypes.memmove(dst, src, nbytes)


_CURRENT = _Stream()
cuda = SimpleNamespace(Stream=_Stream, Event=_Event, Device=_Device,
                       get_current_stream=lambda: _CURRENT,
                       get_elapsed_time=lambda a, b: 0.0,
                       runtime=SimpleNamespace(memcpyAsync=_memcpy))
cupy = SimpleNamespace(cuda=cuda, empty=np.empty, uint8=np.uint8)


_DTYPES = {7: np.uint8, 6: np.float16, 8: np.float32, 9: np.float64,
           10: np.dtype(ml_dtypes.bfloat16)}


class _Nccl:
    """The module-level API: a group collects operations until groupEnd.
    ``base``: the MPI communicator the fake communicators duplicate (a
    node's, for the in-node level), COMM_WORLD by default."""
    NCCL_UINT8, NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 7, 6, 8, 9, 10
    NCCL_SUM = 0

    def __init__(self, base=None):
        self.base = base
        self._group = None
        self.calls = []          # (op, peer, count) of every operation, for the tests
        self.groups = []         # [(op, peer), ...] of every group, for the tests

    def get_unique_id(self):
        return b"fake"

    def groupStart(self):
        self._group = []

    def groupEnd(self):
        ops, self._group = self._group, None
        self.groups.append([(op, peer) for _, op, _, _, peer in ops])
        requests, landings = [], []
        for comm, op, ptr, count, peer in ops:
            if op == "send":
                buf = np.frombuffer(ctypes.string_at(ptr, count), dtype=np.uint8).copy()
                requests.append(comm.mpi.Isend(buf, dest=peer, tag=11))
                landings.append(None)
                keep = buf
            else:
                buf = np.empty(count, dtype=np.uint8)
                requests.append(comm.mpi.Irecv(buf, source=peer, tag=11))
                landings.append((ptr, buf))
            comm.keep.append(keep if op == "send" else buf)
        MPI.Request.Waitall(requests)
        for landing in landings:
            if landing is not None:
                ptr, buf = landing
                ctypes.memmove(ptr, buf.ctypes.data, buf.size)
        for comm, *_ in ops:
            comm.keep.clear()

    def _post(self, comm, op, ptr, count, peer):
        if self._group is None:
            raise RuntimeError("fake NCCL: point-to-point outside a group")
        self.calls.append((op, peer, count))
        self._group.append((comm, op, ptr, count, peer))

    def NcclCommunicator(self, ndev, uid, rank):
        return _Comm(self, ndev, rank)


class _Comm:
    def __init__(self, module, ndev, rank):
        self.module = module
        self.mpi = (module.base or MPI.COMM_WORLD).Dup()
        assert self.mpi.size == ndev and self.mpi.rank == rank
        self.keep = []

    def send(self, ptr, count, dtype, peer, stream):
        self.module._post(self, "send", ptr, count, peer)

    def recv(self, ptr, count, dtype, peer, stream):
        self.module._post(self, "recv", ptr, count, peer)

    def allGather(self, src, dst, count, dtype, stream):
        self.module.calls.append(("allgather", -1, count))
        nbytes = count * np.dtype(_DTYPES[dtype]).itemsize
        mine = np.frombuffer(ctypes.string_at(src, nbytes), dtype=np.uint8)
        everyone = np.empty(nbytes * self.mpi.size, dtype=np.uint8)
        self.mpi.Allgather(mine, everyone)
        ctypes.memmove(dst, everyone.ctypes.data, everyone.size)

    def reduceScatter(self, src, dst, count, dtype, op, stream):
        """Sum of every rank's part ``rank`` (``count`` elements each),
        added in reverse rank order: an order unlike the staged level's, as
        NCCL's own is."""
        assert op == _Nccl.NCCL_SUM
        self.module.calls.append(("reducescatter", -1, count))
        dt = np.dtype(_DTYPES[dtype])
        size = self.mpi.size
        mine = np.frombuffer(ctypes.string_at(src, count * size * dt.itemsize), dtype=dt)
        everyone = np.empty((size, count * size), dtype=dt)
        self.mpi.Allgather(mine.view(np.uint8), everyone.view(np.uint8))
        parts = everyone[:, self.mpi.rank * count:(self.mpi.rank + 1) * count]
        acc = parts[size - 1].copy()
        for r in range(size - 2, -1, -1):
            acc = (acc + parts[r]).astype(dt)
        ctypes.memmove(dst, acc.ctypes.data, acc.nbytes)

    def destroy(self):
        self.mpi.Free()


def modules(base=None):
    """A fresh (cupy, nccl) pair (``base``: see :class:`_Nccl`)."""
    return cupy, _Nccl(base)
