"""Is the CUDA path available here?  ``has_cuda()`` (never raises, cached):
the kernels were built, CuPy imports and a device is usable;
``gpu_module()``: the kernel module, or an error saying why there is none.
"""
from __future__ import annotations

import threading

_lock = threading.Lock()
_state: dict = {}


def _probe() -> tuple[bool, str]:
    try:
        from . import _gpu
    except Exception as exc:  # ImportError, or a broken build
        return False, ("dynamiq_mpi was built without its CUDA kernels (nvcc not found at build "
                       f"time, or DYNAMIQ_NO_CUDA=1): {exc}")
    try:
        if not _gpu.is_usable():
            return False, "no usable CUDA device or driver"
    except Exception as exc:  # pragma: no cover - is_usable() does not raise
        return False, f"CUDA device query failed: {exc}"
    try:
        import cupy  # noqa: F401
    except Exception as exc:
        return False, f"CuPy is not importable: {exc}"
    return True, ""


def _cached() -> tuple[bool, str]:
    with _lock:
        if "result" not in _state:
            _state["result"] = _probe()
        return _state["result"]


def has_cuda() -> bool:
    """True when the CUDA kernels are built, CuPy imports and a GPU is usable."""
    try:
        return _cached()[0]
    except Exception:  # pragma: no cover - never raise
        return False


def why_not() -> str:
    """Empty when has_cuda(), else the reason."""
    return _cached()[1]


def gpu_module():
    """The kernel module ``dynamiq_mpi._gpu``, or RuntimeError saying why there is none."""
    ok, reason = _cached()
    if not ok:
        raise RuntimeError(f"the CUDA kernels are not available: {reason}")
    from . import _gpu
    return _gpu
