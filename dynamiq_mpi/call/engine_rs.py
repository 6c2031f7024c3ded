"""The reduce-scatter's table over the phase skeleton (docs/design.md,
"Reduce-scatter"): rank r's block is fixed by the caller, so each block is a
stream of one chunk (a threshold per block; ``budget="global"``: one), and
schedule chunk c is block ``(c - 1) mod n``: rank r sinks its own block.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np

from .. import schedules
from ..codecs.base import align_up, plan_chunks, plan_layout
from ..errors import NonFiniteInputError
from ..rng import CallKeys, call_keys, splitmix64
from ..transports.ops import Agree, Exchange, ExchangeAll, Route
from .phases import (NATIVE_DTYPES, CallSpec, check_local, check_scatter, reduce_tile,
                     resolve_layout, run_collective)
from .rail_budget import joins
from .workspace import FRESH

BUDGETS = ("per-chunk", "global")


class _Scoped:
    """A workspace whose buffer names carry a block's prefix."""

    def __init__(self, workspace, prefix: str):
        self.ws, self.prefix = workspace, prefix

    def take(self, xp, name, count, dtype):
        return self.ws.take(xp, self.prefix + name, count, dtype)

    def constant(self, xp, name, count, dtype, fill):
        return self.ws.constant(xp, self.prefix + name, count, dtype, fill)

    def sub(self, array, a, b):
        return self.ws.sub(array, a, b)


def block_keys(keys: CallKeys, block: int) -> CallKeys:
    """Generator keys of block ``block`` (independent streams per block)."""
    salt = (block + 1) * 0x9E3779B97F4A7C15

    def mix(k):
        return splitmix64((k ^ salt) & ((1 << 64) - 1)) & 0xFFFFFFFF

    return CallKeys(value=mix(keys.value), perm=mix(keys.perm ^ 0x5BD1E995))


def run_reduce_scatter(plans, schedule, rank):
    """Generator: the reduce-scatter half of ``schedule``, ``plans[c]`` chunk
    c's; blocks may differ in tiles (beyond the shorter list sends and
    receives go apart); a round of several steps is posted as one group, as
    in :func:`~.phases.run_schedule`.  Returns the bytes sent."""
    n = schedule.size
    steps = [s for s in schedule.steps[rank] if s.phase == schedules.REDUCE]
    need = defaultdict(int)
    for s in steps:
        p = plans[s.recv_chunk]
        need[s.recv_chunk] += sum(align_up(p.tile_nbytes(t)) for t in p.chunk_tiles[0])
    arenas = {c: [plans[c].scratch(nb), 0] for c, nb in need.items()}
    pending = defaultdict(list)     # (chunk, tile) -> receive handles of partial sums
    sent = 0
    for group in [g for g in schedule.rounds[rank] if g[0].phase == schedules.REDUCE]:
        posted = []                 # a round of several steps (one peer): one group
        for step in group:
            sp, rp = plans[step.send_chunk], plans[step.recv_chunk]
            send_tiles, recv_tiles = sp.chunk_tiles[0], rp.chunk_tiles[0]
            event = schedule.event(rank, step.send_chunk)
            arena = arenas[step.recv_chunk]
            for i in range(max(len(send_tiles), len(recv_tiles))):
                payload = recv = key = None
                if i < len(send_tiles):
                    t = send_tiles[i]
                    payload = yield from reduce_tile(sp, t, pending.pop((step.send_chunk, t), []),
                                                      event)
                    sent += sp.tile_nbytes(t)
                if i < len(recv_tiles):
                    t = recv_tiles[i]
                    nbytes = rp.tile_nbytes(t)
                    recv = rp.sub(arena[0], arena[1], arena[1] + nbytes)
                    arena[1] += align_up(nbytes)
                    key = (step.recv_chunk, t)
                exchange = Exchange(payload, step.dest if payload is not None else rank,
                                    recv, step.source if recv is not None else rank)
                if len(group) > 1:
                    posted.append((exchange, key))
                    continue
                handle = yield exchange
                if key is not None:
                    pending[key].append(handle)
        if posted:
            handles = yield ExchangeAll([x for x, _ in posted])
            for (_, key), handle in zip(posted, handles):
                if key is not None:
                    pending[key].append(handle)
    own = schedule.owned_chunk(rank)
    plan = plans[own]
    event = schedule.event(rank, own)
    for t in plan.chunk_tiles[0]:
        final = yield from reduce_tile(plan, t, pending.pop((own, t), []), event)
        plan.decode(t, final)           # the sink adopts its own decoded bytes
    assert not pending, pending
    assert n == 1 or event == n - 1
    return sent


def rank_program_rs(rank: int, n: int, x, spec: CallSpec, out=None, workspace=FRESH,
                    detailed_report: bool = True, budget: str = "per-chunk"):
    """Generator: one rank's reduce-scatter.  Returns (output, Report): the
    output is flat, ``len(x) / n`` elements of x's dtype (``out`` if given)."""
    return run_collective(ReduceScatter(budget), rank, n, x, spec, out, workspace, detailed_report)


