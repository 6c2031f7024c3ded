"""The DynamiQ codec's per-call plan: the compiled planner's widths, stable
reorder and class counts (on the device for device inputs), cut on the host
(exact layout) or on the device into slots sized from the budget alone
(fixed layout: ``layout_budget``, nothing read back; docs/design.md).
"""
from __future__ import annotations

import functools
import hashlib
import math

import numpy as np

from ..backend import as_float32
from ..errors import NonFiniteInputError, SumOverflowError
from .allocation import BF16_WIDTH, CLASSES, WIDTHS, record_bits, summarise, theta_to_u, widths_of
from .base import (Plan, StreamLayout, align_up, current_layout, fixed_tiling, planned_chunks,
                   tile_stream)

SUPER = 256
FLT_MAX = np.float32(np.finfo(np.float32).max)
# Largest sum of max |x| over ranks: a margin for partial sums a scale step high.
PARTIAL_SUM_LIMIT = np.float32(0.98) * FLT_MAX

# DqParams.scale_rule of each DynamiQ(scale_code=...)
SCALE_CODES = {"ceil": 0, "hybrid": 1}


# Kernel parameter blobs per (codec, events, correlated), without the per-call keys.
_PARAMS_CACHE: dict = {}


def _params_for(codec, n_events, correlated, keys, kernels):
    """{width: DqParams bytes (uint8 array)} for this call's keys."""
    perm_bits = (n_events - 1).bit_length()
    cache_key = (codec.cached_signature(), n_events, correlated)
    base = _PARAMS_CACHE.get(cache_key)
    if base is None:
        tables = codec.tables()
        base = {w: np.frombuffer(kernels.make_params(
                    w, codec.hierarchical, correlated, n_events, perm_bits, 0, 0,
                    tables[w].mag, tables[w].inv_gap, tables[w].level, tables[w].lut,
                    SCALE_CODES[codec.scale_code]), dtype=np.uint8)
                for w in WIDTHS}
        if len(_PARAMS_CACHE) > 64:
            _PARAMS_CACHE.clear()
        _PARAMS_CACHE[cache_key] = base
    out = {}
    at, ptr_at = kernels.PARAMS_KEYS_AT, kernels.PARAMS_KEY_PTR_AT
    for w, blob in base.items():
        b = blob.copy()
        b[at:at + 8].view(np.uint32)[:] = (keys.value, keys.perm)
        b[ptr_at:ptr_at + 8].view(np.uint64)[0] = keys.device
        out[w] = b
    return out


# The most bits per coordinate set aside for the fixed layout's padding.
LAYOUT_RESERVE_BITS = 0.03


