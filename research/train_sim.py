"""``python -m research train-sim``: data-parallel training with N ranks
simulated in one process, on one device.

    python -m research train-sim --ranks 32 --codec dynamiq:5 --topology ring \\
        --steps 300 --seed 0 --json run.json
    python -m research train-sim table docs/results/train_sim/*.json --png curves.png

Every rank's micro-batch gradient is computed by its own backward pass of the
one model (data-parallel replicas hold the same parameters, so one model
serves them all, rank after rank); the gradients are cut into the buckets of
``dynamiq_mpi.torch.allreduce_gradients`` (``gradient_buckets``) and each
bucket is all-reduced with every rank's input by the real codec, walked role
by role (``scale_allreduce``: ``simulate_allreduce``'s bits, which are a real
job's; CuPy arrays on a GPU), or ``levels_simulate`` for ``--node-size`` (the
hierarchical call; on the host).
The call counter advances per bucket as a real job's does, so at N = 2 the
gradients equal a real two-rank job's bit for bit: ``--real`` runs that job
(under ``mpiexec -n N``, ``allreduce_gradients`` with a ``HookState``), and
tests/test_train_sim.py compares the two.

Reductions: ``fp32`` the exact mean (float64 sum, rounded once); ``bf16``
the semantics of torch's ``bf16_compress_hook`` (each rank's bucket to
BF16, divided by N in BF16, summed, back to float32; the sum is taken in
float32 and rounded once to BF16, where NCCL rounds per hop); anything else
a codec spelt as for ``python -m dynamiq_mpi bench`` (``dynamiq:5``,
``mxfp:e2m1``, ``thc``, ``omnireduce``, ...).  Each reduction's vNMSE
against the exact mean is recorded along the run.

Workload ``lm``: the byte-level causal LM of mpi_examples/train_lm.py
(LLaMA-style, ``transformers`` built from a config, trained from scratch on
the standard-library corpus of research/corpus.py).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import warnings

from .workloads import lr_at, make_workload

PRESETS = {
    # CPU tests: a few steps of a very small model
    "tiny": dict(hidden=32, layers=1, heads=2, intermediate=64, seq_len=32, batch=2, steps=3,
                 lr=3e-3, warmup=1, eval_every=0, val_windows=8, pretrain_steps=2),
    # a quarter of 'small''s parameters (118k): three seeds of a cell at
    # N = 32 in well under an hour on two CPU cores (docs/training.md)
    "compact": dict(hidden=64, layers=2, heads=4, intermediate=176, seq_len=64, batch=4,
                    steps=1500, lr=3e-3, warmup=30, eval_every=100, val_windows=256,
                    pretrain_steps=300),
    # one cell of the table in minutes on one GPU at N = 128
    "small": dict(hidden=128, layers=2, heads=4, intermediate=352, seq_len=128, batch=4,
                  steps=300, lr=2e-3, warmup=30, eval_every=25, val_windows=64,
                  pretrain_steps=300),
}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m research train-sim",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=8, help="simulated data-parallel ranks N")
    p.add_argument("--codec", default="dynamiq:5", help="fp32, bf16, dynamiq:B, mxfp:FMT, ...")
    p.add_argument("--topology", default="ring", choices=["ring", "butterfly"])
    p.add_argument("--node-size", type=int, default=1,
                   help="K > 1: the hierarchical call, N/K nodes of K (rails compressed)")
    p.add_argument("--seed", type=int, default=0, help="model init, data order, codec seed")
    p.add_argument("--workload", default="lm", choices=["lm", "cls"],
                   help="lm: byte-level LM from scratch; cls: fine-tune a pretrained one to "
                        "classify source by package (research/workloads.py)")
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    for k, v in PRESETS["small"].items():
        p.add_argument("--" + k.replace("_", "-"), type=type(v), default=None,
                       help=f"preset's by default ({v} in 'small')")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--batched", action="store_true",
                   help="every rank's gradient in one vectorised pass (torch.func.vmap over the "
                        "ranks' micro-batches): much faster at large N on a GPU; the same "
                        "gradients up to float rounding, not bit for bit the loop's")
    p.add_argument("--reduce-on", choices=["device", "host"], default="device",
                   help="where the codec runs: the training device, or NumPy on the host "
                        "(the same bits; on a GPU machine several runs then share the GPU well)")
    p.add_argument("--rank-chunk", type=int, default=None,
                   help="--batched: ranks per vectorised pass (memory; default all)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--real", action="store_true",
                   help="run the real job instead (under mpiexec -n N: allreduce_gradients)")
    p.add_argument("--dump", default=None, help="write the final parameters here (.npy)")
    p.add_argument("--json", default=None)
    p.add_argument("--checkpoint", default=None,
                   help="save the run's state here at every evaluation (and at --max-seconds), "
                        "and resume from it "
                        "when it exists (the same bits as a run never stopped)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop after the first step that ends this many seconds into training, "
                        "saving --checkpoint (the JSON stays partial; the same command goes on)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.max_seconds is not None and not args.checkpoint:
        p.error("--max-seconds stops a run part way: give --checkpoint to go on from there")
    if args.real and args.checkpoint:
        p.error("--checkpoint resumes a simulated run; a --real job is not checkpointed")
    if args.batched and args.real:
        p.error("--batched simulates ranks; a --real job computes one rank's gradient")
    if args.ranks < 1 or args.node_size < 1 or args.ranks % args.node_size:
        p.error(f"--node-size {args.node_size} must divide --ranks {args.ranks}")
    return args


class Reducer:
    """The mean of N ranks' flat float32 buckets, by ``spec``, with the
    vNMSE of every call against the exact mean."""

    def __init__(self, spec, n, seed, topology, node_size, on_host=False):
        from dynamiq_mpi.codecs import codec_from_string
        self.spec, self.n, self.seed, self.on_host = spec, n, seed, on_host
        self.topology, self.node_size = topology, node_size
        self.codec = None if spec in ("fp32", "bf16") else codec_from_string(spec)
        self.counter = 0            # a real job's call counter: one per bucket
        self.err = self.norm = 0.0
        self.bits = self.coords = 0.0

    def state(self):
        return {"counter": self.counter, "bits": self.bits, "coords": self.coords}

    def load_state(self, state):
        self.counter, self.bits, self.coords = state["counter"], state["bits"], state["coords"]

    def bits_per_coord(self):
        return self.bits / self.coords

    def take_vnmse(self):
        v = self.err / self.norm if self.norm > 0 else 0.0
        self.err = self.norm = 0.0
        return v

    def __call__(self, xs):
        import torch
        exact64 = torch.zeros_like(xs[0], dtype=torch.float64)
        for x in xs:
            exact64 += x.double()
        exact64 /= self.n
        if self.spec == "fp32":
            out = exact64.float()
            self._count(32.0, xs[0].numel())
        elif self.spec == "bf16":
            self._count(16.0, xs[0].numel())
            acc = torch.zeros_like(xs[0])
            for x in xs:
                acc += (x.to(torch.bfloat16) / self.n).to(torch.bfloat16).float()
            out = acc.to(torch.bfloat16).float()
        else:
            out = self._codec(xs)
        self.counter += 1
        d = out.double() - exact64
        self.err += float((d * d).sum())
        self.norm += float((exact64 * exact64).sum())
        return out

    def _codec(self, xs):
        import numpy as np
        import torch

        from dynamiq_mpi import simulate_allreduce
        from .scale_sim import ArraySource, scale_allreduce, supports
        if self.node_size > 1:          # the hierarchical call, on the host
            from .scale_levels import levels_simulate
            res = levels_simulate([x.cpu().numpy() for x in xs], self.node_size,
                                  codec=self.codec, topology=self.topology, op="mean",
                                  seed=self.seed, counter=self.counter)
            self._count(res.bits_per_coord, xs[0].numel())
            return torch.from_numpy(res.out).to(xs[0].device)
        device = xs[0].device
        on_gpu = xs[0].is_cuda and not self.on_host
        if on_gpu:
            import cupy
            arrays = [cupy.from_dlpack(x.detach()) for x in xs]
        else:
            arrays = [x.detach().cpu().numpy() for x in xs]
        # role by role: n codec calls over the whole bucket instead of every
        # rank's program (n^2 small calls), the same bits (on CuPy arrays
        # too: tests/gpu/test_scale_sim_gpu.py)
        if supports(self.codec):
            res = scale_allreduce(ArraySource(arrays), self.n, codec=self.codec,
                                  topology=self.topology, op="mean", seed=self.seed,
                                  counter=self.counter, xp=cupy if on_gpu else np, exact=False)
            self._count(res.bits_per_coord, xs[0].numel())
            return (torch.from_dlpack(res.out) if on_gpu
                    else torch.from_numpy(res.out).to(device))
        # a codec without a role-by-role adapter (none of bench's today): every
        # rank's program
        outs, reps = simulate_allreduce(arrays, codec=self.codec, topology=self.topology,
                                        op="mean", seed=self.seed, counter=self.counter,
                                        return_reports=True)
        self._count(reps[0].bits_per_coord, xs[0].numel())
        return torch.from_dlpack(outs[0]) if on_gpu else torch.from_numpy(outs[0]).to(device)

    def _count(self, bits, coords):
        self.bits += bits * coords
        self.coords += coords


def _grads(params):
    return [p.grad for p in params]


def _set_grads(params, bucket, mean):
    """The parameters of ``bucket`` (indices) take their slices of the
    bucket's reduced ``mean`` as gradients (into ``.grad`` where it exists)."""
    offset = 0
    for i in bucket:
        p = params[i]
        part = mean[offset:offset + p.numel()].view_as(p)
        if p.grad is None:
            p.grad = part.clone()
        else:
            p.grad.copy_(part)
        offset += p.numel()


