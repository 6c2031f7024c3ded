"""Two ranks' exchanges as send/receive pairs against NCCL all-gathers, in one
process, alternating (run under mpiexec -n 2, one GPU per rank; rank 0 prints).

    mpiexec -n 2 python tools/profiling/pair_ab.py --sizes 23,26,27 --codec dynamiq:5 --rounds 3

For each size: NCCL's BF16 all-reduce (its own communicator), DynamiQ over a
transport with point-to-point exchanges and over one whose two-rank exchanges
are all-gathers (`pair_allgather`), timed in alternating rounds of `--calls`
back-to-back calls, so a drifting link (the loopback sockets) weighs on all
three alike.  The reference is also timed before our communicators exist, to
see whether their threads slow it.  Both variants must give the same bytes.
"""
import argparse
import os
import time

from mpi4py import MPI


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="23,26,27", help="log2 of element counts")
    ap.add_argument("--codec", default="dynamiq:5")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tile-bytes", type=int, default=None, help="bytes of compressed stream per message")
    ap.add_argument("--timeline", action="store_true",
                    help="then one profiled call per variant at the largest size: every message's rate")
    args = ap.parse_args()
    import cupy as cp
    from cupy.cuda import nccl

    import dynamiq_mpi as dq
    from dynamiq_mpi.codecs import codec_from_string
    from dynamiq_mpi.studies.gradients import gradient_like_xp

    comm = MPI.COMM_WORLD
    assert comm.size == 2, "two ranks"
    local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", comm.rank))
    cp.cuda.Device(local % cp.cuda.runtime.getDeviceCount()).use()
    stream = cp.cuda.get_current_stream()
    uid = comm.bcast(nccl.get_unique_id() if comm.rank == 0 else None)
    ref = nccl.NcclCommunicator(comm.size, uid, comm.rank)
    codec = codec_from_string(args.codec)

    def timed(fn):
        fn()
        stream.synchronize()
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        stream.synchronize()
        return comm.allreduce((time.perf_counter() - t0) / args.calls, op=MPI.MAX) * 1e3

    sizes = [1 << int(s) for s in args.sizes.split(",")]
    xs = {n: gradient_like_xp(cp, n, comm.rank, dtype=dq.backend.BFLOAT16) for n in sizes}
    outs = {n: cp.empty_like(xs[n]) for n in sizes}

    def reference(n):
        return lambda: ref.allReduce(xs[n].data.ptr, outs[n].data.ptr, n, nccl.NCCL_BFLOAT16,
                                     nccl.NCCL_SUM, stream.ptr)

    alone = {n: timed(reference(n)) for n in sizes}
    colls = {}
    for pair in ("0", "1"):        # the transport reads the switch when it is made
        os.environ["DYNAMIQ_NCCL_PAIR_ALLGATHER"] = pair
        colls[pair] = dq.Collective(comm, transport="nccl", **(
            {"tile_bytes": args.tile_bytes} if args.tile_bytes else {}))
        colls[pair].allreduce(xs[sizes[0]], codec=codec, out=outs[sizes[0]])
    os.environ.pop("DYNAMIQ_NCCL_PAIR_ALLGATHER")
    if comm.rank == 0:
        print(f"# {args.codec}, {args.calls} calls x {args.rounds} rounds, ms per call; "
              f"speed-up = NCCL all-reduce / ours, same rounds")
        print(f"{'log2':>4s} {'round':>5s} {'NCCL alone':>10s} {'NCCL':>8s} {'send/recv':>9s} "
              f"{'all-gather':>10s} {'x send/recv':>11s} {'x all-gather':>12s}")
    for n in sizes:
        got = {}
        for pair, c in colls.items():
            c.allreduce(xs[n], codec=codec, out=outs[n])
            got[pair] = outs[n].copy()
        same = bool(cp.array_equal(got["0"], got["1"]))
        for r in range(args.rounds):
            t_ref = timed(reference(n))
            t = {pair: timed(lambda c=c: c.allreduce(xs[n], codec=codec, out=outs[n]))
                 for pair, c in colls.items()}
            if comm.rank == 0:
                print(f"{n.bit_length() - 1:4d} {r:5d} {alone[n]:10.3f} {t_ref:8.3f} {t['0']:9.3f} "
                      f"{t['1']:10.3f} {t_ref / t['0']:10.2f}x {t_ref / t['1']:11.2f}x", flush=True)
        same = comm.allreduce(int(same), op=MPI.MIN)
        if comm.rank == 0:
            print(f"     2^{n.bit_length() - 1}: same bytes from both variants on every rank: "
                  f"{bool(same)}", flush=True)
    if args.timeline:
        n = sizes[-1]
        for pair, c in colls.items():
            _, rep = c.allreduce(xs[n], codec=codec, out=outs[n], return_report=True, profile=True)
            if comm.rank == 0:
                phases = {k: round(v * 1e6) for k, v in rep.phases.items() if k != "timeline"}
                print(f"== timeline 2^{n.bit_length() - 1}, {'all-gather' if pair == '1' else 'send/recv'}:"
                      f" {phases}")
                for a, b, sent, got in rep.phases.get("timeline", []):
                    print(f"  {a:9.3f} -> {b:9.3f} ms  sent {sent / 1e6:7.2f} MB  received {got / 1e6:7.2f} MB"
                          f"  {max(sent, got) / 1e6 / max(b - a, 1e-9):6.2f} GB/s", flush=True)
    for c in colls.values():
        c.free()
    ref.destroy()


if __name__ == "__main__":
    main()
