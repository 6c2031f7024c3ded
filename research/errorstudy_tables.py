"""The error study's output (``python -m research vnmse``, research/errorstudy.py
runs the study): the sweep and ablation tables it prints and the plot of
vNMSE against the number of ranks it draws."""
from __future__ import annotations

import sys

import numpy as np

# Rows compared at equal wire bits: (MX format, DynamiQ budget at its bits).
EQUAL_BITS = (("mxfp:e4m3", "dynamiq:8.25"), ("mxfp:e3m2", "dynamiq:6.25"),
              ("mxfp:e2m1", "dynamiq:4.25"))


def _fmt(v, spec=".2e"):
    return "-" if v is None else format(v, spec)


def print_sweep(rows, ranks_list, out=None):
    """One table per data set and topology: codecs down, n across; the bits
    column is at n = 8 (or the nearest n run)."""
    out = out or sys.stdout
    pick = min(ranks_list, key=lambda k: abs(np.log2(k) - 3))
    keys = []
    for r in rows:
        k = (r["data"], r["topology"])
        if k not in keys:
            keys.append(k)
    for data, topo in keys:
        sel = [r for r in rows if r["data"] == data and r["topology"] == topo]
        if all("error" in r for r in sel):
            continue
        length = sel[0]["length"]
        k = sel[0].get("node_size", 1)
        nodes = f", nodes of {k}" if k > 1 else ""
        print(f"\n{data}, {topo}{nodes}, {length} elements per rank: vNMSE (bits/coordinate on "
              f"the wire at n={pick})", file=out)
        head = f"{'codec':16s} {'bits':>6s} " + " ".join(f"{'n=' + str(n):>9s}" for n in ranks_list)
        print(head, file=out)
        codecs = []
        for r in sel:
            if r["codec"] not in codecs:
                codecs.append(r["codec"])
        for c in codecs:
            by_n = {r["ranks"]: r for r in sel if r["codec"] == c}
            b = by_n.get(pick, {}).get("bits_per_coord")
            cells = []
            for n in ranks_list:
                r = by_n.get(n, {})
                cells.append(f"{_fmt(r.get('vnmse')):>9s}" if "error" not in r else f"{'err':>9s}")
            print(f"{c:16s} {_fmt(b, '6.3f'):>6s} " + " ".join(cells), file=out)
        swapped = sorted({r["ranks"] for r in sel if r.get("rail_topology", topo) != topo})
        if swapped:
            print(f"(n={','.join(map(str, swapped))}: the node count is not a power of two, "
                  "the rail level ran the ring)", file=out)
        for mx, dq in EQUAL_BITS:
            a = {r["ranks"]: r for r in sel if r["codec"] == mx and r.get("vnmse")}
            b = {r["ranks"]: r for r in sel if r["codec"] == dq and r.get("vnmse")}
            common = [n for n in ranks_list if n in a and n in b]
            if common:
                ratios = " ".join(f"{a[n]['vnmse'] / b[n]['vnmse']:9.1f}" for n in common)
                at = pick if pick in common else common[0]
                print(f"equal bits: {mx} ({a[at]['bits_per_coord']:.2f} b) / {dq} "
                      f"({b[at]['bits_per_coord']:.2f} b at n={at}) vNMSE ratio at n="
                      f"{','.join(map(str, common))}: {ratios}", file=out)


def print_ablation(rows, out=None):
    out = out or sys.stdout
    datas = []
    for r in rows:
        if r["data"] not in datas:
            datas.append(r["data"])
    cfgs = []
    for r in sorted(rows, key=lambda r: (r["topology"] != "ring", r["ranks"])):
        if (r["codec"], r["topology"], r["ranks"]) not in cfgs:
            cfgs.append((r["codec"], r["topology"], r["ranks"]))
    print("\nablation: vNMSE (bits/coordinate on the wire)", file=out)
    print(f"{'configuration':32s} {'topology':9s} {'n':>4s} "
          + " ".join(f"{d:>22s}" for d in datas), file=out)
    for c, topo, n in cfgs:
        cells = []
        for d in datas:
            r = next((r for r in rows if (r["data"], r["codec"], r["topology"], r["ranks"])
                      == (d, c, topo, n)), {})
            cells.append(f"{_fmt(r.get('vnmse')):>10s} ({_fmt(r.get('bits_per_coord'), '.3f')})"
                         .rjust(22) if "error" not in r else f"{'err':>22s}")
        print(f"{c:32s} {topo:9s} {n:4d} " + " ".join(cells), file=out)


def plot_sweep(rows, path, ranks_list):
    """vNMSE against n per codec, log axes: one panel per data set and
    topology.  The exact codec (~1e-15) is left out; labels give the mean
    bits per coordinate over n."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    datas, topos, codecs = [], [], []
    for r in rows:
        for lst, k in ((datas, "data"), (topos, "topology"), (codecs, "codec")):
            if r[k] not in lst:
                lst.append(r[k])
    codecs = [c for c in codecs if c != "exact"]
    families = {f: [c for c in codecs if c.split(":")[0] == f] for f in ("dynamiq", "mxfp")}
    maps = {"dynamiq": plt.get_cmap("viridis"), "mxfp": plt.get_cmap("autumn")}

    def color(c):
        fam = c.split(":")[0]
        if fam in families:
            k, m = families[fam].index(c), len(families[fam])
            return maps[fam](0.1 + 0.75 * k / max(1, m - 1))
        if fam == "bf16":
            return "0.5"
        others = [c2 for c2 in codecs if c2.split(":")[0] not in families and c2 != "bf16"]
        return ("tab:brown", "tab:pink", "tab:cyan", "tab:olive", "k")[min(others.index(c), 4)]

    fig, axes = plt.subplots(len(datas), len(topos), figsize=(5.2 * len(topos), 3.4 * len(datas)),
                             squeeze=False, sharex=True)
    handles = {}
    for i, d in enumerate(datas):
        for j, t in enumerate(topos):
            ax = axes[i][j]
            for c in codecs:
                sel = sorted((r for r in rows if (r["data"], r["topology"], r["codec"]) == (d, t, c)
                              and r.get("vnmse") and r["vnmse"] > 0), key=lambda r: r["ranks"])
                if not sel:
                    continue
                fam = c.split(":")[0]
                style = {"dynamiq": "-", "mxfp": "--", "bf16": ":"}.get(fam, "-.")
                line, = ax.plot([r["ranks"] for r in sel], [r["vnmse"] for r in sel], style,
                                marker="o", ms=3, color=color(c), lw=1.4)
                handles.setdefault(c, line)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            length = next((r["length"] for r in rows if r["data"] == d), 0)
            ax.set_title(f"{d} ({length} elements), {t}", fontsize=9)
            ax.grid(alpha=0.3, which="both")
            if i == len(datas) - 1:
                ax.set_xlabel("ranks n")
            if j == 0:
                ax.set_ylabel("vNMSE")

    def label(c):
        bits = [r["bits_per_coord"] for r in rows if r["codec"] == c and r.get("bits_per_coord")]
        return f"{c} ({np.mean(bits):.2f} b)" if bits else c

    fig.legend([handles[c] for c in codecs if c in handles],
               [label(c) for c in codecs if c in handles], loc="upper center",
               ncol=min(5, len(handles)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / (3.4 * len(datas))))
    fig.savefig(path, dpi=110)
    plt.close(fig)
