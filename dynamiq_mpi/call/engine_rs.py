"""The reduce-scatter: one rank's program, as a generator of requests like
engine.py's all-reduce (same agreement, statistics phase, codec plans,
schedules and transports).

Rank r of n gets coordinates ``[r m, (r + 1) m)`` of the sum, ``m = length / n``
(a length not divisible by n is an error on every rank).  These chunks are
fixed by the caller, so they cannot be cuts of one width-sorted stream.  Each
of the n coordinate ranges (*blocks*) is planned as a stream of its own:

* the codec computes its local statistics per block (a block starts a new
  super-group), the n vectors are concatenated and reduced in **one** exact
  reduction (the same phase as the all-reduce's, a few bytes more: one tail
  per block), and every rank slices block b's statistics out of the result;
* block b's plan is the codec's ordinary plan of ``x[b m : (b + 1) m]`` with
  the world size n (events of correlated rounding, MX headroom, THC widths)
  but one chunk (``codecs.base.plan_chunks``), its own generator keys
  (derived from the call's keys and b) and workspace names;
* so DynamiQ gets **a threshold per block**: every block spends the budget
  ``bits x m``, every ring message carries about the same bytes.  The other
  choice, one global threshold (unequal messages), is kept for the study
  (``budget="global"``, DynamiQ only); docs/design.md has the measurement.

The schedule is the all-reduce's reduce-scatter half, ring or butterfly:
chunk c of the schedule is block ``(c - 1) mod n``, the block of its sink
rank, so rank r ends as the sink of its own block.  The sink runs the fused
step on the last partial sum and decodes its own bytes, as in the
all-reduce, so a block's estimate has the all-reduce's distribution.  The
plans of different blocks may cut their streams into different numbers of
tiles: a step posts sends and receives separately beyond the shorter list
(transports match messages per pair in posting order).

Non-finite input: as the all-reduce (the reduced statistics of every block
are known to every rank, so "propagate" fills every rank's output with NaN
and sends nothing, "raise" raises on every rank); codecs without statistics
sum per coordinate; a small input that DynamiQ hands to BF16 checks its
decoded chunk under "raise" and the ranks agree on the verdict.
"""
from __future__ import annotations

import time
from collections import defaultdict

import numpy as np

from .. import schedules
from ..codecs.base import align_up, plan_chunks, plan_layout
from .phases import (NATIVE_DTYPES, CallSpec, agreement_record, check_agreement, check_local,
                     check_out_buffer, finish_into, propagate_nonfinite, raise_refusal,
                     reduce_stats, reduce_tile, report_plan, resolve_layout)
from .rail_budget import joins
from ..backend import dtype_name
from ..errors import InvalidInputError, NonFiniteInputError, SumOverflowError
from ..report import Report
from ..rng import CallKeys, call_keys, splitmix64
from ..transports.ops import Agree, Exchange, Mark, Route
from .workspace import FRESH

BUDGETS = ("per-chunk", "global")


class _Scoped:
    """A workspace whose buffer names carry a prefix (one per block), so the
    n plans of a call never share a buffer."""

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


def _check_out(out, x, m, backend):
    """The flat view of ``out`` (m elements, x's dtype and array type) or None."""
    if out is None:
        return None
    check_out_buffer(out, x, backend, out.size == m,
                     f"hold len(x) / n = {m} elements of dtype {x.dtype}, "
                     f"got {out.size} of {out.dtype}")
    return out.reshape(-1)


