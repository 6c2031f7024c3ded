"""The native path of a call: the transport's own uncompressed all-reduce
(NCCL's for device arrays, MPI's for host arrays) instead of the codec's
compressed ring, where compression does not pay (see :mod:`.paths`).

The caller's dtype is kept: the input is cast to the wire dtype (BF16 for the
lossy codecs on NCCL, float32 on MPI, which has no BF16 sum; the input's own
dtype for ``Exact``), summed by the transport, and cast back, divided by n
for a mean.  On the GPU each cast is one fused kernel (no temporaries).

:class:`SteadyNative` is the same call without the engine, for a call whose
every argument the ranks already agreed on once: it keeps the agreement
record and its digest, so a steady call costs one 8-byte ``MPI_Allgather``
(every rank's digest, the call counter folded in), the casts and the
transport's all-reduce.  A rank whose call differs sends a different digest,
and then every rank exchanges the full records and raises the engine's
error, exactly as on the engine's path (the digests are the same function
of the record, transports/mpi_host.py), so no rank is left waiting.
"""
from __future__ import annotations

import numpy as np

from .backend import BFLOAT16, dtype_name
from .codecs.base import signature_of
from .errors import InputMismatchError
from .transports.mpi_host import Digests, digest_with_counter, record_digest

_F32_LIKE = ("float32", "float16", "bfloat16")


def wire_dtype(codec, input_dtype: str, wires: tuple) -> str:
    """The dtype the transport sums in: the codec's ``native_wire`` (None:
    the input's own), else the widest the transport takes."""
    want = getattr(codec, "native_wire", "bfloat16") or input_dtype
    if want in wires:
        return want
    if input_dtype == "float64" and "float64" in wires:
        return "float64"
    return "float32"


_KERNELS = {}


def _gpu_kernels():
    """CuPy elementwise kernels: float -> BF16 bits (round to nearest even, NaN
    kept quiet, as ``backend.float32_to_bf16``) and BF16 bits -> scaled float."""
    if not _KERNELS:
        import cupy
        _KERNELS["to_bf16"] = cupy.ElementwiseKernel(
            "T x", "uint16 y",
            """unsigned int u = __float_as_uint((float)x);
               if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x7FFFFFu))
                   y = (unsigned short)((u >> 16) | 0x40u);
               else
                   y = (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);""",
            "dq_native_to_bf16")
        _KERNELS["from_bf16"] = cupy.ElementwiseKernel(
            "uint16 b, float32 s", "T y",
            "y = (T)(__uint_as_float(((unsigned int)b) << 16) * s);",
            "dq_native_from_bf16")
        _KERNELS["bf16_scale"] = cupy.ElementwiseKernel(
            "uint16 b, float32 s", "uint16 y",
            """unsigned int u = __float_as_uint(__uint_as_float(((unsigned int)b) << 16) * s);
               if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x7FFFFFu))
                   y = (unsigned short)((u >> 16) | 0x40u);
               else
                   y = (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);""",
            "dq_native_bf16_scale")
    return _KERNELS


def _bits(a):
    return a.view(np.uint16)


def to_wire(backend, flat, wire: str, result, workspace):
    """(send, recv) buffers of the transport's all-reduce: the input straight
    into ``result`` when the wire dtype is the input's (no copy), else a
    workspace buffer of the wire dtype holding the cast input, in place."""
    xp = backend.xp
    if dtype_name(flat.dtype) == wire:
        return flat, result
    wire_np = BFLOAT16 if wire == "bfloat16" else np.dtype(wire)
    buf = workspace.take(xp, f"native.{wire}", flat.shape[0], wire_np)
    if backend.name == "gpu" and wire == "bfloat16":
        _gpu_kernels()["to_bf16"](flat, _bits(buf))
    else:
        xp.copyto(buf, flat, casting="unsafe")
    return buf, buf


def from_wire(backend, buf, divisor: int, result):
    """``result`` = ``buf`` / ``divisor`` in the result's dtype (in place when
    ``buf`` is ``result``)."""
    xp = backend.xp
    scale = np.float32(1.0 / divisor) if divisor != 1 else None
    if buf is result:
        if scale is None:
            return
        if backend.name == "gpu" and result.dtype == BFLOAT16:
            _gpu_kernels()["bf16_scale"](_bits(result), scale, _bits(result))
        elif result.dtype == BFLOAT16:
            xp.copyto(result, result.astype(np.float32) / np.float32(divisor), casting="unsafe")
        else:
            xp.divide(result, result.dtype.type(divisor), out=result)
        return
    if backend.name == "gpu" and buf.dtype == BFLOAT16:
        k = _gpu_kernels()
        s = np.float32(1.0) if scale is None else scale
        if result.dtype == BFLOAT16:
            k["bf16_scale"](_bits(buf), s, _bits(result))
        else:
            k["from_bf16"](_bits(buf), s, result)
        return
    if scale is None:
        xp.copyto(result, buf, casting="unsafe")
    else:
        wide = buf.astype(np.float32) if buf.dtype == BFLOAT16 else buf
        xp.copyto(result, wide / wide.dtype.type(divisor), casting="unsafe")


def steady_key(x, out, codec, topology, op, seed, transport, tile_bytes, nonfinite, path):
    """What must equal a steady call's for its agreement to carry over
    (everything of the record but the counter, from local facts; ``path``:
    the path asked for, "auto" or "native")."""
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

    def run(self, comm, route, x, out, counter, op, n, workspace):
        """The result (``out`` or a new array of ``x``'s shape); raises the
        agreement's error on every rank when some rank's call differs."""
        if self._digests is None:
            self._digests = Digests(comm)
        if not self._digests.match(digest_with_counter(self.static, counter)):
            from .engine import _agree      # (engine imports this module)
            _agree(comm.allgather(dict(self.record, counter=counter)))
            raise InputMismatchError("ranks disagree on the call")   # _agree raised already
        transport = route(self.transport, x)
        flat = x.reshape(-1)
        result = out.reshape(-1) if out is not None else self.backend.empty(flat.shape[0],
                                                                            flat.dtype)
        send, recv = to_wire(self.backend, flat, self.wire, result, workspace)
        transport._native_allreduce(send, recv)
        from_wire(self.backend, recv, n if op == "mean" else 1, result)
        return out if out is not None else result.reshape(x.shape)
