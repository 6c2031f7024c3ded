"""What the engine needs from a codec.

A :class:`Codec` is an immutable configuration.  Per call it may ask for a
small statistics vector to be all-reduced exactly first (``local_stats``), then
builds a :class:`Plan` from the reduced statistics: the per-call state that
knows how the stream is cut into ``n`` chunks and how to (re)compress, decode
and accumulate each chunk.  Codecs know nothing about ranks, schedules or
transports; the engine knows nothing about wire formats.
"""
from __future__ import annotations

import numpy as np


class Codec:
    name = "codec"

    def signature(self) -> tuple:
        """Hashable description every rank must agree on before any byte moves."""
        raise NotImplementedError

    def local_stats(self, x, backend):
        """(local statistics to all-reduce exactly before planning, or None;
        local state handed to ``plan``)."""
        return None, None

    def plan(self, x, reduced_stats, n, keys, backend, local_state=None) -> "Plan":
        raise NotImplementedError


class Plan:
    """Per-call state of a codec on one rank (see module docstring)."""

    chunk_nbytes: list

    def compress(self, chunk: int, event: int):
        """Compress this rank's local values of ``chunk`` (a leaf of the tree)."""
        raise NotImplementedError

    def accumulate(self, chunk: int, payload, acc):
        """acc (None: the local values) + decode(payload), in float32."""
        raise NotImplementedError

    def dar(self, chunk: int, payload, acc, event: int):
        """compress(decode(payload) + (acc or the local values)), fused."""
        raise NotImplementedError

    def decode(self, chunk: int, payload) -> None:
        """Decode the final compressed sum of ``chunk`` into the result."""
        raise NotImplementedError

    def finish(self, divisor: float):
        """The result in the caller's dtype, flat, divided by ``divisor``."""
        raise NotImplementedError

    def report(self) -> dict:
        return {}


def split_even(count: int, n: int) -> list:
    """Cut ``count`` units into n contiguous ranges of (nearly) equal size."""
    return [(c * count // n, (c + 1) * count // n) for c in range(n)]


def split_by_bytes(unit_bytes: np.ndarray, n: int) -> list:
    """Cut a stream of units into n contiguous ranges of whole units with
    (nearly) equal total bytes: a ring step lasts as long as its largest message."""
    count = len(unit_bytes)
    if count == 0:
        return [(0, 0)] * n
    ends = np.cumsum(unit_bytes, dtype=np.int64)
    total = int(ends[-1])
    targets = [(c * total) // n for c in range(1, n)]
    # boundary after the unit whose cumulative bytes first reach the target
    cuts = [int(np.searchsorted(ends, t, side="left")) + 1 if t > 0 else 0 for t in targets]
    bounds = [0] + [min(max(cut, 0), count) for cut in cuts] + [count]
    for i in range(1, len(bounds)):           # keep the bounds monotone
        bounds[i] = max(bounds[i], bounds[i - 1])
    return [(bounds[c], bounds[c + 1]) for c in range(n)]
