"""The DynamiQ codec's level tables, built on the host in double: codes
``q in [-R, R]`` stored as ``q + R``, magnitudes ``((1 + 2 eps^2)^r - 1) /
((1 + 2 eps^2)^R - 1)``.  The kernels only read them: CPU and GPU agree.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LUT_SIZE = 4096


@dataclass(frozen=True)
class LevelTables:
    width: int
    eps: float
    mag: np.ndarray      # float32[R + 1], mag[0] = 0, mag[R] = 1, strictly increasing
    inv_gap: np.ndarray  # float32[R], 1 / (mag[r+1] - mag[r])
    level: np.ndarray    # float32[2R + 1], level[R + q] = sign(q) mag[|q|]
    lut: np.ndarray      # uint8[4096], largest r <= R-1 with mag[r] <= cell / 4096

    @property
    def radius(self) -> int:
        return (1 << (self.width - 1)) - 1


def magnitudes(width: int, eps: float) -> np.ndarray:
    """Level magnitudes in float64 (exactly 0 and 1 at the ends)."""
    radius = (1 << (width - 1)) - 1
    r = np.arange(radius + 1, dtype=np.float64)
    if eps == 0.0 or radius == 1:
        mag = r / radius
    else:
        growth = 1.0 + 2.0 * eps * eps
        mag = np.expm1(r * np.log(growth)) / np.expm1(radius * np.log(growth))
    mag[0], mag[-1] = 0.0, 1.0
    return mag


def build_tables(width: int, eps: float) -> LevelTables:
    if width not in (2, 4, 8):
        raise ValueError(f"code width must be 2, 4 or 8 bits, got {width}")
    if not (0.0 <= eps < 1.0):
        raise ValueError(f"eps must be in [0, 1), got {eps}")
    radius = (1 << (width - 1)) - 1
    mag = magnitudes(width, eps).astype(np.float32)
    if not np.all(np.diff(mag.astype(np.float64)) > 0):
        raise ValueError(f"eps={eps} makes the {width}-bit levels collapse in float32")
    gaps = np.diff(mag.astype(np.float64))
    inv_gap = (1.0 / gaps).astype(np.float32)
    level = np.concatenate([-mag[:0:-1], mag]).astype(np.float32)
    cells = np.arange(LUT_SIZE, dtype=np.float64) / LUT_SIZE
    lut = np.searchsorted(mag[:radius].astype(np.float64), cells, side="right") - 1
    return LevelTables(width, float(eps), mag, inv_gap, level, lut.astype(np.uint8))