def _batched_grads(work, model, names, step, n, chunk, device):
    """(every rank's loss, {parameter name: (n, *shape) gradients}) in one
    vectorised pass: torch.func's grad of the workload's loss, vmapped over
    the ranks' stacked micro-batches (``chunk`` ranks at a time)."""
    import torch
    from torch.func import functional_call, grad_and_value, vmap
    stacked = tuple(torch.stack(parts).to(device)
                    for parts in zip(*(work.batch(step, r, n) for r in range(n))))
    weights = {name: p.detach() for name, p in model.named_parameters() if name in set(names)}

    def loss(w, *batch):
        return work.batch_loss(batch, call=lambda *a, **k: functional_call(model, w, a, k))
    with warnings.catch_warnings():     # SDPA has no batching rule: it loops, correctly
        warnings.filterwarnings("ignore", message="There is a performance drop")
        grads, losses = vmap(grad_and_value(loss), in_dims=(None,) + (0,) * len(stacked),
                             chunk_size=chunk, randomness="different")(weights, *stacked)
    return [float(v) for v in losses.tolist()], grads


# --------------------------------------------------------------------- runs
def run(args) -> dict:
    import numpy as np
    import torch

    from dynamiq_mpi.torch.ddp import gradient_buckets

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    comm = None
    rank, n = 0, args.ranks
    if args.real:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        rank, n = comm.rank, comm.size
        if n != args.ranks:
            raise SystemExit(f"--real under mpiexec -n {n}, but --ranks {args.ranks}")
    device = torch.device("cuda", rank % torch.cuda.device_count()) if use_cuda \
        else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        import cupy
        cupy.cuda.Device(device.index).use()
    work = make_workload(args, device)
    model = work.model
    params = [p for p in model.parameters() if p.requires_grad]
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    reducer, state = None, None
    if args.real:
        import dynamiq_mpi.torch as dqt
        from dynamiq_mpi.codecs import codec_from_string
        state = dqt.HookState(codec=codec_from_string(args.codec), comm=comm, seed=args.seed,
                              topology=args.topology, path="compressed", reports=False)
    else:
        reducer = Reducer(args.codec, n, args.seed, args.topology, args.node_size,
                          on_host=args.reduce_on == "host")
    sync = torch.cuda.synchronize if use_cuda else (lambda: None)
    record = {"config": dict(vars(args), n_params=sum(p.numel() for p in params),
                             device=torch.cuda.get_device_name(device) if use_cuda else "cpu",
                             torch=str(torch.__version__)),
              "corpus": work.info, "steps": [], "evals": [], "vnmse": []}
    buckets = None
    start, before = 0, 0.0
    if args.checkpoint and not args.real:
        start, before = _resume(args.checkpoint, record, model, opt, reducer)
    # each stint of a resumed run: where it ran (a run may go on on another GPU)
    record.setdefault("segments", []).append(
        {"first_step": start, "device": record["config"]["device"],
         "torch": record["config"]["torch"]})
    progress = _progress(args.steps, args.quiet or rank != 0)
    t0 = time.perf_counter()
    for step in range(start, args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        losses = []
        if args.real:
            opt.zero_grad(set_to_none=True)
            loss = work.loss(step, rank, n)
            loss.backward()
            losses = comm.allgather(float(loss.detach()))
            dqt.allreduce_gradients(params, state, bucket_cap_mb=args.bucket_mb)
        elif args.batched:
            losses, grads = _batched_grads(work, model, names, step, n, args.rank_chunk, device)
            if buckets is None:
                buckets = gradient_buckets([grads[name][0] for name in names], args.bucket_mb)
            for b in buckets:
                mat = torch.cat([grads[names[i]].reshape(n, -1) for i in b], dim=1)
                _set_grads(params, b, reducer(list(mat.unbind(0))))
            del grads
            record["vnmse"].append([step, reducer.take_vnmse()])
        else:
            per_rank = []
            for r in range(n):
                opt.zero_grad(set_to_none=True)
                loss = work.loss(step, r, n)
                loss.backward()
                losses.append(float(loss.detach()))
                if buckets is None:
                    buckets = gradient_buckets(_grads(params), args.bucket_mb)
                per_rank.append([torch.cat([params[i].grad.reshape(-1) for i in b])
                                 for b in buckets])
            for j, b in enumerate(buckets):
                _set_grads(params, b, reducer([per_rank[r][j] for r in range(n)]))
            del per_rank
            record["vnmse"].append([step, reducer.take_vnmse()])
        opt.step()
        record["steps"].append([step, sum(losses) / len(losses)])
        evaluated = rank == 0 and bool(args.eval_every) and (
            (step + 1) % args.eval_every == 0 or step + 1 == args.steps)
        if evaluated:
            sync()
            ev = work.evaluate()
            record["evals"].append([step + 1, ev["val_loss"]])
            if "accuracy" in ev:
                record.setdefault("accuracy", []).append([step + 1, ev["accuracy"]])
        progress(step, record)
        stop = args.max_seconds is not None and time.perf_counter() - t0 >= args.max_seconds
        if step + 1 < args.steps and (evaluated or stop):
            partial = _partial(record, before + time.perf_counter() - t0, reducer)
            if args.json:                       # a run cut short keeps its curve
                _write(args.json, partial)
            if args.checkpoint:
                _save(args.checkpoint, step + 1, partial["seconds"], record, model, opt, reducer)
            if stop:
                return partial
    sync()
    record["seconds"] = before + time.perf_counter() - t0
    if reducer is not None and reducer.coords:
        record["bits_per_coord"] = reducer.bits_per_coord()
    if record["evals"]:
        record["final_val_loss"] = record["evals"][-1][1]
    if record.get("accuracy"):
        record["final_accuracy"] = record["accuracy"][-1][1]
    record["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if args.dump and rank == 0:
        np.save(args.dump, torch.cat([p.detach().reshape(-1).float().cpu()
                                      for p in params]).numpy())
    if args.json and rank == 0:
        _write(args.json, record)
    return record


# Resuming: what a run carries from one step to the next (the parameters,
# AdamW's moments, the reducer's call counter and tallies, the curves); the
# data of a step is drawn from the step number, so nothing else is needed.
_NOT_THE_RUN = ("json", "checkpoint", "max_seconds", "quiet", "dump", "device", "torch",
                "reduce_on")       # where the codec runs: the same bits either way


def _partial(record, elapsed, reducer):
    """The record of a run cut short: its curves so far, the bits counted."""
    out = dict(record, partial=True, seconds=elapsed)
    if reducer is not None and reducer.coords:
        out["bits_per_coord"] = reducer.bits_per_coord()
    return out


def _save(path, step, elapsed, record, model, opt, reducer):
    import torch
    state = {"step": step, "seconds": elapsed, "record": record, "model": model.state_dict(),
             "opt": opt.state_dict(), "reducer": reducer.state()}
    _replace(path, lambda tmp: torch.save(state, tmp))


def _resume(path, record, model, opt, reducer):
    """(first step, seconds already trained) from ``path``; (0, 0) when it
    does not exist yet.  A checkpoint of another run is refused."""
    import os

    import torch
    if not os.path.exists(path):
        return 0, 0.0
    state = torch.load(path, map_location="cpu", weights_only=True)
    mine, theirs = record["config"], state["record"]["config"]
    differ = sorted(k for k in set(mine) | set(theirs)
                    if k not in _NOT_THE_RUN and mine.get(k) != theirs.get(k))
    if (mine["device"] == "cpu") != (theirs["device"] == "cpu"):
        differ.append("device")     # the GPU trains under BF16 autocast, the CPU in float32
    if record["corpus"].get("sha256") != state["record"]["corpus"].get("sha256"):
        differ.append("corpus")     # another Python's standard library: other data
    if differ:
        raise SystemExit(f"--checkpoint {path} is another run's: {', '.join(differ)} differ "
                         f"({', '.join(f'{k}={theirs.get(k)!r}' for k in differ)} there)")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    reducer.load_state(state["reducer"])
    for key in ("steps", "evals", "vnmse", "accuracy", "segments"):
        if key in state["record"]:
            record[key] = state["record"][key]
    return state["step"], state["seconds"]


def _replace(path, write):
    """``write(tmp)``, then the rename: a run killed mid-write keeps its last file."""
    import os
    write(path + ".tmp")
    os.replace(path + ".tmp", path)


def _write(path, record):
    def dump(tmp):
        with open(tmp, "w") as f:
            json.dump(record, f, indent=1)
    _replace(path, dump)


def _progress(total, quiet):
    """A tqdm bar on a terminal, a line every tenth of the run elsewhere."""
    if quiet:
        return lambda step, record: None
    if sys.stderr.isatty():
        from tqdm import tqdm
        bar = tqdm(total=total, unit="step", leave=False)

        def update(step, record):
            bar.update(1)
            bar.set_postfix(loss=f"{record['steps'][-1][1]:.3f}")
            if step + 1 == total:
                bar.close()
        return update

    def line(step, record):
        if (step + 1) % max(1, total // 10) == 0 or step + 1 == total:
            ev = f", val {record['evals'][-1][1]:.4f}" if record["evals"] else ""
            vn = f", vNMSE {record['vnmse'][-1][1]:.2e}" if record["vnmse"] else ""
            print(f"step {step + 1}/{total}: loss {record['steps'][-1][1]:.4f}{ev}{vn}",
                  file=sys.stderr, flush=True)
    return line


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "table":
        p = argparse.ArgumentParser(prog="python -m research train-sim table")
        p.add_argument("runs", nargs="+")
        p.add_argument("--png", default=None)
        a = p.parse_args(argv[1:])
        from .train_sim_table import table
        return table(a.runs, a.png)
    return run(parse_args(argv))
