"""The cost model against what was measured, and where compression pays
(``python -m research model-check`` / ``model-map FILE``; docs/cost-model.md).

Every two-GPU bench run in docs/results (a JSON document with ``meta`` and
``rows``, two ranks) is read. The link of a run follows from its NCCL
environment (``NCCL_P2P_DISABLE`` and ``NCCL_SHM_DISABLE``: sockets;
``NCCL_P2P_DISABLE`` alone: shared memory; neither: NVLink). Its link's
alpha and beta are fitted to **NCCL's own all-reduce rows of the same run**
(two ranks: ``t = c + S / beta``, least squares on the relative error; a run
without NCCL rows takes the nearest run of its link), and our point-to-point
runs at that beta times the ratio the raw NCCL probe measured between a
send/receive and the all-reduce of the same bytes (``P2P_EFFICIENCY``). No
parameter is fitted to a compressed row: those predictions are out of sample.
"""
from __future__ import annotations

import glob
import json
import math
import os
import sys
from pathlib import Path

from dynamiq_mpi.cost_model.io import write_json
from dynamiq_mpi.cost_model.model import (HOST_MODES, Cluster, Link, codec_cost,
                                          compressed_allreduce, copy_rate, kernel_ns, load_rates,
                                          parse_bandwidth, planner_seconds, predict, wire_only)

# our point-to-point over the collective's rate on the same link and bytes (42 MB)
P2P_EFFICIENCY = {
    "nvlink": (241.4 / 239.2, "results/device_runs/p2p_probe_h200x2_2026-11-23.txt"),
    "shm": ({1: 25.5 / 28.4, 2: 28.9 / 28.4, 4: 29.9 / 28.4},
            "results/device_runs/p2p_comms_h200x2_2026-11-23.txt (1, 2, 4 communicators)"),
    "sockets": (11.6 / 15.2, "results/device_runs/p2p_probe_h200x2_2026-11-23.txt (tuned)"),
}
LANES_AUTO_SINCE = "2026-11-23T05:23"     # benchmarks.md 2.0f: 4 lanes on shared memory
CURRENT_CODE_SINCE = "2026-11-24"         # the runs whose kernels kernel_rates.json holds
AIM_FROM = 1 << 24


def _runs(node, where):
    if isinstance(node, dict):
        if "meta" in node and "rows" in node:
            yield where, node
        else:
            for k, v in node.items():
                yield from _runs(v, f"{where}/{k}")


def link_of(env):
    if env.get("NCCL_P2P_DISABLE") == "1" and env.get("NCCL_SHM_DISABLE") == "1":
        # at NCCL's default socket settings the all-reduce runs at ~3.6 GB/s, which
        # says nothing of the point-to-point's rate there, and no probe measured it
        tuned = "NCCL_SOCKET_NTHREADS" in env or "NCCL_NSOCKS_PERTHREAD" in env
        return "sockets" if tuned else "sockets-default"
    return "shm" if env.get("NCCL_P2P_DISABLE") == "1" else "nvlink"


