"""Variable bit-width allocation (paper Appendix A), as a pure function of the
globally reduced squared norms, so every rank computes the same allocation.

The paper's rule gives super-group j width 2, 4 or 8 from
``z_j = SLOPE * log2(F_j) + u`` (``z < 4`` -> 2, ``4 <= z < 8`` -> 4,
``z >= 8`` -> 8) with ``SLOPE = 4 / log2(512/17)``.  Since
``4 / SLOPE = log2(512/17)``, that is one threshold ``T`` on the norms:
width >= 4 iff ``F_j >= T`` and width 8 iff ``F_j >= (512/17) T``.  With
``theta = 512 T``: width >= 4 iff ``512 F_j >= theta`` and width 8 iff
``17 F_j >= theta``.  Both products of a float32 norm are exact in float64, so
the comparisons never depend on a ``log2`` implementation, and the CPU
(NumPy) and the GPU (CuPy) give bit-identical allocations by construction.

Every call picks the smallest candidate ``theta`` (a value ``512 F_j`` or
``17 F_j``, where the cost steps up) whose total cost - statistics, scales
and codes, zero super-groups costing only their statistics - fits the budget:
the largest allocation of the paper's one-parameter family that fits.  The
search sorts the norms once and counts with binary searches; it runs on the
device for CuPy inputs and leaves every result there (no host round trip).

A super-group that is exactly zero on every rank (``F_j == 0`` after the exact
reduction) gets the 0-bit class and sends nothing.

The optional 16-bit class (``bf16_class``: raw BF16 records, no scales; the
paper's large-scale simulation allocates from {2, 4, 8, 16}) follows the
paper's threshold ratio ``T_{8,16} = 2^17/257 T_{4,8}``: width 16 iff
``S16 F_j >= theta`` with ``S16 = 17 * 257 / 2^17`` (exact in float64), and
``S16 F_j`` are candidates too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# The paper's constant, 4 / log2(512/17), not the artifact's 4 / (512/17): the
# one consistent with the threshold ratios T24 = 17/512 T48.
SLOPE = 4.0 / np.log2(512.0 / 17.0)
WIDTHS = (2, 4, 8)
BF16_WIDTH = 16                 # the optional raw BF16 class
S16 = 4369.0 / 131072.0         # 17 * 257 / 2^17: width 16 iff S16 * F >= theta
# Column order of the class counts: 0-bit class last in the stream
# (it is not in the stream at all), widths in stream order before it; the
# 16-bit class (when enabled) is a fifth column, in the stream after width 8.
CLASSES = (2, 4, 8, 0)


def widths_of(bf16_class: bool) -> tuple:
    """The stream's widths, in stream order."""
    return WIDTHS + ((BF16_WIDTH,) if bf16_class else ())


def record_bits(width: int, hierarchical: bool) -> int:
    """Wire bits of one super-group of ``width``-bit codes with its scales
    (width 16: 256 raw BF16 values, no scales)."""
    if width == BF16_WIDTH:
        return 256 * 16
    scales = 16 * 8 + 16 if hierarchical else 16 * 16
    return 256 * width + scales


@dataclass
class DeviceAllocation:
    """An allocation whose arrays live with the norms (NumPy or CuPy)."""
    widths: object        # int8[m]: 0, 2, 4, 8 (or 16)
    theta: object         # float64 scalar: +inf when every live super-group stays at 2 bits
    counts: object        # int64[5]: super-groups per class, in CLASSES order, then 16 bits
    total_bits: object    # int64 scalar: statistics + records of the live super-groups
    exceeded: object      # bool scalar: the total is over budget_bits (tiny inputs)


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


def allocate_xp(xp, norm2, budget_bits: float, padded_budget_bits: float, stats_bits: int,
                hierarchical: bool, zero_class: bool = True, variable: bool = True,
                fixed_width=None, bf16_class: bool = False) -> DeviceAllocation:
    """The allocation on the array module of ``norm2`` (float32[m], finite).

    ``padded_budget_bits`` is used instead of ``budget_bits`` when even every
    live super-group at 2 bits exceeds the budget (inputs so short that the
    statistics and scales outweigh it): the codes then get the budget of the
    padded super-groups rather than starving, and ``exceeded`` says so.
    """
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
        # Candidates: theta = s F_i over the live, positive norms, for every
        # threshold scale s (512: 2 -> 4 bits, 17: 4 -> 8, S16: 8 -> 16).
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
    """Stable reorder into runs of 2-, 4-, 8- (then 16-) bit super-groups.

    Returns ``(order, stream_of_sg)``: ``order[s]`` is the input super-group at
    stream position s (the 0-bit class fills the positions after the live
    ones), ``stream_of_sg[g]`` the stream position of input super-group g, or
    -1 for the 0-bit class.  Integer scans only: the same on NumPy and CuPy.
    """
    m = widths.shape[0]
    # classes in stream order: 2, 4, 8, 16 bits, then the 0-bit class
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


