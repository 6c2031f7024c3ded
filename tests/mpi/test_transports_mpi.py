"""Transports, tiles and the call interface over real MPI ranks.

The NCCL transport runs here on host memory through tests/fake_nccl.py (NCCL
point-to-point mapped onto MPI), so its request handling - messages cut over
lanes, grouped sends and receives, forwarded buffers, claims - is checked on
every CI run; the GPU suite checks it with real NCCL on the device.
"""
import gc
import weakref

import numpy as np
import pytest
from mpi4py import MPI

import dynamiq_mpi as dq
from dynamiq_mpi import schedules
from dynamiq_mpi.call.engine import CallSpec, rank_program
from dynamiq_mpi.transports.nccl import NCCLTransport, destroy_communicator
from dynamiq_mpi.call.planner import resolve_path
from dynamiq_mpi.transports.ops import Route, drive
from dynamiq_mpi.call.workspace import Workspace
from fake_nccl import _Comm as _FakeComm
from fake_nccl import modules as fake_modules
from helpers import BF16, digest, exact_sum, rank_inputs, same_everywhere, shared_seed, vnmse

comm = MPI.COMM_WORLD
N = comm.size
TOPOLOGIES = ["ring"] + (["butterfly"] if N & (N - 1) == 0 else [])
CODECS = [dq.Exact(), dq.BF16(), dq.DynamiQ(bits=5, small_input=0),
          dq.DynamiQ(bits=3, correlated=False, small_input=0), dq.MXFP("e4m3"),
          dq.MXFP("e3m2"), dq.MXFP("e2m1")]


def run_on(transport, x, spec, out=None):
    """One call of the engine driven by ``transport`` (Route answered by it)."""
    program = rank_program(comm.rank, N, x, spec, out, Workspace())
    return drive(program, lambda req: resolve_path(transport.name, req) if isinstance(req, Route)
                 else transport.answer(req))


@pytest.fixture(scope="module", params=["p2p", "pair-allgather"])
def fake_nccl(request):
    cupy, nccl = fake_modules()
    t = NCCLTransport(comm.Dup(), 0, lanes=3, lane_bytes=512, modules=(cupy, nccl),
                      pair_allgather=request.param == "pair-allgather")
    yield t, nccl
    t.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("gather", schedules.GATHERS)
