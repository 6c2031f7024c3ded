"""dynamiq-mpi: compressed multi-hop all-reduce (DynamiQ) over MPI.

    from dynamiq_mpi import allreduce, DynamiQ
    total = allreduce(grad, codec=DynamiQ(bits=5), topology="ring")
"""
from .api import (COLLECTIVE_OPTIONS, Collective, allreduce, check_collective_options,
                  collective_for, default_comm, is_torch_group, plane_of, reduce_scatter,
                  simulate_allreduce, simulate_reduce_scatter)
from .codecs import BF16, MXFP, THC, DynamiQ, Exact, OmniReduce
from .errors import (DynamiQError, InputMismatchError, InvalidInputError, NonFiniteInputError,
                     SumOverflowError)
from .report import Report
from .schedules import TopologyError

__version__ = "0.1.0"   # the one version: setup.cfg reads it from here


def has_cuda() -> bool:
    """True if the CUDA kernels were built and a GPU is usable (never raises)."""
    try:
        from .cuda import has_cuda as _has_cuda
    except Exception:
        return False
    return _has_cuda()


__all__ = ["allreduce", "simulate_allreduce", "reduce_scatter", "simulate_reduce_scatter", "Collective", "collective_for",
           "COLLECTIVE_OPTIONS", "check_collective_options", "plane_of", "default_comm",
           "is_torch_group", "DynamiQ",
           "Exact", "BF16", "MXFP", "THC", "OmniReduce", "Report", "has_cuda", "DynamiQError", "InputMismatchError",
           "InvalidInputError", "NonFiniteInputError", "SumOverflowError", "TopologyError"]
