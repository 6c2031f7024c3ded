"""Host time per call of the library's paths on host (NumPy) arrays, against
MPI's own all-reduce of the same array (run under mpiexec; rank 0 prints and
writes JSON).  The Python of a steady call is the same whatever the arrays,
so this measures, without a GPU, the floor a call adds to the transport's
own all-reduce.

    mpiexec -n 2 python tools/profiling/host_floor.py --json floor.json

Rows: MPI_Allreduce alone; the control plane's digest exchange alone (the
agreement of a steady call); ``path="native"`` (a steady call: one digest
exchange and the all-reduce); the default ``path="auto"`` (its class decided
native); ``path="compressed"`` with DynamiQ at 5 bits (small_input=0: the
codec's CPU kernels included).  Median of --rounds rounds of --calls calls.
``--planes mpi,torch`` adds the same rows over the torch control plane
(torch.distributed started from MPI with gloo; the collective over its
default group): gloo's all-reduce alone, then the library's calls.  Under
torchrun (no MPI in the job) it measures the torch plane alone:

    torchrun --nproc_per_node 2 tools/profiling/host_floor.py --planes torch
"""
import argparse
import json
import statistics
import time

import os

import numpy as np

import dynamiq_mpi as dq


class _TorchWorld:
    """What this script asks of MPI.COMM_WORLD, from torch.distributed (torchrun)."""

    def __init__(self):
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo")
        self.torch, self.dist = torch, dist
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def Barrier(self):
        self.dist.barrier()

    def allreduce(self, value, op=None):
        t = self.torch.tensor([float(value)], dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t[0])


def _world():
    if "WORLD_SIZE" in os.environ and not any(v in os.environ for v in (
            "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")):
        return _TorchWorld(), None
    from mpi4py import MPI
    return MPI.COMM_WORLD, MPI


def per_call_us(fn, comm, calls, rounds):
    for _ in range(max(10, calls // 10)):
        fn()
    times = []
    for _ in range(rounds):
        comm.Barrier()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--log2n", type=int, default=10, help="float32 elements per call: 2^N")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json")
    p.add_argument("--planes", default="mpi", help="mpi, torch or mpi,torch")
    args = p.parse_args(argv)
    comm, MPI = _world()
    x = np.random.default_rng(comm.rank).standard_normal(1 << args.log2n).astype(np.float32)
    out = np.empty_like(x)
    codec = dq.DynamiQ(bits=5, small_input=0)
    colls, cases = [], []
    for plane in args.planes.split(","):
        if plane == "torch":
            import torch
            import dynamiq_mpi.torch as dqt
            if MPI is not None:
                dqt.init_process_group_from_mpi("gloo")
            group = torch.distributed.group.WORLD
            xt = torch.from_numpy(x.copy())
            cases.append(("gloo all_reduce", lambda: torch.distributed.all_reduce(xt)))
            coll = dq.Collective(group)
        else:
            cases.append(("MPI_Allreduce", lambda: comm.Allreduce(x, out)))
            coll = dq.Collective(comm)
        colls.append(coll)
        tag = f" [{plane}]"
        digest, digests = np.ones(1, np.uint64), np.empty(comm.size, np.uint64)
        cases.append(("agreement: 8-byte digest all-gather" + tag,
                      lambda p=coll._plane: p.allgather_array(digest, digests)))
        cases += [
            ("dq path=native (steady)" + tag, lambda c=coll: c.allreduce(x, out=out,
                                                                         path="native")),
            ("dq path=auto (decided)" + tag, lambda c=coll: c.allreduce(x, out=out, path="auto")),
            ("dq path=compressed, DynamiQ 5 bits" + tag, lambda c=coll: c.allreduce(
                x, codec=codec, out=out, path="compressed")),
        ]
    rows = []
    for name, fn in cases:
        calls = args.calls if "compressed" not in name else max(50, args.calls // 10)
        us = comm.allreduce(per_call_us(fn, comm, calls, args.rounds),
                            op=None if MPI is None else MPI.MAX)
        rows.append({"case": name, "us_per_call": us})
    if comm.rank == 0:
        print(f"# host time per call, {comm.size} ranks, 2^{args.log2n} float32 "
              f"(slowest rank, median of {args.rounds} rounds)")
        for r in rows:
            print(f"  {r['case']:<46s} {r['us_per_call']:8.1f} us")
        if args.json:
            meta = {"ranks": comm.size, "log2n": args.log2n, "launcher": "torchrun" if MPI is None
                    else MPI.Get_library_version().splitlines()[0],
                    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    for coll in colls:
        coll.free()


if __name__ == "__main__":
    main()
