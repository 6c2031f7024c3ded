"""Buffers reused across calls of one Collective: named buffers grow when a
call needs more and are handed out again otherwise, so steady calls allocate
nothing (calls are serialised and stream ordered).  :data:`FRESH` allocates
anew, for ranks sharing a process (the simulator).
"""
from __future__ import annotations

import numpy as np


class Workspace:
    def __init__(self):
        self._buffers = {}
        self._views = {}        # (key, count, dtype) -> (buffer, the view last handed out)
        self._filled = {}       # constant buffers: key -> (count, fill) they hold
        self._slices = {}       # (id(array), a, b) -> (array, array[a:b])

    def take(self, xp, name: str, count: int, dtype):
        """A flat ``dtype`` view of ``count`` elements of the buffer ``name``."""
        key = (xp.__name__, -1 if xp is np else _device_of(xp), name)
        # the same view object for steady calls (a device slice costs us)
        vkey = (key, count, dtype)
        cached = self._views.get(vkey)
        if cached is not None and cached[0] is self._buffers.get(key):
            return cached[1]
        dtype = np.dtype(dtype)
        nbytes = int(count) * dtype.itemsize
        buf = self._buffers.get(key)
        if buf is None or buf.nbytes < nbytes:
            # grow with headroom so slowly growing sizes do not reallocate each call
            size = max(nbytes, 0 if buf is None else min(2 * buf.nbytes, nbytes + (nbytes >> 2)))
            # forget every view of the old buffer, so that it is freed
            self._buffers.pop(key, None)
            self._views = {k: v for k, v in self._views.items() if k[0] != key}
            self._slices.clear()
            self._filled.pop(key, None)
            buf = xp.empty(max(size, 16), dtype=np.uint8)
            self._buffers[key] = buf
        view = buf[:nbytes].view(dtype)
        if len(self._views) > 256:
            self._views.clear()
        self._views[vkey] = (buf, view)
        return view

    def constant(self, xp, name: str, count: int, dtype, fill: str):
        """:meth:`take` holding ``fill`` ("zeros", "arange"), written when new; never written to."""
        view = self.take(xp, name, count, dtype)
        key = (xp.__name__, _device_of(xp), name)
        held = self._filled.get(key)
        if held is None or held[1] != fill or held[0] < count or held[2] != np.dtype(dtype):
            _fill(xp, view, fill)
            self._filled[key] = (count, fill, np.dtype(dtype))
        return view

    def sub(self, array, a: int, b: int):
        """``array[a:b]`` of one of this workspace's buffers, the same view object every time."""
        key = (id(array), a, b)
        hit = self._slices.get(key)
        if hit is not None and hit[0] is array:
            return hit[1]
        view = array[a:b]
        if len(self._slices) > 4096:
            self._slices.clear()
        self._slices[key] = (array, view)
        return view

    def clear(self):
        self._buffers.clear()
        self._views.clear()
        self._filled.clear()
        self._slices.clear()


def _fill(xp, view, fill: str):
    """Write a constant's content ("zeros" or "arange") into ``view``."""
    if fill == "zeros":
        view[:] = 0
    elif fill == "arange":
        view[:] = xp.arange(view.shape[0], dtype=view.dtype)
    else:
        raise ValueError(f"unknown fill {fill!r}")
    return view


class _Fresh:
    """Allocates a new buffer every time (no reuse)."""

    def take(self, xp, name: str, count: int, dtype):
        return xp.empty(int(count), dtype=dtype)

    def sub(self, array, a: int, b: int):
        return array[a:b]

    def constant(self, xp, name: str, count: int, dtype, fill: str):
        return _fill(xp, xp.empty(int(count), dtype=dtype), fill)


FRESH = _Fresh()


def _device_of(xp):
    return -1 if xp is np else xp.cuda.runtime.getDevice()
