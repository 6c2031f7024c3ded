"""Steady native calls: the transport's own all-reduce (wire.py) of a call
agreed once, without the engine: one 8-byte digest all-gather (the counter
folded in), the casts and the all-reduce.  A rank whose call differs sends
another digest; then every rank raises the engine's error.
"""
from __future__ import annotations

from ..codecs.base import signature_of
from ..errors import InputMismatchError
from ..control.agreement import Digests, digest_with_counter, record_digest
from .wire import from_wire, to_wire


def steady_key(x, out, codec, topology, op, seed, transport, tile_bytes, nonfinite, path):
    """What must equal a steady call's for its agreement to carry over
    (the record but the counter, from local facts; ``path``: as asked)."""
    dev = getattr(getattr(x, "device", None), "id", None)
    out_key = None if out is None else (
        type(out), out.shape, out.dtype, out.flags.c_contiguous,
        getattr(getattr(out, "device", None), "id", None), out is x)
    return (type(x), x.shape, x.dtype, x.flags.c_contiguous, dev, out_key, signature_of(codec),
            topology, op, seed, transport, tile_bytes, nonfinite, path)


class SteadyNative:
    """The native path of a call agreed before (see the module's doc)."""

    def __init__(self, record: dict, codec, transport: str, wire: str, backend):
        self.record = {k: v for k, v in record.items() if k != "counter"}
        self.static = record_digest(self.record)
        self.codec, self.transport, self.wire, self.backend = codec, transport, wire, backend
        self._digests = None        # the digest exchange's buffers (made on first use)
        self.bits = None            # Report.bits_per_coord of the call

    def run(self, comm, route, x, out, counter, op, n, workspace):
        """The result (``out`` or a new array of ``x``'s shape); raises the
        agreement's error on every rank when some rank's call differs."""
        if self._digests is None:
            self._digests = Digests(comm)
        if not self._digests.match(digest_with_counter(self.static, counter)):
            from .phases import check_agreement
            check_agreement(comm.allgather(dict(self.record, counter=counter)))
            raise InputMismatchError("ranks disagree on the call")   # (raised above)
        transport = route(self.transport, x)
        flat = x.reshape(-1)
        result = out.reshape(-1) if out is not None else self.backend.empty(flat.shape[0],
                                                                            flat.dtype)
        send, recv = to_wire(self.backend, flat, self.wire, result, workspace)
        transport._native_allreduce(send, recv)
        from_wire(self.backend, recv, n if op == "mean" else 1, result)
        return out if out is not None else result.reshape(x.shape)
