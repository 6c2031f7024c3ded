"""The engine: runs one all-reduce for one rank, as a generator of
communication requests that a transport drives (see transports/).

Order of one call:
1. agreement: every rank contributes (length, dtype, codec, topology, op,
   seed, call counter, its local input error); any error or disagreement makes
   every rank raise the same exception before any data byte moves;
2. statistics phase (codecs that ask for it): an exact float32 all-reduce of a
   small vector over the same schedule, so all ranks hold bit-identical values;
3. the codec plans the call from the reduced statistics (widths, order, chunks);
4. reduce-scatter: a leaf compresses; a rank that has received partial sums
   decompresses-accumulates all but the last, then runs the fused
   decompress-accumulate-recompress on the last; the sink of a chunk
   recompresses and decodes its own bytes, exactly like everybody else will;
5. all-gather: compressed bytes are forwarded unchanged and decoded locally.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from . import schedules
from .backend import SUPPORTED_DTYPES, backend_for, dtype_name
from .codecs.base import Codec
from .codecs.plain import _ExactPlan
from .errors import InputMismatchError, InvalidInputError
from .report import Report
from .rng import call_keys
from .transports.ops import AllgatherObject, Exchange

OPS = ("sum", "mean")


@dataclass(frozen=True)
class CallSpec:
    codec: Codec
    topology: str
    op: str
    seed: int
    counter: int


def _check_local(x, spec: CallSpec, n: int):
    """(flat input, backend) or raises; never communicates."""
    if not isinstance(spec.codec, Codec):
        raise TypeError(f"codec must be a dynamiq_mpi codec instance, got {spec.codec!r}")
    if spec.op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {spec.op!r}")
    if not isinstance(spec.seed, (int, np.integer)) or spec.seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {spec.seed!r}")
    schedules.check_topology(spec.topology, n)
    backend = backend_for(x)
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {x.dtype}: pass float32 or bfloat16")
    if not x.flags.c_contiguous:
        raise ValueError("input must be C-contiguous")
    return x.reshape(-1), backend


def _agree(metas: list) -> None:
    bad = [(r, m["error"]) for r, m in enumerate(metas) if m["error"]]
    if bad:
        detail = "; ".join(f"rank {r}: {e}" for r, e in bad)
        raise InvalidInputError(f"invalid all-reduce input ({detail})")
    for key in ("length", "dtype", "backend", "codec", "topology", "op", "seed", "counter"):
        values = [m[key] for m in metas]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise InputMismatchError(f"ranks disagree on {key} ({per_rank})")


def _reduce_chunk(plan, chunk, received, event):
    """Compressed partial sum of this rank's subtree for ``chunk``."""
    if not received:
        return plan.compress(chunk, event)
    acc = None
    for payload in received[:-1]:
        acc = plan.accumulate(chunk, payload, acc)
    return plan.dar(chunk, received[-1], acc, event)


def run_schedule(plan, schedule, rank):
    """Reduce-scatter then all-gather of one plan; returns bytes this rank sent."""
    pending = defaultdict(list)
    held = {}
    sent = 0
    finalised = False

    def finalise():
        own = schedule.owned_chunk(rank)
        final = _reduce_chunk(plan, own, pending.pop(own, []), schedule.event(rank, own))
        plan.decode(own, final)       # the sink adopts its own decoded bytes
        held[own] = final

    for step in schedule.steps[rank]:
        if step.phase == schedules.REDUCE:
            payload = _reduce_chunk(plan, step.send_chunk, pending.pop(step.send_chunk, []),
                                    schedule.event(rank, step.send_chunk))
        else:
            if not finalised:
                finalise()
                finalised = True
            payload = held[step.send_chunk]
        received = yield Exchange(payload, step.dest, plan.chunk_nbytes[step.recv_chunk],
                                  step.source)
        sent += int(payload.nbytes)
        if step.phase == schedules.REDUCE:
            pending[step.recv_chunk].append(received)
        else:
            held[step.recv_chunk] = received
            plan.decode(step.recv_chunk, received)
    if not finalised:
        finalise()
    return sent


def rank_program(rank: int, n: int, x, spec: CallSpec):
    """Generator: one rank's all-reduce.  Returns (output, Report)."""
    t0 = time.perf_counter()
    error, flat, backend = None, None, None
    try:
        flat, backend = _check_local(x, spec, n)
    except Exception as exc:  # reported to every rank, raised after agreement
        error = f"{type(exc).__name__}: {exc}"
    meta = {
        "error": error,
        "length": None if flat is None else int(flat.shape[0]),
        "dtype": None if flat is None else dtype_name(flat.dtype),
        "backend": None if backend is None else backend.name,
        "codec": spec.codec.signature() if isinstance(spec.codec, Codec) else repr(spec.codec),
        "topology": spec.topology, "op": spec.op, "seed": int(spec.seed) if
        isinstance(spec.seed, (int, np.integer)) else repr(spec.seed),
        "counter": spec.counter,
    }
    metas = yield AllgatherObject(meta)
    _agree(metas)

    report = Report(codec=spec.codec.name, topology=spec.topology, world_size=n,
                    length=int(flat.shape[0]), dtype=dtype_name(flat.dtype), op=spec.op,
                    seed=int(spec.seed), call_counter=spec.counter)
    if n == 1 or flat.shape[0] == 0:
        out = flat.copy()
        report.seconds = time.perf_counter() - t0
        return out.reshape(x.shape), report

    schedule = schedules.build(spec.topology, n)
    keys = call_keys(int(spec.seed), spec.counter)
    stats, local_state = spec.codec.local_stats(flat, backend)
    reduced = None
    stats_total = 0
    sent = 0
    if stats is not None:
        stats_plan = _ExactPlan(stats, n, backend)
        sent += yield from run_schedule(stats_plan, schedule, rank)
        reduced = stats_plan.finish(1)
        stats_total = 2 * (n - 1) * sum(stats_plan.chunk_nbytes)
    plan = spec.codec.plan(flat, reduced, n, keys, backend, local_state)
    sent += yield from run_schedule(plan, schedule, rank)
    out = plan.finish(n if spec.op == "mean" else 1)

    report.wire_bytes_total = stats_total + 2 * (n - 1) * sum(plan.chunk_nbytes)
    report.stats_bytes_total = stats_total
    report.bytes_sent = sent
    report.codec_info = plan.report()
    report.seconds = time.perf_counter() - t0
    return out.reshape(x.shape), report
