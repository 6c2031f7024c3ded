"""Which super-groups carry a long ring's error?  (docs/error-study.md, "Long
rings with the defaults".)

    python research/scripts/ring_class_share.py --json docs/results/error_study_defaults_ring_classes.json

For the paper's LogNormal mixture (Table 7 set-up, 2^16 elements per rank) and
each n, the library's ring (``scale_allreduce``, the default codec) is run
once, and its squared error is split by the width each super-group got: the
share of the total error, the class's error over its own energy, and the
share carried by the 5 worst super-groups.  A class whose error over energy
grows faster than n is a runaway (the earlier defaults' 2-bit class grew
9.9 -> 14 230 from 16 to 2048 hops).
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="512,2048,8192")
    ap.add_argument("--bits", default="5,6")
    ap.add_argument("--length", type=int, default=65536)
    ap.add_argument("--topology", default="ring")
    ap.add_argument("--scale-code", default=None, help="override the default group code")
    ap.add_argument("--bf16-class", choices=["on", "off"], default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import dynamiq_mpi as dq
    from research.scale_sim import LogNormalMixture, scale_allreduce
    t0 = time.perf_counter()
    src = LogNormalMixture(args.length, seed=0)
    rows = []
    for bits in [float(b) for b in args.bits.split(",")]:
        kw = {}
        if args.scale_code:
            kw["scale_code"] = args.scale_code
        if args.bf16_class:
            kw["bf16_class"] = args.bf16_class == "on"
        codec = dq.DynamiQ(bits=bits, small_input=0, **kw)
        for n in [int(x) for x in args.ranks.split(",")]:
            r = scale_allreduce(src, n, codec=codec, topology=args.topology, seed=0, detailed=True)
            err = (np.asarray(r.out, np.float64) - r.exact) ** 2
            energy = np.asarray(r.exact, np.float64) ** 2
            nsg = -(-err.size // 256)
            pad = nsg * 256 - err.size
            e_sg = np.pad(err, (0, pad)).reshape(nsg, 256).sum(axis=1)
            s_sg = np.pad(energy, (0, pad)).reshape(nsg, 256).sum(axis=1)
            widths = np.asarray(r.codec_info["supergroup_widths"])
            total = e_sg.sum()
            classes = {}
            for w in sorted(set(widths.tolist())):
                sel = widths == w
                worst = np.sort(e_sg[sel])[::-1][:5]
                classes[int(w)] = dict(count=int(sel.sum()),
                                       error_share=float(e_sg[sel].sum() / total),
                                       energy_share=float(s_sg[sel].sum() / s_sg.sum()),
                                       error_over_energy=float(e_sg[sel].sum() / max(s_sg[sel].sum(), 1e-300)),
                                       worst5_share_of_total=float(worst.sum() / total))
            row = dict(bits=bits, ranks=n, vnmse=r.vnmse, vnmse_per_hop=r.vnmse / n,
                       bits_per_coord=r.bits_per_coord, classes=classes)
            rows.append(row)
            print(f"{bits} bits n={n}: vNMSE {r.vnmse:.3g} ({r.vnmse / n:.3g} per hop); "
                  + "; ".join(f"{w} bits: {c['count']} sg, {c['error_share']:.0%} of the error, "
                              f"{c['energy_share']:.1%} of the energy, error/energy "
                              f"{c['error_over_energy']:.3g}, worst 5 {c['worst5_share_of_total']:.0%}"
                              for w, c in classes.items()), flush=True)
    res = dict(tool="research/scripts/ring_class_share.py",
               command="python research/scripts/ring_class_share.py " + " ".join(sys.argv[1:] if argv is None else argv),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               git=subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                  text=True).stdout.strip(),
               length=args.length, topology=args.topology, seconds=time.perf_counter() - t0,
               rows=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
