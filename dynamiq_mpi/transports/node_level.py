"""The in-node level of the hierarchical call (docs/design.md): every local
rank passes ``(K, segment)`` rows, row ``l`` its part for local rank ``l``;
the reduce-scatter returns the node's sum of row ``local``, the all-gather
stacks every rank's segment.  :func:`node_level_for` picks NCCL's own or the
control plane's (a left-to-right sum), alike on every rank.
"""
from __future__ import annotations

import numpy as np

from ..backend import array_module
from ..settings import env_switch

ENV = "DYNAMIQ_NODE_NCCL"


class StagedNodeLevel:
    """In-node collectives over the control plane's point-to-point (host arrays)."""

    name = "staged"
    device_arrays = False

    def __init__(self, node_plane, local: int, node_size: int):
        self.plane, self.local, self.k = node_plane, local, node_size

    def _exchange_all(self, payload_for, count, dtype):
        """{local rank j: ``count`` elements from j}, ``payload_for(j)`` sent to
        every other j, in K-1 shifted steps."""
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
        """The node's sum of row ``local`` of every rank's ``rows``, left to right by rank."""
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
    """NCCL's own reduce-scatter and all-gather on the caller's stream, a GPU
    per rank; ``modules``: (cupy, cupy.cuda.nccl) or tests/fake_nccl.py's."""

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

    def _wire(self, dtype):
        from .nccl import nccl_type
        return nccl_type(self.nccl, dtype)

    def _stream(self):
        return self.cupy.cuda.get_current_stream().ptr

    def reduce_scatter(self, rows):
        from .nccl import _ptr
        rows = array_module(rows).ascontiguousarray(rows)
        out = array_module(rows).empty(rows.shape[1], dtype=rows.dtype)
        if out.size:
            self.comm.reduceScatter(_ptr(rows), _ptr(out), out.size, self._wire(rows.dtype),
                                    self.nccl.NCCL_SUM, self._stream())
        return out

    def all_gather(self, part):
        from .nccl import _ptr
        part = array_module(part).ascontiguousarray(part)
        out = array_module(part).empty((self.k, part.shape[0]), dtype=part.dtype)
        if part.size:
            self.comm.allGather(_ptr(part), _ptr(out), part.size, self._wire(part.dtype),
                                self._stream())
        return out

    def free(self):
        from .nccl import destroy_communicator
        destroy_communicator(self.comm)


def node_level_for(plane, node_plane, device_id: int, staged, modules=None):
    """(level, why) for device arrays on ``device_id``: NCCL where it loads on
    every rank, no two ranks drive one GPU and ``$DYNAMIQ_NODE_NCCL`` is not
    0, else ``staged``; collective over ``plane``, so alike on every rank."""
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
