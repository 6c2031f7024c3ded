"""The CUDA-aware MPI transport over real MPI ranks.

On CPU the transport runs with NumPy arrays and a fake stream (its array
module and synchronise hook are injected), so its logic - non-blocking
sends and receives, claims, forwarded buffers, the stream syncs, the end of
a call - is checked on every CI run: results bit-identical to the
host-staged MPI transport and to the simulation, and the order of syncs and
MPI calls recorded and checked against the rules in mpi_cuda.py.  The public
API's clear error on an MPI without CUDA support is checked on every rank.

The GPU part (CuPy arrays through ``transport="mpi-cuda"``) runs only where
the kernels are built and every rank's MPI is CUDA-aware
(the mpi-cuda-* stages of tools/device.sh build such an MPI on the GPU machine).
"""
import numpy as np
import pytest
from mpi4py import MPI

import dynamiq_mpi as dq
from dynamiq_mpi.call.engine import CallSpec, rank_program
from dynamiq_mpi.transports.cuda_aware import ENV, cuda_aware_mpi
from dynamiq_mpi.transports.mpi_cuda import MPICudaTransport
from dynamiq_mpi.transports.mpi_host import MPITransport
from dynamiq_mpi.call.planner import resolve_path
from dynamiq_mpi.transports.ops import Route, drive
from dynamiq_mpi.call.workspace import Workspace
from helpers import BF16, digest, rank_inputs, same_everywhere, shared_seed

# The same at every world size above 4: not run again at 6 and 8 ranks (CI time).
pytestmark = pytest.mark.max_size(4)

comm = MPI.COMM_WORLD
N = comm.size
TOPOLOGIES = ["ring"] + (["butterfly"] if N & (N - 1) == 0 else [])
CODECS = [dq.Exact(), dq.BF16(), dq.DynamiQ(bits=5, small_input=0),
          dq.DynamiQ(bits=3, correlated=False, small_input=0), dq.MXFP("e4m3")]


def run_on(transport, x, spec, workspace=None):
    program = rank_program(comm.rank, N, x, spec, None, workspace or Workspace())
    return drive(program, lambda req: resolve_path(transport.name, req) if isinstance(req, Route)
                 else transport.answer(req))


class Recorder:
    """The transport's communicator, recording the order of its MPI calls
    against the syncs of the fake stream, and checking the rules as it goes:
    a computed payload reaches Isend only after a sync; a forwarded one only
    after its receive completed; a receive never lands on a send in flight."""

    def __init__(self, comm):
        self.comm = comm
        self.log = []            # "sync", ("irecv", lo, hi), ("isend", lo, hi, kind)
        self.recvs = {}          # (lo, hi) -> request of the receive into it
        self.sends = []          # (lo, hi, request)
        self.synced = False      # a sync since the last Isend of a computed payload
        self.violations = []

    def sync(self):
        self.log.append("sync")
        self.synced = True

    @staticmethod
    def _range(buf):
        lo = buf[0].ctypes.data
        return lo, lo + buf[0].nbytes

    def Irecv(self, buf, source, tag):
        lo, hi = self._range(buf)
        for a, b, req in self.sends:
            if a < hi and lo < b and req != MPI.REQUEST_NULL:
                self.violations.append(f"Irecv into [{lo}, {hi}) over a send in flight")
        req = self.comm.Irecv(buf, source, tag)
        self.recvs[(lo, hi)] = req
        self.log.append(("irecv", lo, hi))
        return req

    def Isend(self, buf, dest, tag):
        lo, hi = self._range(buf)
        landed = self.recvs.get((lo, hi))
        if landed is not None:
            if landed != MPI.REQUEST_NULL:
                self.violations.append(f"forwarded [{lo}, {hi}) before its receive completed")
            kind = "forwarded"
        else:
            if not self.synced:
                self.violations.append(f"computed [{lo}, {hi}) sent without a sync")
            self.synced = False
            kind = "computed"
        req = self.comm.Isend(buf, dest, tag)
        self.sends.append((lo, hi, req))
        self.log.append(("isend", lo, hi, kind))
        return req

    def reset(self):
        self.log.clear()
        self.recvs.clear()
        self.sends.clear()

    def __getattr__(self, name):
        return getattr(self.comm, name)


@pytest.fixture(scope="module")
def recorded():
    rec = Recorder(None)
    t = MPICudaTransport(comm, xp=np, synchronize=rec.sync)
    rec.comm, t.comm = t.comm, rec
    yield t, rec
    t.comm = rec.comm
    t.free()


