"""Public entry points: :func:`allreduce`, :class:`Collective` and
:func:`simulate_allreduce`."""
from __future__ import annotations

import threading

from .codecs.dynamiq import DynamiQ
from .engine import CallSpec, rank_program
from .transports.simulate import SimulatedTransport


class Collective:
    """A communicator's compressed all-reduce.

    Owns a private duplicate of ``comm`` and the per-communicator call counter
    that keys the generator (successive calls with the same seed draw fresh
    randomness).  Calls are serialised by a lock, so DDP hooks on other
    threads may share it.  Every rank must make the same sequence of calls.
    """

    def __init__(self, comm=None, transport: str = "mpi"):
        if comm is None:
            from mpi4py import MPI
            comm = MPI.COMM_WORLD
        if transport != "mpi":
            raise ValueError(f"unknown transport {transport!r} (available: 'mpi')")
        from .transports.mpi_host import MPITransport
        self.parent = comm
        self.transport = MPITransport(comm)
        self.rank, self.size = self.transport.rank, self.transport.size
        self._counter = 0
        self._lock = threading.Lock()

    def allreduce(self, x, *, codec=None, topology="ring", op="sum", seed=0,
                  return_report=False):
        codec = DynamiQ() if codec is None else codec
        with self._lock:
            counter = self._counter
            self._counter += 1
            spec = CallSpec(codec, topology, op, seed, counter)
            out, report = self.transport.run(rank_program(self.rank, self.size, x, spec))
        return (out, report) if return_report else out


_collectives = {}
_collectives_lock = threading.Lock()


def collective_for(comm=None) -> Collective:
    """The library's cached :class:`Collective` of ``comm`` (COMM_WORLD by default)."""
    if comm is None:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    with _collectives_lock:
        entry = _collectives.get(id(comm))
        if entry is None or entry.parent is not comm:
            entry = _collectives[id(comm)] = Collective(comm)
        return entry


def allreduce(x, *, codec=None, topology="ring", op="sum", comm=None, seed=0,
              return_report=False):
    """Compressed all-reduce of ``x`` over ``comm`` (default ``MPI.COMM_WORLD``).

    Every rank passes an array of the same length and dtype (float32 or
    bfloat16, NumPy or CuPy, any C-contiguous shape) and gets back a new array
    of that shape and dtype holding the same estimate of the sum (or mean) on
    every rank, bit for bit.  With ``return_report=True`` returns
    ``(result, Report)``.
    """
    return collective_for(comm).allreduce(x, codec=codec, topology=topology, op=op, seed=seed,
                                          return_report=return_report)


def simulate_allreduce(xs, *, codec=None, topology="ring", op="sum", seed=0, counter=0,
                       return_reports=False):
    """Run the all-reduce of ``len(xs)`` ranks in this process (rank r passes
    ``xs[r]``).  Returns the list of every rank's output (and reports)."""
    codec = DynamiQ() if codec is None else codec
    n = len(xs)
    spec = CallSpec(codec, topology, op, seed, counter)
    results = SimulatedTransport(n).run([rank_program(r, n, xs[r], spec) for r in range(n)])
    outs = [r[0] for r in results]
    return (outs, [r[1] for r in results]) if return_reports else outs
