"""The engine: runs one all-reduce for one rank, as a generator of requests
that a transport answers (see transports/ops.py).

Order of one call:
0. the codec's local statistics are computed (launched, on a device) while
   the ranks agree: they need nobody else, and are discarded if agreement fails;
1. agreement: every rank contributes (length, dtype, codec, topology, op,
   seed, call counter, transport, its local input error); any error or
   disagreement makes every rank raise the same exception before any data
   byte moves; the transport that runs is chosen from the agreed records;
2. statistics phase (codecs that ask for it): an exact float32 all-reduce of a
   small vector, so all ranks hold bit-identical values;
3. the codec plans the call from the reduced statistics (widths, order,
   chunks of whole records, tiles);
4. reduce-scatter, tile by tile: a leaf compresses; a rank that has received
   partial sums decompress-accumulates all but the last, then runs the fused
   decompress-accumulate-recompress on the last; the sink of a chunk
   recompresses and decodes its own bytes, exactly like everybody else will;
5. all-gather: compressed bytes are forwarded unchanged and decoded locally
   (the first step sends each of the sink's tiles right after its last fused
   step);
6. finish: the result in the caller's layout and dtype, into ``out``.

A call on the *native* path (``CallSpec.path``, chosen by the caller, see
paths.py) agrees like any other, then hands the whole sum to the transport's
own all-reduce (native.py) instead of steps 2-5.

Non-finite input (``CallSpec.nonfinite``): the statistics phase flags it on
every rank alike; "propagate" (NCCL's semantics) fills every rank's output
with NaN and sends no data, "raise" raises on every rank.

The engine posts every exchange as soon as its payload is computed and
claims a received buffer only right before a kernel reads it, so a transport
that works asynchronously (NCCL on its own stream) overlaps the kernel of one
tile with the transfer of another.  The engine itself never waits or syncs.
"""
from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from .. import schedules
from ..backend import BFLOAT16, SUPPORTED_DTYPES, backend_for, dtype_name
from ..codecs.base import DEFAULT_TILE_BYTES, LAYOUTS, Codec, align_up, plan_layout, signature_of
from ..codecs.plain import ByteMaxPlan, ElementwisePlan, exact_sum_into
from ..errors import InputMismatchError, InvalidInputError, NonFiniteInputError, SumOverflowError
from ..report import Report
from ..rng import call_keys
from ..settings import env_choice
from ..transports import TRANSPORTS, choose_transport, native_wires, transport_capabilities
from ..transports.ops import Agree, Claim, Exchange, Mark, NativeAllreduce, Route
from .wire import from_wire, to_wire, wire_dtype
from .workspace import FRESH

OPS = ("sum", "mean")
PATHS = ("compressed", "native")
NONFINITE = ("propagate", "raise")
LAYOUT_CHOICES = ("auto",) + LAYOUTS
# Input dtypes the codecs read directly; others are converted to float32 first.
NATIVE_DTYPES = SUPPORTED_DTYPES[:2]


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
    # the compressed stream's layout (codecs/base.py): "auto" is "fixed" (no
    # host read of the plan) for device arrays with nonfinite="propagate",
    # else "exact"
    layout: str = "auto"
    # the device address of the call's generator keys when it is captured as
    # a CUDA graph (graphs.py: written before each replay), else 0; a local
    # detail, not part of the agreement
    keys_at: int = 0
    # a hierarchical call's rail: ``plan_hook(codec, reduced statistics,
    # backend)`` gives the codec to plan with (call/rail_budget.py: one
    # allocation over the node's rails); called once, after the statistics,
    # on a call that has them.  A local detail, not part of the agreement.
    plan_hook: object = None


def resolve_layout(spec: CallSpec, backend_name) -> str:
    """The layout a call's plan uses, from agreed facts only."""
    if spec.layout != "auto":
        return spec.layout
    return "fixed" if backend_name == "gpu" and spec.nonfinite == "propagate" else "exact"


