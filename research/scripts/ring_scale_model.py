"""NumPy model of the ring's re-quantization chain (independent of the compiled
codec): why DynamiQ's ring error grows faster than n (docs/error-study.md).

    python research/scripts/ring_scale_model.py --n 2048 --width 2 --rules hier,exact,stoch

Every hop: y = q_prev + x_h (x_h ~ N(0,1) i.i.d., one worker of a super-group with
shared magnitude; the relative error is scale-free), group scale by a rule, stochastic
rounding in value space to the width's levels (the library's level tables), q = level*scale.
Rounding: independent, or correlated (u = (pi_h + g)/n, pi a random permutation of 0..n-1
per coordinate, i.i.d. across coordinates).  Width 16 is the paper's raw BF16 class (its
large-scale simulation allocates from {2, 4, 8, 16}): no scales, every hop rounds the
partial sum to BF16, to nearest even (rule "rne", as an uncompressed BF16 hop does) or
stochastically (rule "sr", unbiased, with the same uniforms as the other widths).

Scale rules:
  hier     spec 2.7: unit = bf16_up(f32_up(max_SG/255)), code = ceil(max_G/unit), scale = code*unit
  bf16up   non-hierarchical: scale = bf16_up(max_G)
  exact    scale = max_G (float64; the "no scale inflation" oracle, not a wire format)
  stoch    paper's stochastic uint8 code: unit = max_SG/255 (exact), code = floor + Bernoulli,
           t = y / max_G (exact), decoded value = level * code*unit  (unbiased, noisy scale)
  hierR    like hier, but values are normalised by exact max_G and decoded with code*unit
           (the artifact's biased ceil; for comparison only)
"""
from __future__ import annotations

import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT + "/tests")
sys.path.insert(0, ROOT)
import reference_model as rm  # noqa: E402
from dynamiq_mpi.codecs.levels import magnitudes  # noqa: E402

EPS = {2: 0.27, 4: 0.20, 8: 0.08}


def levels_for(width, eps=None, extra_level=False):
    """Signed level table. extra_level: the artifact simulation's 2^b+1 levels (R = 2^(b-1))."""
    eps = EPS[width] if eps is None else eps
    if extra_level:
        R = 1 << (width - 1)
        r = np.arange(R + 1, dtype=np.float64)
        g = 1 + 2 * eps * eps
        mag = np.expm1(r * np.log(g)) / np.expm1(R * np.log(g))
    else:
        mag = magnitudes(width, eps)
    return np.concatenate([-mag[:0:-1], mag])


def sr(t, lev, u):
    """Unbiased stochastic rounding of t in [-1,1] to sorted levels lev, with uniforms u."""
    k = np.clip(np.searchsorted(lev, t, side="right") - 1, 0, len(lev) - 2)
    lo, hi = lev[k], lev[k + 1]
    p = (t - lo) / (hi - lo)
    return np.where(u < p, hi, lo)


def scales(y, rule, rng):
    """(normaliser, decoded scale) per group, shapes (nsg, 16, 1)."""
    gmax = np.abs(y).max(axis=2)                       # (nsg, 16)
    smax = gmax.max(axis=1)
    if rule == "exact":
        s = gmax
        return s[..., None], s[..., None]
    if rule == "bf16up":
        s = np.where(gmax > 0, rm.bf16_bits_to_f32(rm.bf16_up_bits(gmax)), 0).astype(np.float64)
        return s[..., None], s[..., None]
    if rule in ("hier", "hierR"):
        unit = rm.bf16_bits_to_f32(rm.unit_bf16_bits(smax.astype(np.float32))).astype(np.float64)
        code = np.ceil(gmax / unit[:, None])
        code = np.where(code * unit[:, None] < gmax, code + 1, code)
        s = code * unit[:, None]
        if rule == "hier":
            return s[..., None], s[..., None]
        return gmax[..., None], s[..., None]
    if rule == "hierf32":   # float32 unit rounded up (no BF16), ceil codes
        unit = rm.f32_up(smax / 255.0).astype(np.float64)
        code = np.ceil(gmax / unit[:, None])
        code = np.where(code * unit[:, None] < gmax, code + 1, code)
        s = code * unit[:, None]
        return s[..., None], s[..., None]
    if rule == "stoch":
        unit = smax / 255.0
        f = gmax / unit[:, None]
        code = np.floor(f) + (rng.random(f.shape) < (f - np.floor(f)))
        return gmax[..., None], (code * unit[:, None])[..., None]
    raise ValueError(rule)


