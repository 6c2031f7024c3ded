"""Transports move packed byte buffers between ranks.

The engine is written once, as one generator per rank that yields the
communication it needs (:mod:`dynamiq_mpi.transports.ops`); a transport
answers it:

* ``mpi`` (``mpi_host``): mpi4py, one rank per process; device buffers staged
  through pinned host memory.  Always works.
* ``nccl`` (``nccl``): NCCL point-to-point through CuPy's bindings, on a
  private stream, overlapping with the caller's kernels.  Device arrays only.
* ``simulate`` (``simulate``): all ranks in one process.

``auto`` picks ``nccl`` when every rank passes a device array and NCCL is
usable on every rank, else ``mpi``.  The choice is a pure function of the
agreed per-rank records, so every rank makes it alike.
"""
from __future__ import annotations

from ..errors import InvalidInputError

TRANSPORTS = ("auto", "nccl", "mpi")


def transport_capabilities(backend) -> dict:
    """What this rank could use for its input (part of the agreement record)."""
    if backend is None or backend.name != "gpu":
        return {}
    from .nccl import nccl_status
    ok, why = nccl_status()
    return {"nccl": ok, "nccl_why": why}


def choose_transport(requested: str, metas: list) -> str:
    """The transport of a call, from every rank's agreement record."""
    if requested == "mpi":
        return "mpi"
    host = [r for r, m in enumerate(metas) if m["backend"] != "gpu"]
    no_nccl = [(r, m["can"].get("nccl_why", "")) for r, m in enumerate(metas)
               if m["backend"] == "gpu" and not m["can"].get("nccl")]
    if requested == "nccl":
        if host:
            raise InvalidInputError(
                f"transport='nccl' needs device (CuPy) arrays on every rank; ranks {host} "
                "passed host arrays (use transport='mpi' or 'auto')")
        if no_nccl:
            detail = "; ".join(f"rank {r}: {why}" for r, why in no_nccl)
            raise InvalidInputError(f"transport='nccl' is not usable ({detail})")
        return "nccl"
    return "nccl" if not host and not no_nccl else "mpi"
