"""Is the MPI that mpi4py loaded CUDA-aware?  Asked, never guessed (a wrong
"yes" makes MPI read device pointers as host memory): docs/cuda_aware_mpi.md
gives the sources and their order.  :func:`detect` takes every source
injectable; :func:`cuda_aware_mpi` probes MPI once, never uninitialised.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from dataclasses import dataclass

from ..settings import env_text, environment

ENV = "DYNAMIQ_CUDA_AWARE_MPI"
INFO_KEY = "mpi_memory_alloc_kinds"
GPU_QUERY = "MPIX_GPU_query_support"
CUDA_QUERY = "MPIX_Query_cuda_support"
MPIX_GPU_SUPPORT_CUDA = 0     # MPICH's type id for CUDA in MPIX_GPU_query_support


@dataclass(frozen=True)
class CudaAwareness:
    """``aware``: device buffers may go to MPI; ``source``: "env", "info",
    "query" or "none"; ``why``: one line for errors and reports."""
    aware: bool
    source: str
    why: str


def detect(environ=None, info=None, libraries=None) -> CudaAwareness:
    """The detection, each source asked only if the ones before did not answer:
    ``environ`` (a mapping), ``info`` (an ``MPI.Info``-like object or a
    callable returning one), ``libraries`` (``(name, library)`` pairs whose
    attributes are the C functions); defaults: this process's."""
    environ = environment() if environ is None else environ
    from_env = _from_env(environ.get(ENV, ""))
    if from_env is not None:
        return from_env
    kinds = _alloc_kinds(info)
    if _lists_cuda_device(kinds):
        return CudaAwareness(True, "info", f"{INFO_KEY}={kinds!r} lists CUDA device memory")
    seen = f"{INFO_KEY}={kinds!r}"
    found = _query(_default_libraries() if libraries is None else libraries)
    if found is not None:
        aware, call, name = found
        state = "CUDA-aware" if aware else "not CUDA-aware"
        return CudaAwareness(aware, "query", f"{call} in {name}: {state} ({seen})")
    return CudaAwareness(False, "none",
                         f"cannot tell: {seen} and the loaded MPI library has neither "
                         f"{GPU_QUERY} nor {CUDA_QUERY}; set {ENV}=1 if it is CUDA-aware")


def _from_env(value: str):
    value = value.strip()
    if value in ("0", "1"):
        return CudaAwareness(value == "1", "env", f"{ENV}={value}")
    if value:
        # never raise here: this runs before the agreement, on one rank only
        return CudaAwareness(False, "env", f"{ENV} must be 0 or 1, got {value!r}")
    return None


def _alloc_kinds(info):
    """The info value, or None when the key (or the info) is absent."""
    try:
        if info is None:
            from mpi4py import MPI
            obj = MPI.COMM_WORLD.Get_info()
            try:
                return obj.Get(INFO_KEY)
            finally:
                obj.Free()
        obj = info() if callable(info) and not hasattr(info, "Get") else info
        return obj.Get(INFO_KEY)
    except Exception:   # an MPI before 4.0 has no Comm_get_info: no answer, not an error
        return None


def _lists_cuda_device(kinds) -> bool:
    """``cuda`` (every restrictor) or ``cuda:device`` in a comma list;
    ``cuda:host`` or ``cuda:managed`` alone do not cover cudaMalloc'd buffers."""
    return bool(kinds) and any(k.strip().lower() in ("cuda", "cuda:device")
                               for k in str(kinds).split(","))


def _query(libraries):
    """(aware, call, library name) from the first library that exports a query, or None."""
    for name, lib in libraries:
        gpu = _symbol(lib, GPU_QUERY)
        if gpu is not None:
            flag = ctypes.c_int(0)
            with contextlib.suppress(AttributeError, TypeError):
                gpu.restype = ctypes.c_int
                gpu.argtypes = (ctypes.c_int, ctypes.POINTER(ctypes.c_int))
            rc = gpu(MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag))
            aware = rc == 0 and flag.value == 1
            call = f"{GPU_QUERY}(CUDA) " + (f"= {flag.value}" if rc == 0 else f"failed ({rc})")
            return aware, call, name
        cuda = _symbol(lib, CUDA_QUERY)
        if cuda is not None:
            with contextlib.suppress(AttributeError, TypeError):
                cuda.restype = ctypes.c_int
                cuda.argtypes = ()
            value = int(cuda())
            return value == 1, f"{CUDA_QUERY}() = {value}", name
    return None


def _symbol(lib, name):
    try:
        return getattr(lib, name)
    except (AttributeError, OSError):
        return None


def loaded_mpi_library_paths() -> list:
    """The MPI library files mapped into this process, ``libmpi.so*`` first,
    then mpi4py's extension module (its dependencies are its MPI)."""
    paths = []
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:     # OSError: not Linux
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and "libmpi" in os.path.basename(fields[-1]):
                if fields[-1] not in paths:
                    paths.append(fields[-1])
    paths.sort(key=lambda p: (not os.path.basename(p).startswith("libmpi.so"), p))
    with contextlib.suppress(Exception):
        from mpi4py import MPI
        paths.append(MPI.__file__)
    return paths


def _default_libraries():
    """(path, CDLL) of :func:`loaded_mpi_library_paths`, opened lazily."""
    for path in loaded_mpi_library_paths():
        try:
            yield path, ctypes.CDLL(path)
        except OSError:
            continue


_probe_lock = threading.Lock()
_probed = None


def cuda_aware_mpi() -> CudaAwareness:
    """This process's answer: the environment override, else the MPI probes (made once)."""
    from_env = _from_env(env_text(ENV, ""))
    if from_env is not None:
        return from_env
    if not _mpi_running():
        # e.g. simulate_allreduce: no MPI to ask, and asking must not start one
        return CudaAwareness(False, "none", "MPI is not initialised in this process")
    global _probed
    with _probe_lock:
        if _probed is None:
            try:
                _probed = detect(environ={})
            except Exception as exc:   # a probe that breaks is no "yes"
                _probed = CudaAwareness(False, "none", f"the CUDA-awareness probe failed: {exc}")
        return _probed


def _mpi_running() -> bool:
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        return mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized()
    except Exception:
        return False


def has_cuda_aware_mpi() -> bool:
    """True if device buffers may be handed to this process's MPI."""
    return cuda_aware_mpi().aware