def bf16_round(y, rule, u):
    """y (float64, exactly a float32 here or not) rounded to BF16: "rne" to
    nearest even, "sr" up with probability (y - down) / (up - down)."""
    import ml_dtypes
    if rule == "rne":
        return y.astype(ml_dtypes.bfloat16).astype(np.float64)
    f = y.astype(np.float32)   # the hop adds in float32 (spec 2.10)
    bits = f.view(np.uint32)
    down = (bits & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)
    up = ((bits & np.uint32(0xFFFF0000)) + np.uint32(0x10000)).view(np.float32).astype(np.float64)
    down, up = np.where(f < 0, up, down), np.where(f < 0, down, up)   # down <= f <= up
    gap = up - down
    p = np.where(gap > 0, (f - down) / np.where(gap > 0, gap, 1.0), 0.0)
    return np.where(u < p, up, down)


def chain(n, width=2, rule="hier", nsg=64, correlated=False, seed=0, checkpoints=(),
          extra_level=False, eps=None):
    rng = np.random.default_rng(seed)
    lev = None if width == 16 else levels_for(width, eps, extra_level)
    shape = (nsg, 16, 16)
    q = np.zeros(shape)
    exact = np.zeros(shape)
    perm = None
    if correlated:
        # per coordinate a random permutation of 0..n-1 (argsort of uniforms), int16/32
        m = nsg * 256
        perm = np.argsort(rng.random((m, n), dtype=np.float32), axis=1).astype(np.int32)
        perm = perm.T.reshape(n, *shape)
    out = []
    for h in range(n):
        x = rng.standard_normal(shape)
        exact += x
        y = q + x
        g = rng.random(shape)
        u = (perm[h] + g) / n if correlated else g
        if width == 16:
            q = bf16_round(y, rule, u)
        else:
            norm, dec = scales(y, rule, rng)
            safe = np.where(norm > 0, norm, 1.0)
            t = np.clip(y / safe, -1.0, 1.0)
            q = sr(t, lev, u) * dec
        if (h + 1) in checkpoints or h == n - 1:
            e = float(((q - exact) ** 2).sum()) / float((exact ** 2).sum())
            infl = float(np.median(np.abs(q).max(axis=2) / np.abs(exact).max(axis=2)))
            out.append((h + 1, e, infl))
    return out


def tree(n, width=8, rule="hier", nsg=4, correlated=True, seed=0, eps=None):
    """The butterfly's reduction of one chunk: a binomial tree over the roles
    0..n-1 (n a power of two; role v's parent is v - lowbit(v)).  Every role
    adds its children's decoded sums to its own values and quantizes once (the
    root too: the sink re-encodes its own bytes), with event = its role, so
    correlated rounding gives every role its own stratum pi(v).  Returns the
    relative error of the root's decoded sum."""
    rng = np.random.default_rng(seed)
    lev = None if width == 16 else levels_for(width, eps)
    shape = (nsg, 16, 16)
    x = rng.standard_normal((n,) + shape)
    exact = x.sum(axis=0)
    acc = x.copy()
    pi = None
    if correlated:
        m = nsg * 256
        pi = np.argsort(rng.random((m, n), dtype=np.float32), axis=1).astype(np.int32)
        pi = pi.T.reshape((n,) + shape)
    roles = np.arange(n)
    lowbit = np.where(roles == 0, n, roles & -roles)

    def quantize(y, who):
        g = rng.random(y.shape)
        u = (pi[who] + g) / n if correlated else g
        if width == 16:
            return bf16_round(y, rule, u)
        flat = y.reshape(-1, 16, 16)
        norm, dec = scales(flat, rule, rng)
        safe = np.where(norm > 0, norm, 1.0)
        t = np.clip(flat / safe, -1.0, 1.0)
        return (sr(t, lev, u.reshape(flat.shape)) * dec).reshape(y.shape)

    step = 1
    while step < n:
        senders = roles[lowbit == step]
        acc[senders - step] += quantize(acc[senders], senders)
        step *= 2
    root = quantize(acc[:1], roles[:1])[0]
    return float(((root - exact) ** 2).sum()) / float((exact ** 2).sum())


if __name__ == "__main__":
    import argparse
    import time
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--width", type=int, default=2)
    p.add_argument("--rules", default="hier,exact")
    p.add_argument("--nsg", type=int, default=64)
    p.add_argument("--correlated", type=int, default=0)
    p.add_argument("--extra", type=int, default=0)
    p.add_argument("--eps", type=float, default=None)
    a = p.parse_args()
    cks = [h for h in (16, 64, 256, 512, 1024, 2048, 4096, 8192) if h < a.n]
    for rule in a.rules.split(","):
        t0 = time.time()
        res = chain(a.n, a.width, rule, a.nsg, bool(a.correlated), checkpoints=set(cks),
                    extra_level=bool(a.extra), eps=a.eps)
        print(f"width={a.width} rule={rule} corr={a.correlated} extra={a.extra} n={a.n} "
              f"({time.time() - t0:.0f}s)")
        print("   hops: " + " ".join(f"{h:>9d}" for h, _, _ in res))
        print("    rel: " + " ".join(f"{e:9.3e}" for _, e, _ in res))
        print("  infl.: " + " ".join(f"{i:9.3g}" for _, _, i in res), flush=True)
