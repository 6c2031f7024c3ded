"""The host transport ("mpi") over a control plane, and the agreement every
transport uses.

Payload moves by the control plane's own point-to-point: MPI's over an
mpi4py communicator, the private gloo group's over a torch.distributed one
(control/).  NumPy buffers go as they are.  Device (CuPy) buffers are staged
through pinned host buffers that are reused across calls (see ``staging``);
the CUDA stream is synchronised before a buffer leaves.  Every exchange
completes before the answer, so a :class:`Claim` returns at once.
"""
from __future__ import annotations

import hashlib
import pickle
import sys
import time

import numpy as np

from ..control import as_plane
from .ops import Agree, Claim, Exchange, Mark, NativeAllreduce, Received, payload_array

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


def digests_match(plane, digest: int) -> bool:
    """One fixed-size all-gather of every rank's digest: all equal?"""
    return Digests(plane).match(digest)


class Digests:
    """:func:`digests_match` with its buffers kept, for calls that exchange
    one digest each (a steady native call): no allocation per call.
    ``plane``: a control plane (an mpi4py communicator is taken as its plane)."""

    def __init__(self, plane):
        self.plane = as_plane(plane)
        self.mine = np.empty(1, dtype=np.uint64)
        self.everyone = np.empty(self.plane.size, dtype=np.uint64)

    def match(self, digest: int) -> bool:
        self.mine[0] = digest
        self.plane.allgather_array(self.mine, self.everyone)
        return self.everyone.tolist().count(digest) == self.everyone.shape[0]


def agree(plane, value):
    """Every rank's ``value`` (a small picklable object), as a list.

    Fast path: ranks compare a 64-bit digest of the value (record_digest) in
    one fixed-size Allgather and, when all digests match, nobody sends the
    values.  Only a disagreement pays for the pickled allgather that says who
    differs.
    """
    plane = as_plane(plane)
    if digests_match(plane, record_digest(value)):
        return [value] * plane.size
    return plane.allgather(value)


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
    over the control plane (the transport's ``agreement``)."""

    profile = None
    agreement = None

    def answer(self, request):
        if isinstance(request, Exchange):
            return self._exchange(request)
        if isinstance(request, Claim):
            return self._claim(request.handle)
        if isinstance(request, Agree):
            return agree(self.agreement, request.value)
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


class HostTransport(RequestAnswers):
    """Payload through host memory over a control plane's point-to-point."""
    name = "mpi"

    def __init__(self, comm):
        """``comm``: a control plane, mpi4py communicator or torch process
        group; duplicated here (collective), so our traffic never matches the
        caller's messages."""
        self.plane = self.agreement = as_plane(comm).dup()
        self.rank, self.size = self.plane.rank, self.plane.size
        self._stager = None
        self.profile = None      # a Timeline while profiling

    @property
    def comm(self):
        """The mpi4py communicator of the MPI plane (None on the torch plane)."""
        return self.plane.mpi_comm if self.plane is not None else None

    def _stage_out(self, payload):
        if isinstance(payload, np.ndarray):
            return payload
        if self._stager is None:
            from .staging import HostStager
            self._stager = HostStager()
        return self._stager.to_host(payload)          # synchronises the stream

    def _exchange(self, req):
        send = payload_array(req.send) if req.send is not None else None
        recv = req.recv
        on_device = recv is not None and not isinstance(recv, np.ndarray)
        send_host = self._stage_out(send) if send is not None else None
        recv_host = None
        if recv is not None:
            recv_host = self._stager.recv_buffer(recv.nbytes) if on_device else recv
        if send_host is not None or recv_host is not None:
            self.plane.sendrecv(send_host, req.dest, recv_host, req.source)
        if recv is None:
            return None
        if on_device:
            self._stager.to_device(recv_host, recv)
        return Received(recv)

    def _claim(self, handle):
        return handle.buffer          # every exchange completed before its answer

    def _native_allreduce(self, send, recv):
        self.plane.allreduce_sum(send, recv)
        return recv

    def _mark(self, name):
        if self.profile is not None:
            if self.profile.device:      # device kernels are asynchronous
                sys.modules["cupy"].cuda.get_current_stream().synchronize()
            self.profile.mark(name)

    def start_profile(self, device=False):
        self.profile = Timeline(device)

    def free(self):
        if self.plane is not None:
            self.plane.free()
            self.plane = None


MPITransport = HostTransport      # the name of earlier versions
