"""Pinned host buffers that stage device payloads through a host MPI, grown
on demand and reused; the stream is synchronised before a buffer is handed
to MPI and after the copy back."""
from __future__ import annotations

import numpy as np


class HostStager:
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
