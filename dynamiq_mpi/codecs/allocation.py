"""Variable bit-width allocation (paper Appendix A; docs/design.md, "One
all-reduce, step by step", item 3): width >= 4 iff ``512 F_j >= theta``, 8
iff ``17 F_j >= theta``, 16 iff ``S16 F_j >= theta``.  The compiled planner
runs it per call (tests/allocation_ref.py: as readable array code); here
the record sizes, the report's summary and joint budgets of several parts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SLOPE = 4.0 / np.log2(512.0 / 17.0)    # the paper's (not the artifact's 4 / (512/17))
WIDTHS = (2, 4, 8)
BF16_WIDTH = 16                 # the optional raw BF16 class
S16 = 4369.0 / 131072.0         # 17 * 257 / 2^17: width 16 iff S16 * F >= theta
# The class counts' columns: widths in stream order, the 0-bit class (16 bits: 5th).
CLASSES = (2, 4, 8, 0)


def widths_of(bf16_class: bool) -> tuple:
    """The stream's widths, in stream order."""
    return WIDTHS + ((BF16_WIDTH,) if bf16_class else ())


def record_bits(width: int, hierarchical: bool) -> int:
    """Wire bits of one super-group of ``width``-bit codes and scales (16: raw BF16, no scales)."""
    if width == BF16_WIDTH:
        return 256 * 16
    scales = 16 * 8 + 16 if hierarchical else 16 * 16
    return 256 * width + scales


@dataclass(frozen=True)
class Allocation:
    """Host summary of an allocation (for reports and tests)."""
    widths: np.ndarray
    u: float              # the paper's threshold offset equivalent to theta (nan: fixed width)
    total_bits: int
    budget_bits: float
    binds: bool           # True if the budget kept some live super-group below the widest width
    exceeded: bool
    widest: int = 8       # 16 with the 16-bit class

    def counts(self) -> dict:
        return {w: int(np.count_nonzero(self.widths == w))
                for w in (0,) + widths_of(self.widest == BF16_WIDTH)}


def theta_to_u(theta: float) -> float:
    """u of the paper's rule at the threshold theta (z = 4 exactly at F = theta / 512)."""
    if theta == np.inf:
        return float("-inf")
    return float(4.0 - SLOPE * np.log2(theta / 512.0))


def summarise(widths, theta: float, total_bits: int, budget_bits: float, exceeded: bool,
              variable: bool, widest: int = 8) -> Allocation:
    widths = np.asarray(widths)
    u = theta_to_u(theta) if variable else float("nan")
    binds = bool(np.any((widths > 0) & (widths < widest)))
    return Allocation(widths, u, int(total_bits), float(budget_bits), binds, bool(exceeded), widest)


def joint_costs(norms, budget_bits: float, padded_budget_bits: float, stats_bits,
                hierarchical: bool, zero_class: bool = True, bf16_class: bool = False,
                caps=None) -> list:
    """One threshold over several parts' super-groups (rails, a reduce-scatter's
    blocks) under their whole budget.  ``norms``, ``stats_bits``: each part's,
    in a fixed order; ``caps``: the most bits a part may take (None: no
    limit); ``padded_budget_bits``: spent where every live super-group at 2
    bits exceeds the budget.  Returns each part's bits (ints): planned alone
    with them, a part finds the same widths."""
    rec, steps = _width_steps(hierarchical, bf16_class)
    parts = []
    for f, sb in zip(norms, stats_bits):
        F = np.asarray(f, dtype=np.float32).reshape(-1).astype(np.float64)
        live = np.sort(F[F > 0] if zero_class else F)
        parts.append((live, int(sb) + live.shape[0] * rec[2]))

    def cost(i, theta):
        """Part i's bits at threshold theta (widths: s F >= theta steps up)."""
        live, c = parts[i]
        for s, delta in steps:
            c += delta * (live.shape[0] - int(np.searchsorted(s * live, theta, side="left")))
        return c

    def smallest(cands, fits):
        """The smallest candidate (ascending) that fits: cost falls as theta rises."""
        lo, hi = 0, cands.shape[0] - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(cands[mid]):
                hi = mid
            else:
                lo = mid + 1
        return cands[lo]

    def candidates(live):
        pos = live[live > 0]
        return np.unique(np.concatenate([s * pos for s, _ in steps] + [np.array([np.inf])]))

    k = len(parts)
    floor = [parts[i][1] for i in range(k)]
    budget = padded_budget_bits if sum(floor) > budget_bits else budget_bits
    limit = [0.0] * k           # the smallest threshold a part may take: its cap's
    for i in range(k):
        if caps is not None and caps[i] is not None and cost(i, 0.0) > caps[i]:
            limit[i] = smallest(candidates(parts[i][0]), lambda t, i=i: cost(i, t) <= caps[i])
    everyone = np.unique(np.concatenate([candidates(p[0]) for p in parts]))
    theta = smallest(everyone, lambda t: sum(cost(i, max(t, limit[i])) for i in range(k)) <= budget)
    return [cost(i, max(theta, limit[i])) for i in range(k)]


