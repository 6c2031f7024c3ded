"""Time to BF16's loss: train one LLM with several codecs and seeds
(mpi_examples/train_lm.py, one job a run), then report when each codec first
reaches the validation loss that torch's ``bf16_compress_hook`` ends at.

    # 3 seeds of the BF16 hook and of ours, one plain-DDP reference, 4 GPUs
    python mpi_examples/time_to_loss.py run --nproc 4 --preset 0.8b --steps 300 \\
        --codecs bf16,dynamiq:5 --seeds 0,1,2 --reference fp32:0 --out ttl
    python mpi_examples/time_to_loss.py report ttl --json ttl.json --png ttl.png
    python mpi_examples/time_to_loss.py run --nproc 2 --preset tiny --steps 6 \\
        --codecs bf16,dynamiq:5 --seeds 0 --device cpu --out ttl-cpu   # CPU, gloo

``run`` launches ``train_lm.py`` under torchrun (``--launcher mpiexec``
for MPI), the codecs interleaved seed by seed so that a slow drift of the
link touches every codec alike; a run whose JSON is already in ``--out`` is
kept (re-run the command to resume, or to add seeds).  Arguments after
``--`` go to train_lm.py as they are (``-- --bucket-cap-mb 100``).  Every
codec sees the same initial model and the same batches at a given seed.

A codec written ``CODEC@N`` (``--codecs bf16,dynamiq:5@330``) trains N steps
instead of ``--steps``, its learning-rate schedule stretched to its own end:
the time a codec takes to the baseline's final loss when it may run longer
(the baseline's own step count is the row without ``@``).

``report`` reads every ``run_*.json`` of the folders (or ``{"runs": [...]}``
files) and prints, per codec: final validation loss (mean and spread over
seeds), the step and the training time at which the mean validation curve
first reaches the target (the baseline's mean final validation loss; also
within 1 % of it), tokens/s, the compute-only step and the exposed
communication, the hook's vNMSE along the run and how much the loss still
fell over the last fifth of the run.  Training time is the sum of the step
times up to that step: evaluation, the compute probes and the extra host
synchronisation of the steps that measure the error (their time is replaced
by the run's median step) are left out.  Evaluations come every
``--eval-every`` steps (the command sets 10): that is the resolution.
"""
import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BYTES_RATIO = 5 / 16          # DynamiQ's default 5 bits a coordinate against BF16's 16


# --------------------------------------------------------------------- run
def _pairs(text, what):
    """'bf16,dynamiq:5' -> ['bf16', 'dynamiq:5']; '0,1,2' -> [0, 1, 2]."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise SystemExit(f"time_to_loss: --{what} is empty")
    return items


def run_tag(codec, seed):
    """A file-name-safe tag: 'dynamiq:5:centring=false', 0 -> 'dynamiq5centring-false_s0';
    a step budget of its own, 'dynamiq:5@330' -> 'dynamiq5_n330_s0'."""
    codec = codec.replace("=", "-").replace("@", "_n")
    return f"{re.sub(r'[^A-Za-z0-9._-]', '', codec)}_s{seed}"


def split_steps(spec, steps):
    """'dynamiq:5@330' -> ('dynamiq:5', 330); a codec without '@' trains
    ``steps`` steps (its schedule's cosine ends at its own last step)."""
    codec, at, n = spec.partition("@")
    if not at:
        return spec, steps
    if not codec or not n.isdigit() or int(n) < 1:
        raise SystemExit(f"time_to_loss: codec {spec!r}: expected CODEC@STEPS, "
                         "e.g. dynamiq:5@330")
    return codec, int(n)


def planned_runs(codecs, seeds, reference):
    """(codec, seed) in the order they run: seed by seed, every codec within
    a seed, then the reference runs ('fp32:0' -> ('fp32', 0))."""
    runs = [(c, s) for s in seeds for c in codecs]
    for ref in reference:
        codec, _, seed = ref.rpartition(":")
        if not codec or not seed.isdigit():
            raise SystemExit(f"time_to_loss: --reference {ref!r}: expected CODEC:SEED, e.g. fp32:0")
        runs.append((codec, int(seed)))
    return runs


def launch_command(launcher, nproc, train_args):
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", str(nproc), os.path.join(HERE, "train_lm.py")] + train_args
    return ["mpiexec", "-n", str(nproc), sys.executable,
            os.path.join(HERE, "train_lm.py")] + train_args


def run_job(cmd, timeout):
    """The job's exit status, or "timeout" after its whole process group
    (the launcher and every rank) was stopped: no rank of a run outlives it
    to slow down the next one."""
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):     # a grace period, then no mercy
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            if sig == signal.SIGTERM:
                time.sleep(10)
        proc.wait()
        return "timeout"


