"""The phases of a call and the one skeleton running them for every flat
collective (:func:`run_collective`), over which the all-reduce (engine.py)
and the reduce-scatter (engine_rs.py) are tables; hierarchy.py shares the
checks and the agreement.  The generators yield transports/ops.py's requests."""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from .. import schedules
from ..backend import BFLOAT16, SUPPORTED_DTYPES, backend_for, dtype_name
from ..codecs.base import DEFAULT_TILE_BYTES, LAYOUTS, Codec, align_up, signature_of
from ..codecs.plain import ByteMaxPlan, ElementwisePlan, exact_sum_into
from ..errors import InputMismatchError, InvalidInputError, NonFiniteInputError, SumOverflowError
from ..settings import env_choice, env_text
from ..report import Report
from ..transports import TRANSPORTS, transport_capabilities
from ..transports.ops import Agree, Claim, Exchange, ExchangeAll, Mark, Received

OPS = ("sum", "mean")
PATHS = ("compressed", "native")
NONFINITE = ("propagate", "raise")
LAYOUT_CHOICES = ("auto",) + LAYOUTS
# Input dtypes the codecs read directly; others are converted to float32 first.
NATIVE_DTYPES = SUPPORTED_DTYPES[:2]
# The phase boundaries a program marks, each request made once (never changed)
MARKS = {m: Mark(m) for m in "statistics plan reduce-scatter all-gather finish done".split()}


def decode_into_output() -> bool:
    """Unless ``$DYNAMIQ_DECODE_INTO_OUTPUT`` is "0" (two passes, the same bits: A/B runs)."""
    return env_text("DYNAMIQ_DECODE_INTO_OUTPUT") != "0"


@dataclass(frozen=True)
class CallSpec:
    codec: Codec
    topology: str
    op: str
    seed: int
    counter: int
    transport: str = "auto"
    tile_bytes: int = DEFAULT_TILE_BYTES
    path: str = "compressed"        # or "native": the transport's own all-reduce
    nonfinite: str = "propagate"    # or "raise"
    layout: str = "auto"            # the stream's layout (resolve_layout)
    gather: str = schedules.DEFAULT_GATHER     # the all-gather's schedule (schedules.GATHERS)
    # local details, not agreed: the device address of the generator keys of a
    # call captured as a CUDA graph (else 0); a rail's ``plan_hook(codec,
    # reduced statistics, backend)``, the codec to plan with (rail_budget.py);
    # whether the plan may decode into the result (a call runner reads it once)
    keys_at: int = 0
    plan_hook: object = None
    decode_into: bool = field(default_factory=decode_into_output)


def resolve_layout(spec: CallSpec, backend_name) -> str:
    """The layout a call's plan uses, from agreed facts only: "auto" is
    "fixed" (no host read) for device arrays with nonfinite="propagate"."""
    if spec.layout != "auto":
        return spec.layout
    return "fixed" if backend_name == "gpu" and spec.nonfinite == "propagate" else "exact"


def check_local(x, out, spec: CallSpec, n: int):
    """(flat input, flat out or None, backend) or raises; never communicates."""
    if not isinstance(spec.codec, Codec):
        raise TypeError(f"codec must be a dynamiq_mpi codec instance, got {spec.codec!r}")
    if spec.op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {spec.op!r}")
    if not isinstance(spec.seed, (int, np.integer)) or spec.seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {spec.seed!r}")
    if not isinstance(spec.tile_bytes, (int, np.integer)) or spec.tile_bytes < 1:
        raise ValueError(f"tile_bytes must be a positive integer, got {spec.tile_bytes!r}")
    if spec.transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {spec.transport!r}")
    if spec.path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {spec.path!r}")
    check_nonfinite(spec.nonfinite)
    if spec.layout not in LAYOUT_CHOICES:
        raise ValueError(f"layout must be one of {LAYOUT_CHOICES}, got {spec.layout!r}")
    if spec.gather not in schedules.GATHERS:
        raise ValueError(f"gather must be one of {schedules.GATHERS}, got {spec.gather!r}")
    schedules.check_topology(spec.topology, n)
    backend = backend_for(x)
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {x.dtype}: pass float32, bfloat16, float16 or float64")
    if not x.flags.c_contiguous:
        raise ValueError("input must be C-contiguous")
    flat_out = None
    if out is not None:
        check_out_buffer(out, x, backend, out.shape == x.shape,
                         lambda: f"have the input's shape {x.shape} and dtype {x.dtype}, "
                                 f"got {out.shape} {out.dtype}")
        flat_out = out.reshape(-1)
    return x.reshape(-1), flat_out, backend


