"""Where does the library's error on dense gradients differ from a NumPy
model of the spec?  (Issue 21, item 4; docs/error-study.md, "Dense gradients
against a NumPy model of the spec".)

    python research/scripts/dense_gap_model.py --json docs/results/error_study_dense_gap.json

A plain NumPy model of spec section 2 on the ring (every coordinate's chain of
n quantizations, chunk c starting at rank c), written without the library's
kernels, hashes or Feistel permutations (NumPy's generator draws the uniforms
and the per-coordinate permutations of correlated rounding).  Each switch
moves the model one detail away from what the library does:

* ``stats``: the allocation from the library's float32 F (rounded up) or from
  the float64 F;
* ``unit``: the super-group scale unit sf_SG / 255 rounded up to BF16 (the
  wire format, spec 2.7) or kept exact in float64;
* ``codes``: group scales sent as the uint8 code ceil(255 sf_G / sf_SG)
  ("ceil", spec 2.7), the hybrid code ("hybrid", the default), or the exact
  group maximum ("exact": no scale quantization at all);
* ``eps``: the level spacing per width (ours: the artifact's simulation
  values 2:0.27 4:0.20 8:0.08; "cuda": the artifact's CUDA values 0.23 /
  0.18 / 0.10);
* ``arith``: float32 (the library: decoded values and partial sums in
  float32) or float64 throughout.

The widths come from the library's own allocation (the same F as the model's
``stats`` switch says), so a difference is in the quantization, not in which
super-group gets which width.  The library itself runs beside the model on
the same data (``simulate_allreduce``) with the spec's earlier defaults
(ceil codes, widths {0, 2, 4, 8}) and with the current ones.
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

SUPER, GROUP = 256, 16
EPS = {"ours": {2: 0.27, 4: 0.20, 8: 0.08}, "cuda": {2: 0.23, 4: 0.18, 8: 0.10}}


def bf16_up(v):
    """The smallest BF16 >= v (v >= 0, float64 in, float64 out)."""
    import ml_dtypes
    f = np.asarray(v, dtype=np.float32)
    f = np.where(f.astype(np.float64) < v, np.nextafter(f, np.float32(np.inf)), f)
    b = f.astype(ml_dtypes.bfloat16)                       # nearest even
    bf = b.astype(np.float64)
    lo = bf < f.astype(np.float64)
    bits = b.view(np.uint16).astype(np.uint32) + lo        # one BF16 ulp up where it fell below
    return (bits << 16).astype(np.uint32).view(np.float32).astype(np.float64)


def quantize(P, width, cfg, u, rng, mags):
    """Decoded values of one quantization of the partial sums P (m, 256)."""
    dt = np.float64 if cfg["arith"] == "float64" else np.float32
    m = P.shape[0]
    g = P.reshape(m, 16, GROUP).astype(np.float64)
    gmax = np.abs(g).max(axis=2)                           # (m, 16)
    smax = gmax.max(axis=1, keepdims=True)
    if cfg["codes"] == "exact":
        scale = gmax
        norm = gmax
    else:
        unit = smax / 255.0
        if cfg["unit"] == "bf16":
            unit = bf16_up(unit)
        with np.errstate(divide="ignore", invalid="ignore"):
            f = np.where(unit > 0, gmax / unit, 0.0)
        code = np.minimum(np.ceil(f), 255.0)
        code = np.where(code * unit < gmax, code + 1, code)   # smallest covering code
        scale = (code * unit).astype(dt).astype(np.float64)
        norm = scale
        if cfg["codes"] == "hybrid":
            fl = np.floor(f)
            up = rng.random(f.shape) < (f - fl)
            hyb = code >= 128
            scale = np.where(hyb, ((fl + up) * unit).astype(dt).astype(np.float64), scale)
            norm = np.where(hyb, gmax, scale)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(norm[..., None] > 0, g / norm[..., None], 0.0)
    t = np.clip(t, -1.0, 1.0)
    # levels: -mags[::-1] .. mags; round toward +inf iff u < p in value space
    levels = np.concatenate([-mags[:0:-1], mags])
    idx = np.clip(np.searchsorted(levels, t, side="right") - 1, 0, levels.size - 2)
    lo, hi = levels[idx], levels[idx + 1]
    p = (t - lo) / (hi - lo)
    q = np.where(u.reshape(t.shape) < p, hi, lo)
    out = (q.astype(dt) * scale[..., None].astype(dt)).astype(dt)
    return out.reshape(m, SUPER)


def ring_model(xs, widths, cfg, seed, correlated=True):
    """vNMSE of the model's ring all-reduce of xs (n, length) float32."""
    rng = np.random.default_rng(seed)
    n, length = xs.shape
    nsg = -(-length // SUPER)
    dt = np.float64 if cfg["arith"] == "float64" else np.float32
    X = np.zeros((n, nsg, SUPER), np.float32)
    X.reshape(n, -1)[:, :length] = xs
    mean = X.astype(np.float64).mean(axis=2).astype(np.float32)        # per rank, per super-group
    C = (X - mean[..., None]).astype(dt)
    mean_sum = mean.astype(np.float64).sum(axis=0)
    out = np.zeros((nsg, SUPER))
    eps = EPS[cfg["eps"]]
    from dynamiq_mpi.codecs.levels import magnitudes
    # chunks: live super-groups in width order cut into n nearly equal parts
    live = np.flatnonzero(widths > 0)
    live = live[np.argsort(widths[live], kind="stable")]
    chunk = np.zeros(nsg, np.int64)
    chunk[live] = np.arange(live.size) * n // max(live.size, 1)
    for w in (2, 4, 8, 16):
        rows = np.flatnonzero(widths == w)
        if rows.size == 0:
            continue
        start = chunk[rows]
        if w == 16:
            import ml_dtypes
            acc = None
            for k in range(n):
                v = C[(start + k) % n, rows].astype(np.float32)
                acc = v if acc is None else acc.astype(np.float32) + v
                acc = acc.astype(ml_dtypes.bfloat16).astype(np.float32)
            out[rows] = acc
            continue
        mags = magnitudes(w, eps[w]).astype(np.float64)
        if correlated:
            perm = np.argsort(rng.random((n, rows.size * SUPER)), axis=0)   # per coordinate
        acc = None
        for k in range(n):
            v = C[(start + k) % n, rows]
            acc = v if acc is None else (acc + v).astype(dt)
            gamma = rng.random(rows.size * SUPER)
            u = (perm[k] + gamma) / n if correlated else gamma
            acc = quantize(acc, w, cfg, u, rng, mags)
        out[rows] = acc
    S = xs.astype(np.float64).sum(axis=0)
    res = (out + mean_sum[:, None]).reshape(-1)[:length]
    res = np.where(np.repeat(widths, SUPER)[:length] > 0, res, 0.0)
    return float(np.sum((res - S) ** 2) / np.sum(S ** 2))


def library(xs, codec, seed, calls):
    import dynamiq_mpi as dq
    S = xs.astype(np.float64).sum(axis=0)
    errs, info = [], None
    for t in range(calls):
        outs, reps = dq.simulate_allreduce(list(xs), codec=codec, topology="ring", seed=seed,
                                           counter=t, return_reports=True)
        errs.append(float(np.sum((outs[0].astype(np.float64) - S) ** 2) / np.sum(S ** 2)))
        info = reps[0].codec_info
    return float(np.mean(errs)), errs, info


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--bits", default="5,8.25")
    ap.add_argument("--calls", type=int, default=3, help="calls (library) / seeds (model) averaged")
    ap.add_argument("--cache", default=str(REPO / ".cache" / "gradients"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    import dynamiq_mpi as dq
    from dynamiq_mpi.codecs.allocation import record_bits
    from tests.allocation_ref import allocate_xp
    from research.errorstudy import real_gradients
    grads, meta = real_gradients(args.cache)
    xs = np.asarray(grads[:args.ranks, meta["dense_start"]:], dtype=np.float32)
    n, length = xs.shape
    nsg = -(-length // SUPER)
    X = np.zeros((n, nsg, SUPER), np.float32)
    X.reshape(n, -1)[:, :length] = xs
    C64 = X.astype(np.float64) - X.astype(np.float64).mean(axis=2, keepdims=True)
    F64 = (C64 ** 2).sum(axis=2).sum(axis=0)             # float64 statistics, one sum
    rows = []
    base = dict(stats="float32", unit="bf16", codes="ceil", eps="ours", arith="float32")
    variants = [("model = library (ceil codes)", {}),
                ("float64 statistics", {"stats": "float64"}),
                ("exact unit (no BF16 rounding)", {"unit": "exact"}),
                ("exact group scales (no scale codes)", {"codes": "exact"}),
                ("hybrid codes", {"codes": "hybrid"}),
                ("artifact CUDA eps (0.23/0.18/0.10)", {"eps": "cuda"}),
                ("float64 arithmetic", {"arith": "float64"}),
                ("all of: float64 stats, exact unit, float64 arith",
                 {"stats": "float64", "unit": "exact", "arith": "float64"})]
    for bits in [float(b) for b in args.bits.split(",")]:
        old = dq.DynamiQ(bits=bits, small_input=0, scale_code="ceil", bf16_class=False)
        lib_old, lib_old_calls, info = library(xs, old, 11, args.calls)
        lib_new, lib_new_calls, info_new = library(xs, dq.DynamiQ(bits=bits, small_input=0), 11,
                                                   args.calls)
        w32 = np.asarray(info["supergroup_widths"], dtype=np.int8)
        stats_bits = 32 * (2 * nsg + 2)
        a = allocate_xp(np, F64.astype(np.float32), bits * length, bits * nsg * SUPER + stats_bits,
                        stats_bits, True)
        w64 = np.asarray(a.widths, dtype=np.int8)
        row = dict(bits=bits, ranks=n, length=length,
                   library_ceil_no16=lib_old, library_ceil_no16_calls=lib_old_calls,
                   library_defaults=lib_new, library_defaults_calls=lib_new_calls,
                   widths_library={int(k): int(v) for k, v in info["widths"].items()},
                   widths_float64_stats={int(w): int(np.sum(w64 == w)) for w in (0, 2, 4, 8)},
                   model={})
        print(f"\n{bits} bits, {n} ranks, real-dense ({length} elements): library "
              f"{lib_old:.4g} (ceil, no 16-bit class), {lib_new:.4g} (defaults); widths "
              f"{row['widths_library']}, from float64 F {row['widths_float64_stats']}", flush=True)
        for name, change in variants:
            cfg = {**base, **change}
            widths = w64 if cfg["stats"] == "float64" else w32
            vals = [ring_model(xs, widths, cfg, seed) for seed in range(args.calls)]
            row["model"][name] = dict(config=cfg, vnmse=float(np.mean(vals)), calls=vals)
            print(f"  {name:52s} {np.mean(vals):.4g}  (x{np.mean(vals) / lib_old:.3f} of the library)",
                  flush=True)
        rows.append(row)
    res = dict(tool="research/scripts/dense_gap_model.py", command="python research/scripts/dense_gap_model.py "
               + " ".join(sys.argv[1:] if argv is None else argv),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               git=subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                  text=True).stdout.strip(),
               data={k: meta.get(k) for k in ("model", "sha256", "dense_start", "length")},
               seconds=time.perf_counter() - t0, rows=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    print(f"({res['seconds']:.0f} s)")
    return res


if __name__ == "__main__":
    main()