@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: "-".join(map(str, c.signature()[:3])))
def test_nccl_transport_logic_equals_simulation(fake_nccl, codec, topology, gather):
    # (the simulation runs the ring's all-gather: the doubling's bits must equal it)
    transport, nccl = fake_nccl
    seed = shared_seed(comm)
    xs = rank_inputs(seed, N, 256 * 61 + 19)
    for tile_bytes in (700, 1 << 20):
        spec = CallSpec(codec, topology, "sum", seed % 997, 3, "auto", tile_bytes, gather=gather)
        nccl.calls.clear()
        out, rep = run_on(transport, xs[comm.rank], spec)
        assert rep.gather == gather
        sim = dq.simulate_allreduce(xs, codec=codec, topology=topology, seed=seed % 997,
                                    counter=3, tile_bytes=tile_bytes, gather="ring")[comm.rank]
        assert digest(out) == digest(sim), f"seed {seed}, tile_bytes {tile_bytes}"
        assert same_everywhere(comm, digest(out))
        assert rep.transport == "nccl"
        if transport.pair_allgather:      # two ranks: every exchange is one all-gather
            assert N == 2 and {op for op, _, _ in nccl.calls} == {"allgather"}
            continue
        # large messages were cut over the three lanes, in pieces of >= lane_bytes
        sizes = [c for op, _, c in nccl.calls if op == "send"]
        assert sum(sizes) == rep.bytes_sent
        if tile_bytes > 1 << 19:
            assert max(sizes) < max(rep.bytes_sent // 3 + 1, 1024)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("p2p_disabled", [False, True])
def test_auto_lanes_agree_on_every_rank(monkeypatch, p2p_disabled):
    """lanes="auto" gathers every rank's link record: all ranks of this one
    host make the same number of communicators, and the result is the one
    lane's (the cut over lanes does not change a byte)."""
    if p2p_disabled:
        monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    else:
        monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    monkeypatch.delenv("NCCL_SHM_DISABLE", raising=False)
    cupy, nccl = fake_modules()
    t = NCCLTransport(comm.Dup(), 0, lanes="auto", modules=(cupy, nccl))
    try:
        one_host = len(set(comm.allgather(MPI.Get_processor_name()))) == 1
        expected = 4 if p2p_disabled and one_host else 1
        assert t.lanes == expected and len(t.comms) == expected
        assert same_everywhere(comm, f"{t.lanes} {t.lane_bytes} {t.lanes_why}")
        seed = shared_seed(comm)
        xs = rank_inputs(seed, N, 256 * 23 + 7)
        codec = dq.DynamiQ(bits=5, small_input=0)
        spec = CallSpec(codec, "ring", "sum", seed % 991, 1, "auto", 1 << 20)
        out, _ = run_on(t, xs[comm.rank], spec)
        sim = dq.simulate_allreduce(xs, codec=codec, seed=seed % 991, counter=1,
                                    tile_bytes=1 << 20)[comm.rank]
        assert digest(out) == digest(sim), f"seed {seed}"
    finally:
        t.free()


@pytest.mark.mpi(min_size=3)
def test_nccl_statistics_travel_in_two_groups_of_every_peer(fake_nccl):
    """The direct statistics exchange posts every peer's message in one NCCL group."""
    transport, nccl = fake_nccl
    if N > schedules.STATS_DIRECT_RANKS:
        pytest.skip("the schedule's steps beyond STATS_DIRECT_RANKS ranks")
    xs = rank_inputs(shared_seed(comm), N, 256 * 40)
    nccl.groups.clear()
    run_on(transport, xs[comm.rank], CallSpec(dq.DynamiQ(small_input=0), "ring", "sum", 1, 0,
                                              "auto", 1 << 20))
    peers = sorted((comm.rank + k) % N for k in range(1, N))
    every_peer = [g for g in nccl.groups
                  if sorted(p for op, p in g if op == "send") == peers
                  and sorted(p for op, p in g if op == "recv") == peers]
    assert len(every_peer) == 2 and nccl.groups[:2] == every_peer    # the first two groups


@pytest.mark.mpi(min_size=2)
def test_lane_slices_are_aligned_and_cover_the_message(fake_nccl):
    transport, _ = fake_nccl
    if transport.pair_allgather:
        pytest.skip("one lane with the pair all-gather")
    rng = np.random.default_rng(shared_seed(comm))
    for nbytes in [0, 1, 511, 1024, 1537, 5 * 82 * 123, 2 ** 20 + 7] + list(rng.integers(1, 10**6, 20)):
        cuts = transport._slices(int(nbytes))
        assert cuts[0][0] == 0 and cuts[-1][1] == nbytes
        assert all(a == b_prev for (_, b_prev), (a, _) in zip(cuts, cuts[1:]))
        assert all(a % 256 == 0 for a, _ in cuts)
        assert len(cuts) <= transport.lanes and all(b > a for a, b in cuts[:-1])


@pytest.mark.mpi(min_size=2)
def test_transport_selection():
    x = rank_inputs(shared_seed(comm), N, 3000)[comm.rank]
    out, rep = dq.allreduce(x, codec=dq.BF16(), return_report=True)
    assert rep.transport == "mpi"                 # auto on host arrays
    with pytest.raises(dq.InvalidInputError, match="transport='nccl' needs device"):
        dq.allreduce(x, codec=dq.BF16(), transport="nccl")
    with pytest.raises(dq.InvalidInputError, match="transport must be one of"):
        dq.allreduce(x, codec=dq.BF16(), transport="ucx")
    with pytest.raises(ValueError, match="transport must be one of"):
        dq.Collective(comm, transport="gloo")
    # ranks asking for different transports: every rank raises, none hangs
    mine = "mpi" if comm.rank == 0 else "auto"
    with pytest.raises(dq.InputMismatchError, match="disagree on transport"):
        dq.allreduce(x, codec=dq.BF16(), transport=mine)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec", CODECS[1:3], ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_out_parameter_and_in_place(codec, dtype):
    seed = shared_seed(comm)
    xs = rank_inputs(seed, N, 256 * 50 + 3, dtype=dtype)
    coll = dq.Collective(comm)
    coll.counter = 7
    fresh = coll.allreduce(xs[comm.rank].reshape(-1, 7), codec=codec, op="mean")
    assert fresh.shape == (len(xs[0]) // 7, 7) and fresh.dtype == dtype
    coll.counter = 7
    out = np.full_like(xs[comm.rank], 123).reshape(-1, 7)
    got = coll.allreduce(xs[comm.rank].reshape(-1, 7), codec=codec, op="mean", out=out)
    assert got is out and digest(out) == digest(fresh)
    coll.counter = 7
    x = xs[comm.rank].reshape(-1, 7).copy()
    got = coll.allreduce(x, codec=codec, op="mean", out=x)       # in place, as NCCL users do
    assert got is x and digest(x) == digest(fresh)
    assert same_everywhere(comm, digest(x))
    coll.free()


@pytest.mark.mpi(min_size=2)
def test_bad_out_raises_everywhere_and_writes_nothing():
    x = rank_inputs(shared_seed(comm), N, 4000)[comm.rank]
    out = np.full(4000 if comm.rank else 3999, 5.0, np.float32)
    with pytest.raises(dq.InvalidInputError, match="rank 0: ValueError: out must have"):
        dq.allreduce(x, codec=dq.DynamiQ(small_input=0), out=out)
    assert np.all(out == 5.0)
    out = np.full(4000, 5.0, np.float64 if comm.rank == N - 1 else np.float32)
    with pytest.raises(dq.InvalidInputError, match=f"rank {N - 1}: ValueError: out must have"):
        dq.allreduce(x, codec=dq.DynamiQ(small_input=0), out=out)
    assert np.all(out == 5.0)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("length", [1, 255, 256 * 37 + 5, 70001])
def test_tiles_do_not_change_the_result(length):
    seed = shared_seed(comm)
    xs = rank_inputs(seed, N, length)
    codec = dq.DynamiQ(bits=5, small_input=0)
    results = []
    for tile_bytes in (64, 1000, 1 << 30):
        coll = dq.Collective(comm, tile_bytes=tile_bytes)
        out, rep = coll.allreduce(xs[comm.rank], codec=codec, seed=seed % 1000,
                                  return_report=True)
        results.append(digest(out))
        if tile_bytes == 64 and length > 1000:
            assert rep.tiles_per_chunk > 1
        coll.free()
    assert len(set(results)) == 1, f"seed {seed}"
    assert same_everywhere(comm, results[0])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_float16_and_float64_inputs(dtype):
    seed = shared_seed(comm)
    xs = [x.astype(dtype) for x in rank_inputs(seed, N, 80000, kind="normal")]
    for codec, bound in ((dq.Exact(), 1e-6), (dq.DynamiQ(bits=6), 0.05)):
        out = dq.allreduce(xs[comm.rank], codec=codec)
        assert out.dtype == dtype and out.shape == xs[0].shape
        assert same_everywhere(comm, digest(out))
        assert vnmse(out, exact_sum(xs)) < bound + (1e-6 if dtype == np.float16 else 0)


@pytest.mark.mpi(min_size=2)
def test_small_inputs_go_as_bf16_and_report_it():
    seed = shared_seed(comm)
    for length in (1, 255, 257, 4095):
        xs = rank_inputs(seed, N, length)
        out, rep = dq.allreduce(xs[comm.rank], codec=dq.DynamiQ(bits=5), return_report=True)
        assert "fallback" in rep.codec_info and "bf16" in rep.codec_info["fallback"]
        assert rep.bits_per_coord == pytest.approx(16.0)
        # BF16 on the wire: every partial sum rounded once per hop (relative 2^-9)
        mag = np.sum(np.abs(np.stack(xs).astype(np.float64)), axis=0)
        assert np.all(np.abs(out - exact_sum(xs)) <= N * 2.0 ** -8 * mag), f"length {length}"
    threshold = dq.DynamiQ().small_input
    for length, falls_back in ((threshold - 1, True), (threshold, False)):
        x = np.random.default_rng([seed, comm.rank]).standard_normal(length).astype(np.float32)
        _, rep = dq.allreduce(x, codec=dq.DynamiQ(bits=5), return_report=True)
        assert ("fallback" in rep.codec_info) == falls_back
        assert rep.bits_per_coord == (pytest.approx(16.0) if falls_back else rep.bits_per_coord)
        assert falls_back or rep.bits_per_coord <= 5.0


@pytest.mark.mpi(min_size=2)
def test_small_input_with_nan_still_raises_everywhere():
    x = rank_inputs(shared_seed(comm), N, 300)[comm.rank]
    if comm.rank == N - 1:
        x[7] = np.nan
    keep = x.copy()
    with pytest.raises(dq.NonFiniteInputError, match="NaN or Inf"):
        dq.allreduce(x, codec=dq.DynamiQ(bits=5), out=x, nonfinite="raise")
    assert np.array_equal(x, keep, equal_nan=True)          # nothing written


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m3"])
def test_mx_codecs_identical_everywhere_and_equal_to_simulation(fmt):
    seed = shared_seed(comm)
    xs = rank_inputs(seed, N, 32 * 400 + 5)
    for topology in TOPOLOGIES:
        out, rep = dq.allreduce(xs[comm.rank], codec=dq.MXFP(fmt), topology=topology,
                                return_report=True)
        sim = dq.simulate_allreduce(xs, codec=dq.MXFP(fmt), topology=topology,
                                    counter=rep.call_counter)[comm.rank]
        assert digest(out) == digest(sim), f"seed {seed}"
        assert same_everywhere(comm, digest(out))
        assert rep.codec_info["format"] == fmt


class _CountedComm(_FakeComm):
    """The fake communicator, counting what CuPy's NcclCommunicator does when
    it is deallocated: ncclCommDestroy, unless destroy() ran first."""
    by_collector = 0

    def destroy(self):
        self.destroyed = True
        super().destroy()

    def __del__(self):
        if not getattr(self, "destroyed", False):
            type(self).by_collector += 1


@pytest.mark.mpi(min_size=2)
def test_a_transport_dropped_without_free_keeps_its_communicators():
    """ncclCommDestroy is collective among a node's ranks (NCCL's proxy
    thread lives until every peer has dropped the communicator, and the
    destroy joins it), and CuPy's communicator destroys itself when
    deallocated.  A transport dropped without free() - its Collective in a
    reference cycle, as a HookState's is - goes when each rank's garbage
    collector happens to run: destroyed then, the first rank to collect
    waits inside whatever it was doing for ranks that wait for it in their
    next collective (a hang).  So no collection destroys one; free() does,
    on every rank alike."""
    cupy, nccl = fake_modules()
    nccl.NcclCommunicator = lambda ndev, uid, rank: _CountedComm(nccl, ndev, rank)
    _CountedComm.by_collector = 0
    t = NCCLTransport(comm.Dup(), 0, lanes=2, modules=(cupy, nccl))
    refs = [weakref.ref(c) for c in t.comms]
    cycle = [t]
    cycle.append(cycle)                 # only the garbage collector frees it
    del t, cycle
    gc.collect()
    assert _CountedComm.by_collector == 0, "the garbage collector destroyed a communicator"
    assert all(r() is not None for r in refs)
    for r in refs:                      # what free() would have done, collectively
        destroy_communicator(r())
    assert all(r() is None for r in refs)
    # free() destroys them and lets them go
    t = NCCLTransport(comm.Dup(), 0, lanes=2, modules=(cupy, nccl))
    refs = [weakref.ref(c) for c in t.comms]
    t.free()
    del t
    assert all(r() is None for r in refs) and _CountedComm.by_collector == 0
