"""The engine: one rank's all-reduce, its table over the phase skeleton
(docs/design.md, "One all-reduce, step by step"): one plan of the whole
input in n chunks, or the path the planner's ``Route`` answer names.  Every
exchange is posted once its payload is computed and a received buffer
claimed right before a kernel reads it; the engine never waits.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..backend import dtype_name
from ..codecs.base import plan_layout
from ..errors import NonFiniteInputError, SumOverflowError
from ..rng import call_keys
from ..transports.ops import Agree, NativeAllreduce, Route
from .phases import (NATIVE_DTYPES, CallSpec, check_local, holds_nonfinite, resolve_layout,
                     run_collective, run_schedule)
from .wire import from_wire, to_wire
from .workspace import FRESH


def rank_program(rank: int, n: int, x, spec: CallSpec, out=None, workspace=FRESH,
                 detailed_report: bool = True):
    """Generator: one rank's all-reduce.  Returns (output, Report)."""
    return run_collective(AllReduce(), rank, n, x, spec, out, workspace, detailed_report)


class AllReduce:
    """The all-reduce's table for :func:`~.phases.run_collective`: one plan in
    n chunks, both halves of the schedule, the output in the input's shape."""

    name, collective, halves = "all-reduce", "allreduce", 2
    record = {}                 # the agreement record's own fields: none
    flat = flat_out = backend = None    # until check() has them

    def __init__(self):
        self.early = None       # (values, codec, keys, (stats, local state))

    def check(self, x, out, spec, n):
        self.flat, self.flat_out, self.backend = check_local(x, out, spec, n)

    def start(self, flat, spec, backend, workspace, n):
        if spec.path == "compressed":   # a native call may never need them
            self.early = self.local_statistics(flat, spec, backend, workspace)

    @staticmethod
    def local_statistics(flat, spec, backend, workspace):
        """(values, codec of this length, keys, (stats, local state))."""
        values = flat if flat.dtype in NATIVE_DTYPES else flat.astype(np.float32)
        codec = spec.codec.for_length(int(flat.shape[0]))
        keys = call_keys(int(spec.seed), spec.counter)
        if spec.keys_at:    # a graph's capture: the keys live on the device
            keys = dataclasses.replace(keys, device=int(spec.keys_at))
        return values, codec, keys, codec.local_stats(values, backend, workspace, keys=keys)

    def route(self, spec, flat, backend):
        return Route(spec.transport, spec.path, spec.codec, backend.name, dtype_name(flat.dtype))

    def output_length(self, length, n):
        return length

    def shaped(self, result, x):
        return result.reshape(x.shape)

    def statistics(self, flat, spec, backend, workspace):
        if self.early is None:   # a call that asked for the native path started none
            self.early = self.local_statistics(flat, spec, backend, workspace)
        return self.early[3][0]

    def plan(self, reduced, rank, n, spec, backend, workspace):
        values, codec, keys, (stats, local_state) = self.early
        # a rail's plan hook only re-budgets ``codec`` (the fallback test sees it before)
        planned = codec
        if spec.plan_hook is not None and stats is not None:
            planned = spec.plan_hook(codec, reduced, backend)
        with plan_layout(resolve_layout(spec, backend.name)):
            self.own = planned.plan(values, reduced, n, keys, backend, local_state, workspace,
                                    spec.tile_bytes)
        self.codec, self.plans = codec, [self.own]

    def bind(self, result, divisor, raise_check):
        self.own.bind_output(result, divisor)

    def hops(self, schedule, rank):
        return run_schedule(self.own, schedule, rank)

    def check_sum(self):
        # the decoded sum is the same on every rank: every rank raises alike
        self.own.check_finite()
        yield from ()

    def info(self, chunk_bytes):
        return {}

    def native(self, n, flat, result, spec, routed, backend, workspace, report, detailed_report):
        """Generator: the transport's own all-reduce of ``flat`` into ``result``, and the report."""
        xp = backend.xp
        divisor = n if spec.op == "mean" else 1
        wire = routed.wire
        if spec.nonfinite == "raise":
            # no statistics phase flags NaN/Inf: agree on a local flag first
            flags = yield Agree({"nonfinite": holds_nonfinite(xp, flat)})
            bad = [r for r, f in enumerate(flags) if f["nonfinite"]]
            if bad:
                raise NonFiniteInputError(f"NaN or Inf in the input of ranks {bad}")
        send, recv = to_wire(backend, flat, wire, result, workspace)
        buf = yield NativeAllreduce(send, recv)
        if spec.nonfinite == "raise" and holds_nonfinite(xp, buf):
            # finite inputs, a sum past the wire's range: alike on every rank
            raise SumOverflowError(f"the sum leaves the {wire} range on the native path")
        from_wire(backend, buf, divisor, result)
        if detailed_report:
            report.nonfinite = holds_nonfinite(xp, result)
        # a ring's bytes: what NCCL's and MPI's bandwidth-optimal algorithms send
        length = int(flat.shape[0])
        report.wire_bytes_total = 2 * (n - 1) * length * buf.dtype.itemsize
        report.bytes_sent = report.wire_bytes_total // n
        report.codec_info = {"native": f"{routed.transport}'s all-reduce, {wire} on the wire",
                             "wire": wire}
