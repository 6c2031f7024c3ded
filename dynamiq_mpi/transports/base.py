"""The base of the transports that answer a rank's requests (``ops.py``) one
at a time, and the host-timed profile of the synchronous ones."""
from __future__ import annotations

import time

from ..control.agreement import Digests, agree
from .ops import Agree, Claim, Exchange, ExchangeAll, Mark, NativeAllreduce


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


class Transport:
    """Answers the engine's requests by ``_exchange``, ``_claim``, ``_mark``,
    ``_native_allreduce`` and agreement over ``agreement``, the control plane."""

    profile = None
    agreement = None
    digests = None          # the agreement's Digests, made at the first Agree

    def answer(self, request):
        kind = type(request)            # (by exact type: no isinstance per request)
        if kind is Exchange:
            return self._exchange(request)
        if kind is Claim:
            return self._claim(request.handle)
        if kind is ExchangeAll:
            return self._exchange_all(request.exchanges)
        if kind is Mark:
            return self._mark(request.name)
        if kind is Agree:
            if self.digests is None:
                self.digests = Digests(self.agreement)
            return agree(self.agreement, request.value, self.digests)
        if kind is NativeAllreduce:
            return self._native_allreduce(request.send, request.recv)
        raise RuntimeError(f"unknown request {request!r}")

    def _exchange_all(self, exchanges):
        """Posted one after another (MPI's are non-blocking: they overlap)."""
        return [self._exchange(x) for x in exchanges]

    def stop_profile(self):
        prof, self.profile = self.profile, None
        return prof

    def _native_allreduce(self, send, recv):
        raise RuntimeError(f"transport {self.name!r} has no native all-reduce")
