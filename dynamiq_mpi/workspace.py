"""Buffers reused across calls of one :class:`~dynamiq_mpi.Collective`.

Plans ask for named scratch buffers (the compressed stream, the receive
arena, the decoded values, ...); a buffer grows when a call needs more and is
otherwise handed out again, so steady-state calls allocate nothing.  Calls of
one Collective are serialised and stream-ordered, so the previous call has
finished with a buffer by the time the next call's work reaches it (the NCCL
transport orders a change of the caller's stream, see ``transports/nccl.py``).

``Workspace(None)``-style fresh allocation is :data:`FRESH`, used where ranks
share a process (the simulator) and must not share buffers.
"""
from __future__ import annotations

import numpy as np


class Workspace:
    def __init__(self):
        self._buffers = {}

    def take(self, xp, name: str, count: int, dtype):
        """A flat ``dtype`` view of ``count`` elements of the buffer ``name``."""
        dtype = np.dtype(dtype)
        nbytes = int(count) * dtype.itemsize
        key = (xp.__name__, _device_of(xp), name)
        buf = self._buffers.get(key)
        if buf is None or buf.nbytes < nbytes:
            # grow with headroom so slowly growing sizes do not reallocate each call
            size = max(nbytes, 0 if buf is None else min(2 * buf.nbytes, nbytes + (nbytes >> 2)))
            buf = xp.empty(max(size, 16), dtype=np.uint8)
            self._buffers[key] = buf
        return buf[:nbytes].view(dtype)

    def clear(self):
        self._buffers.clear()


class _Fresh:
    """Allocates a new buffer every time (no reuse)."""

    def take(self, xp, name: str, count: int, dtype):
        return xp.empty(int(count), dtype=dtype)


FRESH = _Fresh()


def _device_of(xp):
    if xp is np:
        return -1
    return xp.cuda.runtime.getDevice()