def cmd_run(args, passthrough):
    seeds = [int(s) for s in _pairs(args.seeds, "seeds")]
    runs = planned_runs(_pairs(args.codecs, "codecs"), seeds,
                        _pairs(args.reference, "reference") if args.reference else [])
    for spec, _ in runs:
        split_steps(spec, args.steps)          # every spec checked before the first run
    os.makedirs(args.out, exist_ok=True)
    t_all = time.perf_counter()
    failed = []
    for i, (codec, seed) in enumerate(runs, 1):
        path = os.path.join(args.out, f"run_{run_tag(codec, seed)}.json")
        if os.path.exists(path):
            print(f"[{i}/{len(runs)}] {codec} seed {seed}: kept {path}", flush=True)
            continue
        name, steps = split_steps(codec, args.steps)
        train_args = ["--codec", name, "--seed", str(seed), "--preset", args.preset,
                      "--steps", str(steps), "--eval-every", str(args.eval_every),
                      "--probe-every", str(args.probe_every), "--device", args.device,
                      "--no-progress", "--json", path + ".part"] + passthrough
        cmd = launch_command(args.launcher, args.nproc, train_args)
        print(f"[{i}/{len(runs)}] {codec} seed {seed}: {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        rc = run_job(cmd, args.run_timeout)
        if rc == 0 and os.path.exists(path + ".part"):
            os.replace(path + ".part", path)
        else:
            failed.append(f"{codec} seed {seed} ({rc})")
        print(f"[{i}/{len(runs)}] {codec} seed {seed}: exit {rc} after "
              f"{time.perf_counter() - t0:.0f} s (all: {time.perf_counter() - t_all:.0f} s)",
              flush=True)
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
    result = report(load_runs([args.out]), args.baseline)
    print_report(result)
    write_outputs(result, args.json, args.png)
    return 1 if failed else 0


# --------------------------------------------------------------------- analysis
def load_runs(sources):
    """Run dicts from folders (their run_*.json) and from JSON files holding
    one run or ``{"runs": [...]}``."""
    runs = []
    for src in sources:
        paths = ([os.path.join(src, f) for f in sorted(os.listdir(src))
                  if f.startswith("run_") and f.endswith(".json")]
                 if os.path.isdir(src) else [src])
        for p in paths:
            with open(p) as f:
                data = json.load(f)
            runs.extend(data["runs"] if "runs" in data else [data])
    if not runs:
        raise SystemExit(f"time_to_loss: no runs in {', '.join(sources)}")
    return runs


def training_times(run):
    """Training time (s) at the end of each step: the sum of its step times,
    with the error-measuring steps (extra host synchronisation) counted as
    the run's median step."""
    plain = [s["step_ms"] for s in run["steps"] if not s.get("measured")]
    typical = statistics.median(plain) if plain else 0.0
    t, out = 0.0, []
    for s in run["steps"]:
        t += (typical if s.get("measured") else s["step_ms"]) / 1e3
        out.append(t)
    return out


def _steady_step_ms(run):
    """The run's median step (train_lm's, after its warm-up); for a run too
    short for that warm-up, the median of its steps that measured nothing."""
    ms = run["summary"]["step_ms"]
    if ms is not None and math.isfinite(ms):
        return ms
    return statistics.median(s["step_ms"] for s in run["steps"] if not s.get("measured"))


def first_reach(points, target):
    """(step, seconds) of the first (step, seconds, loss) point at or below
    ``target``; None if the curve never gets there."""
    for step, sec, loss in points:
        if loss <= target * (1 + 1e-12):       # a seed-mean equal to the target reaches it
            return step, sec
    return None


def curve(run):
    """The run's validation curve as (step, training seconds, loss)."""
    times = training_times(run)
    return [(e["step"], times[e["step"] - 1], e["val_loss"]) for e in run["evals"]]


def mean_curve(curves):
    """Seed-mean of the runs' validation curves (steps common to every run)."""
    common = sorted(set.intersection(*(set(p[0] for p in c) for c in curves)))
    out = []
    for step in common:
        pts = [next(p for p in c if p[0] == step) for c in curves]
        out.append((step, statistics.mean(p[1] for p in pts), statistics.mean(p[2] for p in pts)))
    return out


def _vnmse_along(runs):
    """The hook's measured vNMSE at each measuring step, mean over seeds."""
    at = {}
    for r in runs:
        for v in r["vnmse"]:
            if v["vnmse"] is not None:
                at.setdefault(v["step"], []).append(v["vnmse"])
    return [{"step": s, "vnmse": statistics.mean(x)} for s, x in sorted(at.items())]


def _mean_sd(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return None, None
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _base_steps(runs, baseline):
    """The baseline's step count (the most common one among its runs; among
    all runs when there is no baseline)."""
    own = [r["config"]["steps"] for r in runs if r["summary"]["codec"] == baseline]
    counts = own or [r["config"]["steps"] for r in runs]
    return max(set(counts), key=lambda n: (counts.count(n), -n))


def run_label(run, base_steps):
    """The row a run belongs to: its codec, with '@STEPS' when it trained
    another number of steps than the baseline."""
    codec, steps = run["summary"]["codec"], run["config"]["steps"]
    return codec if steps == base_steps else f"{codec}@{steps}"


def report(runs, baseline="bf16"):
    """The comparison as a dict (printed by ``print_report``, written as JSON).

    A codec run for another number of steps than the baseline (``CODEC@N``)
    is a row of its own: its time to the baseline's final loss counts, its
    final loss is not at equal steps (no loss gap)."""
    base_steps = _base_steps(runs, baseline)
    by_codec = {}
    for r in runs:
        by_codec.setdefault(run_label(r, base_steps), []).append(r)
    for label, rs in by_codec.items():
        rs.sort(key=lambda r: r["summary"]["seed"])
        seeds = [r["summary"]["seed"] for r in rs]
        twice = sorted({s for s in seeds if seeds.count(s) > 1})
        if twice:       # a seed counted twice would weigh twice in the means
            raise SystemExit(f"time_to_loss: {label} has more than one run at seed(s) {twice}; "
                             "report each repeat from its own folder")
    base = by_codec.get(baseline)
    target, base_sd = (_mean_sd([r["summary"]["final_val_loss"] for r in base]) if base
                       else (None, 0.0))
    c0 = runs[0]["config"]
    tokens_per_step = c0["world_size"] * c0["batch"] * c0["seq_len"]
    rows = {}
    for codec, rs in by_codec.items():
        curves = [curve(r) for r in rs]
        mc = mean_curve(curves)
        final_mean, final_sd = _mean_sd([r["summary"]["final_val_loss"] for r in rs])
        step_ms = statistics.mean(_steady_step_ms(r) for r in rs)
        fifth = [p for p in mc if p[0] <= mc[-1][0] * 0.8]
        row = {
            "steps": rs[0]["config"]["steps"],
            "seeds": [r["summary"]["seed"] for r in rs],
            "final_val_loss": [r["summary"]["final_val_loss"] for r in rs],
            "final_val_mean": final_mean, "final_val_sd": final_sd,
            "step_ms": step_ms, "tokens_per_s": tokens_per_step / (step_ms / 1e3),
            "compute_ms": _mean_sd([r["summary"]["compute_ms"] for r in rs])[0],
            "comm_ms": _mean_sd([_steady_step_ms(r) - r["summary"]["compute_ms"]
                                 for r in rs])[0],
            "training_s": statistics.mean(c[-1][1] for c in curves),
            "mean_curve": [{"step": s, "training_s": t, "val_loss": v} for s, t, v in mc],
            "fell_over_last_fifth": (fifth[-1][2] - mc[-1][2]) / mc[-1][2] if fifth else None,
            "vnmse": _vnmse_along(rs),
            "bits_per_coord": _mean_sd([r["summary"]["bits_per_coord"] for r in rs])[0],
        }
        if target is not None:
            for key, goal in (("reach", target), ("reach_1pct", target * 1.01)):
                hit = first_reach(mc, goal)
                row[key] = None if hit is None else {"step": hit[0], "training_s": hit[1]}
                row[key + "_per_seed"] = [
                    None if h is None else {"step": h[0], "training_s": h[1]}
                    for h in (first_reach(c, goal) for c in curves)]
        rows[codec] = row
    result = {"baseline": baseline, "target_val_loss": target, "baseline_sd": base_sd,
              "world_size": c0["world_size"], "device": c0.get("device"),
              "n_params": c0["n_params"], "steps": base_steps,
              "preset": c0.get("preset"), "bucket_cap_mb": c0.get("bucket_cap_mb"),
              "codecs": rows}
    if base and baseline in rows:
        b = rows[baseline]
        compute = statistics.mean(r["compute_ms"] for r in rows.values()
                                  if r["compute_ms"] is not None)
        bound = (compute + b["comm_ms"]) / (compute + BYTES_RATIO * b["comm_ms"])
        result["bound"] = {"compute_ms": compute, "baseline_comm_ms": b["comm_ms"],
                           "speedup_bound": bound}
        for codec, row in rows.items():
            for key in ("reach", "reach_1pct"):
                if b.get(key) and row.get(key):
                    row["speedup_" + key] = b[key]["training_s"] / row[key]["training_s"]
            if row["steps"] != base_steps:
                continue                        # its final loss is not at equal steps
            row["loss_gap"] = (row["final_val_mean"] - b["final_val_mean"]) / b["final_val_mean"]
            # the same seed sees the same model and batches: the paired gap
            # is free of the seeds' spread
            base_at = dict(zip(b["seeds"], b["final_val_loss"]))
            pairs = [(v - base_at[s]) / base_at[s]
                     for s, v in zip(row["seeds"], row["final_val_loss"]) if s in base_at]
            row["paired_gaps"] = pairs
            row.update(_paired_summary(pairs))
            row["loss_allowance"] = max(0.005, 2 * base_sd / b["final_val_mean"])
    return result


def _paired_summary(gaps) -> dict:
    """The paired gaps' mean, its standard error (two seeds or more), and the
    seeds at which two standard errors would fall below the mean's size at
    the observed spread (None while that cannot be said)."""
    if not gaps:
        return {"paired_gap_mean": None, "paired_gap_se": None, "seeds_to_resolve": None}
    mean = statistics.mean(gaps)
    if len(gaps) < 2:
        return {"paired_gap_mean": mean, "paired_gap_se": None, "seeds_to_resolve": None}
    sd = statistics.stdev(gaps)
    need = (math.ceil((2 * sd / abs(mean)) ** 2) if mean != 0 else None)
    return {"paired_gap_mean": mean, "paired_gap_se": sd / math.sqrt(len(gaps)),
            "seeds_to_resolve": None if need is None else max(2, need)}


# --------------------------------------------------------------------- output
def _f(x, fmt):
    """``x`` formatted, or a dash as wide when it is missing."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-".rjust(len(format(0 if fmt.endswith("d") else 0.0, fmt)))
    return format(x, fmt)


def print_report(res):
    print(f"\n{res['n_params'] / 1e6:.3g}M parameters, {res['world_size']} ranks, "
          f"{res['device']}, {res['steps']} steps; target: {res['baseline']}'s mean final "
          f"validation loss {_f(res['target_val_loss'], '.4f')} (sd {res['baseline_sd']:.4f})")
    head = (f"{'codec':15s} {'seeds':>5s} {'final val (sd)':>16s} {'vs base':>8s} "
            f"{'step ms':>8s} {'compute':>8s} {'exposed':>8s} {'tok/s':>8s} "
            f"{'reach: step':>11s} {'time s':>7s} {'speedup':>7s} "
            f"{'1%: step':>8s} {'time s':>7s} {'speedup':>7s} {'last 5th':>8s} {'vNMSE':>8s}")
    print(head)
    for codec, r in res["codecs"].items():
        reach, r1 = r.get("reach"), r.get("reach_1pct")
        vn = [v["vnmse"] for v in r["vnmse"]]
        print(f"{codec:15s} {len(r['seeds']):5d} "
              f"{r['final_val_mean']:9.4f} ({r['final_val_sd']:.4f}) "
              f"{_f(r.get('loss_gap') and 100 * r['loss_gap'], '+7.2f')}% "
              f"{r['step_ms']:8.1f} {_f(r['compute_ms'], '8.1f')} {_f(r['comm_ms'], '8.1f')} "
              f"{r['tokens_per_s']:8.0f} "
              f"{_f(reach and reach['step'], '11d')} {_f(reach and reach['training_s'], '7.1f')} "
              f"{_f(r.get('speedup_reach'), '7.2f')} "
              f"{_f(r1 and r1['step'], '8d')} {_f(r1 and r1['training_s'], '7.1f')} "
              f"{_f(r.get('speedup_reach_1pct'), '7.2f')} "
              f"{_f(r['fell_over_last_fifth'] and 100 * r['fell_over_last_fifth'], '7.2f')}% "
              f"{_f(statistics.mean(vn) if vn else None, '8.2e')}")
    for codec, r in res["codecs"].items():
        if codec != res["baseline"] and r.get("paired_gaps"):
            se = r.get("paired_gap_se")
            spread = ("" if se is None else
                      f"; mean {100 * r['paired_gap_mean']:+.2f} %, standard error "
                      f"{100 * se:.2f} % ({r['seeds_to_resolve']} seeds at this spread put "
                      f"the mean two standard errors from zero)")
            print(f"{codec}: final validation loss against {res['baseline']}'s at the same seed: "
                  + ", ".join(f"{100 * g:+.2f} %" for g in r["paired_gaps"]) + spread
                  + f" (allowed: {100 * r['loss_allowance']:.2f} % on the means)")
    if "bound" in res:
        b = res["bound"]
        print(f"compute-only step {b['compute_ms']:.1f} ms, {res['baseline']}'s exposed "
              f"communication {b['baseline_comm_ms']:.1f} ms: a codec sending "
              f"{BYTES_RATIO:.2f}x its bytes can at most be {b['speedup_bound']:.2f}x sooner")


def write_outputs(res, json_path, png_path):
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {json_path}")
    if png_path:
        plot(res, png_path)
        print(f"wrote {png_path}")


def plot(res, png):
    """Validation loss against steps and against training time (every
    codec's seed-mean curve, the target as a dashed line), and the hook's
    measured vNMSE along the run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    for codec, r in res["codecs"].items():
        mc = r["mean_curve"]
        label = f"{codec} ({len(r['seeds'])} seed{'s' if len(r['seeds']) > 1 else ''})"
        axes[0].plot([p["step"] for p in mc], [p["val_loss"] for p in mc], marker="o",
                     ms=2.5, lw=1.2, label=label)
        axes[1].plot([p["training_s"] / 60 for p in mc], [p["val_loss"] for p in mc],
                     marker="o", ms=2.5, lw=1.2, label=label)
        vn = [v for v in r["vnmse"] if v["vnmse"] > 0]
        if vn:
            axes[2].plot([v["step"] for v in vn], [v["vnmse"] for v in vn], marker="o",
                         ms=2.5, lw=1.2, label=label)
    axes[2].set_yscale("log")
    axes[2].set_xlabel("step")
    axes[2].set_ylabel("vNMSE of the step's all-reduce")
    axes[2].grid(alpha=0.3, which="both")
    axes[2].legend(fontsize=8)
    for ax, xlabel in zip(axes[:2], ("step", "training time (min)")):
        if res["target_val_loss"] is not None:
            ax.axhline(res["target_val_loss"], ls="--", lw=0.8, color="gray",
                       label=f"{res['baseline']}'s final (mean)")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss (nats / byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        # the last stretch, where the codecs meet the target, fills the plot
        tail = [p["val_loss"] for r in res["codecs"].values()
                for p in r["mean_curve"][len(r["mean_curve"]) // 3:]]
        if tail:
            ax.set_ylim(min(tail) - 0.02, max(tail) + 0.05)
    fig.suptitle(f"{res['n_params'] / 1e6:.3g}M-parameter LLaMA, {res['world_size']} ranks, "
                 f"{res['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------- command line
def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    passthrough = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train every codec and seed, then report")
    r.add_argument("--nproc", type=int, default=2, help="ranks (one GPU each)")
    r.add_argument("--launcher", choices=["torchrun", "mpiexec"], default="torchrun")
    r.add_argument("--preset", default="0.8b", help="train_lm.py's model preset")
    r.add_argument("--steps", type=int, default=300,
                   help="fixed in advance; a codec given as CODEC@N trains N steps instead")
    r.add_argument("--codecs", default="bf16,dynamiq:5")
    r.add_argument("--seeds", default="0,1,2")
    r.add_argument("--reference", default="fp32:0",
                   help="CODEC:SEED runs after the others ('' for none)")
    r.add_argument("--eval-every", type=int, default=10)
    r.add_argument("--probe-every", type=int, default=10,
                   help="a compute-only probe every so many steps")
    r.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    r.add_argument("--run-timeout", type=float, default=None, help="seconds a run may take")
    r.add_argument("--out", required=True, help="folder of the runs' JSON")
    for q in (r, sub.add_parser("report", help="the comparison of finished runs")):
        q.add_argument("--baseline", default="bf16", help="the codec whose final loss is the goal")
        q.add_argument("--json", help="write the comparison here")
        q.add_argument("--png", help="draw the curves here (needs matplotlib)")
    sub.choices["report"].add_argument("sources", nargs="+",
                                       help="folders of run_*.json, or runs JSON files")
    args = p.parse_args(argv)
    if args.cmd == "run":
        if args.nproc < 1 or args.steps < 1 or args.eval_every < 1 or args.probe_every < 1:
            p.error("--nproc, --steps, --eval-every and --probe-every must be positive")
        return cmd_run(args, passthrough)
    if passthrough:
        p.error("report takes no train_lm.py arguments")
    result = report(load_runs(args.sources), args.baseline)
    print_report(result)
    write_outputs(result, args.json, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