class _Blocks:
    """The n blocks of one call: values, codec, keys, workspace, statistics."""

    def __init__(self, flat, spec, backend, workspace, n):
        values = flat if flat.dtype in NATIVE_DTYPES else flat.astype(np.float32)
        self.length = int(flat.shape[0])
        self.m = self.length // n
        # small inputs are decided on the whole call (its per-call costs)
        self.codec = spec.codec.for_length(self.length)
        keys = call_keys(int(spec.seed), spec.counter)
        self.values, self.ws, self.keys, self.stats, self.states = [], [], [], [], []
        for b in range(n):
            ws = _Scoped(workspace, f"rs{b}.")
            xb = values[b * self.m:(b + 1) * self.m]
            kb = block_keys(keys, b)
            stats, state = self.codec.local_stats(xb, backend, ws, keys=kb)
            self.values.append(xb)
            self.ws.append(ws)
            self.keys.append(kb)
            self.stats.append(stats)
            self.states.append(state)
        self.combined = None
        if self.stats[0] is not None:
            # one vector, one exact reduction for all blocks
            xp = backend.xp
            sizes = [int(s.shape[0]) for s in self.stats]
            self.bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
            self.combined = workspace.take(xp, "rs.stats", self.bounds[-1], self.stats[0].dtype)
            for b, s in enumerate(self.stats):
                self.combined[self.bounds[b]:self.bounds[b + 1]] = s

    def reduced_of(self, reduced, b):
        if reduced is None:
            return None
        return reduced[self.bounds[b]:self.bounds[b + 1]]

    def tails(self, reduced):
        """Every block's reduced (non-finite flag, sum of max |x|): the last two
        values of each block's statistics (blocks are equal: strided views)."""
        size = self.bounds[1]
        return reduced[size - 2::size], reduced[size - 1::size]


def _global_block_codecs(codec, blocks, reduced, backend):
    """One global DynamiQ threshold: the allocation of all blocks' super-groups
    under the whole budget, then each block planned with exactly the bits that
    allocation gives it (codecs/allocation.joint_costs).  For the design
    study (host work)."""
    if not joins(codec):
        raise ValueError("budget='global' is for DynamiQ with variable widths")
    norms = [codec.reduced_norms(backend.to_host(blocks.reduced_of(reduced, b)), blocks.m)
             for b in range(len(blocks.values))]
    return codec.split_budget(norms, [blocks.m] * len(norms))