def _check_local(x, out, spec: CallSpec, n: int):
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
    schedules.check_topology(spec.topology, n)
    backend = backend_for(x)
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {x.dtype}: pass float32, bfloat16, float16 or float64")
    if not x.flags.c_contiguous:
        raise ValueError("input must be C-contiguous")
    flat_out = None
    if out is not None:
        check_out_buffer(out, x, backend, out.shape == x.shape,
                         f"have the input's shape {x.shape} and dtype {x.dtype}, "
                         f"got {out.shape} {out.dtype}")
        flat_out = out.reshape(-1)
    return x.reshape(-1), flat_out, backend


def check_out_buffer(out, x, backend, size_ok: bool, expected: str) -> None:
    """The checks every ``out=`` passes: x's array type and dtype, its size
    (``size_ok``; ``expected`` says what was wanted and got), C-contiguous,
    on x's device."""
    if type(out) is not type(x):
        raise TypeError(f"out must be a {type(x).__name__} like the input, "
                        f"got {type(out).__name__}")
    if not size_ok or out.dtype != x.dtype:
        raise ValueError(f"out must {expected}")
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous")
    if backend.name == "gpu" and out.device.id != x.device.id:
        raise ValueError(f"out is on device {out.device.id}, the input on {x.device.id}")


def check_nonfinite(nonfinite) -> None:
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")


# what a flat all-reduce's record leaves out (other collectives say it)
_FLAT_DEFAULTS = {"collective": "allreduce", "hierarchy": "flat"}


def _agree(metas: list) -> None:
    first = metas[0]
    if not first.get("error") and all(m is first for m in metas):
        return      # the agreement matched digests and handed back one record
    if any("error" not in m for m in metas):    # hierarchy.NodeCalls._auto_layout's record
        raise InputMismatchError("ranks disagree on hierarchy: some ask 'auto', others not")
    bad = [(r, m["error"]) for r, m in enumerate(metas) if m["error"]]
    if bad:
        detail = "; ".join(f"rank {r}: {e}" for r, e in bad)
        raise InvalidInputError(f"invalid all-reduce input ({detail})")
    for key in ("length", "dtype", "backend", "codec", "topology", "op", "seed", "counter",
                "transport", "tile_bytes", "path", "nonfinite", "layout", "collective",
                "hierarchy", "node_size", "rail_budget"):
        check_agreed([m.get(key, _FLAT_DEFAULTS.get(key)) for m in metas], key)


def check_agreed(values: list, what: str) -> None:
    """Raise InputMismatchError, naming every rank's value, where the ranks'
    ``values`` of ``what`` (one per rank, gathered alike) differ."""
    if any(v != values[0] for v in values):
        per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
        raise InputMismatchError(f"ranks disagree on {what} ({per_rank})")


