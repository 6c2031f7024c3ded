"""The DynamiQ codec: configuration, level tables, statistics (the per-call
plan: dynamiq_plan.py)."""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field

import numpy as np

from .allocation import WIDTHS, grid_summary, joint_costs, joint_costs_on_grid, record_bits
from .base import DEFAULT_TILE_BYTES, Codec
from .dynamiq_plan import (FLT_MAX, LAYOUT_RESERVE_BITS, PARTIAL_SUM_LIMIT, SCALE_CODES,  # noqa: F401
                           SUPER, _DynamiQPlan, _params_for, layout_budget)
from .levels import build_tables
from .plain import BF16

# Level spacing per width: the artifact's *simulation* values (the paper's numbers)
DEFAULT_EPS = {2: 0.27, 4: 0.20, 8: 0.08}

# Shorter inputs go as BF16: per-call costs dominate there and the metadata eats
# the budget.  On 2x H200 BF16 beat DynamiQ below about 2^22 elements on every
# link measured (docs/benchmarks.md).
DEFAULT_SMALL_INPUT = 1 << 21


def metadata_bits_per_coord(hierarchical: bool, centring: bool) -> float:
    stats = 64 if centring else 32
    return (stats + record_bits(2, hierarchical) - 2 * SUPER) / SUPER


@functools.lru_cache(maxsize=64)
def _tables(width: int, eps: float):
    return build_tables(width, eps)


