"""Host time of one FSDP2-sized reduce-scatter through ``dqt.ReduceScatter``
(float32, AVG, graphs on as by default): the median quiet call, then a
cProfile of back-to-back calls on rank 0, by own and by cumulative time.

    mpiexec -n 2 python tools/profiling/fsdp_rs_host.py [--log2 25] [--calls 20]
"""
import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import torch.distributed as dist

import dynamiq_mpi.torch as dqt


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--log2", type=int, default=25, help="elements of the input, log2")
    p.add_argument("--calls", type=int, default=20, help="calls under cProfile")
    p.add_argument("--path", default="compressed", choices=["compressed", "native", "auto"])
    args = p.parse_args()
    rank, world, device = dqt.init_process_group_from_mpi()
    n = 1 << args.log2
    inp = torch.randn(n, device=device) * 1e-3
    out = torch.empty(n // world, device=device)
    rs = dqt.ReduceScatter(seed=0, path=args.path)

    def call():
        rs(out, inp, None, dist.ReduceOp.AVG)
    for _ in range(6):                  # the graph is captured on the second call
        call()
    host = []
    for _ in range(10):
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        t = time.perf_counter()
        call()
        host.append(time.perf_counter() - t)
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        call()
    prof.disable()
    torch.cuda.synchronize()
    # (every rank: a held native path has not made its collective yet, and
    # making one takes every rank)
    graphs = rs.collective.graph_stats()
    if rank == 0:
        print(f"== {args.path}, 2^{args.log2} float32, {world} ranks: host time of a quiet call "
              f"(median of 10) {statistics.median(host) * 1e3:.3f} ms; graphs {graphs}")
        for key in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats(key).print_stats(28)
            print(text.getvalue())
    rs.free()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
