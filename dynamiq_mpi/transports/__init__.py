"""Transports move packed byte buffers between ranks, answering the requests
(``ops.py``) of the engine's per-rank generators (docs/design.md's table).
``auto`` picks NCCL, else a CUDA-aware MPI, else host staging, from the
agreed records: every rank chooses alike, and a transport asked for but
unusable is the same error on every rank.
"""
from __future__ import annotations

import importlib

from ..errors import InvalidInputError
from ..settings import env_text
from .cuda_aware import ENV, _mpi_running, cuda_aware_mpi

# The transports a call may name: (module, class), imported on first use (NCCL's needs CuPy).
REGISTRY = {"nccl": ("nccl", "NCCLTransport"), "mpi-cuda": ("mpi_cuda", "MPICudaTransport"),
            "mpi": ("mpi_host", "HostTransport")}
TRANSPORTS = ("auto",) + tuple(REGISTRY)


def transport_class(name: str):
    """The class of the transport called ``name`` (a key of REGISTRY)."""
    module, cls = REGISTRY[name]
    return getattr(importlib.import_module(f".{module}", __name__), cls)


# The wire dtypes of the transports' own all-reduce per backend (MPI: no BF16 sum).
_NATIVE_WIRES = {("nccl", "gpu"): ("bfloat16", "float16", "float32", "float64"),
                 ("mpi", "cpu"): ("float32", "float64")}


def native_wires(transport: str, backend_name: str) -> tuple:
    """Wire dtypes of ``transport``'s own all-reduce for ``backend_name``
    arrays; () when it has none (then a call runs compressed)."""
    return _NATIVE_WIRES.get((transport, backend_name), ())


_CAPABILITIES: dict = {}


def transport_capabilities(backend) -> dict:
    """What this rank could use (part of the agreement record; CUDA-awareness
    for host arrays too, so ``mpi-cuda`` refuses alike); a copy of the kept."""
    name = None if backend is None else backend.name
    nccl = None
    if name == "gpu":
        from .nccl import nccl_status
        nccl = nccl_status()
    key = (name, env_text(ENV, ""), _mpi_running(), nccl)
    can = _CAPABILITIES.get(key)
    if can is None:
        aware = cuda_aware_mpi()
        can = _CAPABILITIES[key] = {"mpi_cuda": aware.aware, "mpi_cuda_why": aware.why}
        if nccl is not None:
            can.update(nccl=nccl[0], nccl_why=nccl[1])
    return dict(can)


def _by_reason(pairs) -> str:
    """'ranks [0, 1]: why; rank 2: other' (identical reasons grouped)."""
    groups = {}
    for r, why in pairs:
        groups.setdefault(why, []).append(r)
    return "; ".join(f"rank {rs[0]}: {why}" if len(rs) == 1 else f"ranks {rs}: {why}"
                     for why, rs in groups.items())


def explain_transport(requested: str, metas: list) -> tuple:
    """(transport, why) of a call from every rank's agreement record, or
    :class:`InvalidInputError` (alike on every rank) where it cannot run."""
    if requested == "mpi":
        return "mpi", "requested"
    host = [r for r, m in enumerate(metas) if m["backend"] != "gpu"]
    no_nccl = [(r, m["can"].get("nccl_why", "")) for r, m in enumerate(metas)
               if m["backend"] == "gpu" and not m["can"].get("nccl")]
    no_cuda_mpi = [(r, m["can"].get("mpi_cuda_why", "not probed"))
                   for r, m in enumerate(metas) if not m["can"].get("mpi_cuda")]
    if requested == "nccl":
        if host:
            raise InvalidInputError(
                f"transport='nccl' needs device (CuPy) arrays on every rank; ranks {host} "
                "passed host arrays (use transport='mpi' or 'auto')")
        if no_nccl:
            detail = "; ".join(f"rank {r}: {why}" for r, why in no_nccl)
            raise InvalidInputError(f"transport='nccl' is not usable ({detail})")
        return "nccl", "requested"
    if requested == "mpi-cuda":
        if no_cuda_mpi:
            raise InvalidInputError(
                f"transport='mpi-cuda' needs a CUDA-aware MPI on every rank "
                f"({_by_reason(no_cuda_mpi)}); use transport='mpi' (host staging) or 'auto'")
        if host:
            raise InvalidInputError(
                f"transport='mpi-cuda' needs device (CuPy) arrays on every rank; ranks {host} "
                "passed host arrays (use transport='mpi' or 'auto')")
        return "mpi-cuda", "requested"
    # auto: NCCL, then CUDA-aware MPI, then host staging
    if host:
        return "mpi", f"auto: host arrays on ranks {host}"
    if not no_nccl:
        return "nccl", "auto: device arrays and NCCL usable on every rank"
    nccl_why = f"NCCL not usable ({_by_reason(no_nccl)})"
    if not no_cuda_mpi:
        whys = sorted({m["can"].get("mpi_cuda_why", "") for m in metas})
        return "mpi-cuda", f"auto: {nccl_why}; MPI CUDA-aware on every rank ({'; '.join(whys)})"
    return "mpi", (f"auto: {nccl_why}; MPI not CUDA-aware ({_by_reason(no_cuda_mpi)}): "
                   "device buffers staged through host memory")


_CHOSEN: dict = {}


def choose_transport(requested: str, metas: list) -> str:
    """The transport of a call from the agreement records (kept where one record decides)."""
    first = metas[0]
    if not all([m is first for m in metas]):
        return explain_transport(requested, metas)[0]
    key = (requested, len(metas), first["backend"], tuple(sorted(first["can"].items())))
    chosen = _CHOSEN.get(key)
    if chosen is None:
        chosen = explain_transport(requested, metas)[0]    # raises when unusable
        if len(_CHOSEN) < 256:
            _CHOSEN[key] = chosen
    return chosen
