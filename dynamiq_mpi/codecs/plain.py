"""Uncompressed baselines: ``exact`` (float32 on the wire) and ``bf16``.

Both accumulate in float32 at every hop; ``bf16`` rounds each partial sum to
BF16 (nearest-even) before it goes on the wire.  ``exact`` also carries the
statistics phase of the compressed codecs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backend import BFLOAT16, as_float32, bf16_to_float32, float32_to_bf16
from .base import Codec, Plan, split_even


class _ElementwisePlan(Plan):
    """Chunks are even ranges of elements; the wire holds one value each."""

    wire_dtype = np.dtype(np.float32)

    def __init__(self, x, n, backend):
        self.backend = backend
        self.xp = backend.xp
        self.length = x.shape[0]
        self.dtype = x.dtype
        self.local = as_float32(x)
        self.ranges = split_even(self.length, n)
        self.chunk_nbytes = [(b - a) * self.wire_dtype.itemsize for a, b in self.ranges]
        self.result = backend.empty(self.length, np.float32)

    # encode/decode between float32 values and wire bytes
    def _encode(self, values):
        raise NotImplementedError

    def _decode(self, payload):
        raise NotImplementedError

    def _local(self, chunk):
        a, b = self.ranges[chunk]
        return self.local[a:b]

    def compress(self, chunk, event):
        return self._encode(self._local(chunk))

    def accumulate(self, chunk, payload, acc):
        base = self._local(chunk) if acc is None else acc
        with np.errstate(over="ignore"):   # an overflowing sum is inf, as in IEEE
            return base + self._decode(payload)

    def dar(self, chunk, payload, acc, event):
        base = self._local(chunk) if acc is None else acc
        with np.errstate(over="ignore"):
            return self._encode(base + self._decode(payload))

    def decode(self, chunk, payload):
        a, b = self.ranges[chunk]
        self.result[a:b] = self._decode(payload)

    def finish(self, divisor):
        out = self.result if divisor == 1 else self.result / np.float32(divisor)
        return out if self.dtype == np.float32 else float32_to_bf16(out)


class _ExactPlan(_ElementwisePlan):
    def _encode(self, values):
        return self.xp.ascontiguousarray(values, dtype=np.float32).view(np.uint8).copy()

    def _decode(self, payload):
        return payload.view(np.float32)


class _BF16Plan(_ElementwisePlan):
    wire_dtype = BFLOAT16

    def _encode(self, values):
        return float32_to_bf16(values).view(np.uint8)

    def _decode(self, payload):
        return bf16_to_float32(payload)


@dataclass(frozen=True)
class Exact(Codec):
    """float32 on the wire, float32 adds at every hop (about n ulp of error)."""
    name = "exact"

    def signature(self):
        return ("exact",)

    def plan(self, x, reduced_stats, n, keys, backend, local_state=None):
        return _ExactPlan(x, n, backend)


@dataclass(frozen=True)
class BF16(Codec):
    """BF16 on the wire (nearest-even), float32 accumulation at every hop."""
    name = "bf16"

    def signature(self):
        return ("bf16",)

    def plan(self, x, reduced_stats, n, keys, backend, local_state=None):
        return _BF16Plan(x, n, backend)
