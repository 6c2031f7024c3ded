"""Steady native calls: the transport's own all-reduce (wire.py) of a call
agreed once, without the engine: one 8-byte digest all-gather (the counter
folded in), the casts and the all-reduce.  A rank whose call differs sends
another digest; then every rank raises the engine's error.
"""
from __future__ import annotations

from operator import itemgetter

from numpy import ndarray as _NDARRAY

from ..codecs.base import signature_of
from ..errors import InputMismatchError
from ..control.agreement import Digests, digest_with_counter, record_digest
from .wire import from_wire, to_wire

_FIELDS = itemgetter("topology", "op", "seed", "transport", "tile_bytes", "nonfinite", "path")


def steady_key(x, out, call):
    """What must equal a steady call's for its agreement to carry over (local facts)."""
    return (_facts(x), None if out is None else "x" if out is x else _facts(out),
            signature_of(call["codec"]), _FIELDS(call))


def _facts(a):      # (a NumPy array has no device: NumPy 2's says "cpu")
    return (type(a), a.shape, a.dtype, a.flags.c_contiguous, None if type(a) is _NDARRAY
            else getattr(getattr(a, "device", None), "id", None))


class SteadyNative:
    """The native path of a call agreed before (see the module's doc)."""

    def __init__(self, record: dict, codec, transport: str, wire: str, backend, plane):
        self.record = {k: v for k, v in record.items() if k != "counter"}
        self.static = record_digest(self.record)
        self.codec, self.transport, self.wire, self.backend = codec, transport, wire, backend
        self.casts = wire != record.get("dtype")    # only a cast takes a workspace buffer
        self.on_device = record.get("backend") == "gpu"
        self._digests = Digests(plane)      # the digest exchange's buffers
        self.bits = None            # Report.bits_per_coord of the call

    def run(self, rt, x, out, call):
        """The result (``out`` or a new array of ``x``'s shape) on runtime ``rt``; raises
        the agreement's error on every rank when some rank's call differs."""
        if not self._digests.match(digest_with_counter(self.static, call["counter"])):
            from .phases import check_agreement
            check_agreement(rt.plane.allgather(dict(self.record, counter=call["counter"])))
            raise InputMismatchError("ranks disagree on the call")   # (raised above)
        transport = rt.route(self.transport, x)
        flat = x if x.ndim == 1 else x.reshape(-1)      # (reshape costs host time)
        result = (out if out.ndim == 1 else out.reshape(-1)) if out is not None else \
            self.backend.empty(flat.shape[0], flat.dtype)
        send, recv = to_wire(self.backend, flat, self.wire, result, rt.workspace) if self.casts \
            else (flat, result)
        transport._native_allreduce(send, recv)
        if self.casts or call["op"] == "mean":
            from_wire(self.backend, recv, rt.size if call["op"] == "mean" else 1, result)
        return out if out is not None else result if x.ndim == 1 else result.reshape(x.shape)