@dataclass(frozen=True)
class DynamiQ(Codec):
    """DynamiQ with a per-call budget of ``bits`` per coordinate, all metadata
    counted.  The switches turn off each technique for ablations.  Inputs
    shorter than ``small_input`` elements go as BF16 (the report says so)."""
    bits: float = 5.0
    eps: tuple = field(default=(DEFAULT_EPS[2], DEFAULT_EPS[4], DEFAULT_EPS[8]))
    uniform: bool = False           # True: uniform levels (eps = 0)
    variable_width: bool = True     # False: one width for every super-group
    fixed_width: int | None = None  # force this width (2, 4 or 8)
    hierarchical: bool = True       # False: a BF16 scale per group of 16
    correlated: bool = True         # stratified uniforms across the n events
    centring: bool = True           # subtract per-super-group means first
    zero_class: bool = True         # super-groups zero on every rank send nothing
    small_input: int = DEFAULT_SMALL_INPUT
    # group scale codes: "hybrid" (unbiased stochastic codes from 128 up, the
    # rounded-up code below: no scale ratchet on long rings) or "ceil" (all up)
    scale_code: str = "hybrid"
    # outliers as raw BF16 records (the paper's large-scale simulation); False: no 16
    bf16_class: bool = True

    name = "dynamiq"
    rejects_nonfinite = True        # NaN/Inf input: flagged on every rank (raised with nonfinite="raise")
    auto_path = True                # path="auto": NCCL's BF16 all-reduce where it measures faster

    def __post_init__(self):
        if isinstance(self.eps, dict):
            object.__setattr__(self, "eps", tuple(float(self.eps[w]) for w in WIDTHS))
        if len(self.eps) != 3:
            raise ValueError("eps must give one value per width (2, 4, 8)")
        if self.scale_code not in SCALE_CODES:
            raise ValueError(f"scale_code must be one of {tuple(SCALE_CODES)}, got {self.scale_code!r}")
        if self.fixed_width is not None and self.fixed_width not in WIDTHS:
            raise ValueError(f"fixed_width must be one of {WIDTHS}, got {self.fixed_width}")
        if not isinstance(self.small_input, (int, np.integer)) or self.small_input < 0:
            raise ValueError(f"small_input must be a non-negative integer, got {self.small_input!r}")
        floor = self.min_bits()
        if not (self.bits >= floor):
            raise ValueError(
                f"bits={self.bits} is below the smallest achievable budget {floor:.4f} "
                f"(2-bit codes plus {floor - 2:.4f} bits of statistics and scales)")
        self.tables()  # validates eps for every width

    def min_bits(self) -> float:
        return 2.0 + metadata_bits_per_coord(self.hierarchical, self.centring)

    def tables(self):
        return {w: _tables(w, 0.0 if self.uniform else float(e)) for w, e in zip(WIDTHS, self.eps)}

    def signature(self):
        return ("dynamiq", float(self.bits), tuple(float(e) for e in self.eps), self.uniform,
                self.variable_width, self.fixed_width, self.hierarchical, self.correlated,
                self.centring, self.zero_class, int(self.small_input), self.scale_code,
                self.bf16_class)

    def for_length(self, length):
        return _SMALL_INPUT_CODEC if length < self.small_input else self

    def local_stats(self, x, backend, workspace, keys=None):
        """This rank's statistics in one kernel pass, [means | norms | flag,
        max|x|]; summed, max |x| bounds every partial sum (overflow refused)."""
        xp = backend.xp
        nsg = -(-x.shape[0] // SUPER)
        head = 2 * nsg if self.centring else nsg
        stats = workspace.take(xp, "dq.stats", head + 2, np.float32)
        mean = workspace.sub(stats, 0, nsg) if self.centring else None
        norm2 = workspace.sub(stats, head - nsg, head)
        tail = workspace.sub(stats, head, head + 2)
        backend.kernels.stats_into(x, nsg, self.centring, mean, norm2, tail)
        return stats, mean

    @property
    def joins_budgets(self) -> bool:
        """Whether parts of one call (a hierarchical call's rails, a
        reduce-scatter's blocks) may share one allocation (variable widths)."""
        return self.variable_width and self.fixed_width is None

    def reduced_norms(self, reduced, length: int):
        """The squared norms in the reduced statistics of ``length`` elements."""
        nsg = -(-int(length) // SUPER)
        head = 2 * nsg if self.centring else nsg
        return reduced[head - nsg:head]

    def stats_bits(self, length: int) -> int:
        nsg = -(-int(length) // SUPER)
        return 32 * ((2 * nsg if self.centring else nsg) + 2)

    def _shared_budget(self, lengths, cap):
        """(budget, padded budget, statistics bits per part, caps) of one
        allocation over parts of ``lengths``; ``cap``: times a part's own."""
        stats = [self.stats_bits(m) for m in lengths]
        nsg = sum(-(-m // SUPER) for m in lengths)
        caps = None if cap is None else [cap * self.bits * m for m in lengths]
        return self.bits * sum(lengths), self.bits * nsg * SUPER + sum(stats), stats, caps

    def split_budget(self, norms, lengths) -> list:
        """Codecs for parts of ``lengths`` (reduced norms on the host), each with
        exactly the bits one allocation of the whole budget gives it."""
        lengths = [int(m) for m in lengths]
        budget, padded, stats, _ = self._shared_budget(lengths, None)
        costs = joint_costs(norms, budget, padded, stats, self.hierarchical, self.zero_class,
                            self.bf16_class)
        return [self.with_exact_bits(c, m) for c, m in zip(costs, lengths)]

    def share_summary(self, reduced, length: int) -> tuple:
        """This part's (length, grid summary of its reduced norms) for :meth:`shares_on_grid`."""
        norms = self.reduced_norms(reduced, length)
        host = norms if isinstance(norms, np.ndarray) else norms.get()
        return int(length), grid_summary(host, self.zero_class, self.bf16_class)

    def shares_on_grid(self, summaries, cap=None) -> list:
        """:meth:`split_budget` on a grid from the parts' :meth:`share_summary`,
        no part above ``cap`` times its own budget: the joint rail budget."""
        lengths = [m for m, _ in summaries]
        budget, padded, stats, caps = self._shared_budget(lengths, cap)
        costs = joint_costs_on_grid([g for _, g in summaries], budget, padded, stats,
                                    self.hierarchical, self.bf16_class, caps, lengths)
        return [self.with_exact_bits(c, m) for c, m in zip(costs, lengths)]

    def with_exact_bits(self, total_bits: int, length: int):
        """This codec (its signature kept) planning ``length`` elements with
        exactly ``total_bits``, statistics included, no layout reserve."""
        c = copy.copy(self)
        object.__setattr__(c, "bits", (int(total_bits) + 0.5) / int(length))
        c.__dict__["_exact_budget"] = True
        c.__dict__["_cached_signature"] = self.cached_signature()
        return c

    def plan(self, x, reduced_stats, n, keys, backend, local_state, workspace,
             tile_bytes=DEFAULT_TILE_BYTES):
        return _DynamiQPlan(self, x, reduced_stats, n, keys, backend, local_state, workspace,
                            tile_bytes)


_SMALL_INPUT_CODEC = BF16()     # what DynamiQ hands inputs below ``small_input`` to
