"""``python -m research train-sim table RUNS.json... [--png FIG]``: the
table of the simulated-ranks training runs (train_sim.py writes their JSON)
and their curves.  A run's JSON, or a collection ``{"runs": [...]}``."""
from __future__ import annotations

import json
import math
import statistics


def _label(cfg):
    hier = f" nodes of {cfg['node_size']}" if cfg.get("node_size", 1) > 1 else ""
    topo = "" if cfg["codec"] in ("fp32", "bf16") else f" {cfg['topology']}"
    work = "" if cfg.get("workload", "lm") == "lm" else f"{cfg['workload']}: "
    return f"{work}{cfg['codec']}{topo}{hier}"


_PLAIN_BITS = {"fp32": 32.0, "bf16": 16.0}     # runs written before these were counted


def _bits(run):
    """Bits a coordinate of a run's reductions; None for a partial codec run
    (counted when the run ends)."""
    return run.get("bits_per_coord") or _PLAIN_BITS.get(run["config"]["codec"])


def last_fifth_gain(run):
    """How much the validation loss fell over the last fifth of the run's
    steps, relative to where that fifth began (under 1 % of BF16's: a run
    long enough to compare final losses); None without evals."""
    evals = run.get("evals") or []
    if len(evals) < 2:
        return None
    last_step, final = evals[-1]
    start = last_step - last_step / 5
    before = [v for s, v in evals if s <= start]
    return (before[-1] - final) / before[-1] if before else None


def _pct(v):
    return "-" if v is None else format(v, ".1%")


def mean_curve(runs):
    """The seeds' mean validation curve, at the steps every run evaluated."""
    common = set.intersection(*(set(s for s, _ in r["evals"]) for r in runs))
    return [[s, statistics.mean(dict(r["evals"])[s] for r in runs)] for s in sorted(common)]


def table(paths, png=None) -> list:
    """Rows per (N, reduction, run length, sequences a rank): mean final
    validation loss over seeds, the seeds' spread, its ratio to BF16's mean
    over the *same seeds* at the same N, length and batch (all of BF16's
    where it lacks one of them), the step each run first reached that BF16
    mean, the mean vNMSE along the run, the final accuracy (cls) and the
    fall of the validation loss over the last fifth, of the seeds' mean
    curve and of one seed at most (under 1 %: long enough)."""
    runs = []
    for p in paths:             # a run's JSON, or a collection {"runs": [...]}
        with open(p) as f:
            doc = json.load(f)
        runs.extend(doc["runs"] if "runs" in doc else [doc])
    groups = {}
    for r in runs:
        cfg = r["config"]
        groups.setdefault((cfg["ranks"], _label(cfg), cfg["steps"], cfg["batch"]), []).append(r)
    rows = []
    for (n, label, length, batch), rs in sorted(groups.items()):
        done = [r for r in rs if "final_val_loss" in r]
        finals = [r["final_val_loss"] for r in done]
        work = rs[0]["config"].get("workload", "lm")
        bf16_label = "bf16" if work == "lm" else f"{work}: bf16"
        bf16 = {r["config"]["seed"]: r["final_val_loss"]
                for r in groups.get((n, bf16_label, length, batch), []) if "final_val_loss" in r}
        seeds = [r["config"]["seed"] for r in done]
        paired = [bf16[s] for s in seeds if s in bf16]
        target = (statistics.mean(paired) if len(paired) == len(seeds) and paired
                  else statistics.mean(bf16.values()) if bf16 else None)
        reach = [next((s for s, v in r["evals"] if target is not None and v <= target), None)
                 for r in done]
        vn = [v for r in rs for _, v in r["vnmse"]]
        cut = [r for r in rs if "final_val_loss" not in r and r["evals"]]
        # runs cut short: their mean at the last step every one of them evaluated
        cut_curve = mean_curve(cut) if cut else []
        cut_seeds = sorted(r["config"]["seed"] for r in cut)
        rows.append(dict(ranks=n, reduction=label, length=length, batch=batch,
                         seeds=sorted(seeds) if finals else cut_seeds,
                         partial=None if finals or not cut_curve else tuple(cut_curve[-1]),
                         final=statistics.mean(finals) if finals else None,
                         spread=(max(finals) - min(finals)) if len(finals) > 1 else 0.0,
                         vs_bf16=(statistics.mean(finals) / target) if finals and target else None,
                         paired=len(paired) == len(seeds) and bool(paired),
                         steps_to_bf16=reach,
                         vnmse=statistics.mean(vn) if vn else None,
                         last_fifth=max((g for g in map(last_fifth_gain, done) if g is not None),
                                        default=None),
                         last_fifth_mean=(last_fifth_gain({"evals": mean_curve(done)})
                                          if done else None),
                         accuracy=(statistics.mean(r["final_accuracy"] for r in done)
                                   if done and all("final_accuracy" in r for r in done)
                                   else None),
                         bits=statistics.mean([b for b in map(_bits, rs) if b] or [0.0])))
    print(f"{'N':>4s} {'steps':>5s} {'batch':>5s} {'reduction':>36s} {'seeds':>7s} "
          f"{'final val':>10s} {'spread':>8s} "
          f"{'/ BF16':>8s} {'steps to BF16':>14s} {'vNMSE':>9s} {'bits':>6s} {'acc':>6s} "
          f"{'last 1/5 mean, max':>18s}")
    for r in rows:
        fin = (f"{r['final']:.4f}" if r["final"] is not None else
               f"{r['partial'][1]:.4f}@{r['partial'][0]}" if r["partial"] else "-")
        ratio = (f"{r['vs_bf16']:.4f}" + ("" if r["paired"] else "*")) if r["vs_bf16"] else "-"
        steps = ",".join("-" if s is None else str(s) for s in r["steps_to_bf16"])
        vn = f"{r['vnmse']:.2e}" if r["vnmse"] else "-"
        seeds = ",".join(map(str, r["seeds"]))
        print(f"{r['ranks']:>4d} {r['length']:>5d} {r['batch']:>5d} {r['reduction']:>36s} "
              f"{seeds:>7s} {fin:>10s} "
              f"{r['spread']:8.4f} {ratio:>8s} {steps:>14s} {vn:>9s} {r['bits']:6.2f} "
              f"{'-' if r['accuracy'] is None else format(r['accuracy'], '.3f'):>6s} "
              f"{_pct(r['last_fifth_mean']):>9s},{_pct(r['last_fifth']):>8s}")
    print("# last 1/5: the validation loss's fall over the last fifth of the steps, of the "
          "seeds' mean curve and the largest of one seed's")
    if any(r["partial"] for r in rows):
        print("# V@S: runs cut short; their mean validation loss at step S")
    if any(not r["paired"] for r in rows if r["vs_bf16"]):
        print("# *: against BF16's mean over other seeds (BF16 lacks one of the row's)")
    if png:
        _plot(groups, png)
    return rows