def _reduce_tile(plan, tile, received, event):
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
    tile posted to the first all-gather step (which sends that chunk) right
    after it, so no kernel of the chunk waits for the wire; then the sink's own
    decode; the received tiles are claimed and decoded after the last one.
    Returns bytes sent."""
    own = schedule.owned_chunk(rank)
    assert step.phase == schedules.GATHER and step.send_chunk == own, step
    event = schedule.event(rank, own)
    sent, arrived = 0, []
    for send_tile, recv_tile in zip(plan.chunk_tiles[own], plan.chunk_tiles[step.recv_chunk]):
        final = yield from _reduce_tile(plan, send_tile, pending.pop(send_tile, []), event)
        held[send_tile] = final
        held[recv_tile] = yield Exchange(final, step.dest, plan.wire_slot(recv_tile), step.source)
        sent += plan.tile_nbytes(send_tile)
        plan.decode(send_tile, final)        # the sink adopts its own decoded bytes
        arrived.append(recv_tile)
    for recv_tile in arrived:
        plan.decode(recv_tile, (yield Claim(held[recv_tile])))
    return sent


def run_schedule(plan, schedule, rank):
    """Generator: reduce-scatter then all-gather of one plan, tile by tile.
    Returns the bytes this rank sent."""
    steps = schedule.steps[rank]
    reduce_recv = sum(align_up(plan.tile_nbytes(t)) for s in steps if s.phase == schedules.REDUCE
                      for t in plan.chunk_tiles[s.recv_chunk])
    arena = plan.scratch(reduce_recv)
    arena_used = 0
    pending = defaultdict(list)     # tile -> receive handles of partial sums
    held = {}                       # tile -> final compressed bytes (array or handle)
    sent = 0
    finalised = False
    for step in steps:
        if step.phase == schedules.GATHER and not finalised:
            # every schedule's first all-gather step sends the chunk this rank
            # has just finished reducing
            yield Mark("all-gather")
            finalised = True
            sent += yield from _finish_and_send(plan, schedule, rank, step, pending, held)
            continue
        event = schedule.event(rank, step.send_chunk)
        for send_tile, recv_tile in zip(plan.chunk_tiles[step.send_chunk],
                                        plan.chunk_tiles[step.recv_chunk]):
            nbytes = plan.tile_nbytes(recv_tile)
            if step.phase == schedules.REDUCE:
                payload = yield from _reduce_tile(plan, send_tile, pending.pop(send_tile, []),
                                                  event)
                recv = plan.sub(arena, arena_used, arena_used + nbytes)
                arena_used += align_up(nbytes)      # aligned slots, like the wire buffer
            else:
                payload = held[send_tile]
                recv = plan.wire_slot(recv_tile)
            handle = yield Exchange(payload, step.dest, recv, step.source)
            sent += plan.tile_nbytes(send_tile)
            if step.phase == schedules.REDUCE:
                pending[recv_tile].append(handle)
            else:
                held[recv_tile] = handle
                buf = yield Claim(handle)
                plan.decode(recv_tile, buf)
    return sent


def _reduce_stats(stats, n, rank, schedule, backend, workspace, tile_bytes):
    """Generator: the reduction of every rank's statistics vector, bit-identical
    on every rank: the exact float32 sum (float32 vectors) or the element-wise
    maximum (uint8 vectors).  Returns (reduced, bytes sent, bytes sent by all
    ranks)."""
    xp = backend.xp
    by_max = stats.dtype == np.uint8
    if n == 2:
        # One exchange of the whole vector instead of the ring's two steps:
        # the same bytes in one latency, and a + b == b + a in IEEE (max too),
        # so both ranks hold the same bits (the ring computes the same values).
        peer = 1 - rank
        other = workspace.take(xp, "stats.peer", stats.shape[0], stats.dtype)
        handle = yield Exchange(stats.view(np.uint8), peer, other.view(np.uint8), peer)
        received = (yield Claim(handle)).view(stats.dtype)
        reduced = workspace.take(xp, "stats.sum", stats.shape[0], stats.dtype)
        if by_max:
            xp.maximum(stats, received, out=reduced)
        else:
            exact_sum_into(backend, stats, received, reduced)
        return reduced, stats.nbytes, 2 * stats.nbytes
    plan = (ByteMaxPlan if by_max else ElementwisePlan)(stats, n, backend, workspace, tile_bytes,
                                                       prefix="stats")
    sent = yield from run_schedule(plan, schedule, rank)
    return plan.reduced_values(), sent, 2 * (n - 1) * sum(plan.chunk_nbytes)


def agreement_record(error, flat, backend, spec: CallSpec, **extra) -> dict:
    """What a rank contributes to the agreement of a call (``extra``: fields
    of other collectives)."""
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
        "layout": spec.layout, "can": transport_capabilities(backend),
    }


def propagate_nonfinite(exc, spec: CallSpec, result, report, stats_total, sent):
    """A plan refused non-finite input (decided from the reduced statistics,
    so alike on every rank): re-raise it, or fill the result with NaN and
    say so in the report (NCCL's semantics)."""
    if spec.nonfinite == "raise":
        raise exc
    result.fill(np.nan)
    report.nonfinite = True
    report.wire_bytes_total = report.stats_bytes_total = stats_total
    report.bytes_sent = sent
    report.codec_info = {"nonfinite": f"{type(exc).__name__}: {exc}; output set to NaN"}


def finish_into(plan, divisor, result, workspace, xp):
    """The plan's result, divided, into ``result`` (through a float32 stage
    for the dtypes the codecs do not write)."""
    if result.dtype in NATIVE_DTYPES:
        plan.finish(divisor, result)
        return
    staged = workspace.take(xp, "finish.f32", result.shape[0], np.float32)
    plan.finish(divisor, staged)
    result[...] = staged.astype(result.dtype)


def report_plan(report, plan, fixed, had_stats, detailed, xp, result) -> dict:
    """``report.nonfinite`` and the plan's report (its codec_info).  A plan in
    the fixed layout refused on the device (finish wrote NaN): learning it
    costs a host read, made only for a detailed report."""
    refusal = ""
    if fixed:
        if detailed:
            refusal = plan.refusal()
            report.nonfinite = bool(refusal)
    elif had_stats:
        report.nonfinite = False       # the statistics would have flagged it
    elif detailed:
        report.nonfinite = _holds_nonfinite(xp, result)
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


def _holds_nonfinite(xp, a) -> bool:
    """Any NaN/Inf in ``a`` (BF16 by its exponent bits: no float ufunc needed)."""
    if a.dtype == BFLOAT16:
        return bool(((a.view(np.uint16) & np.uint16(0x7F80)) == np.uint16(0x7F80)).any())
    return not bool(xp.isfinite(a).all())


def _local_statistics(flat, spec, backend, workspace):
    """(values, codec of this length, keys, (stats, local state)): the part of
    a compressed call that needs no other rank."""
    values = flat if flat.dtype in NATIVE_DTYPES else flat.astype(np.float32)
    codec = spec.codec.for_length(int(flat.shape[0]))
    keys = call_keys(int(spec.seed), spec.counter)
    if spec.keys_at:
        keys = dataclasses.replace(keys, device=int(spec.keys_at))
    return values, codec, keys, codec.local_stats(values, backend, workspace, keys=keys)


def rank_program(rank: int, n: int, x, spec: CallSpec, out=None, workspace=FRESH,
                 detailed_report: bool = True):
    """Generator: one rank's all-reduce.  Returns (output, Report)."""
    t0 = time.perf_counter()
    error, flat, flat_out, backend = None, None, None, None
    try:
        flat, flat_out, backend = _check_local(x, out, spec, n)
    except Exception as exc:  # reported to every rank, raised after agreement
        error = f"{type(exc).__name__}: {exc}"
    # The local statistics need no other rank: start them now, so that a
    # device runs them while the host agrees with the other ranks; a call that
    # fails agreement discards them (they live in the workspace, nothing of
    # the caller's is touched).
    early = None
    if error is None and n > 1 and flat.shape[0] > 0 and spec.path == "compressed":
        try:
            early = _local_statistics(flat, spec, backend, workspace)
        except Exception as exc:  # reported to every rank like a bad input
            error = f"{type(exc).__name__}: {exc}"
    metas = yield Agree(agreement_record(error, flat, backend, spec))
    _agree(metas)
    transport = yield Route(choose_transport(spec.transport, metas))

    length = int(flat.shape[0])
    report = Report(codec=spec.codec.name, topology=spec.topology, world_size=n, length=length,
                    dtype=dtype_name(flat.dtype), op=spec.op, seed=int(spec.seed),
                    call_counter=spec.counter, transport=transport)
    xp = backend.xp
    result = flat_out if flat_out is not None else backend.empty(length, flat.dtype)
    shaped = out if out is not None else result.reshape(x.shape)
    if n == 1 or length == 0:
        result[...] = flat
        report.seconds = time.perf_counter() - t0
        return shaped, report

    divisor = n if spec.op == "mean" else 1
    if spec.path == "native":
        wires = native_wires(transport, backend.name)
        if wires:
            wire = wire_dtype(spec.codec, dtype_name(flat.dtype), wires)
            report.path = "native"
            if spec.nonfinite == "raise":
                # the transport's all-reduce has no statistics phase to flag
                # NaN/Inf: one more agreement on a local flag, before any data
                # byte moves (all ranks alike: one digest exchange when clean)
                flags = yield Agree({"nonfinite": _holds_nonfinite(xp, flat)})
                bad = [r for r, f in enumerate(flags) if f["nonfinite"]]
                if bad:
                    raise NonFiniteInputError(f"NaN or Inf in the input of ranks {bad}")
            send, recv = to_wire(backend, flat, wire, result, workspace)
            buf = yield NativeAllreduce(send, recv)
            if spec.nonfinite == "raise" and _holds_nonfinite(xp, buf):
                # finite inputs (checked above), a sum past the wire's range:
                # the same sum on every rank, so every rank raises
                raise SumOverflowError(f"the sum leaves the {wire} range on the native path")
            from_wire(backend, buf, divisor, result)
            if detailed_report:
                report.nonfinite = _holds_nonfinite(xp, result)
            # a ring's bytes: what NCCL's and MPI's bandwidth-optimal algorithms send
            report.wire_bytes_total = 2 * (n - 1) * length * buf.dtype.itemsize
            report.bytes_sent = report.wire_bytes_total // n
            report.codec_info = {"native": f"{transport}'s all-reduce, {wire} on the wire",
                                 "wire": wire}
            report.seconds = time.perf_counter() - t0
            return shaped, report
        report.path_reason = f"no native all-reduce on {transport} for {backend.name} arrays"
        early = _local_statistics(flat, spec, backend, workspace)

    values, codec, keys, (stats, local_state) = early
    schedule = schedules.build(spec.topology, n)
    yield Mark("statistics")
    reduced, sent, stats_total = None, 0, 0
    if stats is not None:
        reduced, sent, stats_total = yield from _reduce_stats(
            stats, n, rank, schedule, backend, workspace, spec.tile_bytes)
    yield Mark("plan")
    if spec.plan_hook is not None and stats is not None:
        codec = spec.plan_hook(codec, reduced, backend)
    try:
        with plan_layout(resolve_layout(spec, backend.name)):
            plan = codec.plan(values, reduced, n, keys, backend, local_state, workspace,
                              spec.tile_bytes)
        fixed = getattr(plan, "fixed", False)
        if fixed and spec.nonfinite == "raise":
            raise_refusal(plan.refusal())       # the one host read such a call makes
    except (NonFiniteInputError, SumOverflowError) as exc:
        propagate_nonfinite(exc, spec, result, report, stats_total, sent)
        report.seconds = time.perf_counter() - t0
        return shaped, report
    # native output dtype: the plan may decode straight into the result
    if result.dtype in NATIVE_DTYPES:
        plan.bind_output(result, divisor)
    yield Mark("reduce-scatter")
    sent += yield from run_schedule(plan, schedule, rank)
    yield Mark("finish")
    if (codec is not spec.codec and getattr(spec.codec, "rejects_nonfinite", False)
            and spec.nonfinite == "raise"):
        # A small input sent uncompressed keeps the contract of the codec asked
        # for: the decoded sum is the same on every rank, so every rank raises
        # alike, and nothing reached the caller's buffer yet.
        plan.check_finite()
    finish_into(plan, divisor, result, workspace, xp)
    yield Mark("done")

    report.wire_bytes_total = stats_total + 2 * (n - 1) * sum(plan.chunk_nbytes)
    report.stats_bytes_total = stats_total
    report.bytes_sent = sent
    report.tiles_per_chunk = len(plan.chunk_tiles[0])
    report.sync_free = bool(getattr(plan, "sync_free", False)) and spec.nonfinite == "propagate"
    info = report_plan(report, plan, fixed, stats is not None, detailed_report, xp, result)
    if codec is not spec.codec:
        info["fallback"] = (f"{codec.name}: {length} elements < small_input="
                            f"{getattr(spec.codec, 'small_input', '?')}")
    report.codec_info = info
    report.seconds = time.perf_counter() - t0
    return shaped, report


def default_layout(value=None) -> str:
    """``value``, else ``$DYNAMIQ_LAYOUT``, else "auto" (the compressed
    stream's layout, engine.CallSpec: "fixed" for device arrays, so no call
    reads its plan back; "exact" / "fixed" force one, for A/B runs)."""
    return env_choice(value, "DYNAMIQ_LAYOUT", LAYOUT_CHOICES, "layout")