def summarise(widths, theta: float, total_bits: int, budget_bits: float, exceeded: bool,
              variable: bool, widest: int = 8) -> Allocation:
    widths = np.asarray(widths)
    u = theta_to_u(theta) if variable else float("nan")
    binds = bool(np.any((widths > 0) & (widths < widest)))
    return Allocation(widths, u, int(total_bits), float(budget_bits), binds, bool(exceeded),
                      widest)


def joint_costs(norms, budget_bits: float, padded_budget_bits: float, stats_bits,
                hierarchical: bool, zero_class: bool = True, bf16_class: bool = False,
                caps=None) -> list:
    """One allocation over several parts' super-groups (the rails of a
    hierarchical call, the blocks of a reduce-scatter): the paper's rule
    with one threshold for all of them under their whole budget.  ``norms``:
    each part's reduced squared norms (float32[m_i]), in a fixed order;
    ``stats_bits``: each part's statistics bits; ``caps``: the most bits a
    part may take (None: no limit), a part held at its cap keeping the
    threshold its cap allows.  Returns the bits each part's records and
    statistics take (ints): a part planned alone with exactly those bits
    finds the same widths, the cost being monotone in the threshold.
    ``padded_budget_bits`` as in :func:`allocate_xp` (inputs too short for
    their statistics).  Host work: a binary search over the candidate
    thresholds, each step a few binary searches per part."""
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
    theta = smallest(everyone, lambda t: sum(cost(i, max(t, limit[i])) for i in range(k))
                     <= budget)
    return [cost(i, max(theta, limit[i])) for i in range(k)]


# The threshold grid of joint_costs_on_grid: float64 values whose low 48 bits
# are zero (11 exponent bits and 4 mantissa bits: steps of at most 2^(1/16),
# 4.4 %), indexed by their bits >> 48 (monotone for non-negative values).
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
    """What one part contributes to :func:`joint_costs_on_grid`: (live
    super-groups, per width step (first key, counts of the keys of ``s F``
    from it on)), from the part's reduced squared norms on the host (a
    device part copies them here once: a few hundred KB, one wait, where
    counting on the device would read back per step); a few KB whatever
    the part's length."""
    F = np.asarray(norm2).astype(np.float64)
    live = F[F > 0] if zero_class else np.abs(F)
    out = []
    for s, _ in _width_steps(True, bf16_class)[1]:
        keys = np.clip((s * live).view(np.int64) >> GRID_SHIFT, 0, GRID_SIZE - 1)
        if keys.shape[0] == 0:
            out.append((0, np.zeros(0, dtype=np.int64)))
            continue
        lo = int(keys.min())
        out.append((lo, np.bincount(keys - lo).astype(np.int64)))
    return int(live.shape[0]), out


def joint_costs_on_grid(summaries, budget_bits: float, padded_budget_bits: float, stats_bits,
                        hierarchical: bool, bf16_class: bool = False, caps=None,
                        weights=None) -> list:
    """:func:`joint_costs` with the threshold on a grid instead of the
    candidates, from each part's :func:`grid_summary`: fast enough for every
    call of a hierarchical all-reduce (each part summarises its own norms;
    what is exchanged and searched is a few thousand counts a part, not the
    norms).

    The rule: the threshold is the smallest grid value
    whose total cost fits the budget, a part held at its cap keeping the
    smallest grid value its cap allows.  ``s F >= theta`` for a grid
    ``theta`` counts exactly from the keys of ``s F`` (``s F`` is exact in
    float64), so every part's cost is exact and a part planned alone with it
    finds the same widths (its own candidates' rule: the smallest candidate
    at or above the grid value).  Against the candidates the grid can leave
    up to one grid step's worth of super-groups a width lower; with
    ``weights`` (the parts' lengths) that unspent budget is shared by
    weight, each part planning its share with its own candidates."""
    rec, steps = _width_steps(hierarchical, bf16_class)
    k = len(summaries)
    if k == 0:
        return []
    # Only the grid indices between the smallest and the largest key can
    # change a count: below them every count is that at the smallest, above
    # them none (as at +inf).  Index ``size`` stands for +inf.
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
    # What the grid leaves unspent, shared by weight (under the caps): each
    # part then plans its share with its own candidates (at least the grid's
    # widths), so the whole budget is spent even where many super-groups
    # fall in one grid step.
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
