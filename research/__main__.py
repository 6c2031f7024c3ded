"""Command line of the studies: ``python -m research {vnmse,train-sim,model-check,
model-check-runs,model-map,schedule,kernels}``, run from the repository root (no MPI: every
rank is simulated; ``kernels`` times the CUDA kernels on one GPU)."""
from __future__ import annotations

import argparse
import sys


def describe(schedule) -> str:
    """Human-readable table of a schedule (one line per step and rank)."""
    lines = [f"{schedule.topology} schedule, n={schedule.size}"]
    for r, steps in enumerate(schedule.steps):
        for i, s in enumerate(steps):
            lines.append(f"rank {r} step {i:2d} {s.phase:6s} send chunk {s.send_chunk} -> "
                         f"{s.dest}, recv chunk {s.recv_chunk} <- {s.source}")
    return "\n".join(lines)


def cmd_schedule(args):
    from dynamiq_mpi.schedules import build
    print(describe(build(args.topology, args.n)))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train-sim"]:  # the training simulator keeps its own options
        from .train_sim import main as train_sim_main
        train_sim_main(argv[1:])
        return None
    if argv[:1] == ["kernels"]:    # so does the kernel benchmark
        from .kernels import main as kernels_main
        return kernels_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m research", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from . import errorstudy
    p = sub.add_parser("vnmse", help="error study of every codec, simulated ranks",
                       description=errorstudy.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    errorstudy.add_arguments(p)
    p.set_defaults(func=errorstudy.run)
    from . import model_check
    p = sub.add_parser("model-check", help="the cost model against every two-GPU measurement "
                                           "in docs/results", description=model_check.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    model_check.add_arguments(p)
    p.set_defaults(func=model_check.run, check=True, map=None)
    from . import model_check_runs
    p = sub.add_parser("model-check-runs", help="the cost model against every recorded "
                                                "compressed call from 2^20, two and four ranks",
                       description=model_check_runs.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    model_check_runs.add_arguments(p)
    p.set_defaults(func=model_check_runs.run)
    p = sub.add_parser("model-map", help="where compression pays, by the cost model (a PNG, "
                                         "its data beside it as JSON; needs matplotlib)")
    p.add_argument("map", metavar="FILE")
    model_check.add_arguments(p)
    p.set_defaults(func=model_check.run, check=False)
    sub.add_parser("train-sim", help="training with N simulated ranks on one device "
                                     "(python -m research train-sim --help)")
    sub.add_parser("kernels", help="the CUDA kernels against the GPU's copy roofline "
                                   "(python -m research kernels --help)")
    p = sub.add_parser("schedule", help="print a ring or butterfly schedule")
    p.add_argument("topology", choices=["ring", "butterfly"])
    p.add_argument("n", type=int)
    p.set_defaults(func=cmd_schedule)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    main()
