"""``python -m dynamiq_mpi model``: the cost model's command (predictions and
sweeps), dispatching to ``model.py`` and ``io.py`` (arguments and output)."""
from __future__ import annotations

import sys

from .io import (_SWEEPABLE, _describe, _inputs, _predict_args, _rates_for, _table,
                 add_arguments, plot_sweep, write_json)  # noqa: F401 (add_arguments: the CLI's)


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