def check_scatter(x, out, flat, backend, n: int):
    """A reduce-scatter's checks after :func:`check_local` of ``x`` alone (a
    length divisible by n, ``out`` of ``len(x) / n``): the flat ``out`` or None."""
    if flat.shape[0] % n:
        raise ValueError(f"reduce_scatter needs a length divisible by the {n} ranks, got "
                         f"{flat.shape[0]} (pad it, as FSDP does)")
    if out is None:
        return None
    m = flat.shape[0] // n
    check_out_buffer(out, x, backend, out.size == m,
                     lambda: f"hold len(x) / n = {m} elements of dtype {x.dtype}, "
                             f"got {out.size} of {out.dtype}")
    return out.reshape(-1)


def check_out_buffer(out, x, backend, size_ok: bool, expected) -> None:
    """Every ``out=``'s checks: x's type, dtype and device, its size
    (``size_ok``; ``expected()``: what was wanted and got), C-contiguous."""
    if type(out) is not type(x):
        raise TypeError(f"out must be a {type(x).__name__} like the input, "
                        f"got {type(out).__name__}")
    if not size_ok or out.dtype != x.dtype:
        raise ValueError(f"out must {expected()}")
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous")
    if backend.name == "gpu" and out.device.id != x.device.id:
        raise ValueError(f"out is on device {out.device.id}, the input on {x.device.id}")


def check_nonfinite(nonfinite) -> None:
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")


# what a flat all-reduce's record leaves out (other collectives say it)
_FLAT_DEFAULTS = {"collective": "allreduce", "hierarchy": "flat"}


def check_agreement(metas: list, what: str = "all-reduce") -> None:
    """Raise alike on every rank where one reported an error or the records differ."""
    first = metas[0]
    if not first.get("error") and all([m is first for m in metas]):
        return      # the agreement matched digests and handed back one record
    if any("error" not in m for m in metas):    # hierarchy.NodeCalls.auto_layout's record
        raise InputMismatchError("ranks disagree on hierarchy: some ask 'auto', others not")
    bad = [(r, m["error"]) for r, m in enumerate(metas) if m["error"]]
    if bad:
        detail = "; ".join(f"rank {r}: {e}" for r, e in bad)
        raise InvalidInputError(f"invalid {what} input ({detail})")
    for key in ("length", "dtype", "backend", "codec", "topology", "op", "seed", "counter",
                "transport", "tile_bytes", "path", "nonfinite", "layout", "gather", "collective",
                "hierarchy", "node_size", "rail_budget", "budget"):
        check_agreed([m.get(key, _FLAT_DEFAULTS.get(key)) for m in metas], key)
    # any other field (the digests differed for a reason): never a silent pass;
    # the transports' capabilities may differ (the route explains them)
    for key in sorted(set().union(*metas) - {"can", "error"}):
        check_agreed([m.get(key, _FLAT_DEFAULTS.get(key)) for m in metas], key)


def check_agreed(values: list, what: str) -> None:
    """InputMismatchError naming every rank's value where ``values`` (one per rank) differ."""
    if any(v != values[0] for v in values):
        per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
        raise InputMismatchError(f"ranks disagree on {what} ({per_rank})")


