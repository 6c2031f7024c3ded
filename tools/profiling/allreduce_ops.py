"""What a DDP hook's plain all-reduce costs by how it averages: torch's
NCCL all-reduce of a float32 bucket with ReduceOp.SUM, with ReduceOp.AVG,
and a division kernel then SUM (torch's ``allreduce_hook``); back to back on
the current stream, median of the slowest rank, per bucket size.  On an
NVSwitch host with NCCL's NVLS algorithms on, SUM may take them and AVG
(a pre-multiplied sum) cannot.

    torchrun --nproc_per_node 2 tools/profiling/allreduce_ops.py [MB ...]
"""
import statistics
import sys
import time

import torch
import torch.distributed as dist


def timed(fn, reps=20, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def main():
    dist.init_process_group("nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    pg = dist.distributed_c10d._get_default_group()
    sizes = [float(a) for a in sys.argv[1:]] or [25.0, 100.0, 400.0]

    def op(reduce_op):
        opts = dist.AllreduceOptions()
        opts.reduceOp = reduce_op
        return opts
    rows = []
    for mb in sizes:
        buf = torch.randn(int(mb * 2 ** 20) // 4, device="cuda")
        sum_ms = timed(lambda: pg.allreduce([buf], op(dist.ReduceOp.SUM)).wait()) * 1e3
        avg_ms = timed(lambda: pg.allreduce([buf], op(dist.ReduceOp.AVG)).wait()) * 1e3
        div_ms = timed(lambda: (buf.div_(n),
                                pg.allreduce([buf], op(dist.ReduceOp.SUM)).wait())) * 1e3
        rows.append((mb, sum_ms, avg_ms, div_ms))
    if rank == 0:
        print(f"{n} ranks, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
        print("| bucket (MB) | SUM (ms) | AVG (ms) | div + SUM (ms) |")
        print("|---|---|---|---|")
        for mb, s, a, d in rows:
            print(f"| {mb:g} | {s:.3f} | {a:.3f} | {d:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
