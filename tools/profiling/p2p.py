"""Ranks' exchanges over NCCL, two probes in one tool (run under mpiexec, one GPU
per rank; rank 0 prints):

    mpiexec -n 2 python tools/profiling/p2p.py probe --sizes 4M,21M,42M --split 1,4
    mpiexec -n 4 python tools/profiling/p2p.py probe --sizes 4K,256K,4M,21M --comms 1,4
    mpiexec -n 2 python tools/profiling/p2p.py pair-ab --sizes 23,26,27 --codec dynamiq:5 --rounds 3

probe    raw NCCL point-to-point (and all-gather) against NCCL's all-reduce on
         the link at hand, two ranks or a ring of more: how fast can our
         exchanges go?
pair-ab  DynamiQ with send/receive exchanges against all-gather exchanges and
         NCCL's BF16 all-reduce, alternating in one process

`p2p.py SUBCOMMAND --help` says what each one measures and takes.  CuPy and
NCCL are imported inside the subcommands, so --help needs neither.
"""
import argparse
import os
import time

from mpi4py import MPI

# tools/profiling/ is on sys.path when run as a script
from host_time import event_ms, log2_sizes, use_gpu


def parse_size(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * units[s[-1]]) if s[-1] in units else int(s)


def two_ranks(cp, local):
    """The world of two ranks, one GPU each (see host_time.use_gpu)."""
    comm = MPI.COMM_WORLD
    assert comm.size == 2, "two ranks"
    use_gpu(cp, comm, local=local)
    return comm


def nccl_communicators(comm, nccl, count):
    """`count` NCCL communicators over comm's ranks (rank 0 makes the ids)."""
    uids = comm.bcast([nccl.get_unique_id() for _ in range(count)] if comm.rank == 0 else None)
    return [nccl.NcclCommunicator(comm.size, uid, comm.rank) for uid in uids]


# ---------------------------------------------------------------- probe

def report(comm, nbytes, ncomm, split, t, t_ar):
    """One row: the slowest rank's exchange and all-reduce times, as GB/s per
    direction, the all-reduce's as its bus rate (2 (n - 1) / n of the bytes;
    for two ranks, the bytes)."""
    worst = comm.allreduce(t, op=MPI.MAX)
    worst_ar = comm.allreduce(t_ar, op=MPI.MAX)
    bus = 2 * (comm.size - 1) / comm.size
    if comm.rank == 0:
        print(f"{nbytes:>11d} {ncomm:>5} {split:>5} {worst * 1e3:8.3f} "
              f"{nbytes / worst / 1e9:9.1f} {worst_ar * 1e3:12.3f} "
              f"{bus * nbytes / worst_ar / 1e9:14.1f}", flush=True)


def probe(args):
    """NCCL point-to-point against NCCL's all-reduce on the link at hand (two
ranks or more, one GPU each): how fast can our exchanges go?

For each message size: one grouped send + receive of `size` bytes with the
peer (more than two ranks: a ring, every rank sending to the next and
receiving from the previous at once, as a ring's step does; `--split k`: the message cut into k sends and k receives in the same
group; `--comms c`: the pieces spread over c communicators, each on its own
stream, as our transport's lanes; `--allgather`: also the same bytes as one
NCCL all-gather of two `size`-byte parts, in place, which uses the
collective's channels instead of point-to-point's), timed with CUDA events over `--iters`
calls (median), as GB/s per direction; beside it NCCL's all-reduce of `size` bytes of BF16 (its bus
rate; for two ranks, per direction). Small sizes give the exchange's latency. Run it under the NCCL
environment to probe:

    mpiexec -n 2 python tools/profiling/p2p.py probe --sizes 4M,21M,42M --split 1,4
"""
    import cupy as cp
    from cupy.cuda import nccl

    comm = MPI.COMM_WORLD
    assert comm.size >= 2, "two ranks or more"
    use_gpu(cp, comm, local=False)
    rank = comm.rank
    if args.allgather and comm.size != 2:
        raise SystemExit("p2p.py probe: --allgather times two ranks only")
    max_comms = max(int(c) for c in args.comms.split(","))
    ncs = nccl_communicators(comm, nccl, max_comms)
    nc = ncs[0]
    lanes = [cp.cuda.Stream(non_blocking=True) for _ in range(max_comms)]
    stream = cp.cuda.get_current_stream()
    to, frm = (rank + 1) % comm.size, (rank - 1) % comm.size     # two ranks: the peer
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
                        c.send(send.data.ptr + a, b - a, nccl.NCCL_UINT8, to, lane.ptr)
                        c.recv(recv.data.ptr + a, b - a, nccl.NCCL_UINT8, frm, lane.ptr)
                    nccl.groupEnd()
                    for lane in lanes[:ncomm]:
                        done = cp.cuda.Event(disable_timing=True)
                        done.record(lane)
                        stream.wait_event(done)
                t = 1e-3 * event_ms(cp, exchange, args.iters)
                report(comm, nbytes, ncomm, k, t, t_ar)
    for c in ncs:
        c.destroy()


# ---------------------------------------------------------------- pair-ab

def pair_allgather_ab(args):
    """Two ranks' exchanges as send/receive pairs against NCCL all-gathers, in one
process, alternating (run under mpiexec -n 2, one GPU per rank; rank 0 prints).

    mpiexec -n 2 python tools/profiling/p2p.py pair-ab --sizes 23,26,27 --codec dynamiq:5 --rounds 3

For each size: NCCL's BF16 all-reduce (its own communicator), DynamiQ over a
transport with point-to-point exchanges and over one whose two-rank exchanges
are all-gathers (`pair_allgather`), timed in alternating rounds of `--calls`
back-to-back calls, so a drifting link (the loopback sockets) weighs on all
three alike.  The reference is also timed before our communicators exist, to
see whether their threads slow it.  Both variants must give the same bytes.
"""
    import cupy as cp
    from cupy.cuda import nccl

    import dynamiq_mpi as dq
    from dynamiq_mpi.codecs import codec_from_string
    from dynamiq_mpi.bench.gradients import gradient_like_xp

    comm = two_ranks(cp, local=True)
    stream = cp.cuda.get_current_stream()
    ref, = nccl_communicators(comm, nccl, 1)
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

    sizes = [1 << log2 for log2 in log2_sizes(args.sizes)]
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


# ---------------------------------------------------------------- command line

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", metavar="SUBCOMMAND", required=True)

    def command(name, fn, help):
        p = sub.add_parser(name, help=help, description=fn.__doc__.strip("\n"),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(run=fn)
        return p

    p = command("probe", probe, "raw NCCL point-to-point and all-gather against the all-reduce")
    p.add_argument("--sizes", default="4M,21M,42M")
    p.add_argument("--split", default="1,4")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--comms", default="1", help="communicators (lanes) to spread over, e.g. 1,2")
    p.add_argument("--allgather", action="store_true", help="also time an in-place all-gather")

    p = command("pair-ab", pair_allgather_ab, "DynamiQ's send/receive against all-gather exchanges, alternating")
    p.add_argument("--sizes", default="23,26,27", help="log2 of element counts")
    p.add_argument("--codec", default="dynamiq:5")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tile-bytes", type=int, default=None, help="bytes of compressed stream per message")
    p.add_argument("--timeline", action="store_true",
                   help="then one profiled call per variant at the largest size: every message's rate")

    args = ap.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
