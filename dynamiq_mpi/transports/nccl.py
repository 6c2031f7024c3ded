"""NCCL point-to-point transport through CuPy (docs/design.md's table): the
caller's stream computes, private *lane* streams (a communicator each) carry
the messages, a :class:`~.ops.Claim` makes the compute stream wait on the
receive's events; the host never waits.
"""
from __future__ import annotations

import contextlib
import threading
import time

from ..backend import dtype_name
from .base import Transport
from .ops import Received, payload_array

_status_lock = threading.Lock()
_status = None

# NCCL communicators made here and not destroyed yet.  ncclCommDestroy waits
# until every other rank of the node has dropped the same communicator, and
# CuPy's communicator destroys itself when deallocated: one dropped without
# free() (a HookState and its Collective sit in a reference cycle) would be
# destroyed by the garbage collector at each rank's own moment, the first rank
# waiting inside its call for peers that wait for it (a hang).  Held here, it
# waits for free() or the interpreter's exit, every rank alike.
_HELD: list = []


def new_communicator(nccl, size: int, uid, rank: int):
    """``nccl.NcclCommunicator(size, uid, rank)``, held until
    :func:`destroy_communicator`: never destroyed by the garbage collector."""
    comm = nccl.NcclCommunicator(size, uid, rank)
    _HELD.append(comm)
    return comm


def destroy_communicator(comm) -> None:
    """Destroy a communicator of :func:`new_communicator` (collective: every
    rank of it, in the same order), ignoring errors, and let it go."""
    with contextlib.suppress(Exception):
        comm.destroy()
    with contextlib.suppress(ValueError):
        _HELD.remove(comm)


MIN_LANE_BYTES = 1 << 20     # the smallest slice worth a lane of its own
LANE_ALIGN = 256             # lane slices start at multiples of this
# lanes="auto" on a shared-memory link (2x H200, docs/benchmarks.md): 4 lanes
# took 2^26-2^28 from 1.9-2.3x to 2.1-2.6x NCCL's all-reduce; slicing the 2.6 MB
# messages of 2^23 cost a third, so slices of at least 4 MiB.
SHM_LANES, SHM_LANE_BYTES = 4, 4 << 20
NCCL_TYPES = {"bfloat16": "NCCL_BFLOAT16", "float16": "NCCL_FLOAT16",
              "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64"}
_TYPES: dict = {}


def nccl_type(nccl, dtype):
    """``nccl``'s data type of an array dtype its collectives sum."""
    key = (id(nccl), dtype)
    if key not in _TYPES:
        _TYPES[key] = getattr(nccl, NCCL_TYPES[dtype_name(dtype)])
    return _TYPES[key]


def _env_on(value) -> bool:
    return str(value or "").strip().lower() not in ("", "0", "false", "no", "off")


def link_record(environ=None) -> dict:
    """What this rank knows of its NCCL link (gathered to choose lanes alike)."""
    import socket

    from ..settings import environment
    env = environment() if environ is None else environ
    return {"host": socket.gethostname(), "p2p_disabled": _env_on(env.get("NCCL_P2P_DISABLE")),
            "shm_disabled": _env_on(env.get("NCCL_SHM_DISABLE"))}


def auto_lanes(records) -> tuple:
    """(lanes, lane_bytes, why) for ``lanes="auto"`` from every rank's
    :func:`link_record`: more lanes only over shared memory, where NCCL gives
    a peer 2 channels; one lane elsewhere (measured slower with more)."""
    one_host = len({r["host"] for r in records}) == 1
    if (len(records) > 1 and one_host and all(r["p2p_disabled"] for r in records)
            and not any(r["shm_disabled"] for r in records)):
        return SHM_LANES, SHM_LANE_BYTES, (f"{SHM_LANES} lanes: shared-memory link "
                                           "(one host, NCCL_P2P_DISABLE)")
    return 1, MIN_LANE_BYTES, "1 lane"


def nccl_status():
    """(usable, reason): CuPy imports, was built with NCCL, and NCCL loads."""
    global _status
    with _status_lock:
        if _status is None:
            try:
                from cupy.cuda import nccl
                if not getattr(nccl, "available", True):
                    _status = (False, "CuPy's NCCL library could not be loaded")
                else:
                    nccl.get_version()
                    _status = (True, "")
            except Exception as exc:  # ImportError, CUDA errors
                _status = (False, f"NCCL is not available through CuPy: {exc}")
        return _status