# The grid: float64 values with the low 48 bits zero (steps <= 2^(1/16)), by bits >> 48.
GRID_SHIFT = 48
GRID_SIZE = 1 << (63 - GRID_SHIFT)          # non-negative float64 keys; index GRID_SIZE: +inf


def _width_steps(hierarchical: bool, bf16_class: bool):
    """(scale s, extra bits) of each width step: a super-group steps up where
    ``s F >= theta`` (2 -> 4 bits at s = 512, 4 -> 8 at 17, 8 -> 16 at S16)."""
    rec = {w: record_bits(w, hierarchical) for w in WIDTHS + (BF16_WIDTH,)}
    steps = [(512.0, rec[4] - rec[2]), (17.0, rec[8] - rec[4])]
    if bf16_class:
        steps.append((S16, rec[BF16_WIDTH] - rec[8]))
    return rec, steps


def grid_summary(norm2, zero_class: bool = True, bf16_class: bool = False) -> tuple:
    """One part's input to :func:`joint_costs_on_grid` from its reduced norms
    on the host: (live super-groups, per width step (first key, key counts))."""
    F = np.asarray(norm2).astype(np.float64)
    live = F[F > 0] if zero_class else np.abs(F)
    out = []
    for s, _ in _width_steps(True, bf16_class)[1]:
        keys = np.clip((s * live).view(np.int64) >> GRID_SHIFT, 0, GRID_SIZE - 1)
        lo = int(keys.min()) if keys.shape[0] else 0
        out.append((lo, np.bincount(keys - lo).astype(np.int64)))
    return int(live.shape[0]), out


def joint_costs_on_grid(summaries, budget_bits: float, padded_budget_bits: float, stats_bits,
                        hierarchical: bool, bf16_class: bool = False, caps=None,
                        weights=None) -> list:
    """:func:`joint_costs` with the threshold on a grid, from each part's
    :func:`grid_summary` (counts, not norms: fast enough for every call);
    with ``weights`` (the parts' lengths) what the grid leaves unspent is
    shared by weight."""
    rec, steps = _width_steps(hierarchical, bf16_class)
    k = len(summaries)
    if k == 0:
        return []
    # only indices between the smallest and largest key change a count; ``size``: +inf
    spans = [(lo, lo + c.shape[0] - 1) for _, part in summaries for lo, c in part if c.shape[0]]
    lo = min((a for a, _ in spans), default=0)
    size = max((b for _, b in spans), default=0) - lo + 1
    cost = np.empty((k, size + 1), dtype=np.int64)
    for i, ((n_live, part), sb) in enumerate(zip(summaries, stats_bits)):
        cost[i] = int(sb) + n_live * rec[2]
        for (_, delta), (first, counts) in zip(steps, part):
            if counts.shape[0] == 0:
                continue
            at_or_above = np.cumsum(counts[::-1])[::-1]
            cost[i, :first - lo] += delta * at_or_above[0]            # below: all of them
            cost[i, first - lo:first - lo + counts.shape[0]] += delta * at_or_above
    # the smallest grid index each part may take (its cap's); costs fall as j rises
    floor = np.zeros(k, dtype=np.int64)
    if caps is not None:
        for i in range(k):
            if caps[i] is not None:
                fits = np.flatnonzero(cost[i] <= caps[i])
                floor[i] = fits[0] if fits.size else size
    held = np.maximum(np.arange(size + 1)[None, :], floor[:, None])
    total = np.take_along_axis(cost, held, axis=1).sum(axis=0)
    budget = padded_budget_bits if int(cost[:, size].sum()) > budget_bits else budget_bits
    fits = np.flatnonzero(total <= budget)
    j = int(fits[0]) if fits.size else size
    costs = [int(cost[i, max(j, int(floor[i]))]) for i in range(k)]
    if weights is None:
        return costs
    # what the grid leaves unspent, shared by weight under the caps
    room = [math.inf if caps is None or caps[i] is None else max(0, int(math.floor(caps[i])) - c)
            for i, c in enumerate(costs)]
    left = int(math.floor(budget)) - sum(costs)
    open_ = [i for i in range(k) if room[i] > 0]
    while left > 0 and open_:        # water-filling: a part at its cap passes its part on
        w = sum(int(weights[i]) for i in open_) or len(open_)
        give = {i: min(room[i], left * (int(weights[i]) or 1) // w) for i in open_}
        if not any(give.values()):
            break                    # less than one bit each: left unspent
        for i, g in give.items():
            costs[i] += g
            room[i] -= g
            left -= g
        open_ = [i for i in open_ if room[i] > 0]
    return costs