class ReduceScatter:
    """The reduce-scatter's table for :func:`~.phases.run_collective`: n
    blocks, each its own stream; the output flat, this rank's block."""

    name, collective, halves = "reduce-scatter", "reduce_scatter", 1
    flat = flat_out = backend = None    # until check() has them

    def __init__(self, budget):
        self.budget = budget
        self.record = {"collective": "reduce_scatter", "budget": budget}
        self.combined = None    # every block's statistics, one vector (or None)

    def check(self, x, out, spec, n):
        if self.budget not in BUDGETS:
            raise ValueError(f"budget must be one of {BUDGETS}, got {self.budget!r}")
        self.flat, _, self.backend = check_local(x, None, spec, n)
        self.flat_out = check_scatter(x, out, self.flat, self.backend, n)

    def start(self, flat, spec, backend, workspace, n):
        values = flat if flat.dtype in NATIVE_DTYPES else flat.astype(np.float32)
        self.m = int(flat.shape[0]) // n
        # small inputs are decided on the whole call (its per-call costs)
        self.codec = spec.codec.for_length(int(flat.shape[0]))
        keys = call_keys(int(spec.seed), spec.counter)
        self.values = [values[b * self.m:(b + 1) * self.m] for b in range(n)]
        self.ws = [_Scoped(workspace, f"rs{b}.") for b in range(n)]
        self.keys = [block_keys(keys, b) for b in range(n)]
        if spec.keys_at:    # a graph's capture: block b's keys live on the device, 8 bytes each
            self.keys = [dataclasses.replace(k, device=int(spec.keys_at) + 8 * b)
                         for b, k in enumerate(self.keys)]
        self.stats, self.states = zip(*[self.codec.local_stats(xb, backend, ws, keys=kb)
                                        for xb, ws, kb in zip(self.values, self.ws, self.keys)])
        if self.stats[0] is not None:       # one vector, one exact reduction
            sizes = [int(s.shape[0]) for s in self.stats]
            self.bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
            self.combined = workspace.take(backend.xp, "rs.stats", self.bounds[-1],
                                           self.stats[0].dtype)
            for b, s in enumerate(self.stats):
                self.combined[self.bounds[b]:self.bounds[b + 1]] = s

    def route(self, spec, flat, backend):
        return Route(spec.transport)    # the compressed path: no native reduce-scatter

    def output_length(self, length, n):
        return length // n

    def shaped(self, result, x):
        return result

    def statistics(self, flat, spec, backend, workspace):
        return self.combined

    def reduced_of(self, reduced, b):
        return None if reduced is None else reduced[self.bounds[b]:self.bounds[b + 1]]

    def tails(self, reduced):
        """Every block's reduced (non-finite flag, sum of max |x|): the last two
        values of each block's statistics (blocks are equal: strided views)."""
        size = self.bounds[1]
        return reduced[size - 2::size], reduced[size - 1::size]

    def plan(self, reduced, rank, n, spec, backend, workspace):
        codecs, layout = [self.codec] * n, resolve_layout(spec, backend.name)
        if self.budget == "global":
            # one threshold over all blocks (host work: the exact layout)
            if not joins(self.codec):
                raise ValueError("budget='global' is for DynamiQ with variable widths")
            norms = [self.codec.reduced_norms(backend.to_host(self.reduced_of(reduced, b)),
                                              self.m) for b in range(n)]
            codecs, layout = self.codec.split_budget(norms, [self.m] * n), "exact"
        self.plans = []
        for b in range(n):
            with plan_chunks(1), plan_layout(layout):
                self.plans.append(codecs[b].plan(self.values[b], self.reduced_of(reduced, b), n,
                                                 self.keys[b], backend, self.states[b],
                                                 self.ws[b], spec.tile_bytes))
        self.own = self.plans[rank]
        if getattr(self.own, "fixed", False) and spec.nonfinite != "raise":
            self.own.refuse_with(*self.tails(reduced))  # the device writes NaN, no host read

    def bind(self, result, divisor, raise_check):
        if not raise_check:     # a checked sum reaches ``out`` only after its check
            self.own.bind_output(result, divisor)

    def hops(self, schedule, rank):
        # schedule chunk c is the block of its sink, rank c - 1
        n = schedule.size
        return run_reduce_scatter([self.plans[(c - 1) % n] for c in range(n)], schedule, rank)

    def check_sum(self):
        # each rank checks its decoded chunk, the ranks agree on the verdict
        local = None
        try:
            self.own.check_finite()
        except NonFiniteInputError as exc:
            local = str(exc)
        verdicts = yield Agree({"nonfinite": local})
        bad = [v["nonfinite"] for v in verdicts if v["nonfinite"]]
        if bad:
            raise NonFiniteInputError(bad[0])

    def info(self, chunk_bytes):
        info = {"block_bytes": chunk_bytes}     # message bytes of each rank's block
        if self.budget != "per-chunk":
            info["budget"] = self.budget
        return info
