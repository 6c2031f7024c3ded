"""The engine: runs one all-reduce for one rank, as a generator of requests
that a transport answers (see transports/ops.py).

Order of one call:
0. the codec's local statistics are computed (launched, on a device) while
   the ranks agree: they need nobody else, and are discarded if agreement fails;
1. agreement: every rank contributes (length, dtype, codec, topology, op,
   seed, call counter, transport, its local input error); any error or
   disagreement makes every rank raise the same exception before any data
   byte moves; the planner chooses from the agreed records the transport
   that runs and the path the program runs on it (the answer to ``Route``);
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

The engine makes no choice of path: it asks for ``CallSpec.path`` (chosen
by the caller, see paths.py) and runs the one the planner's answer to
``Route`` names (planner.resolve_path).  A call on the *native* path agrees
like any other, then hands the whole sum to the transport's own all-reduce
(``NativeAllreduce``) in the answer's wire dtype instead of steps 2-5; a native path
asked for on a transport with none for the call's arrays is answered with
the compressed program and the reason, which the report carries.

Non-finite input (``CallSpec.nonfinite``): the statistics phase flags it on
every rank alike; "propagate" (NCCL's semantics) fills every rank's output
with NaN and sends no data, "raise" raises on every rank.

The engine posts every exchange as soon as its payload is computed and
claims a received buffer only right before a kernel reads it, so a transport
that works asynchronously (NCCL on its own stream) overlaps the kernel of one
tile with the transfer of another.  The engine itself never waits or syncs.
"""
from __future__ import annotations

import time

from .. import schedules
from ..backend import dtype_name
from ..codecs.base import plan_layout
from ..errors import NonFiniteInputError, SumOverflowError
from ..report import Report
from ..transports.ops import Agree, Mark, NativeAllreduce, Route
from .phases import (NATIVE_DTYPES, CallSpec, agreement_record, check_agreement, check_local,
                     finish_into, holds_nonfinite, local_statistics, propagate_nonfinite,
                     raise_refusal, reduce_stats, report_plan, resolve_layout, run_schedule)
from .wire import from_wire, to_wire
from .workspace import FRESH


def rank_program(rank: int, n: int, x, spec: CallSpec, out=None, workspace=FRESH,
                 detailed_report: bool = True):
    """Generator: one rank's all-reduce.  Returns (output, Report)."""
    t0 = time.perf_counter()
    error, flat, flat_out, backend = None, None, None, None
    try:
        flat, flat_out, backend = check_local(x, out, spec, n)
    except Exception as exc:  # reported to every rank, raised after agreement
        error = f"{type(exc).__name__}: {exc}"
    # The local statistics need no other rank: start them now, so that a
    # device runs them while the host agrees with the other ranks; a call that
    # fails agreement discards them (they live in the workspace, nothing of
    # the caller's is touched).
    early = None
    if error is None and n > 1 and flat.shape[0] > 0 and spec.path == "compressed":
        try:
            early = local_statistics(flat, spec, backend, workspace)
        except Exception as exc:  # reported to every rank like a bad input
            error = f"{type(exc).__name__}: {exc}"
    metas = yield Agree(agreement_record(error, flat, backend, spec))
    check_agreement(metas)
    # the planner answers from the records: the transport, and the path on it
    routed = yield Route(spec.transport, spec.path, spec.codec, backend.name,
                         dtype_name(flat.dtype))

    length = int(flat.shape[0])
    report = Report(codec=spec.codec.name, topology=spec.topology, world_size=n, length=length,
                    dtype=dtype_name(flat.dtype), op=spec.op, seed=int(spec.seed),
                    call_counter=spec.counter, transport=routed.transport)
    result = flat_out if flat_out is not None else backend.empty(length, flat.dtype)
    shaped = out if out is not None else result.reshape(x.shape)
    if n == 1 or length == 0:
        result[...] = flat
        report.seconds = time.perf_counter() - t0
        return shaped, report

    report.path, report.path_reason = routed.path, routed.reason
    if routed.path == "native":
        yield from native_program(n, flat, result, spec, routed, backend, workspace, report,
                                  detailed_report)
    else:
        if early is None:   # a call that asked for the native path started none
            early = local_statistics(flat, spec, backend, workspace)
        yield from compressed_program(rank, n, flat, result, spec, early, backend, workspace,
                                      report, detailed_report)
    report.seconds = time.perf_counter() - t0
    return shaped, report


def native_program(n, flat, result, spec, routed, backend, workspace, report, detailed_report):
    """Generator: the native path (``routed.path``): the transport's own
    all-reduce of ``flat`` in ``routed.wire``, into ``result``; fills the
    report."""
    xp = backend.xp
    divisor = n if spec.op == "mean" else 1
    wire = routed.wire
    if spec.nonfinite == "raise":
        # the transport's all-reduce has no statistics phase to flag
        # NaN/Inf: one more agreement on a local flag, before any data
        # byte moves (all ranks alike: one digest exchange when clean)
        flags = yield Agree({"nonfinite": holds_nonfinite(xp, flat)})
        bad = [r for r, f in enumerate(flags) if f["nonfinite"]]
        if bad:
            raise NonFiniteInputError(f"NaN or Inf in the input of ranks {bad}")
    send, recv = to_wire(backend, flat, wire, result, workspace)
    buf = yield NativeAllreduce(send, recv)
    if spec.nonfinite == "raise" and holds_nonfinite(xp, buf):
        # finite inputs (checked above), a sum past the wire's range:
        # the same sum on every rank, so every rank raises
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


def compressed_program(rank, n, flat, result, spec, early, backend, workspace, report,
                       detailed_report):
    """Generator: the compressed path, steps 2-6 of the module's doc, from
    the local statistics ``early``, into ``result``; fills the report."""
    xp = backend.xp
    length = int(flat.shape[0])
    divisor = n if spec.op == "mean" else 1
    values, codec, keys, (stats, local_state) = early
    schedule = schedules.build(spec.topology, n)
    yield Mark("statistics")
    reduced, sent, stats_total = None, 0, 0
    if stats is not None:
        reduced, sent, stats_total = yield from reduce_stats(
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
        return
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
