"""Host-staged MPI transport over mpi4py, and the MPI agreement every transport uses.

NumPy buffers go to MPI as they are.  Device (CuPy) buffers are staged through
pinned host buffers that are reused across calls (see ``staging``); the CUDA
stream is synchronised before a buffer reaches MPI.  Every exchange completes
before the answer, so a :class:`Claim` returns at once.
"""
from __future__ import annotations

import hashlib
import pickle
import sys
import time

import numpy as np

from .ops import Agree, Claim, Exchange, Mark, NativeAllreduce, Received, payload_array

_TAG = 0x5D17


_COUNTER_STEP = 0x9E3779B97F4A7C15


_STATIC_DIGESTS: dict = {}     # frozen record (no counter) -> its hash: steady calls repeat one


def _frozen(value):
    if isinstance(value, dict):
        return tuple((k, _frozen(v)) for k, v in sorted(value.items()))
    if isinstance(value, list):
        return ("list",) + tuple(_frozen(v) for v in value)
    return (type(value).__name__, value) if isinstance(value, (bool, int, float)) else value


def record_digest(value) -> int:
    """64-bit digest of an agreement value: a hash of the value without its
    ``counter``, plus the counter times an odd constant (mod 2^64), so that a
    steady caller may keep the first part and add the counter itself.  The
    hash of a value seen before is looked up, not pickled and hashed again."""
    counter = 0
    if isinstance(value, dict) and "counter" in value:
        counter = int(value["counter"])
        value = {k: v for k, v in value.items() if k != "counter"}
    try:
        key = _frozen(value)
        static = _STATIC_DIGESTS.get(key)
    except TypeError:           # an unhashable part: hash it every time
        key = static = None
    if static is None:
        raw = hashlib.blake2b(pickle.dumps(value, protocol=4), digest_size=8).digest()
        static = int.from_bytes(raw, "little")
        if key is not None:
            if len(_STATIC_DIGESTS) >= 1024:
                _STATIC_DIGESTS.clear()
            _STATIC_DIGESTS[key] = static
    return digest_with_counter(static, counter)


def digest_with_counter(static: int, counter: int) -> int:
    return (static + counter * _COUNTER_STEP) & 0xFFFFFFFFFFFFFFFF


def digests_match(comm, digest: int) -> bool:
    """One fixed-size Allgather of every rank's digest: all equal?"""
    return Digests(comm).match(digest)


class Digests:
    """:func:`digests_match` with its buffers kept, for calls that exchange
    one digest each (a steady native call): no allocation per call."""

    def __init__(self, comm):
        self.comm = comm
        self.mine = np.empty(1, dtype=np.uint64)
        self.everyone = np.empty(comm.Get_size(), dtype=np.uint64)

    def match(self, digest: int) -> bool:
        self.mine[0] = digest
        self.comm.Allgather(self.mine, self.everyone)
        return self.everyone.tolist().count(digest) == self.everyone.shape[0]


def agree(comm, value):
    """Every rank's ``value`` (a small picklable object), as a list.

    Fast path: ranks compare a 64-bit digest of the value (record_digest) in
    one fixed-size Allgather and, when all digests match, nobody sends the
    values.  Only a disagreement pays for the pickled allgather that says who
    differs.
    """
    if digests_match(comm, record_digest(value)):
        return [value] * comm.Get_size()
    return comm.allgather(value)


class Timeline:
    """Host timestamps of the phase marks of one call (profiling only); the
    host transport is synchronous, so these are the phases' real durations."""

    def __init__(self, device=False):
        self.marks = []
        self.device = device

    def mark(self, name):
        self.marks.append((name, time.perf_counter()))

    def summary(self):
        return {}


class RequestAnswers:
    """What every transport does with the engine's requests: data requests go
    to its own ``_exchange``, ``_claim`` and ``_mark``; agreement always goes
    over MPI (the transport's ``agreement_comm``)."""

    profile = None
    agreement_comm = None

    def answer(self, request):
        if isinstance(request, Exchange):
            return self._exchange(request)
        if isinstance(request, Claim):
            return self._claim(request.handle)
        if isinstance(request, Agree):
            return agree(self.agreement_comm, request.value)
        if isinstance(request, Mark):
            return self._mark(request.name)
        if isinstance(request, NativeAllreduce):
            return self._native_allreduce(request.send, request.recv)
        raise RuntimeError(f"unknown request {request!r}")

    def stop_profile(self):
        prof, self.profile = self.profile, None
        return prof

    def _native_allreduce(self, send, recv):
        raise RuntimeError(f"transport {self.name!r} has no native all-reduce")


class MPITransport(RequestAnswers):
    name = "mpi"

    def __init__(self, comm):
        # A private duplicate: our point-to-point traffic never matches the
        # caller's messages on the same communicator.
        self.comm = self.agreement_comm = comm.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self._stager = None
        self.profile = None      # a Timeline while profiling

    def _stage_out(self, payload):
        if isinstance(payload, np.ndarray):
            return payload
        if self._stager is None:
            from .staging import HostStager
            self._stager = HostStager()
        return self._stager.to_host(payload)          # synchronises the stream

    def _exchange(self, req):
        from mpi4py import MPI

        send = payload_array(req.send) if req.send is not None else None
        recv = req.recv
        on_device = recv is not None and not isinstance(recv, np.ndarray)
        send_host = self._stage_out(send) if send is not None else None
        recv_host = None
        if recv is not None:
            recv_host = self._stager.recv_buffer(recv.nbytes) if on_device else recv
        if send_host is not None and recv_host is not None:
            self.comm.Sendrecv([send_host, MPI.BYTE], req.dest, _TAG,
                               [recv_host, MPI.BYTE], req.source, _TAG)
        elif send_host is not None:
            self.comm.Send([send_host, MPI.BYTE], req.dest, _TAG)
        elif recv_host is not None:
            self.comm.Recv([recv_host, MPI.BYTE], req.source, _TAG)
        if recv is None:
            return None
        if on_device:
            self._stager.to_device(recv_host, recv)
        return Received(recv)

    def _claim(self, handle):
        return handle.buffer          # every exchange completed before its answer

    def _native_allreduce(self, send, recv):
        MPI = sys.modules["mpi4py.MPI"]     # imported: this transport holds a communicator
        # out=x arrives as two views of one memory: MPI forbids aliased buffers
        same = send is recv or (send.__array_interface__["data"][0]
                                == recv.__array_interface__["data"][0])
        self.comm.Allreduce(MPI.IN_PLACE if same else send, recv, op=MPI.SUM)
        return recv

    def _mark(self, name):
        if self.profile is not None:
            if self.profile.device:      # device kernels are asynchronous
                sys.modules["cupy"].cuda.get_current_stream().synchronize()
            self.profile.mark(name)

    def start_profile(self, device=False):
        self.profile = Timeline(device)

    def free(self):
        if self.comm is not None:
            self.comm.Free()
            self.comm = None
