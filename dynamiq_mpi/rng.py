"""Keys of the counter-based generator: the kernels draw every uniform as a
hash of (key, coordinate, event) (``src_cuda/dq_codec.h``), the keys a pure
function of (seed, call counter, domain): every rank derives the same ones
without communication, and every call draws fresh randomness.
"""
from __future__ import annotations

from dataclasses import dataclass

_MASK64 = (1 << 64) - 1

# Key domains: value rounding and correlated rounding never share uniforms.
DOMAIN_VALUE = 1
DOMAIN_PERM = 2


def splitmix64(x: int) -> int:
    """One step of the SplitMix64 finaliser (a bijective 64-bit mixer)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass(frozen=True)
class CallKeys:
    value: int
    perm: int
    # where a call replayed as a CUDA graph finds them on the device (uint32 x 2), or 0
    device: int = 0


def call_keys(seed: int, counter: int) -> CallKeys:
    """32-bit keys of one all-reduce call."""
    base = splitmix64(splitmix64(seed & _MASK64) ^ (counter & _MASK64))

    def key(domain: int) -> int:
        return splitmix64(base ^ (domain * 0xD1B54A32D192ED03 & _MASK64)) & 0xFFFFFFFF

    return CallKeys(value=key(DOMAIN_VALUE), perm=key(DOMAIN_PERM))
