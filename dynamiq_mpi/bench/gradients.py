"""Synthetic gradient-like data for demos, benchmarks and tests, like the
paper's fine-tuning gradients: layers of scales orders of magnitude apart,
heavy-tailed entries, a skewed magnitude per super-group, and an embedding
table whose rows are zero on every rank but a few."""
from __future__ import annotations

import numpy as np

SUPER = 256


def layer_layout(length: int, seed: int = 1234):
    """Shared (all ranks) layer boundaries, layer scales and active embedding rows."""
    rng = np.random.default_rng(seed)
    emb = length // 4 // SUPER * SUPER          # first quarter: an embedding table
    active_rows = rng.random(emb // SUPER) < 0.1
    rest = length - emb
    n_layers = max(1, min(24, rest // 4096))
    cuts = np.sort(rng.choice(np.arange(1, max(2, rest)), size=n_layers - 1, replace=False)) \
        if n_layers > 1 else np.array([], dtype=np.int64)
    bounds = np.concatenate([[0], cuts, [rest]]).astype(np.int64) + emb
    scales = 10.0 ** rng.uniform(-5, 0, size=n_layers)
    return emb, active_rows, bounds, scales


def gradient_like(length: int, rank: int, seed: int = 0, dtype=np.float32,
                  with_embedding: bool = True) -> np.ndarray:
    """One rank's gradient of ``length`` entries; the layout is shared across ranks."""
    emb, active_rows, bounds, scales = layer_layout(length)
    rng = np.random.default_rng([seed, rank])
    g = np.zeros(length, dtype=np.float64)
    if with_embedding:
        rows = np.flatnonzero(active_rows)
        for r in rows:
            g[r * SUPER:(r + 1) * SUPER] = rng.standard_t(4, SUPER) * 1e-2
    else:
        g[:emb] = rng.standard_t(4, emb) * 1e-2
    for i, s in enumerate(scales):
        a, b = bounds[i], bounds[i + 1]
        nsg = -(-(b - a) // SUPER)
        sg_scale = np.repeat(np.exp(rng.normal(0, 1.0, nsg)), SUPER)[: b - a]
        g[a:b] = rng.standard_t(3, b - a) * s * sg_scale
    return g.astype(dtype)


def gradient_like_xp(xp, length: int, rank: int, seed: int = 0, dtype=np.float32,
                     with_embedding: bool = True):
    """A fast gradient-like array made by ``xp`` (NumPy or CuPy; not bit-equal):
    :func:`gradient_like`'s layout, normal entries, log-normal scales."""
    emb, active_rows, bounds, scales = layer_layout(length)
    nsg = -(-length // SUPER)
    host = np.random.default_rng([seed, rank, 1])
    sg_scale = np.zeros(nsg, dtype=np.float32)
    emb_rows = emb // SUPER
    if with_embedding:
        sg_scale[:emb_rows] = np.where(active_rows, 1e-2, 0.0)
    else:
        sg_scale[:emb_rows] = 1e-2
    first = emb_rows
    for i, s in enumerate(scales):
        last = -(-int(bounds[i + 1]) // SUPER)
        sg_scale[first:last] = s * np.exp(host.normal(0.0, 1.0, last - first))
        first = last
    if xp is np:
        noise = np.random.default_rng([seed, rank, 2]).standard_normal(length, dtype=np.float32)
    else:
        noise = xp.random.RandomState(seed * 1_000_003 + rank).standard_normal(length, dtype=np.float32)
    scale = xp.repeat(xp.asarray(sg_scale), SUPER)[:length]
    return (noise * scale).astype(dtype)