def run_reduce_scatter(plans, schedule, rank):
    """Generator: the reduce-scatter half of ``schedule``; ``plans[c]`` is the
    plan of schedule chunk c (one chunk of tiles each).  This rank's own chunk
    ends decoded in its plan.  Returns the bytes this rank sent."""
    n = schedule.size
    steps = [s for s in schedule.steps[rank] if s.phase == schedules.REDUCE]
    need = defaultdict(int)
    for s in steps:
        p = plans[s.recv_chunk]
        need[s.recv_chunk] += sum(align_up(p.tile_nbytes(t)) for t in p.chunk_tiles[0])
    arenas = {c: [plans[c].scratch(nb), 0] for c, nb in need.items()}
    pending = defaultdict(list)     # (chunk, tile) -> receive handles of partial sums
    sent = 0
    for step in steps:
        sp, rp = plans[step.send_chunk], plans[step.recv_chunk]
        send_tiles, recv_tiles = sp.chunk_tiles[0], rp.chunk_tiles[0]
        event = schedule.event(rank, step.send_chunk)
        arena = arenas[step.recv_chunk]
        for i in range(max(len(send_tiles), len(recv_tiles))):
            payload = recv = None
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
            handle = yield Exchange(payload, step.dest if payload is not None else rank,
                                    recv, step.source if recv is not None else rank)
            if recv is not None:
                pending[(step.recv_chunk, recv_tiles[i])].append(handle)
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
    t0 = time.perf_counter()
    error, flat, flat_out, backend, blocks = None, None, None, None, None
    try:
        if budget not in BUDGETS:
            raise ValueError(f"budget must be one of {BUDGETS}, got {budget!r}")
        flat, _, backend = check_local(x, None, spec, n)
        if flat.shape[0] % n:
            raise ValueError(f"reduce_scatter needs a length divisible by the {n} ranks, got "
                             f"{flat.shape[0]} (pad it, as FSDP does)")
        flat_out = _check_out(out, x, flat.shape[0] // n, backend)
    except Exception as exc:  # reported to every rank, raised after agreement
        error = f"{type(exc).__name__}: {exc}"
    if error is None and n > 1 and flat.shape[0] > 0:
        try:     # needs no other rank: runs while the ranks agree
            blocks = _Blocks(flat, spec, backend, workspace, n)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    metas = yield Agree(agreement_record(error, flat, backend, spec,
                                         collective="reduce_scatter", budget=budget))
    try:
        check_agreement(metas)
    except InvalidInputError as exc:
        raise InvalidInputError(str(exc).replace("all-reduce", "reduce-scatter", 1)) from None
    # the driver decides from the records (a reduce-scatter asks the compressed path)
    transport = (yield Route(spec.transport)).transport

    length = int(flat.shape[0])
    m = length // n
    report = Report(codec=spec.codec.name, topology=spec.topology, world_size=n, length=length,
                    dtype=dtype_name(flat.dtype), op=spec.op, seed=int(spec.seed),
                    call_counter=spec.counter, transport=transport,
                    collective="reduce_scatter")
    xp = backend.xp
    result = flat_out if flat_out is not None else backend.empty(m, flat.dtype)
    if n == 1 or length == 0:
        result[...] = flat
        report.seconds = time.perf_counter() - t0
        return result if out is None else out, result_report(report, t0)

    divisor = n if spec.op == "mean" else 1
    schedule = schedules.build(spec.topology, n)
    yield Mark("statistics")
    reduced, sent, stats_total = None, 0, 0
    if blocks.combined is not None:
        reduced, sent, stats_total = yield from reduce_stats(
            blocks.combined, n, rank, schedule, backend, workspace, spec.tile_bytes)
    yield Mark("plan")
    codec = blocks.codec
    try:
        if budget == "global":
            codecs = _global_block_codecs(codec, blocks, reduced, backend)
        else:
            codecs = [codec] * n
        # the global budget's study plans on the host: the exact layout
        layout = "exact" if budget == "global" else resolve_layout(spec, backend.name)
        plans = []
        for b in range(n):
            with plan_chunks(1), plan_layout(layout):
                plans.append(codecs[b].plan(blocks.values[b], blocks.reduced_of(reduced, b), n,
                                            blocks.keys[b], backend, blocks.states[b],
                                            blocks.ws[b], spec.tile_bytes))
        fixed = getattr(plans[rank], "fixed", False)
        if fixed and spec.nonfinite == "raise":
            for p in plans:                 # the host reads; the same verdict on every rank
                raise_refusal(p.refusal())
        elif fixed:
            plans[rank].refuse_with(*blocks.tails(reduced))
    except (NonFiniteInputError, SumOverflowError) as exc:
        propagate_nonfinite(exc, spec, result, report, stats_total, sent)
        return (result if out is None else out), result_report(report, t0)
    # schedule chunk c is the block of its sink, rank c - 1
    by_chunk = [plans[(c - 1) % n] for c in range(n)]
    own = plans[rank]
    raise_check = (codec is not spec.codec and getattr(spec.codec, "rejects_nonfinite", False)
                   and spec.nonfinite == "raise")
    if result.dtype in NATIVE_DTYPES and not raise_check:
        own.bind_output(result, divisor)
    yield Mark("reduce-scatter")
    sent += yield from run_reduce_scatter(by_chunk, schedule, rank)
    yield Mark("finish")
    if raise_check:
        # A small input sent uncompressed keeps the contract of the codec asked
        # for: each rank checks its decoded chunk, the ranks agree on the
        # verdict, and nothing has reached the caller's buffer yet.
        local = None
        try:
            own.check_finite()
        except NonFiniteInputError as exc:
            local = str(exc)
        verdicts = yield Agree({"nonfinite": local})
        bad = [v["nonfinite"] for v in verdicts if v["nonfinite"]]
        if bad:
            raise NonFiniteInputError(bad[0])
    finish_into(own, divisor, result, workspace, xp)
    yield Mark("done")

    chunk_bytes = [sum(p.chunk_nbytes) for p in plans]
    report.wire_bytes_total = stats_total + (n - 1) * sum(chunk_bytes)
    report.stats_bytes_total = stats_total
    report.bytes_sent = sent
    report.tiles_per_chunk = max(len(p.chunk_tiles[0]) for p in plans)
    report.sync_free = (all(getattr(p, "sync_free", False) for p in plans) and not raise_check
                        and spec.nonfinite == "propagate")
    info = report_plan(report, own, fixed, blocks.combined is not None, detailed_report, xp,
                       result)
    info["block_bytes"] = chunk_bytes      # message bytes of each rank's block
    if budget != "per-chunk":
        info["budget"] = budget
    if codec is not spec.codec:
        info["fallback"] = (f"{codec.name}: {length} elements < small_input="
                            f"{getattr(spec.codec, 'small_input', '?')}")
    report.codec_info = info
    return (result if out is None else out), result_report(report, t0)


def result_report(report, t0):
    report.seconds = time.perf_counter() - t0
    return report
