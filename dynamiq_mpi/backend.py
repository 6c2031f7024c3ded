"""Array backends: NumPy arrays run on the CPU codec (``dynamiq_mpi._cpu``),
CuPy arrays on the CUDA kernels (``dynamiq_mpi._gpu``) when they were built.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
# float16 and float64 inputs are read as float32, the result cast back.
SUPPORTED_DTYPES = (np.dtype(np.float32), BFLOAT16, np.dtype(np.float16), np.dtype(np.float64))


@dataclass(frozen=True)
class Backend:
    name: str      # "cpu" or "gpu"
    xp: Any        # numpy or cupy
    kernels: Any   # dynamiq_mpi._cpu or dynamiq_mpi._gpu

    def empty(self, shape, dtype):
        return self.xp.empty(shape, dtype=dtype)

    def zeros(self, shape, dtype):
        return self.xp.zeros(shape, dtype=dtype)

    def to_host(self, array):
        return array if self.name == "cpu" else self.xp.asnumpy(array)


def array_module(x):
    """NumPy for a NumPy array, else CuPy."""
    return np if isinstance(x, np.ndarray) else __import__("cupy")


@functools.cache         # (kept once the extension imports)
def _cpu_backend() -> Backend:
    from . import _cpu
    return Backend("cpu", np, _cpu)


def backend_for(x) -> Backend:
    """The backend of an input array (NumPy -> cpu, CuPy -> gpu)."""
    if isinstance(x, np.ndarray):
        return _cpu_backend()
    if type(x).__module__.startswith("cupy"):
        return gpu_backend()
    raise TypeError(f"unsupported array type {type(x).__name__}: pass a NumPy or CuPy array "
                    "(or use dynamiq_mpi.torch for torch tensors)")


_DTYPE_NAMES: dict = {}


def dtype_name(dtype) -> str:
    # cached: NumPy's dtype.name costs ~7 us, twice per call
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = "bfloat16" if np.dtype(dtype) == BFLOAT16 else np.dtype(dtype).name
        if len(_DTYPE_NAMES) < 64:
            _DTYPE_NAMES[dtype] = name
    return name


_GPU_BACKEND = None


def gpu_backend() -> Backend:
    """The CUDA backend (kept once it works); an error saying why without it."""
    global _GPU_BACKEND
    if _GPU_BACKEND is None:
        from .cuda import gpu_module
        kernels = gpu_module()
        import cupy
        _GPU_BACKEND = Backend("gpu", cupy, kernels)
    return _GPU_BACKEND


def bf16_to_float32(x):
    """Exact BF16 -> float32 with integer ops (same on NumPy and CuPy)."""
    xp = array_module(x)
    bits = x.view(xp.uint16).astype(xp.uint32) << 16
    return bits.view(xp.float32)


def float32_to_bf16(x):
    """float32 -> BF16, round to nearest even, with integer ops (same on NumPy
    and CuPy, and equal to ml_dtypes for every non-NaN value)."""
    xp = array_module(x)
    u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    rounded = (u + xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1))) >> 16
    nan = (u & xp.uint32(0x7F800000)) == xp.uint32(0x7F800000)
    nan &= (u & xp.uint32(0x7FFFFF)) != 0
    rounded = xp.where(nan, (u >> 16) | xp.uint32(0x40), rounded)
    return rounded.astype(xp.uint16).view(BFLOAT16)


def as_float32(x):
    return bf16_to_float32(x) if x.dtype == BFLOAT16 else x.astype(np.float32, copy=False)