@pytest.fixture(scope="module")
def host():
    t = MPITransport(comm)
    yield t
    t.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: "-".join(map(str, c.signature()[:3])))
def test_mpi_cuda_logic_equals_host_staged_mpi(recorded, host, codec, topology):
    transport, rec = recorded
    seed = shared_seed(comm)
    xs = rank_inputs(seed, N, 256 * 61 + 19)
    for tile_bytes in (100, 700, 1 << 20):
        spec = CallSpec(codec, topology, "sum", seed % 997, 5, "auto", tile_bytes)
        rec.reset()
        out, rep = run_on(transport, xs[comm.rank], spec)
        ref, ref_rep = run_on(host, xs[comm.rank], spec)
        assert digest(out) == digest(ref), f"seed {seed}, tile_bytes {tile_bytes}"
        assert same_everywhere(comm, digest(out))
        sim = dq.simulate_allreduce(xs, codec=codec, topology=topology, seed=seed % 997,
                                    counter=5, tile_bytes=tile_bytes)[comm.rank]
        assert digest(out) == digest(sim)
        assert rep.transport == "mpi-cuda" and ref_rep.transport == "mpi"
        assert rep.bytes_sent == ref_rep.bytes_sent
        assert rec.violations == [], rec.violations[:3]
        sent = [e for e in rec.log if e != "sync" and e[0] == "isend"]
        assert sum(hi - lo for _, lo, hi, _ in sent) == rep.bytes_sent
        assert rec.log[0] == "sync"                 # the first exchange of a call syncs
        if tile_bytes == 100:                       # many tiles: many requests in flight
            assert rep.tiles_per_chunk > 1
            # beyond two ranks the all-gather forwards what it received
            assert (N > 2) == any(k == "forwarded" for *_, k in sent)
        # the call ended with nothing in flight
        assert not transport._sends and not transport._recvs and transport._fresh
        assert all(req == MPI.REQUEST_NULL for *_, req in rec.sends)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_successive_calls_reuse_the_workspace(recorded, dtype):
    """Calls back to back on one workspace (buffers reused across calls)."""
    transport, _ = recorded
    seed = shared_seed(comm)
    ws = Workspace()
    codec = dq.DynamiQ(bits=4, small_input=0)
    for counter in range(3):
        xs = rank_inputs(seed + counter, N, 256 * 40 + 3, dtype=dtype)
        spec = CallSpec(codec, "ring", "mean", 3, counter, "auto", 300)
        out, _ = run_on(transport, xs[comm.rank], spec, ws)
        sim = dq.simulate_allreduce(xs, codec=codec, op="mean", seed=3, counter=counter,
                                    tile_bytes=300)[comm.rank]
        assert digest(out) == digest(sim), f"seed {seed}, call {counter}"


@pytest.mark.mpi(min_size=2)
def test_a_call_that_fails_after_data_moved_leaves_nothing_in_flight(recorded):
    """NaN on one rank: every rank raises after the statistics exchange; the
    requests still posted are completed by end_call, and the next call works."""
    transport, _ = recorded
    seed = shared_seed(comm)
    xs = rank_inputs(seed, N, 256 * 30)
    bad = xs[comm.rank].copy()
    if comm.rank == N - 1:
        bad[5] = np.nan
    spec = CallSpec(dq.DynamiQ(bits=5, small_input=0), "ring", "sum", 1, 0, "auto", 500,
                    nonfinite="raise")
    with pytest.raises(dq.NonFiniteInputError):
        run_on(transport, bad, spec)
    transport.end_call(failed=True)
    assert not transport._sends and not transport._recvs
    out, _ = run_on(transport, xs[comm.rank], spec)
    sim = dq.simulate_allreduce(xs, codec=spec.codec, seed=1, counter=0, tile_bytes=500)
    assert digest(out) == digest(sim[comm.rank])


@pytest.mark.mpi(min_size=2)
def test_profiled_marks_serialise_and_drain(recorded):
    transport, rec = recorded
    xs = rank_inputs(shared_seed(comm), N, 256 * 20)
    transport.start_profile(device=True)
    rec.reset()
    run_on(transport, xs[comm.rank], CallSpec(dq.BF16(), "ring", "sum", 0, 0, "auto", 400))
    prof = transport.stop_profile()
    names = [name for name, _ in prof.marks]
    assert names[:3] == ["statistics", "plan", "reduce-scatter"] and names[-1] == "done"
    assert rec.violations == []