def run_collective(table, rank: int, n: int, x, spec: CallSpec, out, workspace,
                   detailed_report: bool):
    """Generator: one rank's call of the collective ``table`` describes,
    returning (output, Report): the local checks (``table.check``), the local
    statistics (``table.start``: a device computes while the host agrees), the
    agreement and ``Route``; then ``table.native``, or the compressed phases:
    the statistics reduced exactly, the plans (``table.plan`` sets ``codec``,
    ``plans``, ``own``), the hops, the finish and the report."""
    t0 = time.perf_counter()
    error = None
    try:
        table.check(x, out, spec, n)
    except Exception as exc:  # reported to every rank, raised after agreement
        error = f"{type(exc).__name__}: {exc}"
    flat, flat_out, backend = table.flat, table.flat_out, table.backend
    if error is None and n > 1 and flat.shape[0] > 0:
        try:
            table.start(flat, spec, backend, workspace, n)
        except Exception as exc:  # reported to every rank like a bad input
            error = f"{type(exc).__name__}: {exc}"
    metas = yield Agree(agreement_record(error, flat, backend, spec, **table.record))
    check_agreement(metas, table.name)
    routed = yield table.route(spec, flat, backend)

    length = int(flat.shape[0])
    report = Report(codec=spec.codec.name, topology=spec.topology, world_size=n, length=length,
                    dtype=dtype_name(flat.dtype), op=spec.op, seed=int(spec.seed),
                    call_counter=spec.counter, transport=routed.transport,
                    collective=table.collective)
    result = (flat_out if flat_out is not None
              else backend.empty(table.output_length(length, n), flat.dtype))
    output = out if out is not None else table.shaped(result, x)
    if n == 1 or length == 0:
        result[...] = flat
        report.seconds = time.perf_counter() - t0
        return output, report
    report.path, report.path_reason = routed.path, routed.reason
    if routed.path == "native":     # only where the table's Route asked for it
        yield from table.native(n, flat, result, spec, routed, backend, workspace, report,
                                detailed_report)
        report.seconds = time.perf_counter() - t0
        return output, report

    xp = backend.xp
    divisor = n if spec.op == "mean" else 1
    stats = table.statistics(flat, spec, backend, workspace)
    schedule = schedules.build(spec.topology, n, spec.gather)
    yield MARKS["statistics"]
    reduced, sent, stats_total = None, 0, 0
    if stats is not None:
        reduced, sent, stats_total = yield from reduce_stats(
            stats, n, rank, schedule, backend, workspace, spec.tile_bytes)
    yield MARKS["plan"]
    try:
        table.plan(reduced, rank, n, spec, backend, workspace)
        fixed = getattr(table.own, "fixed", False)
        if fixed and spec.nonfinite == "raise":
            for p in table.plans:       # the host reads; the same verdict on every rank
                raise_refusal(p.refusal())
    except (NonFiniteInputError, SumOverflowError) as exc:
        propagate_nonfinite(exc, spec, result, report, stats_total, sent)
        report.seconds = time.perf_counter() - t0
        return output, report
    codec = table.codec
    # a small input sent uncompressed keeps the codec's contract: its sum is checked
    raise_check = (codec is not spec.codec and getattr(spec.codec, "rejects_nonfinite", False)
                   and spec.nonfinite == "raise")
    if spec.decode_into and result.dtype in NATIVE_DTYPES:  # the plan may decode into it
        table.bind(result, divisor, raise_check)
    yield MARKS["reduce-scatter"]
    sent += yield from table.hops(schedule, rank)
    yield MARKS["finish"]
    if raise_check:
        yield from table.check_sum()
    finish_into(table.own, divisor, result, workspace, xp)
    yield MARKS["done"]

    chunk_bytes = [sum(p.chunk_nbytes) for p in table.plans]
    report.gather = schedule.gather if table.halves == 2 else ""
    report.wire_bytes_total = stats_total + table.halves * (n - 1) * sum(chunk_bytes)
    report.stats_bytes_total = stats_total
    report.bytes_sent = sent
    report.tiles_per_chunk = max([len(p.chunk_tiles[0]) for p in table.plans])
    report.sync_free = (all([getattr(p, "sync_free", False) for p in table.plans])
                        and not raise_check and spec.nonfinite == "propagate")
    info = report_plan(report, table.own, fixed, stats is not None, detailed_report, xp, result)
    info.update(table.info(chunk_bytes))
    if codec is not spec.codec:
        info["fallback"] = (f"{codec.name}: {report.length} elements < small_input="
                            f"{getattr(spec.codec, 'small_input', '?')}")
    report.codec_info = info
    report.seconds = time.perf_counter() - t0
    return output, report


