"""Variable bit-width allocation (paper Appendix A), as a pure function of the
globally reduced squared norms, so every rank computes the same allocation.

Super-group j gets width 2, 4 or 8 from ``z_j = SLOPE * log2(F_j) + u``
(``z < 4`` -> 2, ``4 <= z < 8`` -> 4, ``z >= 8`` -> 8); a super-group that is
exactly zero on every rank gets the 0-bit class.  ``u`` is chosen every call:
the largest total cost (statistics + scales + codes) that fits the budget.
Instead of bisecting ``u`` we sort the 2m break points ``4 - a_j`` and
``8 - a_j`` (``a_j = SLOPE * log2 F_j``), where the cost steps up, and take the
largest one that fits: the exact optimum of the same one-parameter family.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# The paper's constant, 4 / log2(512/17), not the artifact's 4 / (512/17): the
# one consistent with the threshold ratios T24 = 17/512 T48 (paper-notes 3.2).
SLOPE = 4.0 / np.log2(512.0 / 17.0)
WIDTHS = (2, 4, 8)


@dataclass(frozen=True)
class Allocation:
    widths: np.ndarray       # int8 per super-group: 0, 2, 4 or 8
    u: float                 # threshold offset chosen (-inf: all at 2 bits, +inf: all at 8)
    total_bits: int          # statistics + records of the non-zero super-groups
    budget_bits: float
    binds: bool              # True if the budget kept some super-group below 8 bits
    exceeded: bool           # True if even all-2-bit does not fit (tiny inputs)

    def counts(self) -> dict:
        return {w: int(np.count_nonzero(self.widths == w)) for w in (0,) + WIDTHS}


def record_bits(width: int, hierarchical: bool) -> int:
    """Wire bits of one super-group of ``width``-bit codes with its scales."""
    scales = 16 * 8 + 16 if hierarchical else 16 * 16
    return 256 * width + scales


def allocate(norm2: np.ndarray, budget_bits: float, stats_bits: int, hierarchical: bool,
             zero_class: bool = True, variable: bool = True, fixed_width=None) -> Allocation:
    """Widths for the super-groups with reduced squared norms ``norm2``."""
    norm2 = np.asarray(norm2, dtype=np.float32)
    m = norm2.shape[0]
    zero = (norm2 == 0) if zero_class else np.zeros(m, dtype=bool)
    live = np.flatnonzero(~zero)
    rec = {w: record_bits(w, hierarchical) for w in WIDTHS}
    base = stats_bits + len(live) * rec[2]
    widths = np.zeros(m, dtype=np.int8)

    if fixed_width is not None or not variable:
        if fixed_width is None:   # the widest single width that fits the budget
            fits = [w for w in WIDTHS if stats_bits + len(live) * rec[w] <= budget_bits]
            fixed_width = fits[-1] if fits else 2
        widths[live] = fixed_width
        total = stats_bits + len(live) * rec[fixed_width]
        return Allocation(widths, float("nan"), total, budget_bits,
                          binds=fixed_width != 8, exceeded=total > budget_bits)

    if len(live) == 0:
        return Allocation(widths, float("inf"), stats_bits, budget_bits, False,
                          stats_bits > budget_bits)
    with np.errstate(divide="ignore"):
        # F == 0 without the 0-bit class: log2 = -inf, always 2 bits.
        a = SLOPE * np.log2(norm2[live].astype(np.float64))
    up4, up8 = 4.0 - a, 8.0 - a               # u at which the width reaches 4, 8
    points = np.concatenate([up4, up8])
    steps = np.concatenate([np.full(len(live), rec[4] - rec[2], np.int64),
                            np.full(len(live), rec[8] - rec[4], np.int64)])
    order = np.argsort(points, kind="stable")
    points, steps = points[order], steps[order]
    cost = base + np.cumsum(steps)            # cost once u >= points[i] (and all before)
    # a tie group only counts at its last member
    last_of_tie = np.ones(len(points), dtype=bool)
    last_of_tie[:-1] = points[1:] != points[:-1]
    ok = np.flatnonzero(last_of_tie & (cost <= budget_bits) & np.isfinite(points))
    u = float(points[ok[-1]]) if len(ok) else float("-inf")
    w = np.full(len(live), 2, dtype=np.int8)
    w[up4 <= u] = 4
    w[up8 <= u] = 8
    widths[live] = w
    total = base + int(np.count_nonzero(w >= 4)) * (rec[4] - rec[2]) \
        + int(np.count_nonzero(w == 8)) * (rec[8] - rec[4])
    binds = bool(np.any(w < 8))
    return Allocation(widths, u, int(total), budget_bits, binds, total > budget_bits)
