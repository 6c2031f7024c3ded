"""The native path's wire: the dtype the transport's own all-reduce sums in
(BF16 for the lossy codecs on NCCL, float32 on MPI, the input's own for
``Exact``) and the casts into and out of it, dividing for a mean (NumPy, or
one fused CuPy kernel per cast).  Used by the engine and native.py."""
from __future__ import annotations

import numpy as np

from ..backend import BFLOAT16, dtype_name


def wire_dtype(codec, input_dtype: str, wires: tuple) -> str:
    """The sum's dtype: the codec's ``native_wire`` (None: input's), else the widest taken."""
    want = getattr(codec, "native_wire", "bfloat16") or input_dtype
    if want in wires:
        return want
    if input_dtype == "float64" and "float64" in wires:
        return "float64"
    return "float32"


_KERNELS = {}
# float bits u -> BF16 bits y: the tail of both rounding kernels below
_ROUND_TO_BF16 = """
    if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x7FFFFFu))
        y = (unsigned short)((u >> 16) | 0x40u);
    else
        y = (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);"""


def _gpu_kernels():
    """CuPy elementwise kernels: float -> BF16 bits (round to nearest even, NaN
    kept quiet, as ``backend.float32_to_bf16``) and BF16 bits -> scaled float."""
    if not _KERNELS:
        import cupy
        _KERNELS["to_bf16"] = cupy.ElementwiseKernel(
            "T x", "uint16 y",
            "unsigned int u = __float_as_uint((float)x);" + _ROUND_TO_BF16,
            "dq_native_to_bf16")
        _KERNELS["from_bf16"] = cupy.ElementwiseKernel(
            "uint16 b, float32 s", "T y",
            "y = (T)(__uint_as_float(((unsigned int)b) << 16) * s);",
            "dq_native_from_bf16")
        _KERNELS["bf16_scale"] = cupy.ElementwiseKernel(
            "uint16 b, float32 s", "uint16 y",
            "unsigned int u = __float_as_uint(__uint_as_float(((unsigned int)b) << 16) * s);"
            + _ROUND_TO_BF16,
            "dq_native_bf16_scale")
    return _KERNELS


def _bits(a):
    return a.view(np.uint16)


def to_wire(backend, flat, wire: str, result, workspace):
    """(send, recv) of the transport's all-reduce: the input into ``result``
    where the wire is its dtype, else the cast input, reduced in place."""
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
    """``result`` = ``buf`` / ``divisor`` in the result's dtype (``buf`` may be ``result``)."""
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