def _plot(groups, png):
    """One panel per (workload, N, run length, batch): validation loss
    against step (lm), or accuracy (cls: its loss overfits while accuracy
    still climbs).  The y range follows the runs that train: a diverged run
    is named in the legend with its final value, off the chart.  Below each,
    the last 40 % of the steps zoomed (``_zoom``)."""

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = {}
    for (n, label, length, batch), rs in sorted(groups.items()):
        work = rs[0]["config"].get("workload", "lm")
        panels.setdefault((work, n, length, batch), []).append((label, rs))
    fig, axes = plt.subplots(2, len(panels), figsize=(6 * len(panels), 8.5), squeeze=False,
                             gridspec_kw=dict(height_ratios=[4.5, 4]))
    for ax, zoom, ((work, n, length, batch), members) in zip(axes[0], axes[1],
                                                             sorted(panels.items())):
        key = "accuracy" if work == "cls" else "evals"
        curves = [(label, r[key]) for label, rs in members for r in rs if r.get(key)]
        starts = [c[0][1] for _, c in curves if math.isfinite(c[0][1])]
        lo = min((v for _, c in curves for _, v in c if math.isfinite(v)), default=0.0)
        hi = statistics.median(starts) * 1.05 if starts else 1.0
        for k, (label, rs) in enumerate(members):
            for i, r in enumerate(rs):
                if not r.get(key):
                    continue
                xs, ys = zip(*r[key])
                off = key == "evals" and not ys[-1] <= hi      # NaN too
                name = f"{label} (off the chart: {ys[-1]:.2f})" if off else label
                ax.plot(xs, ys, label=name if i == 0 else None, alpha=0.8, color=f"C{k}")
        if key == "evals":
            ax.set_ylim(lo - 0.03 * (hi - lo), hi)
        ax.set_title(f"{work}, N = {n} simulated ranks, {length} steps of {batch} a rank",
                     fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("validation accuracy" if key == "accuracy" else
                      "validation loss (nats/byte)")
        ax.legend(fontsize=7)
        _zoom(zoom, members, key, length)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def _zoom(ax, members, key, length):
    """The last 40 % of the steps, at the scale where the codecs that keep
    up with BF16 differ: the runs whose final value lies within 5 % of the
    panel's median final (the others are left out of this view)."""
    start = 0.6 * length
    runs = [(k, r[key]) for k, (_, rs) in enumerate(members) for r in rs if r.get(key)]
    finals = [c[-1][1] for _, c in runs if math.isfinite(c[-1][1])]
    if not finals:
        return
    mid = statistics.median(finals)
    near = [(k, [(s, v) for s, v in c if s >= start]) for k, c in runs
            if abs(c[-1][1] - mid) <= 0.05 * abs(mid)]
    values = [v for _, c in near for _, v in c]
    for k, c in near:
        if c:
            ax.plot(*zip(*c), alpha=0.8, color=f"C{k}", marker=".", markersize=3)
    if values:
        pad = 0.05 * (max(values) - min(values) or 1e-3)
        ax.set_ylim(min(values) - pad, max(values) + pad)
    ax.set_xlim(start, length)
    ax.set_title(f"the last 40 % of the steps (runs ending within 5 % of the median; "
                 f"{len(near)} of {len(runs)})", fontsize=9)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