def describe_sharing(keys) -> str:
    """Which ranks share a GPU by their (host, PCI bus id) keys ('' if none)."""
    groups = {}
    for rank, key in enumerate(keys):
        groups.setdefault(tuple(key), []).append(rank)
    return "; ".join(f"ranks {ranks} share GPU {key[1]} on {key[0]}"
                     for key, ranks in groups.items() if len(ranks) > 1)


def ranks_sharing_a_gpu(plane, device_id: int) -> str:
    """Which ranks drive the same GPU ('' if none), alike on every rank
    (collective): NCCL refuses them, so they stage through host memory."""
    import cupy

    from ..control import as_plane
    plane = as_plane(plane)
    key = (plane.node_name(), cupy.cuda.Device(device_id).pci_bus_id)
    return describe_sharing(plane.allgather(key))


class _Profile:
    """CUDA events of one call (compute stream and lanes), for the breakdown."""

    def __init__(self, cupy, compute):
        self.cupy = cupy
        self.ref = _event(cupy, compute)
        self.compute = []        # (kind, event): kind of the request that recorded it
        self.wire = []           # (start event, end event, bytes sent, bytes received) per lane
        self.marks = []          # (name, host time) after synchronising

    def at(self, kind, stream):
        self.compute.append((kind, _event(self.cupy, stream)))

    def ms(self, event):
        return self.cupy.cuda.get_elapsed_time(self.ref, event)

    def summary(self):
        """Seconds inside the data phases: kernels (compute-stream intervals
        holding no wait), wire (the lanes' messages) and their union."""
        times = [(kind, self.ms(e)) for kind, e in self.compute]
        start = next((t for kind, t in times if kind == "mark:reduce-scatter"), 0.0)
        kernels, busy = 0.0, []
        for (_, t0), (kind, t1) in zip(times, times[1:]):
            # a claim's interval ends with a wait for a receive: not kernel time
            if t0 >= start and kind != "claim" and t1 > t0:
                kernels += t1 - t0
                busy.append((t0, t1))
        messages = [(self.ms(a), self.ms(b), sent, got) for a, b, sent, got in self.wire]
        wire_iv = sorted((a, b) for a, b, _, _ in messages if a >= start)
        return {"kernels": kernels / 1e3, "wire": _union(wire_iv) / 1e3,
                "kernels_or_wire": _union(sorted(busy + wire_iv)) / 1e3,
                # per lane message: start and end (ms after the call began), bytes each way
                "timeline": [(round(a, 4), round(b, 4), sent, got) for a, b, sent, got in messages]}


class _Scratch:
    """Raw device memory of the transport (the all-gather's staging)."""

    def __init__(self, cupy, nbytes, device_id):
        with cupy.cuda.Device(device_id):
            self.array = cupy.empty(nbytes, dtype=cupy.uint8)
        self.nbytes = nbytes
        self.ptr = _ptr(self.array)


def _ptr(array) -> int:
    """Address of an array's first byte (CuPy; NumPy for the CPU tests' fake)."""
    return array.ctypes.data if type(array).__module__ == "numpy" else array.data.ptr


def _event(cupy, stream, timing=True):
    """A CUDA event recorded on ``stream`` (``timing``: its elapsed time may be read)."""
    e = cupy.cuda.Event(block=False, disable_timing=not timing)
    e.record(stream)
    return e


def _union(intervals):
    total, end = 0.0, float("-inf")
    for a, b in intervals:
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


