"""Transports move packed byte buffers between ranks.

The engine is written once, as one generator per rank that yields the
communication it needs (:mod:`dynamiq_mpi.transports.ops`); a transport drives
it: ``mpi`` runs one rank per process over mpi4py, ``simulate`` runs all ranks
in lockstep in one process.
"""
from .ops import AllgatherObject, Exchange
from .simulate import SimulatedTransport

__all__ = ["AllgatherObject", "Exchange", "SimulatedTransport"]