@pytest.mark.mpi(min_size=2)
def test_asking_for_mpi_cuda_without_it_raises_on_every_rank(monkeypatch):
    seed = shared_seed(comm)
    x = rank_inputs(seed, N, 3000)[comm.rank]
    out = np.full_like(x, 9)
    monkeypatch.delenv(ENV, raising=False)
    aware_everywhere = comm.allreduce(int(cuda_aware_mpi().aware), op=MPI.MIN)
    if aware_everywhere:
        pytest.skip("this MPI is CUDA-aware")
    with pytest.raises(dq.InvalidInputError, match="transport='mpi-cuda' needs a CUDA-aware MPI"):
        dq.allreduce(x, codec=dq.BF16(), transport="mpi-cuda", out=out)
    assert np.all(out == 9)                        # nothing moved, nothing written
    # an override on some ranks only: every rank still raises, naming the others
    if comm.rank == 0:
        monkeypatch.setenv(ENV, "1")
    with pytest.raises(dq.InvalidInputError) as err:
        dq.allreduce(x, codec=dq.BF16(), transport="mpi-cuda")
    text = str(err.value)
    assert "rank 0" not in text and ("rank 1:" in text or "ranks [1" in text)
    assert same_everywhere(comm, text)
    # overridden everywhere: the MPI passes, the host arrays do not
    monkeypatch.setenv(ENV, "1")
    with pytest.raises(dq.InvalidInputError, match=r"needs device \(CuPy\) arrays"):
        dq.allreduce(x, codec=dq.BF16(), transport="mpi-cuda")
    # and the library still works, reporting why it chose what it chose
    monkeypatch.delenv(ENV)
    got, rep = dq.allreduce(x, codec=dq.BF16(), return_report=True)
    assert rep.transport == "mpi" and rep.transport_reason.startswith("auto: host arrays")
    assert same_everywhere(comm, digest(got))


# -- the real thing: CuPy arrays through a CUDA-aware MPI -------------------------------
def _gpu_and_cuda_aware_everywhere():
    ok = dq.has_cuda() and cuda_aware_mpi().aware
    return bool(comm.allreduce(int(ok), op=MPI.MIN))


GPU_OK = _gpu_and_cuda_aware_everywhere()
needs_gpu = pytest.mark.skipif(not GPU_OK,
                               reason="needs the CUDA kernels and a CUDA-aware MPI on every rank")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("tile_bytes", [4096, 8 << 20], ids=["tiles4K", "tiles8M"])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: "-".join(map(str, c.signature()[:2])))
def test_gpu_mpi_cuda_equals_cpu_bit_for_bit(codec, topology, dtype, tile_bytes):
    import cupy as cp
    cp.cuda.Device(comm.rank % cp.cuda.runtime.getDeviceCount()).use()
    seed = shared_seed(comm)
    xs = rank_inputs(seed, N, 256 * 300 + 77, dtype=dtype)
    d_x = cp.asarray(xs[comm.rank])
    coll = dq.Collective(comm, transport="mpi-cuda", tile_bytes=tile_bytes)
    try:
        d_out, rep = coll.allreduce(d_x, codec=codec, topology=topology, seed=seed % 1000,
                                    return_report=True)
        assert rep.transport == "mpi-cuda" and rep.transport_reason == "requested"
        out = cp.asnumpy(d_out)
        cpu = dq.simulate_allreduce(xs, codec=codec, topology=topology, seed=seed % 1000,
                                    counter=rep.call_counter, tile_bytes=tile_bytes)[comm.rank]
        assert digest(out) == digest(cpu), f"seed {seed}"
        assert same_everywhere(comm, digest(out))
        # in place, on another stream, a second call: still the same bits
        with cp.cuda.Stream(non_blocking=True):
            coll.counter = rep.call_counter
            got = coll.allreduce(d_x, codec=codec, topology=topology, seed=seed % 1000, out=d_x)
            assert got is d_x
            assert digest(cp.asnumpy(d_x)) == digest(cpu)
    finally:
        coll.free()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.mpi(min_size=2)
def test_gpu_auto_uses_mpi_cuda_when_nccl_is_refused(monkeypatch):
    import cupy as cp

    import dynamiq_mpi.transports.nccl as nccl_mod
    cp.cuda.Device(comm.rank % cp.cuda.runtime.getDeviceCount()).use()
    monkeypatch.setattr(nccl_mod, "_status", (False, "NCCL refused by the test"))
    x = cp.asarray(rank_inputs(shared_seed(comm), N, 5000)[comm.rank])
    _, rep = dq.allreduce(x, codec=dq.BF16(), return_report=True)
    assert rep.transport == "mpi-cuda"
    assert "NCCL refused by the test" in rep.transport_reason
    assert "MPI CUDA-aware on every rank" in rep.transport_reason