class NCCLTransport(Transport):
    name = "nccl"

    def __init__(self, plane, device_id: int, lanes=1, lane_bytes: int | None = None,
                 modules=None, pair_allgather=None):
        """``plane``: the control plane (or an mpi4py communicator);
        ``modules``: (cupy, cupy.cuda.nccl) or the CPU tests' stand-ins;
        ``pair_allgather`` (two ranks, off by default): an exchange as one
        NCCL all-gather (slower on NVLink and shared memory; for other
        fabrics); ``lanes="auto"``: :func:`auto_lanes`."""
        if modules is None:
            import cupy
            from cupy.cuda import nccl
            modules = (cupy, nccl)
        cupy, nccl = modules
        self.cupy, self.nccl = cupy, nccl
        from ..control import as_plane
        self.plane = self.agreement = as_plane(plane)
        self.rank, self.size = self.plane.rank, self.plane.size
        self.device_id = int(device_id)
        if lanes == "auto":
            lanes, auto_bytes, self.lanes_why = auto_lanes(self.plane.allgather(link_record()))
            lane_bytes = auto_bytes if lane_bytes is None else lane_bytes
        else:
            self.lanes_why = f"{int(lanes)} lane{'s' if int(lanes) != 1 else ''}: requested"
        self.lanes = max(1, int(lanes))
        self.lane_bytes = max(1, int(MIN_LANE_BYTES if lane_bytes is None else lane_bytes))
        ids = [nccl.get_unique_id() for _ in range(self.lanes)] if self.rank == 0 else None
        ids = self.plane.bcast(ids, root=0)
        with cupy.cuda.Device(self.device_id):
            self.comms = [new_communicator(nccl, self.size, uid, self.rank) for uid in ids]
            self.streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(self.lanes)]
        self.profile = None
        self.pair_allgather = self.size == 2 and bool(pair_allgather)
        self._scratch = {}
        self._retired = []
        self._cuts = {}
        self._native = None      # the communicator of the native all-reduce (made on first use)
        self._join_events = None

    def _slices(self, nbytes):
        """Byte ranges of a message per lane, a function of its size (both ends
        cut alike); one lane with the pair all-gather (a forwarded buffer
        stays on the lane that received it)."""
        cut = self._cuts.get(nbytes)
        if cut is None:
            if len(self._cuts) > 256:
                self._cuts.clear()
            cut = self._cuts[nbytes] = self._cut(nbytes)
        return cut

    def _cut(self, nbytes):
        lanes = 1 if self.pair_allgather else self.lanes
        k = min(lanes, max(1, nbytes // self.lane_bytes))
        # a slice off a 16-byte boundary takes NCCL's slow copy path
        cuts = [0] + [(i * nbytes // k) // LANE_ALIGN * LANE_ALIGN for i in range(1, k)] + [nbytes]
        return list(zip(cuts[:-1], cuts[1:]))

    def _buffer(self, name, nbytes):
        buf = self._scratch.get(name)
        if buf is None or buf.nbytes < nbytes:
            # used on lane 0 only; a replaced buffer is kept (enqueued work may read it)
            if buf is not None:
                self._retired.append(buf)
            self._scratch[name] = buf = _Scratch(self.cupy, max(nbytes, 1 << 20), self.device_id)
        return buf

    def _copy(self, dst_ptr, src_ptr, nbytes, stream):
        if nbytes:
            self.cupy.cuda.runtime.memcpyAsync(dst_ptr, src_ptr, nbytes, 3, stream.ptr)  # D2D

    def _pair_exchange(self, send, recv):
        """Both ranks' messages through one all-gather on lane 0 (rank r's at
        r * count, count the larger of the two); the peer's copied to ``recv``."""
        nccl, lane = self.nccl, self.streams[0]
        count = max(send.nbytes, recv.nbytes)
        src = _ptr(send)
        if send.nbytes < count:          # the collective reads `count` bytes: pad
            pad = self._buffer("in", count)
            self._copy(pad.ptr, src, send.nbytes, lane)
            src = pad.ptr
        out = self._buffer("out", 2 * count)
        if count:
            self.comms[0].allGather(src, out.ptr, count, nccl.NCCL_UINT8, lane.ptr)
        self._copy(_ptr(recv), out.ptr + (1 - self.rank) * count, recv.nbytes, lane)

    def _post(self, send, sends, recv, recvs, dest, source):
        """One exchange's sends and receives, cut over the lanes (inside a group)."""
        nccl = self.nccl
        for i, (a, b) in enumerate(sends):
            if b > a:
                self.comms[i].send(_ptr(send) + a, b - a, nccl.NCCL_UINT8, dest,
                                   self.streams[i].ptr)
        for i, (a, b) in enumerate(recvs):
            if b > a:
                self.comms[i].recv(_ptr(recv) + a, b - a, nccl.NCCL_UINT8, source,
                                   self.streams[i].ptr)

    def _lanes_wait_for(self, compute):
        """Every lane waits for the caller's stream (a send's buffer is written there)."""
        ready = _event(self.cupy, compute, timing=False)
        for lane in self.streams:
            lane.wait_event(ready)

    def _exchange(self, req):
        cupy, nccl = self.cupy, self.nccl
        compute = cupy.cuda.get_current_stream()
        if req.send is not None and not isinstance(req.send, Received):
            self._lanes_wait_for(compute)
        if self.profile is not None:
            self.profile.at("exchange", compute)
        send = payload_array(req.send) if req.send is not None else None
        pair = (self.pair_allgather and send is not None and req.recv is not None
                and req.dest == req.source)
        sends = self._slices(send.nbytes) if send is not None else []
        recvs = self._slices(req.recv.nbytes) if req.recv is not None else []
        used = range(1 if pair else max(len(sends), len(recvs)))
        starts = []
        if self.profile is not None:
            starts = [_event(cupy, self.streams[i]) for i in used]
        if pair:
            self._pair_exchange(send, req.recv)
            recvs = recvs[:1]
        else:
            nccl.groupStart()
            try:
                self._post(send, sends, req.recv, recvs, req.dest, req.source)
            finally:
                nccl.groupEnd()
        if self.profile is not None:
            for i, start in zip(used, starts):
                sent = sends[i][1] - sends[i][0] if i < len(sends) else 0
                got = recvs[i][1] - recvs[i][0] if i < len(recvs) else 0
                self.profile.wire.append((start, _event(cupy, self.streams[i]), sent, got))
        if req.recv is None:
            return None
        done = [_event(cupy, self.streams[i], timing=False) for i in range(len(recvs))]
        return Received(req.recv, done)

    def _exchange_all(self, exchanges):
        """Every exchange's messages in one NCCL group: they travel together."""
        if len(exchanges) == 1 or self.pair_allgather:
            return [self._exchange(x) for x in exchanges]
        cupy, nccl = self.cupy, self.nccl
        compute = cupy.cuda.get_current_stream()
        if any(x.send is not None and not isinstance(x.send, Received) for x in exchanges):
            self._lanes_wait_for(compute)
        if self.profile is not None:
            self.profile.at("exchange", compute)
            starts = [_event(cupy, lane) for lane in self.streams]
        cuts = []
        nccl.groupStart()
        try:
            for x in exchanges:
                send = payload_array(x.send) if x.send is not None else None
                sends = self._slices(send.nbytes) if send is not None else []
                recvs = self._slices(x.recv.nbytes) if x.recv is not None else []
                self._post(send, sends, x.recv, recvs, x.dest, x.source)
                cuts.append((sends, recvs))
        finally:
            nccl.groupEnd()
        if self.profile is not None:
            for i, start in enumerate(starts):
                sent = sum(a[i][1] - a[i][0] for a, _ in cuts if i < len(a))
                got = sum(b[i][1] - b[i][0] for _, b in cuts if i < len(b))
                self.profile.wire.append((start, _event(cupy, self.streams[i]), sent, got))
        lanes = [len(recvs) for _, recvs in cuts]
        done = [_event(cupy, self.streams[i], timing=False) for i in range(max(lanes))]
        return [None if x.recv is None else Received(x.recv, done[:k])
                for x, k in zip(exchanges, lanes)]

    def _native_allreduce(self, send, recv):
        """NCCL's own all-reduce on the caller's stream and a communicator of its
        own, made by the first native call (agreed: alike on every rank)."""
        nccl = self.nccl
        if self._native is None:
            uid = self.plane.bcast(nccl.get_unique_id() if self.rank == 0 else None, root=0)
            with self.cupy.cuda.Device(self.device_id):
                self._native = new_communicator(nccl, self.size, uid, self.rank)
        compute = self.cupy.cuda.get_current_stream()
        self._native.allReduce(_ptr(send), _ptr(recv), recv.size, nccl_type(nccl, recv.dtype),
                               nccl.NCCL_SUM, compute.ptr)
        return recv

    def join(self, fresh=False):
        """The caller's stream waits for every lane's last work: an unclaimed
        send must end before its buffer is rewritten, a capture must join
        every stream it forked (``fresh``: new events, for a capture)."""
        compute = self.cupy.cuda.get_current_stream()
        if fresh or self._join_events is None:
            events = [self.cupy.cuda.Event(block=False, disable_timing=True) for _ in self.streams]
            if not fresh:
                self._join_events = events
        else:
            events = self._join_events
        for lane, e in zip(self.streams, events):
            e.record(lane)
            compute.wait_event(e)

    def _claim(self, handle):
        compute = self.cupy.cuda.get_current_stream()
        for e in handle.token or ():
            compute.wait_event(e)
        if self.profile is not None:
            self.profile.at("claim", compute)
        return handle.buffer

    def _mark(self, name):
        if self.profile is None:
            return
        compute = self.cupy.cuda.get_current_stream()
        self.profile.at(f"mark:{name}", compute)
        compute.synchronize()            # profiling serialises the phases
        for lane in self.streams:
            lane.synchronize()
        self.profile.marks.append((name, time.perf_counter()))

    def start_profile(self, device=True):
        self.profile = _Profile(self.cupy, self.cupy.cuda.get_current_stream())

    def free(self):
        if self._native is not None:
            destroy_communicator(self._native)
            self._native = None
        for c in getattr(self, "comms", ()):
            destroy_communicator(c)
        self.comms = []
