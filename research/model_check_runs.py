"""The cost model against every recorded compressed call from 2^20 elements at
two and four ranks (docs/cost-model.md, "Predicted against measured").

    python -m research model-check-runs [--json docs/results/cost_model_check_2026-11-28.json]

Runs read (docs/results, docs/benchmarks.md sections 2, 4 and 5):

* 2x H200, 2026-11-24, the exact layout (the plan's header read back):
  ``bench_{paths,defaults}_{nvlink,shm}_h200x2_2026-11-24.json``,
  ``bench_paths_sockets_h200x2_2026-11-24.json``; kernel set ``h200``, host ``exact``;
* 4x H100, 2026-11-26, the fixed layout, eager calls each read for the bench's
  report: ``bench_sockets_h100x4_2026-11-26.json``,
  ``bench_flat_nvlink_h100x4_2026-11-26.json``; kernel set ``h100``, host ``eager``;
* 2x H100, 2026-11-26, the same call replayed as a CUDA graph (host ``graph``):
  ``device_runs/graphs_h100_2026-11-26.txt``, call 5 (wall per call);
* 4x H200, 2026-11-28, graphs replaying (host ``graph``), kernel set ``h200``:
  ``stats_direct_ab_h200x4_2026-11-28/{shm,sockets}_{steps,direct}.json``.

What is fitted, and to what:

* each run's link: NCCL's own all-reduce rows of the same run, at its rank
  count, ``t = c + 2(n-1)/n S / beta`` (least squares on the relative error),
  a message's latency ``c / (2(n-1))``; runs without NCCL rows take the run of
  their link minutes apart; our point-to-point at ``beta`` times the probed
  ratio of model_check.py (``P2P_EFFICIENCY``);
* the host's time per message at four ranks: the 4x H100 NVLink run's own
  compressed-path rows of 2^20 elements, which DynamiQ sends as BF16 (below
  its ``small_input``; device work under 0.1 ms, so these rows time the
  host); those two rows are in sample and left out of the summary.  At two
  ranks the profiled 46 us of ``kernel_rates.json`` is used unchanged.

No DynamiQ row is fitted: every DynamiQ prediction is out of sample.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from dynamiq_mpi.cost_model import model as cm

from . import model_check as mc

ROOT = Path(__file__).resolve().parents[1]

FROM = 1 << 20
RUNS = [  # file, kernel set, host mode, the run whose NCCL rows fit the link
    ("bench_paths_nvlink_h200x2_2026-11-24.json", "h200", "exact", None),
    ("bench_paths_shm_h200x2_2026-11-24.json", "h200", "exact", None),
    ("bench_paths_sockets_h200x2_2026-11-24.json", "h200", "exact", None),
    ("bench_defaults_nvlink_h200x2_2026-11-24.json", "h200", "exact",
     "bench_paths_nvlink_h200x2_2026-11-24.json"),
    ("bench_defaults_shm_h200x2_2026-11-24.json", "h200", "exact",
     "bench_paths_shm_h200x2_2026-11-24.json"),
    ("bench_flat_nvlink_h100x4_2026-11-26.json", "h100", "eager", None),
    ("bench_sockets_h100x4_2026-11-26.json", "h100", "eager", None),
    # 4x H200, 2026-11-28, graphs on (replays): the statistics' exchange A/B
    ("stats_direct_ab_h200x4_2026-11-28/shm_steps.json", "h200", "graph", None),
    ("stats_direct_ab_h200x4_2026-11-28/shm_direct.json", "h200", "graph", None),
    ("stats_direct_ab_h200x4_2026-11-28/sockets_steps.json", "h200", "graph", None),
    ("stats_direct_ab_h200x4_2026-11-28/sockets_direct.json", "h200", "graph", None),
]
# Runs made before bench recorded the statistics' exchange in its JSON:
# (ranks, bytes) up to which their statistics travelled directly (these ran
# it at every size, 2^26 elements' 2 MiB included)
STATS_DIRECT_OF = {
    "stats_direct_ab_h200x4_2026-11-28/shm_direct.json": (8, 2 << 20),
    "stats_direct_ab_h200x4_2026-11-28/sockets_direct.json": (8, 2 << 20),
}
HOST_FIT_RUN = "bench_flat_nvlink_h100x4_2026-11-26.json"   # its BF16 rows time the host
# 2x H100 NV18, 2026-11-26, graphs=True, path="compressed", out= reused, no report,
# 30 back-to-back calls, median of 5 rounds: wall per call (host 50 / 62 us)
GRAPH_SOURCE = "results/device_runs/graphs_h100_2026-11-26.txt (call 5)"
GRAPH_ROWS = [(1 << 20, 56.0), (1 << 23, 321.0)]
GRAPH_LINK_RUN = "bench_flat_nvlink_h100x4_2026-11-26.json"  # NV18 H100s, NCCL rows


def fit_link(doc):
    """(c seconds, bus beta bytes/s) of NCCL's rows at the run's rank count."""
    n = doc["meta"]["ranks"]
    f = 2 * (n - 1) / n
    rows = [(f * 2 * r["count"], r["time_us"] * 1e-6) for r in doc["rows"]
            if r["codec"] == "nccl all-reduce"]
    return mc.fit_nccl(rows)


def _p2p(doc):
    meta = doc["meta"]
    link = mc.link_of(meta["env"])
    eff = mc.P2P_EFFICIENCY[link][0]
    run = {"env": meta["env"], "link": link, "date": meta["date"]}
    return link, (eff[mc.lanes_of(run)] if isinstance(eff, dict) else eff)


def _compressed_rows(doc):
    for r in doc["rows"]:
        if (r["codec"] != "nccl all-reduce" and r.get("ran") == "compressed"
                and r.get("hierarchy", "flat") == "flat" and r.get("transport") == "nccl"):
            yield r


def run_stats_direct(meta):
    """Up to how many ranks and bytes a run's statistics travelled directly
    (bench records it; runs without the field took the ring's steps)."""
    return (meta.get("stats_direct_ranks", 2), meta.get("stats_direct_bytes", 0))


def predict_row(r, n, link, rates, host, stats_direct=(2, 0)):
    codec, bits, widths = mc.codec_of(r)
    ne = r["count"]
    tiles = max(1, int(r.get("tiles_per_chunk") or 1))
    probe = cm.codec_cost(codec, bits, rates, ne / n, widths=widths)
    tile_bytes = ne / n * probe.wire_bits / 8 / tiles * (1 + 1e-9)
    # the all-gather the run recorded; runs without the field ran the ring,
    # and the butterfly's levels step by step
    return cm.compressed_allreduce(
        n, ne, lambda te: cm.codec_cost(codec, bits, rates, te, widths=widths),
        lambda d: link, rates, r.get("topology", "ring"), host, tile_bytes,
        stats_direct=stats_direct, gather=r.get("gather") or "ring", grouped="gather" in r)


def _rates(name, per_hop_us=None):
    rates = cm.load_rates(name)
    if per_hop_us is not None:
        rates["host_us"] = dict(rates["host_us"], per_hop=per_hop_us)
    return rates


def fit_host_per_message(results):
    """Host us per message at four ranks: the value that minimises the squared
    relative error of the BF16-encoded compressed rows of ``HOST_FIT_RUN``."""
    doc = json.loads(Path(results, HOST_FIT_RUN).read_text())
    n = doc["meta"]["ranks"]
    c, beta = fit_link(doc)
    _, eff = _p2p(doc)
    link = cm.Link(c / (2 * (n - 1)), beta * eff)
    rows = [r for r in _compressed_rows(doc) if mc.codec_of(r)[0] == "bf16"]
    direct = run_stats_direct(doc["meta"])

    def loss(p):
        rates = _rates("h100", p)
        return sum((predict_row(r, n, link, rates, "eager", direct)["seconds"] * 1e6
                    / r["time_us"] - 1) ** 2 for r in rows)
    lo, hi = 0.0, 500.0                  # golden-section search, the loss is convex in p
    g = (math.sqrt(5) - 1) / 2
    for _ in range(60):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        lo, hi = (lo, b) if loss(a) < loss(b) else (a, hi)
    return round((lo + hi) / 2, 1), [(r["topology"], r["count"], r["time_us"]) for r in rows]


def check(results=None):
    results = results or str(ROOT / "docs" / "results")
    per_hop_4, host_rows = fit_host_per_message(results)
    out, fits = [], []
    for fname, kernels, host, fit_from in RUNS:
        doc = json.loads(Path(results, fname).read_text())
        src = json.loads(Path(results, fit_from).read_text()) if fit_from else doc
        n = doc["meta"]["ranks"]
        c, beta = fit_link(src)
        link_name, eff = _p2p(doc)
        link = cm.Link(c / (2 * (n - 1)), beta * eff)
        rates = _rates(kernels, per_hop_4 if n > 2 else None)
        fits.append({"run": fname, "ranks": n, "link": link_name, "device": doc["meta"]["device"],
                     "date": doc["meta"]["date"][:10], "c_us": c * 1e6, "beta_GBps": beta / 1e9,
                     "p2p_efficiency": eff, "from": fit_from or "its own NCCL rows",
                     "host_per_message_us": rates["host_us"]["per_hop"]})
        direct = STATS_DIRECT_OF.get(fname) or run_stats_direct(doc["meta"])
        for r in _compressed_rows(doc):
            p = predict_row(r, n, link, rates, host, direct)
            in_sample = fname == HOST_FIT_RUN and mc.codec_of(r)[0] == "bf16"
            out.append(_row(fname, doc["meta"], link_name, n, r["codec"], r.get("topology"),
                            r["count"], r["time_us"], p, host, kernels, in_sample,
                            bool(r.get("fallback"))))
    gdoc = json.loads(Path(results, GRAPH_LINK_RUN).read_text())
    c, beta = fit_link(gdoc)
    link = cm.Link(c / (2 * (gdoc["meta"]["ranks"] - 1)), beta * mc.P2P_EFFICIENCY["nvlink"][0])
    rates = _rates("h100")
    for ne, wall in GRAPH_ROWS:
        codec = "dynamiq:5" if ne >= 1 << 21 else "bf16"
        row = {"codec": codec, "count": ne, "topology": "ring", "tiles_per_chunk": 1,
               "fallback": "" if ne >= 1 << 21 else "bf16"}
        p = predict_row(row, 2, link, rates, "graph")
        out.append(_row(GRAPH_SOURCE, {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-26"},
                        "nvlink", 2, "dynamiq:5", "ring", ne, wall, p, "graph", "h100", False,
                        ne < 1 << 21))
    return {"from_elements": FROM, "host_per_message_4_ranks_us": per_hop_4,
            "host_fit_rows": host_rows, "fits": fits, "rows": out, "summary": summarise(out),
            "summary_2^20_to_2^24": summarise(out, hi=1 << 24)}


def _row(run, meta, link, n, codec, topo, count, measured, p, host, kernels, in_sample, bf16):
    return {"run": run, "device": meta["device"], "date": meta["date"][:10], "link": link,
            "ranks": n, "codec": codec, "sent_as": "bf16" if bf16 else codec, "topology": topo,
            "elements": count, "log2": round(math.log2(count)), "host": host, "kernels": kernels,
            "measured_us": measured, "predicted_us": p["seconds"] * 1e6,
            "error": p["seconds"] * 1e6 / measured - 1, "device_us": p["device"] * 1e6,
            "host_us": p["host"] * 1e6, "in_sample": in_sample}


def summarise(rows, lo=FROM, hi=None):
    groups = {}
    for r in rows:
        if r["in_sample"] or r["elements"] < lo or (hi and r["elements"] > hi):
            continue
        for key in (f"{r['link']}, {r['ranks']} ranks", "all"):
            groups.setdefault(key, []).append(abs(r["error"]))
    return {k: {"rows": len(v), "mean_abs_error": sum(v) / len(v), "max_abs_error": max(v),
                "within_25pct": sum(e <= 0.25 for e in v)} for k, v in sorted(groups.items())}


def print_table(res, out=sys.stdout):
    out.write(f"host per message at 4 ranks: {res['host_per_message_4_ranks_us']} us "
              f"(fitted to {res['host_fit_rows']})\n")
    for f in res["fits"]:
        out.write(f"  link {f['run']:46s} {f['ranks']} ranks {f['link']:7s} c {f['c_us']:7.1f} us "
                  f"beta {f['beta_GBps']:6.1f} GB/s x {f['p2p_efficiency']:.2f}\n")
    out.write(f"{'link':7s} {'n':>2s} {'log2':>4s} {'codec':22s} {'topo':9s} {'host':6s} "
              f"{'measured':>9s} {'predicted':>9s} {'error':>7s}\n")
    for r in res["rows"]:
        if r["elements"] < FROM:
            continue
        mark = "  (in sample)" if r["in_sample"] else ""
        out.write(f"{r['link']:7s} {r['ranks']:2d} {r['log2']:4d} {r['codec'][:22]:22s} "
                  f"{r['topology']:9s} {r['host']:6s} {r['measured_us']:8.0f}u "
                  f"{r['predicted_us']:8.0f}u {r['error']:+7.1%}{mark}\n")
    for title, key in (("from 2^20", "summary"), ("2^20 to 2^24", "summary_2^20_to_2^24")):
        out.write(f"{title} (out of sample):\n")
        for k, s in res[key].items():
            out.write(f"  {k:18s} {s['rows']:3d} rows  mean {s['mean_abs_error']:5.1%}  max "
                      f"{s['max_abs_error']:5.1%}  within 25 %: {s['within_25pct']}\n")


def add_arguments(p):
    p.add_argument("--results", default=None, help="docs/results (default: this checkout's)")
    p.add_argument("--json", default=None, help="write the result as JSON")


def run(args):
    res = check(args.results)
    print_table(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return res
