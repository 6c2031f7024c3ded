"""NCCL point-to-point against NCCL's all-reduce on the link at hand (two
ranks, one GPU each): how fast can our exchanges go?

For each message size: one grouped send + receive of `size` bytes with the
peer (`--split k`: the message cut into k sends and k receives in the same
group; `--comms c`: the pieces spread over c communicators, each on its own
stream, as our transport's lanes; `--allgather`: also the same bytes as one
NCCL all-gather of two `size`-byte parts, in place, which uses the
collective's channels instead of point-to-point's), timed with CUDA events over `--iters`
calls (median), as GB/s per direction; beside it NCCL's all-reduce of `size` bytes of BF16 (its algbw:
per direction, for two ranks). Run it under the NCCL environment to probe:

    mpiexec -n 2 python tools/profiling/p2p_probe.py --sizes 4M,21M,42M --split 1,4
"""
import argparse

from mpi4py import MPI

from profile_call import event_ms    # tools/ is on sys.path when run as a script


def parse_size(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * units[s[-1]]) if s[-1] in units else int(s)


def report(comm, nbytes, ncomm, split, t, t_ar):
    """One row: the slowest rank's exchange and all-reduce times, as GB/s per direction."""
    worst = comm.allreduce(t, op=MPI.MAX)
    worst_ar = comm.allreduce(t_ar, op=MPI.MAX)
    if comm.rank == 0:
        print(f"{nbytes:>11d} {ncomm:>5} {split:>5} {worst * 1e3:8.3f} "
              f"{nbytes / worst / 1e9:9.1f} {worst_ar * 1e3:12.3f} "
              f"{nbytes / worst_ar / 1e9:14.1f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4M,21M,42M")
    ap.add_argument("--split", default="1,4")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--comms", default="1", help="communicators (lanes) to spread over, e.g. 1,2")
    ap.add_argument("--allgather", action="store_true", help="also time an in-place all-gather")
    args = ap.parse_args()
    import cupy as cp
    from cupy.cuda import nccl

    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    assert size == 2, "two ranks"
    cp.cuda.Device(rank % cp.cuda.runtime.getDeviceCount()).use()
    max_comms = max(int(c) for c in args.comms.split(","))
    uids = comm.bcast([nccl.get_unique_id() for _ in range(max_comms)] if rank == 0 else None)
    ncs = [nccl.NcclCommunicator(size, uid, rank) for uid in uids]
    nc = ncs[0]
    lanes = [cp.cuda.Stream(non_blocking=True) for _ in range(max_comms)]
    stream = cp.cuda.get_current_stream()
    peer = 1 - rank
    if rank == 0:
        print(f"{'bytes':>11s} {'comms':>5s} {'split':>5s} {'p2p ms':>8s} {'p2p GB/s':>9s} "
              f"{'allreduce ms':>12s} {'allreduce GB/s':>14s}", flush=True)
    for s in args.sizes.split(","):
        nbytes = parse_size(s)
        send = cp.ones(nbytes, cp.uint8)
        recv = cp.zeros(nbytes, cp.uint8)
        ar = cp.ones(nbytes // 2, cp.float16)   # BF16-sized payload (NCCL has no bf16 in CuPy's enum)
        t_ar = 1e-3 * event_ms(cp, lambda: nc.allReduce(ar.data.ptr, ar.data.ptr, ar.size, nccl.NCCL_FLOAT16,
                                              nccl.NCCL_SUM, stream.ptr), args.iters)
        if args.allgather:      # the peer's part lands beside ours: same bytes each way
            both = cp.zeros(2 * nbytes, cp.uint8)
            t = 1e-3 * event_ms(cp, lambda: nc.allGather(both.data.ptr + rank * nbytes, both.data.ptr, nbytes,
                                                     nccl.NCCL_UINT8, stream.ptr), args.iters)
            report(comm, nbytes, 1, "AG", t, t_ar)
        for ncomm in (int(v) for v in args.comms.split(",")):
            for k in (int(v) for v in args.split.split(",")):
                k = max(k, ncomm)
                cuts = [(i * nbytes // k, (i + 1) * nbytes // k) for i in range(k)]

                def exchange():
                    ready = cp.cuda.Event(disable_timing=True)
                    ready.record(stream)
                    for lane in lanes[:ncomm]:
                        lane.wait_event(ready)
                    nccl.groupStart()
                    for i, (a, b) in enumerate(cuts):
                        c, lane = ncs[i % ncomm], lanes[i % ncomm]
                        c.send(send.data.ptr + a, b - a, nccl.NCCL_UINT8, peer, lane.ptr)
                        c.recv(recv.data.ptr + a, b - a, nccl.NCCL_UINT8, peer, lane.ptr)
                    nccl.groupEnd()
                    for lane in lanes[:ncomm]:
                        done = cp.cuda.Event(disable_timing=True)
                        done.record(lane)
                        stream.wait_event(done)
                t = 1e-3 * event_ms(cp, exchange, args.iters)
                report(comm, nbytes, ncomm, k, t, t_ar)
    for c in ncs:
        c.destroy()


if __name__ == "__main__":
    main()