def _slots(data_max: int, chunks: int, widest: int, tile_bytes: int) -> tuple:
    """(tiles per chunk, slot bytes) of the fixed layout for ``data_max``
    payload bytes: a cut lands within one record after its target."""
    per_chunk = -(-data_max // chunks) + widest - 1
    tiles = max(1, -(-per_chunk // max(1, int(tile_bytes))))
    return tiles, align_up(per_chunk if tiles == 1 else -(-per_chunk // tiles) + widest - 1)


def stream_classes(codec, bf16_class: bool) -> list:
    """The stream's widths (2, 4, 8, 16 bits) a call of ``codec`` can use."""
    return [w for w in widths_of(bf16_class) if codec.fixed_width in (None, w)]


@functools.lru_cache(maxsize=256)
def layout_budget(codec, nsg: int, length: int, chunks: int, tile_bytes: int, stats_bits: int,
                  bf16_class: bool, reserve: bool = True) -> tuple:
    """(the planner's budget, bits; the fixed layout's tiles per chunk, slot
    bytes; the widest present record's bytes).  Both layouts plan with the
    budget less the slots' worst padding (the same values), except where that
    reserve would cost over LAYOUT_RESERVE_BITS per coordinate, tip the
    planner into the padded budget or drop a width (docs/design.md,
    "Sync-free calls")."""
    rb = {w: record_bits(w, codec.hierarchical) // 8 for w in WIDTHS + (BF16_WIDTH,)}
    widest = max(rb[w] for w in stream_classes(codec, bf16_class))
    budget = codec.bits * length
    padded = codec.bits * nsg * SUPER + stats_bits
    if codec.fixed_width is not None:       # the widths do not depend on the budget
        return (budget,) + _slots(nsg * rb[codec.fixed_width], chunks, widest, tile_bytes) + (widest,)
    allowed = (math.floor(budget) - stats_bits) // 8        # payload bytes the budget allows
    def fits(d):
        tiles, slot = _slots(d, chunks, widest, tile_bytes)
        return chunks * tiles * slot <= allowed
    # the largest payload whose slots fit (bisection; the slots grow with it)
    lo, hi = 0, max(0, min(allowed, nsg * widest))
    if not fits(lo):
        hi = -1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    data = hi
    worst_base = stats_bits + nsg * 8 * rb[2]       # every super-group live at 2 bits
    variable = codec.variable_width                 # (fixed_width is None here)
    if (reserve and variable and 8 * (allowed - data) <= LAYOUT_RESERVE_BITS * length
            and worst_base <= stats_bits + 8 * data):
        planned = stats_bits + 8 * max(data, 0)
    else:       # no reserve: the fixed layout's padding may exceed the budget
        planned, data = budget, allowed
    # the padded budget where every super-group live at 2 bits exceeds ``planned``
    if worst_base > planned:
        data = min((math.floor(max(planned, padded)) - stats_bits) // 8, nsg * widest)
    return (planned,) + _slots(max(data, 0), chunks, widest, tile_bytes) + (widest,)


class _DynamiQPlan(Plan):
    def __init__(self, codec, x, reduced, n, keys, backend, local_mean, ws, tile_bytes):
        self.codec, self.backend, self.xp, self.ws = codec, backend, backend.xp, ws
        self.k = backend.kernels
        xp = self.xp
        self.x = x
        self.length = x.shape[0]
        self.nsg = nsg = -(-self.length // SUPER)
        head = 2 * nsg if codec.centring else nsg
        self.mean_sum = reduced[:nsg] if codec.centring else self._zeros("mean_sum", nsg)
        self.norm2 = codec.reduced_norms(reduced, self.length)
        stats_bits = codec.stats_bits(self.length)
        hier = codec.hierarchical
        widths = ws.take(xp, "dq.widths", nsg, np.int8)
        order = ws.take(xp, "dq.order", nsg, np.int64)
        stream_of_sg = ws.take(xp, "dq.stream_of_sg", nsg, np.int64)
        header = ws.take(xp, "dq.header", self.k.PLAN_HEADER, np.float64)
        variable = codec.joins_budgets
        bf16_class = codec.bf16_class and variable
        padded_budget_bits = codec.bits * nsg * SUPER + stats_bits
        self.chunks = planned_chunks(n)
        # (blocks given their bits by a joint allocation plan them exactly)
        self.planned_bits, tiles, slot, _ = layout_budget(
            codec, nsg, self.length, self.chunks, int(tile_bytes), stats_bits, bf16_class,
            not codec.__dict__.get("_exact_budget", False))
        args = (nsg, codec.centring, codec.zero_class, variable, codec.fixed_width or 0,
                stats_bits, [record_bits(w, hier) for w in WIDTHS + (BF16_WIDTH,)],
                self.planned_bits, padded_budget_bits, self.norm2,
                self.mean_sum if codec.centring else None, reduced[head:head + 2],
                widths, order, stream_of_sg, header)
        if backend.name == "gpu":
            scratch = ws.take(xp, "dq.plan_scratch", self.k.plan_scratch_bytes(nsg), np.uint8)
            self.k.plan(*args, scratch, bf16_class=bf16_class)
        else:
            self.k.plan(*args, bf16_class=bf16_class)
        # host work that runs while the device plans
        correlated = codec.correlated and n > 1
        self.params = _params_for(codec, n if correlated else 1, correlated, keys, self.k)
        self.local_mean = local_mean
        # stream super-group s reads input row order[s]
        self.source = self.k.Source(x, order, 0, local_mean)
        self.widths = widths_of(bf16_class)
        self.rec_bytes = {w: record_bits(w, hier) // 8 for w in self.widths}
        self.alloc_widths = widths                  # device/host int8 per super-group
        self.budget_bits = codec.bits * self.length
        self.stream_of_sg = stream_of_sg
        self._order_full = order
        self.header = header
        self._bound = None
        self._result = None             # float32 stream of decoded values, made on first use
        self._padded = None
        self._host_header = None
        # (2^32 elements or more keep the exact layout: the generator's bound)
        self.fixed = current_layout() == "fixed" and nsg * SUPER < 2 ** 32
        self.sync_free = self.fixed        # nothing of the plan is read back
        if self.fixed:
            self._layout_fixed(bf16_class, tiles, slot)
        else:
            self._layout_exact(n, tile_bytes)

    def _layout_exact(self, n, tile_bytes):
        """Read the plan's header (the call's one device-to-host copy), refuse
        what must be, and cut the stream at record boundaries."""
        h = self._read_header()
        nonfinite_ranks, absmax_sum, means_ok, exceeded = h[0], h[1], h[2], h[3]
        if nonfinite_ranks > 0:
            raise NonFiniteInputError("input holds NaN or Inf on at least one rank "
                                      f"({int(nonfinite_ranks)} of {n} ranks)")
        if not absmax_sum <= PARTIAL_SUM_LIMIT:
            raise SumOverflowError(
                "the inputs' max |x| summed over ranks exceeds the float32 range "
                f"({PARTIAL_SUM_LIMIT:.3g}): partial sums could overflow")
        if not means_ok:
            raise SumOverflowError("the sum of the inputs' super-group means exceeds the float32 range")
        counts = self.counts
        n_live = sum([counts[w] for w in self.widths])
        if n_live * SUPER >= 2 ** 32:
            raise ValueError("too many coordinates for one call (2^32 limit of the generator)")
        self.order = self._order_full[:n_live]
        self.runs = [(w, counts[w]) for w in self.widths]
        layout = StreamLayout([(c, self.rec_bytes[w]) for w, c in self.runs])
        self.tiling = tile_stream(layout, self.chunks, tile_bytes)
        key = ("dq.pieces", self.widths)
        pieces = self.tiling.derived.get(key)
        if pieces is None:
            pieces = self.tiling.derived[key] = self._split(layout)
        self.pieces = pieces        # per tile: one compiled call launches them all
        self.wire = self.ws.take(self.xp, "dq.wire", self.tiling.wire_bytes, np.uint8)

    def _layout_fixed(self, bf16_class, tiles, slot):
        """Slots sized from the budget alone; the device cuts the stream into
        them (plan_pieces) and refuses non-finite input by NaN in finish."""
        codec, chunks = self.codec, self.chunks
        classes = WIDTHS + (BF16_WIDTH,)
        record_bytes = [record_bits(w, codec.hierarchical) // 8 for w in classes]
        present = stream_classes(codec, bf16_class)
        self.slot_caps = [min(slot // rb, self.nsg) if w in present else 0
                          for w, rb in zip(classes, record_bytes)]
        self.range_cap = min(slot // min(record_bytes), self.nsg)
        self.table_widths = classes
        self.tiling = fixed_tiling(chunks, tiles, slot)
        self.order = self._order_full
        self.runs = self.pieces = None
        self.wire = self.ws.take(self.xp, "dq.wire", self.tiling.wire_bytes, np.uint8)
        self.table = self.ws.take(self.xp, "dq.table", chunks * tiles * self.k.TILE_INTS, np.int64)
        self.k.plan_pieces(self.header, chunks, tiles, record_bytes, slot, self.table, self.wire)

    def _read_header(self):
        """The plan's header on the host, read once per call (on the GPU: after the planner)."""
        if self._host_header is None:
            h = self._host_header = self.backend.to_host(self.header)
            self.counts = {w: int(c) for w, c in zip(CLASSES, h[4:8])}
            self.counts[BF16_WIDTH] = int(h[10])
            self.theta, self.total_bits = float(h[8]), int(h[9])
            self.exceeded = bool(h[3])
        return self._host_header

    def refusal(self):
        """Why the result is NaN ('' if not), from the header (a device-to-host copy)."""
        h = self._read_header()
        if h[0] > 0:
            return (f"NonFiniteInputError: input holds NaN or Inf on at least one rank "
                    f"({int(h[0])} ranks)")
        if not h[1] <= PARTIAL_SUM_LIMIT:
            return ("SumOverflowError: the inputs' max |x| summed over ranks exceeds the "
                    f"float32 range ({PARTIAL_SUM_LIMIT:.3g})")
        if not h[2]:
            return "SumOverflowError: the sum of the inputs' super-group means exceeds the float32 range"
        if h[11]:
            return "RuntimeError: a tile's payload exceeded its slot (a bug: please report it)"
        if h[12]:
            return ("NonFiniteInputError: another block of the reduce-scatter holds NaN or Inf "
                    "(or sums that could overflow)")
        return ""

    def refuse_with(self, flags, absmax):
        """Refuse on the device where any block's reduced tail flags non-finite
        input or overflow (a fixed-layout reduce-scatter's NaN on every rank)."""
        xp = self.xp
        bad = xp.logical_or(flags > 0, xp.logical_not(absmax <= PARTIAL_SUM_LIMIT)).any()
        self.header[12:13] = bad.astype(np.float64)

    def _zeros(self, name, count):
        z = self.ws.take(self.xp, f"dq.{name}", count, np.float32)
        z[:] = 0
        return z

    def _split(self, layout):
        """Per tile, its width-homogeneous pieces (width, first stream sg,
        count, byte offset in the tile, bytes); width 16: raw BF16 records."""
        out = []
        for a, b in self.tiling.units:
            base = layout.offset(a)
            out.append([])
            for k, (w, count) in enumerate(self.runs):
                s0, s1 = max(a, layout.starts[k]), min(b, layout.starts[k + 1])
                if s1 > s0:
                    out[-1].append((w, s0, s1 - s0, layout.offset(s0) - base,
                                    layout.offset(s1) - layout.offset(s0)))
        return out

    @property
    def result(self):
        """The decoded float32 stream where the plan does not decode into the caller's buffer."""
        if self._result is None:
            rows = self.nsg if self.fixed else self.order.shape[0]
            self._result = self.ws.take(self.xp, "dq.result", rows * SUPER, np.float32)
        return self._result

    def scratch(self, nbytes):
        return self.ws.take(self.xp, "dq.recv", nbytes, np.uint8)

    def _local_values(self, tile):
        """float32 copy of this rank's centred values of a tile (fixed layout:
        into the tile's rows of a whole-stream buffer, returned)."""
        if not self.fixed:
            a, b = self.tiling.units[tile]
            return self._stream_values(a, b)
        acc = self.ws.take(self.xp, "dq.acc", self.nsg * SUPER, np.float32)
        if self.backend.name == "gpu":
            self.k.local_values_table(self.source, self.table, tile, self.range_cap, acc,
                                      rows=self.nsg)
        else:
            row = self.table[tile * self.k.TILE_INTS + 16:]
            a, count = int(row[0]), int(row[1])
            acc[a * SUPER:(a + count) * SUPER] = self._stream_values(a, a + count)
        return acc

    def _stream_values(self, a, b):
        """float32 copy of this rank's centred values of stream super-groups [a, b), padded."""
        xp = self.xp
        if self.backend.name == "gpu":   # the kernels read the source as compress does
            out = xp.empty((b - a) * SUPER, dtype=np.float32)
            src = self.k.Source(self.x, self.order[a:b], 0, self.local_mean)
            self.k.exact_compress(src, b - a, out)
            return out
        if self._padded is None:
            self._padded = np.zeros((self.nsg, SUPER), dtype=np.float32)
            self._padded.reshape(-1)[:self.length] = as_float32(self.x)
        rows = self.order[a:b]
        vals = self._padded[rows]
        if self.local_mean is not None:
            vals = vals - self.local_mean[rows][:, None]
        return np.ascontiguousarray(vals.reshape(-1), dtype=np.float32)

    # fixed layout: pieces from the device table (*_table); exact: from the host
    def _encode(self, tile, src, event, out, payload=None):
        if self.fixed:
            self.k.encode_table(self.params, src, self.table, tile, self.slot_caps,
                                self.table_widths, self.codec.hierarchical, event, out, payload)
        else:
            self.k.encode_pieces(self.params, src, self.pieces[tile], event, out, payload)

    def compress(self, tile, event):
        out = self.wire_slot(tile)
        self._encode(tile, self.source, event, out)
        return out

    def accumulate(self, tile, payload, acc):
        if acc is None:
            acc = self._local_values(tile)
        if self.fixed:
            self.k.decompress_table(self.params, payload, self.table, tile, self.slot_caps,
                                    self.table_widths, self.codec.hierarchical, acc, True,
                                    rows=self.nsg)
            return acc
        a, _ = self.tiling.units[tile]
        self.k.decompress_pieces(self.params, payload, self.pieces[tile], acc, True, a)
        return acc

    def dar(self, tile, payload, acc, event):
        if acc is None:
            src = self.source
        elif self.fixed:         # acc: the whole stream's rows
            src = self.k.Source(acc, None, 0, None)
        else:
            src = self.k.Source(acc, None, self.tiling.units[tile][0], None)
        out = self.wire_slot(tile)
        self._encode(tile, src, event, out, payload)
        return out

    def bind_output(self, out, divisor):
        """Decode straight into the caller's layout, one pass, the same bits
        (unbound, the plan decodes in two passes: ``CallSpec.decode_into``)."""
        self._bound = (out, float(divisor))
        return True

    def decode(self, tile, payload):
        if self._bound is not None:
            out, divisor = self._bound
            if self.fixed:
                self.k.decompress_out_table(self.params, payload, self.table, tile,
                                            self.slot_caps, self.table_widths,
                                            self.codec.hierarchical, self._order_full,
                                            self.mean_sum, divisor, out, rows=self.nsg)
            else:
                self.k.decompress_out_pieces(self.params, payload, self.pieces[tile],
                                             self._order_full, self.mean_sum, divisor, out)
            return
        if self.fixed:
            self.k.decompress_table(self.params, payload, self.table, tile, self.slot_caps,
                                    self.table_widths, self.codec.hierarchical, self.result, False,
                                    rows=self.nsg)
            return
        self.k.decompress_pieces(self.params, payload, self.pieces[tile], self.result, False)

    def finish(self, divisor, out):
        # the fixed layout's refusal: NaN everywhere where the device header says so
        refuse = dict(refuse=self.header, limit=float(PARTIAL_SUM_LIMIT)) if self.fixed else {}
        if self._bound is not None:
            assert self._bound[0] is out and self._bound[1] == float(divisor)
            self.k.finish(None, self.stream_of_sg, self.mean_sum, float(divisor), out, **refuse)
            return out
        self.k.finish(self.result, self.stream_of_sg, self.mean_sum, float(divisor), out, **refuse)
        return out

    def report(self, detailed=True):
        """What the plan decided; the fixed layout reads its header and piece
        table back only for a detailed report (else no host read)."""
        if self.fixed and not detailed:
            return {"layout": "fixed", "budget_bits": self.budget_bits,
                    "slot_bytes": self.tiling.nbytes[0]}
        self._read_header()
        c = self.counts
        variable = self.codec.joins_budgets
        info = {"layout": "fixed" if self.fixed else "exact",
                "widths": {w: c[w] for w in (0,) + self.widths},
                "threshold_u": theta_to_u(self.theta) if variable else float("nan"),
                "threshold_theta": self.theta, "budget_bits": self.budget_bits,
                "planned_budget_bits": self.planned_bits,
                "budget_binds": sum([c[w] for w in self.widths[:-1]]) > 0,
                "budget_exceeded": self.exceeded}
        if self.fixed:
            table = self.backend.to_host(self.table).reshape(-1, self.k.TILE_INTS)
            payload = int(table[:, 19].sum())
            info.update({"slot_bytes": self.tiling.nbytes[0], "payload_bytes": payload,
                         "padding_bytes": self.tiling.wire_bytes - payload})
        if not detailed:
            return info
        widths = self.backend.to_host(self.alloc_widths)
        a = summarise(widths, self.theta, self.total_bits, self.budget_bits, self.exceeded,
                      variable, widest=self.widths[-1])
        norm2 = np.minimum(self.backend.to_host(self.norm2), FLT_MAX)   # as planned
        mean_sum = self.backend.to_host(self.mean_sum)
        digest = hashlib.sha256(mean_sum.tobytes() + norm2.tobytes()).hexdigest()
        positive = norm2[norm2 > 0]
        assert a.counts() == info["widths"] and a.binds == info["budget_binds"]
        info.update({"supergroup_widths": a.widths,
                     "stats_digest": digest,           # of the reduced statistics planned
                     "norm2_min_positive": float(positive.min()) if positive.size else 0.0,
                     "norm2_max": float(norm2.max()) if norm2.size else 0.0})
        return info