def reduce_tile(plan, tile, received, event):
    """Generator: the compressed partial sum of this rank's subtree for ``tile``."""
    if not received:
        return plan.compress(tile, event)
    acc = None
    for handle in received[:-1]:
        buf = yield Claim(handle)
        acc = plan.accumulate(tile, buf, acc)
    buf = yield Claim(received[-1])
    return plan.dar(tile, buf, acc, event)


def _finish_and_send(plan, schedule, rank, step, pending, held):
    """Generator: the sink's last fused step of every tile of its chunk, each
    sent on at once (no kernel waits for the wire), then the decodes.
    Returns bytes sent."""
    own = schedule.owned_chunk(rank)
    assert step.phase == schedules.GATHER and step.send_chunk == own, step
    event = schedule.event(rank, own)
    sent, arrived = 0, []
    for send_tile, recv_tile in zip(plan.chunk_tiles[own], plan.chunk_tiles[step.recv_chunk]):
        final = yield from reduce_tile(plan, send_tile, pending.pop(send_tile, []), event)
        # forwarded later (the doubling's rounds) as what the lanes have sent
        # already: no wait for the compute stream's decodes in between
        held[send_tile] = Received(final)
        held[recv_tile] = yield Exchange(final, step.dest, plan.wire_slot(recv_tile), step.source)
        sent += plan.tile_nbytes(send_tile)
        plan.decode(send_tile, final)        # the sink adopts its own decoded bytes
        arrived.append(recv_tile)
    for recv_tile in arrived:
        plan.decode(recv_tile, (yield Claim(held[recv_tile])))
    return sent


def run_schedule(plan, schedule, rank):
    """Generator: one plan's reduce-scatter then all-gather, tile by tile; the
    bytes sent.  A round of one step pipelines its tiles (each sent once
    computed); a round of several steps (one peer) is posted as one group."""
    steps = schedule.steps[rank]
    reduce_recv = sum(align_up(plan.tile_nbytes(t)) for s in steps if s.phase == schedules.REDUCE
                      for t in plan.chunk_tiles[s.recv_chunk])
    arena = plan.scratch(reduce_recv)
    arena_used = 0
    pending = defaultdict(list)     # tile -> receive handles of partial sums
    held = {}                       # tile -> final compressed bytes (array or handle)
    sent = 0
    finalised = False
    for group in schedule.rounds[rank]:
        if group[0].phase == schedules.GATHER and not finalised:
            # the first all-gather round sends the chunk just reduced
            yield MARKS["all-gather"]
            finalised = True
            sent += yield from _finish_and_send(plan, schedule, rank, group[0], pending, held)
            continue
        together = len(group) > 1
        posted = []                 # (exchange, tile received) of a round posted together
        for step in group:
            event = schedule.event(rank, step.send_chunk)
            for send_tile, recv_tile in zip(plan.chunk_tiles[step.send_chunk],
                                            plan.chunk_tiles[step.recv_chunk]):
                nbytes = plan.tile_nbytes(recv_tile)
                if step.phase == schedules.REDUCE:
                    payload = yield from reduce_tile(plan, send_tile,
                                                     pending.pop(send_tile, []), event)
                    recv = plan.sub(arena, arena_used, arena_used + nbytes)
                    arena_used += align_up(nbytes)      # aligned slots, like the wire buffer
                else:
                    payload = held[send_tile]
                    recv = plan.wire_slot(recv_tile)
                exchange = Exchange(payload, step.dest, recv, step.source)
                sent += plan.tile_nbytes(send_tile)
                if together:
                    posted.append((exchange, recv_tile))
                else:
                    yield from _received(plan, step.phase, recv_tile, (yield exchange),
                                         pending, held)
        if posted:
            handles = yield ExchangeAll([x for x, _ in posted])
            for (_, recv_tile), handle in zip(posted, handles):
                yield from _received(plan, group[0].phase, recv_tile, handle, pending, held)
    return sent


