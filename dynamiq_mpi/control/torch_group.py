"""The torch control plane over a ``torch.distributed`` process group: a
private gloo group of the same ranks, made on the first operation and keyed
in the job's store by the global ranks and a per-process count, so only the
members take part (docs/design.md, "Control planes", says why not the
caller's group nor ``new_group``).  Every value travels as a CPU tensor.
"""
from __future__ import annotations

import atexit
import datetime
import pickle
import socket
import threading
import weakref

import numpy as np
import torch
import torch.distributed as dist

from ..errors import InvalidInputError
from . import ControlPlane, shm_slots, socket_ring

_TAG = 0x5D17
_made = {}                   # global ranks -> private groups made by this process
_made_lock = threading.Lock()
_live = weakref.WeakSet()    # planes holding a private group


@atexit.register
def _close_all():
    """Destroy the private groups before the interpreter tears down: a gloo
    group collected during finalisation can abort the process."""
    for plane in list(_live):
        plane.free()
    import gc
    gc.collect()


def group_timeout(group) -> datetime.timedelta:
    """The group's timeout (its CPU backend's, else CUDA's), else torch's default."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except Exception:
            continue
    return getattr(dist, "default_pg_timeout", datetime.timedelta(minutes=30))


def _check_member(group):
    if group is None or group is dist.GroupMember.WORLD:
        if not dist.is_initialized():
            raise InvalidInputError(
                "dynamiq_mpi: torch.distributed is not initialised: call "
                "torch.distributed.init_process_group(...) before making a collective over it")
        return dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise InvalidInputError("dynamiq_mpi: this rank is not a member of the process group "
                                "it was given")
    return group


class TorchPlane(ControlPlane):
    name = "torch"
    thread_safe = True

    def __init__(self, group=None, *, _members=None):
        if _members is not None:        # a subset of another plane (split)
            self.group, self.ranks, self.rank, self.timeout = _members
            self.size = len(self.ranks)
        else:
            self.group = _check_member(group)
            self.ranks = dist.get_process_group_ranks(self.group)
            self.rank, self.size = self.group.rank(), self.group.size()
            self.timeout = group_timeout(self.group)
        self._pg = None
        self._ring = None           # socket_ring.SocketRing, made with the gloo group
        self._slots = None          # shm_slots.SharedSlots (members on one host)
        self._lock = threading.Lock()

    # -- the private gloo group (made on the first operation: collective)
    def _gloo(self):
        pg = self._pg
        if pg is not None:
            return pg
        with self._lock:
            if self._pg is None:
                from torch.distributed.distributed_c10d import _get_default_store
                key = tuple(self.ranks)
                with _made_lock:
                    index = _made[key] = _made.get(key, 0) + 1
                name = ",".join(map(str, key)) if len(key) <= 16 else \
                    f"{len(key)}:{hash(key) & 0xFFFFFFFF:08x}"
                store = dist.PrefixStore(f"dynamiq_mpi/{name}/{index}/", _get_default_store())
                pg = dist.ProcessGroupGloo(store, self.rank, self.size, self.timeout)
                _live.add(self)
                self._ring, self._slots = self._fast_paths(pg, store)
                self._pg = pg
            return self._pg

    def _fast_paths(self, pg, store):
        """(socket ring, shared-memory slots) for small exchanges, each kept
        only if every member has it; slots need every member on this host."""
        if self.size < 2 or not socket_ring.enabled():
            return None, None
        host = np.frombuffer(socket.gethostname().encode()[:64].ljust(64, b"\0"), np.uint8)
        hosts = np.empty((self.size, 64), np.uint8)
        self._gloo_allgather(pg, host, hosts)
        same_host = bool((hosts == hosts[0]).all())
        seconds = self.timeout.total_seconds()
        slots = (shm_slots.SharedSlots(store, self.rank, self.size, seconds)
                 if same_host and shm_slots.supported() else None)
        ring = socket_ring.SocketRing(store, self.rank, self.size, seconds, same_host)
        flags = np.empty((self.size, 2), np.uint8)
        self._gloo_allgather(pg, np.array([ring.ok, slots is not None and slots.ok], np.uint8),
                             flags)
        if not flags[:, 0].all():
            ring.close()
            ring = None
        if slots is not None:
            if flags[:, 1].all():
                slots.release_name()      # every member attached (they did before the flags)
            else:
                slots.close()
                slots = None
        return ring, slots

    # -- object collectives (pickled into uint8 tensors)
    def allgather(self, value) -> list:
        if self.size == 1:
            return [value]
        data = np.frombuffer(pickle.dumps(value, protocol=4), dtype=np.uint8)
        sizes = np.empty(self.size, dtype=np.int64)
        self.allgather_array(np.array([data.size], dtype=np.int64), sizes)
        width = int(sizes.max())
        mine = np.zeros(width, dtype=np.uint8)
        mine[:data.size] = data
        everyone = np.empty((self.size, width), dtype=np.uint8)
        self.allgather_array(mine, everyone)
        return [pickle.loads(everyone[r, :sizes[r]].tobytes()) for r in range(self.size)]

    def bcast(self, value, root: int = 0):
        if self.size == 1:
            return value
        pg = self._gloo()
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = int(root), 0
        data = pickle.dumps(value, protocol=4) if self.rank == root else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        pg.broadcast([size], opts).wait()
        buf = torch.empty(int(size[0]), dtype=torch.uint8)
        if self.rank == root:
            buf.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        pg.broadcast([buf], opts).wait()
        return value if self.rank == root else pickle.loads(buf.numpy().tobytes())

    # -- fixed-size NumPy collectives
    def allgather_array(self, mine, everyone) -> None:
        """``everyone`` (``size`` rows of ``mine``'s bytes) gets every rank's
        ``mine``, as MPI's Allgather: bytes, so any dtype goes."""
        rows = everyone.view(np.uint8).reshape(self.size, -1)   # (contiguous: ours)
        flat = np.ascontiguousarray(mine).view(np.uint8).reshape(-1)
        if self.size == 1:
            rows[0] = flat
            return
        pg = self._gloo()
        if self._slots is not None and rows.shape[1] <= shm_slots.SLOT:
            for r, part in enumerate(self._slots.allgather(flat.tobytes())):
                rows[r] = np.frombuffer(part, np.uint8)
            return
        ring = self._ring
        if ring is not None and rows.size <= socket_ring.MAX_BYTES:
            for r, part in enumerate(ring.allgather(flat.tobytes())):
                rows[r] = np.frombuffer(part, np.uint8)
            return
        self._gloo_allgather(pg, flat, rows)

    def _gloo_allgather(self, pg, flat, rows):
        rows = rows.view(np.uint8).reshape(self.size, -1)
        outs = [torch.from_numpy(rows[r]) for r in range(self.size)]
        pg.allgather([outs], [torch.from_numpy(_writable(flat.view(np.uint8).reshape(-1)))]).wait()

    def allreduce_max(self, mine, out) -> None:
        self._allreduce(mine, out, dist.ReduceOp.MAX)

    def allreduce_sum(self, send, recv) -> None:
        self._allreduce(send, recv, dist.ReduceOp.SUM)

    def _allreduce(self, send, recv, op):
        if send is not recv:
            np.copyto(recv, send)
        if self.size == 1:
            return
        pg = self._gloo()
        if self._ring is not None and recv.nbytes * self.size <= socket_ring.MAX_BYTES:
            # small: over the ring, combined in rank order (alike on every rank)
            everyone = np.empty((self.size,) + recv.shape, recv.dtype)
            self.allgather_array(np.ascontiguousarray(recv), everyone)
            acc = everyone[0].copy()
            for r in range(1, self.size):
                if op == dist.ReduceOp.MAX:
                    np.maximum(acc, everyone[r], out=acc)
                else:
                    np.add(acc, everyone[r], out=acc)
            recv[...] = acc
            return
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        pg.allreduce([torch.from_numpy(recv)], opts).wait()

    # -- host payload, point to point
    def sendrecv(self, send, dest, recv, source) -> None:
        pg = self._gloo()
        works = []
        if send is not None:
            works.append(pg.send([torch.from_numpy(_writable(send).reshape(-1))], dest, _TAG))
        if recv is not None:
            works.append(pg.recv([torch.from_numpy(recv.reshape(-1))], source, _TAG))
        for w in works:
            w.wait()

    def barrier(self) -> None:
        if self.size > 1:
            self.allgather_array(np.zeros(1, np.uint8), np.empty(self.size, np.uint8))

    def node_name(self) -> str:
        return socket.gethostname()

    def dup(self) -> "TorchPlane":
        return TorchPlane(_members=(self.group, list(self.ranks), self.rank, self.timeout))

    def split(self, color: int, key: int) -> "TorchPlane":
        """Members by the job's global ranks: their private gloo group is
        keyed by those ranks, so only they take part in making it."""
        everyone = self.allgather((int(color), int(key), self.ranks[self.rank]))
        mine = sorted((k, g) for c, k, g in everyone if c == int(color))
        ranks = [g for _, g in mine]
        return TorchPlane(_members=(self.group, ranks, ranks.index(self.ranks[self.rank]),
                                    self.timeout))

    def free(self) -> None:
        for fast in (self._ring, self._slots):
            if fast is not None:
                fast.close()
        self._ring = self._slots = None
        self._pg = None         # gloo closes its pairs when the group is collected


def _writable(a):
    """torch.from_numpy refuses read-only arrays: copy those only."""
    return a if a.flags.writeable else a.copy()
