"""The width allocation as readable array code (NumPy or CuPy): the reference
the tests hold the compiled planner (src_cuda/dq_plan.h) to, bit for bit.
The rule is ``dynamiq_mpi.codecs.allocation``'s (its module docstring)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynamiq_mpi.codecs.allocation import (BF16_WIDTH, CLASSES, S16, WIDTHS, Allocation,
                                           record_bits, summarise)


@dataclass
class DeviceAllocation:
    """An allocation whose arrays live with the norms (NumPy or CuPy)."""
    widths: object        # int8[m]: 0, 2, 4, 8 (or 16)
    theta: object         # float64 scalar: +inf when every live super-group stays at 2 bits
    counts: object        # int64[5]: super-groups per class, in CLASSES order, then 16 bits
    total_bits: object    # int64 scalar: statistics + records of the live super-groups
    exceeded: object      # bool scalar: the total is over budget_bits (tiny inputs)


def allocate_xp(xp, norm2, budget_bits: float, padded_budget_bits: float, stats_bits: int,
                hierarchical: bool, zero_class: bool = True, variable: bool = True,
                fixed_width=None, bf16_class: bool = False) -> DeviceAllocation:
    """The allocation on the array module of ``norm2`` (float32[m], finite).
    ``padded_budget_bits`` replaces ``budget_bits`` where every live
    super-group at 2 bits exceeds it (tiny inputs); ``exceeded`` says so."""
    rec = {w: record_bits(w, hierarchical) for w in WIDTHS + (BF16_WIDTH,)}
    F = norm2.astype(np.float64)
    m = F.shape[0]
    live = F > 0 if zero_class else xp.ones(m, dtype=bool)
    n_live = xp.sum(live, dtype=np.int64)
    base = stats_bits + n_live * rec[2]
    budget = xp.where(base > budget_bits, padded_budget_bits, budget_bits)

    if fixed_width is not None or not variable:
        if fixed_width is None:      # the widest single width that fits the budget
            chosen = xp.where(stats_bits + n_live * rec[8] <= budget, 8,
                              xp.where(stats_bits + n_live * rec[4] <= budget, 4, 2))
        else:
            chosen = xp.asarray(fixed_width)
        widths = xp.where(live, chosen, 0).astype(np.int8)
        theta = xp.asarray(np.nan)
    else:
        # candidates theta = s F_i, s = 512 (2 -> 4 bits), 17 (4 -> 8), S16 (8 -> 16)
        key = xp.where(live, F, -1.0)          # non-live never reach a positive theta
        asc = xp.sort(key)
        scales = [(512.0, rec[4] - rec[2]), (17.0, rec[8] - rec[4])]
        if bf16_class:
            scales.append((S16, rec[BF16_WIDTH] - rec[8]))
        positive = asc > 0
        inf = xp.asarray(np.inf)
        theta = inf
        for s_cand, _ in scales:               # theta = s_cand * asc[i]
            cost = base
            for s_up, delta in scales:         # super-groups with s_up F >= theta step up
                cost = cost + delta * (m - xp.searchsorted(s_up * asc, s_cand * asc, side="left"))
            theta = xp.minimum(theta, xp.min(xp.where(positive & (cost <= budget),
                                                      s_cand * asc, inf)))
        widths = xp.where(17.0 * F >= theta, 8, xp.where(512.0 * F >= theta, 4, 2))
        if bf16_class:
            widths = xp.where(S16 * F >= theta, BF16_WIDTH, widths)
        widths = xp.where(~live, 0, widths).astype(np.int8)
    counts = xp.stack([xp.sum(widths == w, dtype=np.int64) for w in CLASSES + (BF16_WIDTH,)])
    total = (stats_bits + counts[0] * rec[2] + counts[1] * rec[4] + counts[2] * rec[8]
             + counts[4] * rec[BF16_WIDTH])
    return DeviceAllocation(widths, theta, counts, total, total > budget_bits)


def stream_positions(xp, widths):
    """Stable reorder into runs of 2-, 4-, 8- (then 16-) bit super-groups:
    ``(order, stream_of_sg)``, ``order[s]`` the input super-group at stream
    position s (the 0-bit class after the live ones), ``stream_of_sg[g]``
    input super-group g's position (-1: 0-bit class)."""
    m = widths.shape[0]
    cls = xp.where(widths == 2, 0, xp.where(widths == 4, 1, xp.where(
        widths == 8, 2, xp.where(widths == BF16_WIDTH, 3, 4))))
    onehot = (cls[None, :] == xp.arange(5)[:, None]).astype(np.int64)
    running = xp.cumsum(onehot, axis=1)                       # (5, m)
    counts = running[:, -1] if m else xp.zeros(5, np.int64)
    starts = xp.cumsum(counts) - counts
    idx = xp.arange(m)
    pos = starts[cls] + running[cls, idx] - 1
    order = xp.empty(m, dtype=np.int64)
    order[pos] = idx
    stream_of_sg = xp.where(cls == 4, -1, pos).astype(np.int64)
    return order, stream_of_sg


def allocate(norm2, budget_bits: float, stats_bits: int, hierarchical: bool,
             zero_class: bool = True, variable: bool = True, fixed_width=None,
             padded_budget_bits: float | None = None, bf16_class: bool = False) -> Allocation:
    """Host (NumPy) allocation with a summary, for tests and tools."""
    norm2 = np.asarray(norm2, dtype=np.float32)
    a = allocate_xp(np, norm2, budget_bits,
                    budget_bits if padded_budget_bits is None else padded_budget_bits,
                    stats_bits, hierarchical, zero_class, variable, fixed_width, bf16_class)
    return summarise(a.widths, float(a.theta), int(a.total_bits), budget_bits,
                     bool(a.exceeded), variable and fixed_width is None,
                     widest=BF16_WIDTH if bf16_class and variable and fixed_width is None else 8)