def _received(plan, phase, tile, handle, pending, held):
    """Generator: a posted receive of ``tile``: a partial sum waits for its
    fused step; an all-gather's bytes are held (to forward) and decoded."""
    if phase == schedules.REDUCE:
        pending[tile].append(handle)
        return
    held[tile] = handle
    plan.decode(tile, (yield Claim(handle)))


def reduce_stats(stats, n, rank, schedule, backend, workspace, tile_bytes):
    """Generator: the statistics' exact float32 sum (uint8: maximum), the same
    bits on every rank.  Returns (reduced, bytes sent, bytes sent by all ranks)."""
    xp = backend.xp
    by_max = stats.dtype == np.uint8
    if n == 2:
        # one exchange instead of two steps: a + b == b + a, the same bits
        peer = 1 - rank
        other = workspace.take(xp, "stats.peer", stats.shape[0], stats.dtype)
        handle = yield Exchange(stats.view(np.uint8), peer, other.view(np.uint8), peer)
        received = (yield Claim(handle)).view(stats.dtype)
        reduced = workspace.take(xp, "stats.sum", stats.shape[0], stats.dtype)
        _combine_stats(backend, by_max, stats, received, reduced)
        return reduced, stats.nbytes, 2 * stats.nbytes
    if schedules.stats_direct(n, stats.nbytes) and stats.shape[0] >= n:
        return (yield from _reduce_stats_direct(stats, n, rank, backend, workspace, by_max))
    plan = (ByteMaxPlan if by_max else ElementwisePlan)(stats, n, backend, workspace, tile_bytes,
                                                       prefix="stats")
    sent = yield from run_schedule(plan, schedule, rank)
    return plan.reduced_values(), sent, 2 * (n - 1) * sum(plan.chunk_nbytes)


def _combine_stats(backend, by_max, a, b, out):
    """out = a + b in float32 (uint8 statistics: the maximum)."""
    if by_max:
        backend.xp.maximum(a, b, out=out)
    else:
        exact_sum_into(backend, a, b, out)