def fit_nccl(rows):
    """(c seconds, beta bytes/s) minimising sum ((c + S g - t) / t)^2, g = 1/beta."""
    a11 = a12 = a22 = b1 = b2 = 0.0
    for s, t in rows:
        u, v = 1 / t, s / t
        a11, a12, a22, b1, b2 = a11 + u * u, a12 + u * v, a22 + v * v, b1 + u, b2 + v
    det = a11 * a22 - a12 * a12
    c, g = (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
    if c < 0:                            # keep the constant physical
        c, g = 0.0, b2 / a22
    return c, 1 / g


def codec_of(row):
    if row.get("fallback", "").startswith("bf16"):
        return "bf16", 16.0, None
    name = row["codec"]
    if name.startswith("dynamiq"):
        return "dynamiq", float(name.split(":")[1]), row.get("widths")
    mx = {"mxfp:e4m3": "mxfp8", "mxfp:e5m2": "mxfp8", "mxfp:e3m2": "mxfp6", "mxfp:e2m3": "mxfp6",
          "mxfp:e2m1": "mxfp4"}
    if name in mx:
        return mx[name], 0.0, None
    return (name, 16.0, None) if name == "bf16" else (None, None, None)


def collect(results_dir):
    """Every two-GPU run: (label, meta, link, NCCL fit or None, rows)."""
    runs = []
    for path in sorted(glob.glob(os.path.join(results_dir, "bench_*.json"))):
        doc = json.loads(Path(path).read_text())
        for where, run in _runs(doc, os.path.basename(path)):
            meta = run["meta"]
            if meta.get("ranks") != 2:
                continue
            env = meta.get("env", {})
            nccl = [(2 * r["count"], r["time_us"] * 1e-6) for r in run["rows"]
                    if r["codec"] == "nccl all-reduce"]
            runs.append({"label": where, "date": meta.get("date", ""), "link": link_of(env),
                         "env": env, "fit": fit_nccl(nccl) if len(nccl) >= 2 else None,
                         "nccl_rows": nccl, "rows": run["rows"],
                         # calls replayed as CUDA graphs: modelled as replays
                         "graphs": bool(meta.get("graphs") and (meta.get("graph_stats") or {})
                                        .get("replays") and not meta["graph_stats"].get("failed"))})
    for r in runs:                       # no reference rows: the nearest run of the link
        if r["fit"] is None:
            same = [o for o in runs if o["fit"] and o["link"] == r["link"]]
            if same:
                o = min(same, key=lambda o: abs(_stamp(o["date"]) - _stamp(r["date"])))
                r["fit"], r["fit_from"] = o["fit"], o["label"]
    return runs


def _stamp(date):
    import datetime
    try:
        return datetime.datetime.fromisoformat(date).timestamp()
    except ValueError:
        return 0.0


def lanes_of(run):
    if "DYNAMIQ_NCCL_LANES" in run["env"]:
        return int(run["env"]["DYNAMIQ_NCCL_LANES"])
    return 4 if run["link"] == "shm" and run["date"] >= LANES_AUTO_SINCE else 1


def check(results_dir, rates_name="h200", host="exact"):
    rates = load_rates(rates_name)
    out, skipped = [], {}
    for run in collect(results_dir):
        if run["fit"] is None:
            continue
        c, beta = run["fit"]
        if run["link"] not in P2P_EFFICIENCY:
            why = f"{run['link']}: no probe of the point-to-point rate against NCCL's"
            skipped[why] = skipped.get(why, 0) + sum(r["codec"] != "nccl all-reduce"
                                                     for r in run["rows"])
            continue
        eff = P2P_EFFICIENCY[run["link"]][0]
        eff = eff[lanes_of(run)] if isinstance(eff, dict) else eff
        link = Link(c / 2, beta * eff)   # the collective's constant over its two steps
        for r in run["rows"]:
            codec, bits, widths = codec_of(r)
            why = None
            if r["codec"] == "nccl all-reduce":
                continue
            if r.get("transport") != "nccl":
                why = f"transport {r.get('transport')} (host-staged or CUDA-aware MPI: not modelled)"
            elif r.get("ran", r.get("path", "compressed")) != "compressed":
                why = "native path"
            elif codec is None:
                why = f"codec {r['codec']} (array code on the GPU: not kernel-rated)"
            if why:
                skipped[why] = skipped.get(why, 0) + 1
                continue
            n_el = r["count"]
            probe = codec_cost(codec, bits, rates, n_el / 2, widths=widths)
            tiles = max(1, int(r.get("tiles_per_chunk") or 1))
            tile_bytes = n_el / 2 * probe.wire_bits / 8 / tiles * (1 + 1e-9)
            p = compressed_allreduce(2, n_el, lambda te: codec_cost(codec, bits, rates, te,
                                                                      widths=widths),
                                     lambda d: link, rates, "ring",
                                     "graph" if run["graphs"] else host, tile_bytes)
            meas = r["time_us"] * 1e-6
            out.append({"run": run["label"], "date": run["date"][:16], "link": run["link"],
                        "lanes": lanes_of(run), "codec": r["codec"], "elements": n_el,
                        "measured_us": meas * 1e6, "predicted_us": p["seconds"] * 1e6,
                        "error": p["seconds"] / meas - 1, "nccl_us": _nccl_at(run, n_el),
                        "current_code": run["date"] >= CURRENT_CODE_SINCE,
                        "device_us": p["device"] * 1e6, "host_us": p["host"] * 1e6})
    fits = [{"run": r["label"], "link": r["link"], "date": r["date"][:16],
             "c_us": r["fit"][0] * 1e6, "beta_GBps": r["fit"][1] / 1e9,
             "from": r.get("fit_from", "its own NCCL rows"),
             "nccl_max_error": max((abs(r["fit"][0] + s / r["fit"][1] - t) / t
                                    for s, t in r["nccl_rows"]), default=None)}
            for r in collect(results_dir) if r["fit"]]
    return {"rates": rates_name, "host": host, "rows": out, "fits": fits, "skipped": skipped,
            "summary": summarise(out)}


def _nccl_at(run, n_el):
    for s, t in run["nccl_rows"]:
        if s == 2 * n_el:
            return t * 1e6
    return None


def summarise(rows):
    groups = {}
    for r in rows:
        era = "2026-11-24" if r["current_code"] else "before 2026-11-24"
        for key in [(era, r["link"], "all sizes"), (era, r["link"], ">= 2^24"),
                    (era, "all", ">= 2^24")]:
            if key[2] == ">= 2^24" and r["elements"] < AIM_FROM:
                continue
            groups.setdefault(" / ".join(key), []).append(abs(r["error"]))
    return {k: {"rows": len(v), "mean_abs_error": sum(v) / len(v), "max_abs_error": max(v),
                "within_25pct": sum(e <= 0.25 for e in v)} for k, v in sorted(groups.items())}


# ------------------------------------------------------------------ where it pays

def _cluster(nodes, k, nic_gbps, nics, intra="400GB/s"):
    return Cluster(nodes, k, Link(2e-6, parse_bandwidth(intra)), Link(6e-6, nic_gbps * 1e9), nics)


def sanity_points(rates_name="h100-final"):
    rates = load_rates(rates_name)
    wire = wire_only(rates)
    cases = {"16 nodes x 8 GPUs, 2 x 200Gb/s NICs, NVLink 400 GB/s": _cluster(16, 8, 25, 2),
             "paper testbed: 4 nodes x 2 GPUs, NVLink NV4 56 GB/s, one 100Gb/s NIC":
                 _cluster(4, 2, 12.5, 1, "56GB/s")}
    out = {}
    for name, c in cases.items():
        for label, rs, host in (("wire only", wire, "graph"), ("kernels, host fixed", rates, "fixed"),
                                ("kernels, graph replay", rates, "graph")):
            p = predict(c, 1 << 28, rs, "dynamiq", 5.0, ("ring",), host)
            out.setdefault(name, {})[label] = {k: round(p[k]["speedup"], 2)
                                               for k in ("flat_ring", "levels_ring")}
    return out


def map_data(rates_name="h100-final", host="fixed"):
    rates = load_rates(rates_name)
    per_gpu = [1, 2, 3, 5, 8, 12.5, 20, 30, 50, 80, 125]
    panel_a = []
    for bw in per_gpu:                 # 16 nodes of 8, one NIC per GPU
        p = predict(_cluster(16, 8, bw, 8), 1 << 28, rates, host=host)
        panel_a.append({"per_gpu_GBps": bw, **{k: p[k]["speedup"] for k in p}})
    panel_c = []
    for bw in [3, 6.25, 12.5, 25, 50, 100]:   # the paper's shape: 2 GPUs and one NIC a node
        p = predict(_cluster(4, 2, bw, 1, "56GB/s"), 1 << 28, rates, host=host)
        panel_c.append({"nic_GBps": bw, "per_gpu_GBps": bw / 2, **{k: p[k]["speedup"] for k in p}})
    nodes = [2, 4, 8, 16, 32, 64, 128]
    grid = []
    for n in nodes:
        for bw in per_gpu:
            p = predict(_cluster(n, 8, bw, 8), 1 << 28, rates, topologies=("ring",), host=host)
            best = max(("nccl", "flat_ring", "levels_ring"), key=lambda k: p[k]["speedup"])
            grid.append({"nodes": n, "per_gpu_GBps": bw, "best": best,
                         "flat_ring": p["flat_ring"]["speedup"],
                         "levels_ring": p["levels_ring"]["speedup"]})
    return {"rates": rates_name, "host": host, "elements": 1 << 28, "codec": "dynamiq:5",
            "speedup_16x8": panel_a, "paper_shape_4x2": panel_c, "winner": grid,
            "nodes": nodes, "per_gpu": per_gpu}


def _plain_ticks(a, xs, ys):
    from matplotlib.ticker import NullFormatter
    a.set_xticks(xs, [f"{x:g}" for x in xs], fontsize=7)
    lo, hi = a.get_ylim()
    a.set_yticks([y for y in ys if lo <= y <= hi], [f"{y:g}" for y in ys if lo <= y <= hi])
    a.xaxis.set_minor_formatter(NullFormatter()), a.yaxis.set_minor_formatter(NullFormatter())


def draw_map(data, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.8))
    styles = {"flat_ring": ("C1", "-"), "flat_butterfly": ("C1", ":"),
              "levels_ring": ("C2", "-"), "levels_butterfly": ("C2", ":")}
    for a, key, xkey, title in ((ax[0], "speedup_16x8", "per_gpu_GBps",
                                 "16 nodes x 8 GPUs, a NIC per GPU, NVLink 400 GB/s"),
                                (ax[2], "paper_shape_4x2", "per_gpu_GBps",
                                 "4 nodes x 2 GPUs, one NIC a node, NVLink 56 GB/s")):
        rows = data[key]
        for k, (color, ls) in styles.items():
            a.plot([r[xkey] for r in rows], [r[k] for r in rows], color=color, ls=ls,
                   marker="o", ms=3, label=k.replace("_", " "))
        a.axhline(1.0, color="k", lw=1, label="NCCL BF16 ring")
        a.set_xscale("log"), a.set_yscale("log")
        _plain_ticks(a, [r[xkey] for r in rows], [0.2, 0.3, 0.5, 0.7, 1, 1.5, 2, 3, 5])
        a.set_xlabel("inter-node bandwidth per GPU (GB/s)"), a.set_ylabel("speed-up over NCCL")
        a.set_title(title, fontsize=9), a.grid(True, which="both", alpha=0.3), a.legend(fontsize=7)
    names = ["nccl", "flat_ring", "levels_ring"]
    z = [[names.index(next(g["best"] for g in data["winner"]
                           if g["nodes"] == n and g["per_gpu_GBps"] == bw))
          for bw in data["per_gpu"]] for n in data["nodes"]]
    ax[1].pcolormesh(range(len(data["per_gpu"]) + 1), range(len(data["nodes"]) + 1), z,
                     cmap=ListedColormap(["0.85", "C1", "C2"]), vmin=0, vmax=2)
    for i, n in enumerate(data["nodes"]):
        for j, bw in enumerate(data["per_gpu"]):
            g = next(g for g in data["winner"] if g["nodes"] == n and g["per_gpu_GBps"] == bw)
            s = max(g["flat_ring"], g["levels_ring"])
            ax[1].text(j + 0.5, i + 0.5, f"{s:.1f}", ha="center", va="center", fontsize=6)
    ax[1].set_xticks([j + 0.5 for j in range(len(data["per_gpu"]))],
                     [f"{b:g}" for b in data["per_gpu"]], fontsize=7)
    ax[1].set_yticks([i + 0.5 for i in range(len(data["nodes"]))], data["nodes"])
    ax[1].set_xlabel("inter-node bandwidth per GPU (GB/s), a NIC per GPU")
    ax[1].set_ylabel("nodes of 8 GPUs")
    ax[1].set_title("fastest: grey NCCL, orange flat ring, green levels (ring);\n"
                    "number: best compressed speed-up over NCCL", fontsize=9)
    fig.suptitle(f"Predicted, 2^28 BF16 elements per GPU, DynamiQ 5 bits, kernels "
                 f"{data['rates']}, host {data['host']} (python -m research model-map)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ command line

def _default_results():
    return str(Path(__file__).resolve().parents[1] / "docs" / "results")


def _print_check(res, out):
    out.write("link fits (NCCL's all-reduce rows, two ranks: t = c + S / beta):\n")
    for f in res["fits"]:
        err = "" if f["nccl_max_error"] is None else f", NCCL rows within {f['nccl_max_error']:.0%}"
        out.write(f"  {f['run']:58s} {f['link']:7s} c {f['c_us']:7.1f} us  beta "
                  f"{f['beta_GBps']:6.1f} GB/s{err}\n")
    out.write(f"\ncompressed rows (kernels {res['rates']}, host {res['host']}):\n")
    out.write(f"  {'run':46s} {'link':7s} {'codec':30s} {'log2':>4s} {'measured':>9s} "
              f"{'predicted':>9s} {'error':>7s}\n")
    for r in res["rows"]:
        out.write(f"  {r['run'][:46]:46s} {r['link']:7s} {r['codec'][:30]:30s} "
                  f"{math.log2(r['elements']):4.0f} {r['measured_us']:8.0f}u "
                  f"{r['predicted_us']:8.0f}u "
                  f"{r['error']:+7.1%}\n")
    out.write("\nsummary (|error|):\n")
    for k, s in res["summary"].items():
        out.write(f"  {k:42s} {s['rows']:3d} rows  mean {s['mean_abs_error']:5.1%}  max "
                  f"{s['max_abs_error']:5.1%}  within 25 %: {s['within_25pct']}\n")
    for why, count in res["skipped"].items():
        out.write(f"  not predicted: {count} rows, {why}\n")


def add_arguments(p):
    p.add_argument("--results", default=None, help="docs/results (default: this checkout's)")
    p.add_argument("--json", default=None, help="write the result as JSON ('-': stdout)")
    p.add_argument("--gpu", default="h100-final",
                   help="kernel rates: a set of kernel_rates.json (h100, h200, h100-final, "
                        "h200-final); the check takes h200 for h100-final (the runs' GPUs)")
    p.add_argument("--host", choices=HOST_MODES, default="fixed",
                   help="host time per call (the check takes exact for fixed: the runs' layout)")


def run(args, out=None):
    out = out or sys.stdout
    results = args.results or _default_results()
    doc = {}
    if args.check:
        rates = args.gpu if args.gpu != "h100-final" else "h200"   # the runs were on H200s
        host = args.host if args.host != "fixed" else "exact"     # the layout they ran
        doc["check"] = check(results, rates, host)
        doc["sanity"] = sanity_points()
        if args.json != "-":
            _print_check(doc["check"], out)
            out.write("\nthe issue's two sanity points, 2^28, DynamiQ 5 bits (speed-up over NCCL):\n")
            for name, v in doc["sanity"].items():
                out.write(f"  {name}\n")
                for label, s in v.items():
                    out.write(f"    {label:24s} flat ring {s['flat_ring']:.2f}x, levels ring "
                              f"{s['levels_ring']:.2f}x\n")
    if args.map:
        doc["map"] = map_data(args.gpu, args.host)
        draw_map(doc["map"], args.map)
        Path(args.map).with_suffix(".json").write_text(json.dumps(doc["map"], indent=1) + "\n")
        if args.json != "-":
            out.write(f"wrote {args.map} and {Path(args.map).with_suffix('.json')}\n")
    if args.json:
        write_json(doc, args.json, out)
    return doc


# ------------------------------------------------------------------ kernels inside a call

GRAPH_RUN = "graph_host_time_h100_2026-11-25.json"
NORMAL_WIDTHS = {"4": 15628, "8": 756}   # the planner on standard normal BF16 at 5 bits (CPU)


def calibrate_in_call(results_dir, rates_name="h100"):
    """How much slower the kernels run inside a whole call than alone: a
    two-rank call replayed as one CUDA graph on one H100 (no host, no NCCL;
    docs/benchmarks.md 2.0j), 2^23 against 2^26 elements, so that the fixed
    costs cancel, over the same difference of the model's per-element device
    work (both ranks' kernels and the simulated transport's copies)."""
    doc = json.loads(Path(results_dir, GRAPH_RUN).read_text())
    meas = {r["log2"]: r["device_ms_per_call"] * 1e-3 for r in doc["rows"]
            if r["mode"].startswith("graph")}
    rates = dict(load_rates(rates_name), in_call_factor=1.0)

    def per_element(length):
        c = codec_cost("dynamiq", 5.0, rates, length / 2, widths=NORMAL_WIDTHS)
        work = ((c.compress + c.dar + 2 * c.decode) * length / 2
                + length * kernel_ns(rates, "stats", length) * 1e-9)
        work += 2 * (length / 2) * c.wire_bits / 8 * 2 / copy_rate(rates)    # two messages copied
        return 2 * work, 2 * planner_seconds(rates, length)                  # both ranks

    (w23, p23), (w26, p26) = per_element(1 << 23), per_element(1 << 26)
    return {"factor": (meas[26] - meas[23] - (p26 - p23)) / (w26 - w23),
            "measured_ms": {"2^23": meas[23] * 1e3, "2^26": meas[26] * 1e3},
            "model_per_element_ms": {"2^23": w23 * 1e3, "2^26": w26 * 1e3},
            "source": f"results/{GRAPH_RUN}", "rates": rates_name}
