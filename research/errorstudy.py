"""``python -m research vnmse``: the error study, on simulated ranks (no MPI).

    python -m research vnmse                                  # the default study
    python -m research vnmse --data real --ranks 8 --topologies ring
    python -m research vnmse --ablation --json ablation.json  # the ablation ladder
    python -m research vnmse --data lognormal --ranks 8192 --length 1048576 \\
        --codecs dynamiq:5 --topologies ring                     # the scale simulator
    python -m research vnmse --data lognormal --ranks 8192 --length 65536 \\
        --codecs dynamiq:5 --node-size 8                         # 1024 nodes of 8

For every data set, codec, topology and number of ranks ``n`` it prints the
vNMSE of the all-reduce, ``||out - sum||^2 / ||sum||^2`` against the float64
sum of the inputs, beside the bits per coordinate actually put on the wire
(all bytes of all ranks, statistics included).  Every codec runs on the
library's own engine: :func:`research.scale_sim.scale_allreduce` (bit for
bit :func:`~dynamiq_mpi.simulate_allreduce`, in memory independent of ``n``)
where it has an adapter for the codec, else ``simulate_allreduce``.

``--node-size K`` (default 1: the flat call) runs the hierarchical
all-reduce instead (research/scale_levels.py): in-node sums of K
consecutive ranks, then K rails, each the flat compressed all-reduce of one
interleaved shard (the 256-element blocks ``j`` with ``j mod K == l``) over
the n / K nodes (a butterfly over a node count that is not a power of two
runs the ring there: the row's ``rail_topology``), scattered back.  Its
rows carry ``node_size``, ``nodes`` and ``rail_topology``; its bits per
coordinate are the rail level's wire bytes over the input's coordinates.

Data sets (``--data``):

* ``real``: gradients of a small LLaMA (transformers, word-level vocabulary
  built from Python's standard library, the corpus of
  mpi_examples/train_lm.py), captured by research/scripts/capture_gradients.py: rank
  ``r`` = micro-batch ``r`` at one model step.  The embedding rows of words
  absent from every rank's micro-batch are exactly zero (the skew of the
  paper's fine-tuning gradients).  A contiguous slice of whole tensors (the
  embedding table, every decoder layer, the final norm; not the LM head)
  of the captured length.  Captured on first use into ``--cache``.
* ``real-dense``: the decoder layers of the same capture (no embedding; no
  super-group is zero on every rank).
* ``lognormal``: the paper's large-scale synthetic gradient (section 6.2):
  super-group magnitudes from its two-component LogNormal mixture,
  coordinates i.i.d. normal, generated on the fly (any ``n``).
* ``gradient_like``: :func:`dynamiq_mpi.bench.gradients.gradient_like` (layer
  scales over five decades, Student-t entries, an embedding table with 90 %
  of rows zero on every rank).

DynamiQ codecs run with ``small_input=0`` unless the spelling sets it: the
study measures the codec, not the library's hand-over of small inputs to BF16.
They run with the codec's defaults (hybrid group codes, the 16-bit class, since
2026-11-23) unless the spelling sets ``scale_code`` / ``bf16_class`` or the
command line ``--scale-code ceil`` / ``--bf16-class off`` (the earlier defaults).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from .errorstudy_tables import plot_sweep, print_ablation, print_sweep

REPO = Path(__file__).resolve().parents[1]     # the checkout (this file: research/)
DEFAULT_CACHE = REPO / ".cache" / "gradients"
CAPTURE_SCRIPT = REPO / "research" / "scripts" / "capture_gradients.py"
REAL_NAME = "llama_words"

# The default codec list; spellings that this installation's codec_from_string
# does not accept (THC, OmniReduce before they land) are dropped at run time.
DEFAULT_CODECS = ("exact", "bf16", "dynamiq:4.25", "dynamiq:5", "dynamiq:6.25", "dynamiq:8.25",
                  "mxfp:e4m3", "mxfp:e3m2", "mxfp:e2m1", "thc", "omnireduce")
DEFAULT_RANKS = (2, 4, 8, 16, 32, 64)
DATASETS = ("real", "real-dense", "lognormal", "gradient_like")
DEFAULT_DATA = ("real", "real-dense", "lognormal", "gradient_like")


# ----------------------------------------------------------------------------- codecs
def parse_codec(spec: str, overrides=None):
    """A codec from its spelling (``codec_from_string``); DynamiQ gets
    ``small_input=0`` unless the spelling sets it, and each field of
    ``overrides`` (``--scale-code``, ``--bf16-class``) unless the spelling
    sets that field."""
    from dynamiq_mpi.codecs import DynamiQ, codec_from_string
    codec = codec_from_string(spec)
    if isinstance(codec, DynamiQ):
        fields = {"small_input": 0, **(overrides or {})}
        given = {item.split("=", 1)[0].strip() for item in spec.split(":")[1:] if "=" in item}
        change = {k: v for k, v in fields.items() if k not in given}
        if change:
            codec = dataclasses.replace(codec, **change)
    return codec


def dynamiq_overrides(args) -> dict:
    """The DynamiQ fields that --scale-code / --bf16-class set."""
    out = {}
    if getattr(args, "scale_code", None):
        out["scale_code"] = args.scale_code
    if getattr(args, "bf16_class", None):
        out["bf16_class"] = args.bf16_class == "on"
    return out


def available_codecs(specs=DEFAULT_CODECS) -> list:
    """The spellings of ``specs`` that codec_from_string accepts here."""
    ok = []
    for s in specs:
        try:
            parse_codec(s)
        except (ValueError, TypeError):
            continue
        ok.append(s)
    return ok


def ablation_ladder(bits):
    """Paper Table 6 order, each row adding one technique, all at ``bits``;
    the paper's rows use widths {0, 2, 4, 8} and the rounded-up group codes,
    then two rows add what the library's defaults add (spec 2.3, 2.7): the
    hybrid group codes, then the 16-bit class (the last row is ``DynamiQ(bits)``)."""
    from dynamiq_mpi.codecs import DynamiQ
    base = dict(bits=bits, uniform=True, variable_width=False, hierarchical=False,
                correlated=False, zero_class=False, small_input=0, scale_code="ceil",
                bf16_class=False)
    steps = [("uniform, one width", {}), ("+ non-uniform levels", {"uniform": False}),
             ("+ variable width, 0-bit class", {"variable_width": True, "zero_class": True}),
             ("+ hierarchical scales", {"hierarchical": True}),
             ("+ correlated rounding", {"correlated": True}),
             ("+ hybrid group codes", {"scale_code": "hybrid"}),
             ("+ 16-bit class (defaults)", {"bf16_class": True})]
    rows = []
    for name, change in steps:
        base.update(change)
        rows.append((name, DynamiQ(**base)))
    return rows


# ----------------------------------------------------------------------------- data
def real_gradients(cache=DEFAULT_CACHE, capture=True, quiet=False):
    """(gradients (ranks, length) float32, metadata) of the captured model;
    runs research/scripts/capture_gradients.py first when the capture is missing."""
    cache = Path(cache)
    npy, meta_path = cache / f"{REAL_NAME}.npy", cache / f"{REAL_NAME}.json"
    if not (npy.exists() and meta_path.exists()):
        if not capture:
            raise FileNotFoundError(f"no captured gradients at {npy}")
        if not CAPTURE_SCRIPT.exists():
            raise FileNotFoundError(f"{npy} is missing and so is {CAPTURE_SCRIPT} to make it")
        if not quiet:
            print(f"capturing real gradients into {cache} (research/scripts/capture_gradients.py) ...",
                  file=sys.stderr, flush=True)
        subprocess.run([sys.executable, str(CAPTURE_SCRIPT), "--out", str(cache / REAL_NAME)],
                       check=True, stdout=sys.stderr)
    with open(meta_path) as f:
        meta = json.load(f)
    return np.load(npy, mmap_mode="r"), meta


class _Data:
    """One data set: a source for up to ``max_ranks`` ranks, and its notes."""

    def __init__(self, name, args, max_ranks):
        from dynamiq_mpi.bench.gradients import gradient_like
        from .scale_sim import ArraySource, LogNormalMixture
        self.name, self.notes = name, {}
        if name in ("real", "real-dense"):
            grads, meta = real_gradients(args.cache)
            if grads.shape[0] < max_ranks:
                raise SystemExit(f"the capture has {grads.shape[0]} ranks, {max_ranks} asked "
                                 f"for: re-run research/scripts/capture_gradients.py --ranks {max_ranks}")
            start = meta["dense_start"] if name == "real-dense" else 0
            xs = np.asarray(grads[:max_ranks, start:], dtype=np.float32)
            self.source = ArraySource(xs)
            self.notes = {"capture": {k: meta[k] for k in ("model", "tensors", "corpus", "steps",
                                                             "micro_batch", "sha256")
                                      if k in meta},
                          "slice": "decoder layers and final norm" if start else
                          "embedding table, decoder layers and final norm"}
        elif name == "lognormal":
            self.source = LogNormalMixture(args.length, seed=args.seed)
            self.notes = {"mixture": "paper Appendix E, K=2: pi=(0.79, 0.21), "
                          "mu=(-3.99, -16.41), sigma=(1.22, 4.63); M_j shared by the ranks"}
        elif name in ("gradient_like", "gradient_like-dense"):
            dense = name.endswith("-dense")
            self.source = ArraySource([gradient_like(args.length, r, seed=args.seed,
                                                     with_embedding=not dense)
                                       for r in range(max_ranks)])
        else:
            raise SystemExit(f"unknown data set {name!r}; known: {DATASETS}")
        self.length = self.source.length
        self.notes["length"] = self.length
        self.notes.update(_zero_fractions(self.source, max_ranks))

    def xs(self, n):
        return [self.source.rank_vector(np, r) for r in range(n)]


def _zero_fractions(source, max_ranks):
    """Fraction of super-groups that are zero on every rank, at a few n."""
    from .scale_sim import ArraySource
    if not isinstance(source, ArraySource):
        return {}
    nsg = -(-source.length // 256)
    rows = source._data.reshape(source.ranks, nsg, 256)
    live = np.zeros(nsg, dtype=bool)
    out = {}
    for n in range(1, max_ranks + 1):
        live |= (rows[n - 1] != 0).any(axis=1)
        if n in (1, 2, 8, 64) or n == max_ranks:
            out[f"zero_supergroups_n{n}"] = round(1.0 - float(live.mean()), 4)
    return {"zero_supergroup_fraction": out}


# ----------------------------------------------------------------------------- one run
def run_one(data, n, codec, topology, seed, counter, engine="auto", progress=False,
            node_size=1, rail_budget="joint"):
    """(vNMSE, bits per coordinate, codec info, seconds, engine) of one
    all-reduce; ``node_size`` > 1: the hierarchical one (scale_levels.py)
    with ``rail_budget``."""
    from dynamiq_mpi import simulate_allreduce
    from .scale_sim import scale_allreduce, supports
    t0 = time.perf_counter()
    if node_size > 1:
        from .scale_levels import levels_allreduce, levels_simulate
        if engine != "simulate" and supports(codec):
            r = levels_allreduce(data.source, n, node_size, codec=codec, topology=topology,
                                 seed=seed, counter=counter, progress=progress,
                                 rail_budget=rail_budget)
            kind = "scale"
        else:
            r = levels_simulate(data.xs(n), node_size, codec=codec, topology=topology,
                                seed=seed, counter=counter, rail_budget=rail_budget)
            kind = "simulate"
        info = dict(r.codec_info, rails=r.rails)
        return r.vnmse, r.bits_per_coord, info, time.perf_counter() - t0, kind
    if engine != "simulate" and supports(codec):
        r = scale_allreduce(data.source, n, codec=codec, topology=topology, seed=seed,
                            counter=counter, progress=progress)
        return r.vnmse, r.bits_per_coord, r.codec_info, time.perf_counter() - t0, "scale"
    xs = data.xs(n)
    outs, reps = simulate_allreduce(xs, codec=codec, topology=topology, seed=seed,
                                    counter=counter, return_reports=True)
    exact = np.sum(np.stack(xs).astype(np.float64), axis=0)
    norm = float(np.sum(exact ** 2))
    err = float(np.sum((outs[0].astype(np.float64) - exact) ** 2)) / norm if norm else float("nan")
    return err, reps[0].bits_per_coord, reps[0].codec_info, time.perf_counter() - t0, "simulate"


def _widths(info):
    w = info.get("widths")
    if not w:
        return ""
    keys = (0, 2, 4, 8) + ((16,) if 16 in w or "16" in w else ())   # the 16-bit class
    text = "/".join(str(w.get(k, w.get(str(k), 0))) for k in keys)
    return text + ("" if info.get("budget_binds", True) else " (budget does not bind)")


class _Bar:
    def __init__(self, total, quiet):
        self.total, self.done, self.bar, self.quiet = total, 0, None, quiet
        if not quiet:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, file=sys.stderr, unit="run",
                                mininterval=1.0 if sys.stderr.isatty() else 30.0, miniters=1)
            except ImportError:
                pass

    def update(self, text):
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif not self.quiet:
            print(f"  [{self.done}/{self.total}] {text}", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _jsonable(v):
    if isinstance(v, dict):
        return {str(a): _jsonable(b) for a, b in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(b) for b in v]
    if isinstance(v, (np.floating, np.integer, np.bool_)):
        return v.item()
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if hasattr(v, "shape"):                    # arrays: a summary, not the data
        return f"array{tuple(v.shape)}"
    return str(v)


def _jsonable_info(info):
    return {str(k): _jsonable(v) for k, v in info.items()}


def _rows_for(args, datasets, codecs, ranks_list, topologies, quiet):
    from .scale_levels import rail_topology
    node_size = getattr(args, "node_size", 1) or 1
    rail_budget = getattr(args, "rail_budget", "joint")
    total = len(datasets) * len(codecs) * len(topologies) * len(ranks_list)
    bar = _Bar(total, quiet)
    rows = []
    for data in datasets:
        for label, codec in codecs:
            for topo in topologies:
                for n in ranks_list:
                    row = dict(data=data.name, codec=label, topology=topo, ranks=n,
                               length=data.length)
                    if node_size > 1:
                        row.update(node_size=node_size, nodes=n // node_size,
                                   rail_budget=rail_budget)
                    if node_size > 1 and n % node_size:
                        row["error"] = (f"{n} ranks are not nodes of {node_size} "
                                        "(the ranks must be a multiple of the node size)")
                    elif node_size > 1:
                        # never an error: a butterfly over a node count that is
                        # not a power of two runs the ring on the rail level
                        row["rail_topology"] = rail_topology(topo, n // node_size)
                        if row["rail_topology"] != topo:
                            row["rail_note"] = (f"{n // node_size} nodes is not a power of "
                                                "two: the ring ran on the rail level")
                    elif topo == "butterfly" and n & (n - 1):
                        row["error"] = "butterfly needs a power-of-two n"
                    if "error" not in row:
                        errs, secs = [], 0.0
                        try:
                            for t in range(args.repeats):
                                err, bits, info, s, engine = run_one(
                                    data, n, codec, topo, args.seed, t, args.engine,
                                    progress=not quiet and n >= 1024, node_size=node_size,
                                    rail_budget=rail_budget)
                                errs.append(err)
                                secs += s
                            row.update(bits_per_coord=bits, vnmse=float(np.mean(errs)),
                                       vnmse_calls=errs, widths=_widths(info),
                                       codec_info=_jsonable_info(info), seconds=secs,
                                       engine=engine)
                        except Exception as exc:          # recorded, the study goes on
                            row["error"] = f"{type(exc).__name__}: {exc}"
                    rows.append(row)
                    v = row.get("vnmse")
                    bar.update(f"{data.name} {label} {topo} n={n}: "
                               + (f"{v:.3e}" if v is not None else row.get("error", "")))
    bar.close()
    return rows


def _git_state():
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--",
                                "dynamiq_mpi", "research", "src_cuda", "pyx"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("+local changes" if dirty else "")
    except Exception:
        return None


# ----------------------------------------------------------------------------- command
def add_arguments(p):
    p.add_argument("--data", default=",".join(DEFAULT_DATA),
                   help=f"comma list of data sets: {', '.join(DATASETS)}, gradient_like-dense")
    p.add_argument("--codecs", default=None,
                   help="comma list of codec spellings (codec_from_string), default: "
                        + ",".join(DEFAULT_CODECS) + " (those this installation has)")
    p.add_argument("--ranks", default=",".join(map(str, DEFAULT_RANKS)),
                   help="comma list of world sizes")
    p.add_argument("--topologies", default="ring,butterfly")
    p.add_argument("--length", type=int, default=1 << 18,
                   help="elements per rank of the synthetic data (real: the capture's length)")
    p.add_argument("--repeats", type=int, default=1,
                   help="calls per configuration (call counters 0..R-1), vNMSE averaged")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", choices=["auto", "simulate"], default="auto",
                   help="auto: the scale simulator where it has the codec; simulate: "
                        "simulate_allreduce always")
    p.add_argument("--ablation", action="store_true",
                   help="run the ablation ladder (paper Table 6) instead of the codec sweep")
    p.add_argument("--ablation-bits", type=float, default=5.5)
    p.add_argument("--scale-code", choices=["hybrid", "ceil"], default=None,
                   help="group scale code of every DynamiQ spelling that does not set "
                        "scale_code (default: the codec's, hybrid)")
    p.add_argument("--bf16-class", choices=["on", "off"], default=None,
                   help="the 16-bit class of every DynamiQ spelling that does not set "
                        "bf16_class (default: the codec's, on); off: widths {0, 2, 4, 8}")
    p.add_argument("--node-size", type=int, default=1,
                   help="ranks per node: K > 1 runs the hierarchical all-reduce (in-node sums "
                        "in the input's dtype, then K rails of n/K nodes, each the flat "
                        "compressed call on one interleaved shard of 256-element blocks); "
                        "default 1: the flat call")
    p.add_argument("--rail-budget", choices=["joint", "even"], default="joint",
                   help="with --node-size: one DynamiQ allocation over the rails (joint, the "
                        "collective's default) or each rail planned apart (even)")
    p.add_argument("--cache", default=str(DEFAULT_CACHE),
                   help="folder of the captured real gradients")
    p.add_argument("--json", default=None, help="write every row (and the set-up) here")
    p.add_argument("--plot", default=None, help="PNG of vNMSE against n per codec (matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _int_list(text):
    return [int(float(s)) for s in text.split(",") if s.strip()]


def run(args, out=None):
    out = out or sys.stdout
    t0 = time.perf_counter()
    git, started = _git_state(), datetime.datetime.now(datetime.timezone.utc)
    if args.plot and not args.ablation:
        import importlib.util                 # fail now, not after the study
        if importlib.util.find_spec("matplotlib") is None:
            raise SystemExit("--plot needs matplotlib (pip install matplotlib)")
    ranks_list = _int_list(args.ranks)
    node_size = getattr(args, "node_size", 1) or 1
    if node_size < 1:
        raise SystemExit(f"--node-size must be >= 1, got {node_size}")
    topologies = [t.strip() for t in args.topologies.split(",") if t.strip()]
    names = [d.strip() for d in args.data.split(",") if d.strip()]
    if args.ablation:
        codecs = [(name, c) for name, c in ablation_ladder(args.ablation_bits)]
    else:
        specs = ([s.strip() for s in args.codecs.split(",") if s.strip()] if args.codecs
                 else available_codecs())
        overrides = dynamiq_overrides(args)
        codecs = [(s, parse_codec(s, overrides)) for s in specs]
    datasets = [_Data(d, args, max(ranks_list)) for d in names]
    print(f"vNMSE study: data {', '.join(f'{d.name} ({d.length})' for d in datasets)}; "
          f"n = {', '.join(map(str, ranks_list))}; {', '.join(topologies)}; "
          f"{args.repeats} call(s) each, seed {args.seed}"
          + (f"; nodes of {node_size} (hierarchical, {args.rail_budget} rail budget)"
             if node_size > 1 else ""),
          file=out, flush=True)
    rows = _rows_for(args, datasets, codecs, ranks_list, topologies, args.quiet)
    if args.ablation:
        print_ablation(rows, out)
    else:
        print_sweep(rows, ranks_list, out)
    seconds = time.perf_counter() - t0
    print(f"\n({seconds:.0f} s)", file=out)
    result = dict(
        kind="ablation" if args.ablation else "sweep",
        command="python -m research vnmse " + " ".join(sys.argv[2:]) if
        sys.argv[1:2] == ["vnmse"] else None,
        date=started.isoformat(timespec="seconds"), git=git, host=platform.node(),
        cpu=platform.processor() or platform.machine(),
        seconds=seconds, ranks=ranks_list, topologies=topologies, repeats=args.repeats,
        seed=args.seed, node_size=node_size,
        rail_budget=getattr(args, "rail_budget", "joint") if node_size > 1 else None,
        ablation_bits=args.ablation_bits if args.ablation else None,
        dynamiq_overrides=dynamiq_overrides(args) or None,
        codecs=[c for c, _ in codecs],
        codec_signatures={c: list(map(str, codec.signature())) for c, codec in codecs},
        datasets={d.name: d.notes for d in datasets}, rows=rows)
    if args.json:
        text = json.dumps(result, indent=1)        # all of it or nothing
        with open(args.json, "w") as f:
            f.write(text)
    if args.plot and not args.ablation:
        plot_sweep(rows, args.plot, ranks_list)
    return result


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m research vnmse", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
