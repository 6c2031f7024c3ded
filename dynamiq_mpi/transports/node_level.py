"""The in-node level of the hierarchical call (hierarchy.py): an uncompressed
reduce-scatter and all-gather among the ranks of one node.

Both kinds take the same shape of work: every local rank passes a
``(K, segment)`` array whose row ``l`` is its part for local rank ``l``;
the reduce-scatter returns the sum of row ``local`` over the node, the
all-gather stacks every rank's ``segment`` elements into ``(K, segment)``.

* :class:`StagedNodeLevel` (host arrays): K-1 shifted exchanges over the
  node's control plane (MPI, or gloo over a torch group); the sum is added
  left to right in local-rank order, in the input's dtype, so a reference
  written from the definition gets the same bits.
* :class:`NCCLNodeLevel` (device arrays, one GPU per rank): NCCL's own
  ``ncclReduceScatter`` / ``ncclAllGather`` on the caller's stream, in the
  input's dtype, over NVLink where the node has it.  NCCL chooses its own
  order of summation (the same on every rank of the node), so only the
  rail level is bit-exact against a reference, given the same in-node sums.

:func:`node_level_for` decides which serves device arrays, alike on every
rank: NCCL when it loads on every rank, no two ranks drive one GPU (NCCL
refuses them) and ``$DYNAMIQ_NODE_NCCL`` is not 0.
"""
from __future__ import annotations

import numpy as np

from ..backend import dtype_name
from ..settings import env_switch

ENV = "DYNAMIQ_NODE_NCCL"


def _xp(a):
    if isinstance(a, np.ndarray):
        return np
    import cupy
    return cupy


class StagedNodeLevel:
    """In-node collectives over the control plane's point-to-point (host arrays)."""

    name = "staged"
    device_arrays = False

    def __init__(self, node_plane, local: int, node_size: int):
        self.plane, self.local, self.k = node_plane, local, node_size

    def _exchange_all(self, payload_for, count, dtype):
        """{local rank: ``count`` elements received from it} after sending
        ``payload_for(j)`` to every other local rank j, in K-1 shifted steps."""
        k, me = self.k, self.local
        got = {}
        for s in range(1, k):
            dest, source = (me + s) % k, (me - s) % k
            send = np.ascontiguousarray(payload_for(dest))
            recv = np.empty(count, dtype=dtype)
            self.plane.sendrecv(send.view(np.uint8) if send.size else None, dest,
                                recv.view(np.uint8) if recv.size else None, source)
            got[source] = recv
        return got

    def reduce_scatter(self, rows):
        """The node's sum of row ``local`` of every rank's ``rows``, added
        left to right in local-rank order in ``rows.dtype``."""
        got = self._exchange_all(lambda j: rows[j], rows.shape[1], rows.dtype)
        got[self.local] = rows[self.local]
        acc = np.array(got[0], copy=True)
        for j in range(1, self.k):
            np.add(acc, got[j], out=acc)
        return acc

    def all_gather(self, part):
        """Every local rank's ``part``, stacked in local-rank order."""
        out = np.empty((self.k, part.shape[0]), dtype=part.dtype)
        got = self._exchange_all(lambda j: part, part.shape[0], part.dtype)
        got[self.local] = part
        for j, p in got.items():
            out[j] = p
        return out

    def free(self):
        pass


class NCCLNodeLevel:
    """NCCL's own reduce-scatter and all-gather among the node's ranks, one
    GPU each, on the caller's current stream.  ``modules``: (cupy,
    cupy.cuda.nccl) or the CPU tests' stand-ins (tests/fake_nccl.py)."""

    name = "nccl"
    device_arrays = True

    def __init__(self, node_plane, device_id: int, modules=None):
        if modules is None:
            import cupy
            from cupy.cuda import nccl
            modules = (cupy, nccl)
        self.cupy, self.nccl = modules
        self.k, self.local = node_plane.size, node_plane.rank
        from .nccl import new_communicator
        uid = node_plane.bcast(self.nccl.get_unique_id() if self.local == 0 else None, root=0)
        with self.cupy.cuda.Device(int(device_id)):
            self.comm = new_communicator(self.nccl, self.k, uid, self.local)
        self._types = {}

    def _wire(self, dtype):
        wire = self._types.get(dtype)
        if wire is None:
            from .nccl import NCCL_TYPES
            wire = self._types[dtype] = getattr(self.nccl, NCCL_TYPES[dtype_name(dtype)])
        return wire

    def _stream(self):
        return self.cupy.cuda.get_current_stream().ptr

    def reduce_scatter(self, rows):
        from .nccl import _ptr
        rows = _xp(rows).ascontiguousarray(rows)
        out = _xp(rows).empty(rows.shape[1], dtype=rows.dtype)
        if out.size:
            self.comm.reduceScatter(_ptr(rows), _ptr(out), out.size, self._wire(rows.dtype),
                                    self.nccl.NCCL_SUM, self._stream())
        return out

    def all_gather(self, part):
        from .nccl import _ptr
        part = _xp(part).ascontiguousarray(part)
        out = _xp(part).empty((self.k, part.shape[0]), dtype=part.dtype)
        if part.size:
            self.comm.allGather(_ptr(part), _ptr(out), part.size, self._wire(part.dtype),
                                self._stream())
        return out

    def free(self):
        from .nccl import destroy_communicator
        destroy_communicator(self.comm)


def node_level_for(plane, node_plane, device_id: int, staged, modules=None):
    """(level, why) for device arrays on ``device_id``: NCCL inside the node
    where it can run, else ``staged``.  Collective over the whole ``plane``
    (every rank gets the same answer, so a node never splits between the
    two)."""
    from .nccl import describe_sharing, nccl_status
    wanted = env_switch(ENV)
    if modules is None:
        usable, why_not = nccl_status()
        key = ("?", "?")
        if usable:
            import cupy
            key = (plane.node_name(), cupy.cuda.Device(int(device_id)).pci_bus_id)
    else:                       # the CPU tests' stand-ins: one fake GPU per rank
        usable, why_not, key = True, "", (plane.node_name(), f"fake:{plane.rank}")
    records = plane.allgather((wanted, usable, why_not, key))
    if not all(r[0] for r in records):
        return staged, f"in-node level staged through host memory: {ENV}=0"
    bad = [f"rank {r}: {rec[2]}" for r, rec in enumerate(records) if not rec[1]]
    if bad:
        return staged, "in-node level staged through host memory: " + "; ".join(bad)
    shared = describe_sharing([rec[3] for rec in records])
    if shared:
        return staged, ("in-node level staged through host memory: NCCL needs one GPU per "
                        f"rank ({shared})")
    return NCCLNodeLevel(node_plane, device_id, modules), "in-node level: NCCL on the device"