def _reduce_stats_direct(stats, n, rank, backend, workspace, by_max):
    """Rank j owns elements [L j / n, L (j + 1) / n): every rank sends each
    owner its part at once, the owner sums the n parts in rank order, then
    sends the sum to every rank at once."""
    xp, length = backend.xp, stats.shape[0]
    bounds = [length * j // n for j in range(n + 1)]
    part = lambda a, j: a[bounds[j]:bounds[j + 1]]      # noqa: E731
    peers = [((rank + k) % n, (rank - k) % n) for k in range(1, n)]     # (dest, source)
    size = bounds[rank + 1] - bounds[rank]
    rows = {rank: part(stats, rank)}
    got = workspace.take(xp, "stats.parts", (n - 1) * size, stats.dtype)
    handles = yield ExchangeAll([
        Exchange(part(stats, dest).view(np.uint8), dest,
                 got[k * size:(k + 1) * size].view(np.uint8), source)
        for k, (dest, source) in enumerate(peers)])
    for (_, source), handle in zip(peers, handles):
        rows[source] = (yield Claim(handle)).view(stats.dtype)
    reduced = workspace.take(xp, "stats.sum", length, stats.dtype)
    mine = part(reduced, rank)
    for j in range(1, n):                   # in rank order: the same bits on every rank
        _combine_stats(backend, by_max, rows[0] if j == 1 else mine, rows[j], mine)
    handles = yield ExchangeAll([
        Exchange(mine.view(np.uint8), dest, part(reduced, source).view(np.uint8), source)
        for dest, source in peers])
    for handle in handles:
        yield Claim(handle)
    item = stats.itemsize
    sent = (length - size) * item + (n - 1) * size * item
    return reduced, sent, 2 * (n - 1) * length * item


def agreement_record(error, flat, backend, spec: CallSpec, **extra) -> dict:
    """A rank's contribution to a call's agreement (``extra``: other collectives' fields)."""
    return {
        **extra, "error": error,
        "length": None if flat is None else int(flat.shape[0]),
        "dtype": None if flat is None else dtype_name(flat.dtype),
        "backend": None if backend is None else backend.name,
        "codec": signature_of(spec.codec),
        "topology": spec.topology, "op": spec.op, "seed": int(spec.seed) if
        isinstance(spec.seed, (int, np.integer)) else repr(spec.seed),
        "counter": spec.counter, "transport": spec.transport,
        "tile_bytes": spec.tile_bytes, "path": spec.path, "nonfinite": spec.nonfinite,
        "layout": spec.layout, "gather": spec.gather, "can": transport_capabilities(backend),
    }


def propagate_nonfinite(exc, spec: CallSpec, result, report, stats_total, sent):
    """A plan refused non-finite input (alike everywhere): re-raise, or NaN (NCCL's semantics)."""
    if spec.nonfinite == "raise":
        raise exc
    result.fill(np.nan)
    report.nonfinite = True
    report.wire_bytes_total = report.stats_bytes_total = stats_total
    report.bytes_sent = sent
    report.codec_info = {"nonfinite": f"{type(exc).__name__}: {exc}; output set to NaN"}


def finish_into(plan, divisor, result, workspace, xp):
    """The plan's result / divisor into ``result`` (via float32 for dtypes codecs don't write)."""
    if result.dtype in NATIVE_DTYPES:
        plan.finish(divisor, result)
        return
    staged = workspace.take(xp, "finish.f32", result.shape[0], np.float32)
    plan.finish(divisor, staged)
    result[...] = staged.astype(result.dtype)


def report_plan(report, plan, fixed, had_stats, detailed, xp, result) -> dict:
    """``report.nonfinite`` and codec_info (a fixed-layout refusal: read only when detailed)."""
    refusal = ""
    if fixed:
        if detailed:
            refusal = plan.refusal()
            report.nonfinite = bool(refusal)
    elif had_stats:
        report.nonfinite = False       # the statistics would have flagged it
    elif detailed:
        report.nonfinite = holds_nonfinite(xp, result)
    info = plan.report(detailed)
    if refusal:
        info["nonfinite"] = f"{refusal}; output set to NaN"
    return info


def raise_refusal(refusal: str) -> None:
    """Raise a plan's refusal ("Type: message", or '' for none) as its type."""
    if not refusal:
        return
    kind, _, message = refusal.partition(": ")
    raise {"NonFiniteInputError": NonFiniteInputError,
           "SumOverflowError": SumOverflowError}.get(kind, RuntimeError)(message)


def holds_nonfinite(xp, a) -> bool:
    """Any NaN/Inf in ``a`` (BF16 by its exponent bits: no float ufunc needed)."""
    if a.dtype == BFLOAT16:
        return bool(((a.view(np.uint16) & np.uint16(0x7F80)) == np.uint16(0x7F80)).any())
    return not bool(xp.isfinite(a).all())


def default_layout(value=None) -> str:
    """``value``, else ``$DYNAMIQ_LAYOUT``, else "auto" (:func:`resolve_layout`)."""
    return env_choice(value, "DYNAMIQ_LAYOUT", LAYOUT_CHOICES, "layout")


def default_gather(value=None) -> str:
    """``value``, else ``$DYNAMIQ_GATHER``, else "ring" (schedules.DEFAULT_GATHER)."""
    return env_choice(value, "DYNAMIQ_GATHER", schedules.GATHERS, "gather",
                      default=schedules.DEFAULT_GATHER)
