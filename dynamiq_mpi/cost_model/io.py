"""``python -m dynamiq_mpi model``, the cost model's command (``model.py`` is the
model): its arguments, the cluster, call and rates they name, the predictions
and sweeps it runs and what it prints and writes (the table, the JSON)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .model import (DEFAULT_TILE_BYTES, HOST_MODES, Cluster, Link, load_rates, parse_bandwidth,
                    parse_count, parse_time, predict, wire_only)


def add_arguments(p):
    g = p.add_argument_group("cluster")
    g.add_argument("--nodes", default="2", help="node count N (default 2)")
    g.add_argument("--gpus-per-node", default="8", help="GPUs per node K (default 8)")
    g.add_argument("--intra", default="400GB/s",
                   help="one GPU's NVLink bus bandwidth per direction (default 400GB/s)")
    g.add_argument("--inter", default="50GB/s",
                   help="one NIC per direction, e.g. 400Gb/s or 50GB/s (default 50GB/s)")
    g.add_argument("--nics-per-node", default=None, help="NICs per node (default: K)")
    g.add_argument("--intra-latency", default="2us", help="per NVLink step (default 2us)")
    g.add_argument("--inter-latency", default="6us", help="per network message (default 6us)")
    g.add_argument("--launch", default="10us", help="a collective's fixed cost (default 10us)")
    g.add_argument("--p2p-efficiency", type=float, default=1.0,
                   help="our point-to-point's share of the collective's network rate (default 1)")
    g = p.add_argument_group("call")
    g.add_argument("--elements", default="2^28", help="elements per rank (2^28, 268435456, 256Mi)")
    g.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    g.add_argument("--codec", default="dynamiq", help="dynamiq, bf16, exact, mxfp8, mxfp6, mxfp4")
    g.add_argument("--bits", type=float, default=5.0, help="DynamiQ's budget, statistics included")
    g.add_argument("--topology", choices=["ring", "butterfly", "both"], default="both")
    g.add_argument("--tile-bytes", default=str(DEFAULT_TILE_BYTES))
    g.add_argument("--gather", choices=["ring", "doubling"], default="ring",
                   help="the compressed all-gather's schedule ($DYNAMIQ_GATHER; default ring)")
    g = p.add_argument_group("model")
    g.add_argument("--gpu", default="h100-final",
                   help="kernel rates: a set of kernel_rates.json (h100, h200, h100-final, "
                        "h200-final) or a `python -m research kernels --json` file")
    g.add_argument("--host", choices=HOST_MODES, default="fixed",
                   help="host time per call: exact (the plan's header read back, as measured "
                        "on 2026-11-24), fixed (no host read nor report: back-to-back calls "
                        "overlap), eager (no host read, but each call waited for, as with a "
                        "report), graph (a replayed CUDA graph, the default of steady calls)")
    g.add_argument("--host-per-message", default=None,
                   help="host time per message of an eager call (default 46us, profiled at "
                        "two ranks; 4x H100 eager calls measured ~100us)")
    g.add_argument("--no-kernels", action="store_true",
                   help="wire only: no kernel, statistics, planner or host time")
    g = p.add_argument_group("output")
    g.add_argument("--json", default=None, help="write the prediction(s) as JSON ('-': stdout)")
    g.add_argument("--sweep", default=None,
                   help="PARAM=v1,v2,...: one row per value (inter, intra, nodes, gpus-per-node, "
                        "nics-per-node, elements, bits)")
    g.add_argument("--plot", default=None, help="with --sweep: speed-up over NCCL as a PNG")


_SWEEPABLE = {"inter": "inter", "intra": "intra", "nodes": "nodes", "gpus-per-node": "gpus_per_node",
              "nics-per-node": "nics_per_node", "elements": "elements", "bits": "bits"}


def _rates_for(args):
    rates = load_rates(args.gpu)
    if getattr(args, "host_per_message", None):
        rates["host_us"] = dict(rates["host_us"], per_hop=parse_time(args.host_per_message) * 1e6)
    return wire_only(rates) if args.no_kernels else rates


def _setup(args, overrides=None):
    v = {k: getattr(args, k) for k in ("inter", "intra", "nodes", "gpus_per_node",
                                       "nics_per_node", "elements", "bits")}
    v.update(overrides or {})
    k = int(v["gpus_per_node"])
    c = Cluster(nodes=int(v["nodes"]), gpus_per_node=k,
                intra=Link(parse_time(args.intra_latency), parse_bandwidth(v["intra"])),
                nic=Link(parse_time(args.inter_latency), parse_bandwidth(v["inter"])),
                nics_per_node=int(v["nics_per_node"] or k), launch=parse_time(args.launch),
                p2p_efficiency=args.p2p_efficiency)
    if c.nodes < 1 or k < 1 or c.nics_per_node < 1:
        raise SystemExit("--nodes, --gpus-per-node and --nics-per-node must be >= 1")
    return c, parse_count(v["elements"]), float(v["bits"])


def _predict_args(args, rates, overrides=None):
    c, elements, bits = _setup(args, overrides)
    topos = ("ring", "butterfly") if args.topology == "both" else (args.topology,)
    in_bytes = {"bf16": 2, "fp16": 2, "fp32": 4}[args.dtype]
    res = predict(c, elements, rates, args.codec, bits, topos, args.host, in_bytes,
                  parse_count(args.tile_bytes), gather=getattr(args, "gather", "ring"))
    return c, elements, bits, res


def _describe(c, elements, bits, args, rates):
    per_gpu = c.nic.beta * min(c.nics_per_node, c.gpus_per_node) / c.gpus_per_node
    return (f"{c.nodes} node(s) x {c.gpus_per_node} GPU(s) = {c.ranks} ranks; NVLink "
            f"{c.intra.beta / 1e9:g} GB/s per GPU; {c.nics_per_node} NIC(s) x {c.nic.beta / 1e9:g} "
            f"GB/s per node ({per_gpu / 1e9:g} GB/s per GPU)\n{elements} {args.dtype} elements "
            f"per rank ({elements * (4 if args.dtype == 'fp32' else 2) / 2 ** 20:g} MiB); codec "
            f"{args.codec}{':%g' % bits if args.codec == 'dynamiq' else ''}; kernels "
            f"{'none' if args.no_kernels else rates['name']}; host {args.host}")


def _inputs(c, elements, bits, args, rates):
    return {"nodes": c.nodes, "gpus_per_node": c.gpus_per_node, "nics_per_node": c.nics_per_node,
            "intra_GBps": c.intra.beta / 1e9, "nic_GBps": c.nic.beta / 1e9,
            "intra_latency_us": c.intra.alpha * 1e6, "inter_latency_us": c.nic.alpha * 1e6,
            "launch_us": c.launch * 1e6, "p2p_efficiency": c.p2p_efficiency, "elements": elements,
            "dtype": args.dtype, "codec": args.codec, "bits": bits, "kernels": rates["name"],
            "no_kernels": args.no_kernels, "host": args.host}


def _table(res, out):
    out.write(f"{'call':18s} {'time':>10s} {'vs NCCL':>8s}  notes\n")
    for key, r in res.items():
        name = {"nccl": "NCCL BF16 ring"}.get(key, key.replace("_", " "))
        notes = [r.get("note", "")] if r.get("note") else []
        if "rails" in r:
            notes.insert(0, f"in-node RS {r['in_node_reduce_scatter'] * 1e3:.3g} ms + rails "
                            f"{r['rails']['seconds'] * 1e3:.3g} ms + AG "
                            f"{r['in_node_all_gather'] * 1e3:.3g} ms")
        elif "parts" in r:
            notes.insert(0, f"device {r['device'] * 1e3:.3g} ms (wire {r['wire'] * 1e3:.3g}, "
                            f"kernels {r['kernels'] * 1e3:.3g}), host {r['host'] * 1e3:.3g} ms, "
                            f"{r['tiles']} tile(s)/chunk")
        out.write(f"{name:18s} {r['seconds'] * 1e3:8.3f}ms {r['speedup']:7.2f}x  "
                  f"{'; '.join(notes)}\n")


def write_json(doc, path, out):
    text = json.dumps(doc, indent=1)
    if path == "-":
        out.write(text + "\n")
    else:
        Path(path).write_text(text + "\n")


def plot_sweep(rows, param, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = list(range(len(rows)))
    for k in rows[0]:
        if k != "value":
            ax.plot(xs, [r[k]["speedup"] for r in rows], marker="o", label=k.replace("_", " "))
    ax.set_xticks(xs, [r["value"] for r in rows], fontsize=7)
    ax.set_xlabel(param), ax.set_ylabel("speed-up over NCCL"), ax.set_yscale("log")
    ax.grid(True, alpha=0.3), ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args, out=None):
    out = out or sys.stdout
    rates = _rates_for(args)
    if not args.sweep:
        c, elements, bits, res = _predict_args(args, rates)
        if args.json != "-":
            out.write(_describe(c, elements, bits, args, rates) + "\n")
            _table(res, out)
        if args.json:
            write_json({"inputs": _inputs(c, elements, bits, args, rates), "prediction": res},
                        args.json, out)
        return res
    param, _, values = args.sweep.partition("=")
    if param not in _SWEEPABLE or not values:
        raise SystemExit(f"--sweep {args.sweep!r}: write PARAM=v1,v2 with PARAM one of "
                         f"{', '.join(_SWEEPABLE)}")
    rows = []
    for v in values.split(","):
        c, elements, bits, res = _predict_args(args, rates, {_SWEEPABLE[param]: v.strip()})
        rows.append({"value": v.strip(), **{k: {"seconds": r["seconds"], "speedup": r["speedup"]}
                                          for k, r in res.items()}})
    keys = [k for k in rows[0] if k != "value"]
    if args.json != "-":
        out.write(f"{param:>14s} " + " ".join(f"{k:>17s}" for k in keys) + "   (ms, speed-up)\n")
        for r in rows:
            out.write(f"{r['value']:>14s} " + " ".join(
                f"{r[k]['seconds'] * 1e3:9.3f} {r[k]['speedup']:5.2f}x " for k in keys) + "\n")
    if args.json:
        write_json({"inputs": _inputs(c, elements, bits, args, rates), "sweep": param,
                     "rows": rows}, args.json, out)
    if args.plot:
        plot_sweep(rows, param, args.plot)
    return rows
