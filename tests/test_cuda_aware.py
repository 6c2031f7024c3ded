"""CUDA-aware MPI: detection, the transport choice and its errors, in one process.

Detection is driven against fake MPIs that say yes, no and nothing: the info
object and the library's C functions are injected (the library's functions
are real ctypes callbacks, called the way the MPI's would be).  The real MPI
of this machine (PyPI MPICH, not CUDA-aware) is probed too.
"""
import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

import dynamiq_mpi as dq
from dynamiq_mpi.transports import (TRANSPORTS, choose_transport, explain_transport,
                                    transport_capabilities)
from dynamiq_mpi.transports import cuda_aware
from dynamiq_mpi.transports.cuda_aware import ENV, CudaAwareness, cuda_aware_mpi, detect
from dynamiq_mpi.transports.mpi_cuda import MPICudaTransport
from dynamiq_mpi.transports.ops import Claim, Exchange, Mark, Received
from helpers import fresh_seed, rank_inputs

GPU_QUERY_T = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int))
CUDA_QUERY_T = ctypes.CFUNCTYPE(ctypes.c_int)


class Info:
    """An MPI.Info stand-in holding one value of mpi_memory_alloc_kinds."""

    def __init__(self, kinds):
        self.kinds = kinds
        self.asked = []

    def Get(self, key):
        self.asked.append(key)
        return self.kinds if key == "mpi_memory_alloc_kinds" else None


class Untouchable:
    """A source that must not be consulted (an earlier step answered)."""

    def Get(self, key):
        raise AssertionError("consulted after an earlier source answered")

    def __iter__(self):
        raise AssertionError("consulted after an earlier source answered")


def mpich_like(flag, rc=0, calls=None):
    """A library exporting MPIX_GPU_query_support (and the CUDA query, which
    must then not be called: it asserts in old MPICH builds)."""
    def gpu_query(kind, out):
        if calls is not None:
            calls.append(("gpu", kind))
        out[0] = flag
        return rc

    def cuda_query():       # an exception would not cross ctypes: record the call
        if calls is not None:
            calls.append(("cuda",))
        return 1
    # keep the callbacks alive as long as the library object
    return SimpleNamespace(MPIX_GPU_query_support=GPU_QUERY_T(gpu_query),
                           MPIX_Query_cuda_support=CUDA_QUERY_T(cuda_query))


def openmpi_like(value):
    return SimpleNamespace(MPIX_Query_cuda_support=CUDA_QUERY_T(lambda: value))


NO_QUERY = SimpleNamespace()      # a library that exports neither query


# -- detection ------------------------------------------------------------------
@pytest.mark.parametrize("value, aware", [("1", True), ("0", False), (" 1 ", True)])
def test_env_override_decides_first_and_consults_nothing_else(value, aware):
    got = detect(environ={ENV: value}, info=Untouchable(), libraries=Untouchable())
    assert got == CudaAwareness(aware, "env", f"{ENV}={value.strip()}")


def test_env_override_beats_an_mpi_that_says_yes():
    got = detect(environ={ENV: "0"}, info=Info("mpi,system,cuda"),
                 libraries=[("libmpi.so", openmpi_like(1))])
    assert not got.aware and got.source == "env"


def test_bad_env_value_is_no_and_says_why():
    got = detect(environ={ENV: "yes"}, info=Untouchable(), libraries=Untouchable())
    assert not got.aware and got.source == "env" and "must be 0 or 1, got 'yes'" in got.why


@pytest.mark.parametrize("kinds", ["mpi,system,cuda", "system, mpi ,cuda:device",
                                   "mpi,system,cuda:device,cuda:managed,cuda", "CUDA"])
def test_info_key_listing_cuda_device_memory_says_yes(kinds):
    info = Info(kinds)
    got = detect(environ={}, info=info, libraries=Untouchable())
    assert got.aware and got.source == "info" and repr(kinds) in got.why
    assert info.asked == ["mpi_memory_alloc_kinds"]


@pytest.mark.parametrize("kinds", ["mpi,system", None, "mpi,system,cuda:host", "",
                                   "mpi,system,rocm", "cudax"])
def test_info_key_without_cuda_device_falls_through_to_the_query(kinds):
    """MPICH lists 'mpi,system', Open MPI 5 gives None, and Open MPI 6 lists
    GPU kinds only when asked for: none of these is an answer."""
    got = detect(environ={}, info=Info(kinds), libraries=[("libmpi.so.40", openmpi_like(1))])
    assert got.aware and got.source == "query"
    assert "MPIX_Query_cuda_support() = 1 in libmpi.so.40" in got.why


def test_info_that_raises_is_no_answer():
    class Broken:
        def Get(self, key):
            raise NotImplementedError("MPI 3.1")
    got = detect(environ={}, info=Broken(), libraries=[("l", openmpi_like(0))])
    assert not got.aware and got.source == "query" and "=None" in got.why


def test_info_may_be_a_callable_returning_the_info_object():
    got = detect(environ={}, info=lambda: Info("mpi,cuda"), libraries=[])
    assert got.aware and got.source == "info"


@pytest.mark.parametrize("flag, rc, aware, text", [
    (1, 0, True, "MPIX_GPU_query_support(CUDA) = 1 in libmpich.so.12: CUDA-aware"),
    (0, 0, False, "MPIX_GPU_query_support(CUDA) = 0 in libmpich.so.12: not CUDA-aware"),
    (1, 17, False, "MPIX_GPU_query_support(CUDA) failed (17)"),
])
def test_mpich_style_query_is_asked_for_cuda_and_preferred(flag, rc, aware, text):
    calls = []
    got = detect(environ={}, info=Info("mpi,system"),
                 libraries=[("libmpich.so.12", mpich_like(flag, rc, calls))])
    assert got.aware is aware and got.source == "query" and text in got.why
    assert "mpi_memory_alloc_kinds='mpi,system'" in got.why
    assert calls == [("gpu", cuda_aware.MPIX_GPU_SUPPORT_CUDA)]


@pytest.mark.parametrize("value, aware", [(1, True), (0, False)])
def test_open_mpi_style_query(value, aware):
    got = detect(environ={}, info=Info(None), libraries=[("libmpi.so.40", openmpi_like(value))])
    assert got.aware is aware and got.source == "query"


def test_first_library_exporting_a_query_answers():
    libs = [("libmpi_mpifh.so", NO_QUERY), ("libmpi.so.40", openmpi_like(1)),
            ("other", openmpi_like(0))]
    got = detect(environ={}, info=Info(None), libraries=libs)
    assert got.aware and "libmpi.so.40" in got.why


def test_an_mpi_that_says_nothing_is_no_with_the_override_named():
    got = detect(environ={}, info=Info(None), libraries=[("libmpi.so", NO_QUERY)])
    assert not got.aware and got.source == "none"
    assert f"set {ENV}=1" in got.why and "cannot tell" in got.why
    assert not detect(environ={}, info=Info("mpi,system"), libraries=[]).aware


def test_real_ctypes_library_without_the_symbols_says_nothing():
    libc = ctypes.CDLL(None)          # this process: no MPIX_* symbols in libc's namespace?
    if hasattr(libc, "MPIX_Query_cuda_support"):
        pytest.skip("the MPI library was loaded into the global namespace")
    got = detect(environ={}, info=Info(None), libraries=[("self", libc)])
    assert got.source == "none"


def test_this_machines_mpi_is_probed_in_the_library_mpi4py_loaded():
    paths = cuda_aware.loaded_mpi_library_paths()
    assert any("libmpi" in p for p in paths) and paths[-1] == MPI.__file__
    got = detect(environ={})
    vendor = MPI.get_vendor()[0]
    # neither PyPI MPI is CUDA-aware; both export a query (spec/environment.md)
    assert not got.aware and got.source == "query", got
    if vendor == "MPICH":
        assert "MPIX_GPU_query_support(CUDA) = 0" in got.why and "'mpi,system'" in got.why


def test_process_answer_rereads_the_environment_and_probes_once(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    assert cuda_aware_mpi() == CudaAwareness(True, "env", f"{ENV}=1")
    monkeypatch.setenv(ENV, "0")
    assert not cuda_aware_mpi().aware
    monkeypatch.delenv(ENV)
    first = cuda_aware_mpi()
    assert first.source != "env" and cuda_aware_mpi() is first
    assert cuda_aware.has_cuda_aware_mpi() is first.aware


# -- choice of transport ----------------------------------------------------------
def meta(backend="gpu", nccl=True, mpi_cuda=False, transport="auto", why="q: no"):
    can = {"mpi_cuda": mpi_cuda, "mpi_cuda_why": "q: yes" if mpi_cuda else why}
    if backend == "gpu":
        can.update(nccl=nccl, nccl_why="" if nccl else "no libnccl")
    return {"backend": backend, "can": can, "transport": transport}


def test_transport_names_and_capabilities():
    assert TRANSPORTS == ("auto", "nccl", "mpi-cuda", "mpi")
    can = transport_capabilities(None)
    assert set(can) == {"mpi_cuda", "mpi_cuda_why"} and can["mpi_cuda"] is cuda_aware_mpi().aware


def test_auto_ladder_nccl_then_mpi_cuda_then_host_staging():
    assert explain_transport("auto", [meta(), meta()]) == (
        "nccl", "auto: device arrays and NCCL usable on every rank")
    name, why = explain_transport("auto", [meta(nccl=False, mpi_cuda=True), meta(mpi_cuda=True)])
    assert name == "mpi-cuda" and "NCCL not usable (rank 0: no libnccl)" in why
    assert "MPI CUDA-aware on every rank (q: yes)" in why
    name, why = explain_transport("auto", [meta(nccl=False, mpi_cuda=True), meta(nccl=False)])
    assert name == "mpi" and "MPI not CUDA-aware (rank 1: q: no)" in why
    assert "staged through host memory" in why
    assert explain_transport("auto", [meta("cpu", mpi_cuda=True), meta(mpi_cuda=True)]) == (
        "mpi", "auto: host arrays on ranks [0]")
    assert explain_transport("mpi", [meta(), meta()]) == ("mpi", "requested")
    assert choose_transport("auto", [meta(nccl=False, mpi_cuda=True)] * 3) == "mpi-cuda"


def test_mpi_cuda_on_an_mpi_without_it_is_a_clear_error():
    metas = [meta(mpi_cuda=True), meta(why="w: 0"), meta(why="w: 0"), meta(why="z")]
    with pytest.raises(dq.InvalidInputError,
                       match=r"transport='mpi-cuda' needs a CUDA-aware MPI on every rank "
                             r"\(ranks \[1, 2\]: w: 0; rank 3: z\); use transport='mpi'"):
        choose_transport("mpi-cuda", metas)
    with pytest.raises(dq.InvalidInputError, match="needs a CUDA-aware MPI"):
        choose_transport("mpi-cuda", [meta("cpu"), meta("cpu")])     # the MPI first
    with pytest.raises(dq.InvalidInputError, match=r"needs device \(CuPy\) arrays.*ranks \[1\]"):
        choose_transport("mpi-cuda", [meta(mpi_cuda=True), meta("cpu", mpi_cuda=True)])
    assert explain_transport("mpi-cuda", [meta(nccl=False, mpi_cuda=True)] * 2) == (
        "mpi-cuda", "requested")


def test_public_api_single_rank(monkeypatch):
    x = rank_inputs(fresh_seed(), 1, 1000)[0]
    monkeypatch.delenv(ENV, raising=False)
    out = np.full_like(x, 7)
    with pytest.raises(dq.InvalidInputError, match="needs a CUDA-aware MPI.*MPIX_"):
        dq.allreduce(x, comm=MPI.COMM_SELF, transport="mpi-cuda", out=out)
    assert np.all(out == 7)
    monkeypatch.setenv(ENV, "1")
    with pytest.raises(dq.InvalidInputError, match=r"needs device \(CuPy\) arrays"):
        dq.allreduce(x, comm=MPI.COMM_SELF, transport="mpi-cuda")
    coll = dq.Collective(MPI.COMM_SELF, transport="mpi-cuda")
    _, rep = coll.allreduce(x, transport="auto", return_report=True)
    assert rep.transport == "mpi" and rep.transport_reason == "auto: host arrays on ranks [0]"
    coll.free()
    with pytest.raises(ValueError, match="'mpi-cuda'"):
        dq.Collective(MPI.COMM_SELF, transport="cuda")


def test_bench_accepts_the_transport():
    import argparse

    from dynamiq_mpi.bench import add_arguments
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--transport", "mpi-cuda"]).transport == "mpi-cuda"


# -- the transport on one rank (exchanges with itself) ---------------------------------
class FakeStream:
    def __init__(self):
        self.syncs = 0

    def __call__(self):
        self.syncs += 1


def test_transport_sync_rules_on_one_rank():
    stream = FakeStream()
    t = MPICudaTransport(MPI.COMM_SELF, xp=np, synchronize=stream)
    a = np.arange(100, dtype=np.uint8)
    b = np.zeros(100, np.uint8)
    c = np.zeros(100, np.uint8)
    h = t.answer(Exchange(a, 0, b, 0))             # computed payload: one sync
    assert stream.syncs == 1 and isinstance(h, Received)
    assert t.answer(Claim(h)) is b and np.array_equal(b, a)
    h2 = t.answer(Exchange(h, 0, c, 0))            # forwarded: no sync
    assert stream.syncs == 1
    assert np.array_equal(t.answer(Claim(h2)), a)
    assert t.answer(Exchange(np.zeros(0, np.uint8), 0, np.zeros(0, np.uint8), 0)).token is None
    assert t.answer(Mark("done")) is None and not t._sends and not t._recvs
    t.answer(Exchange(None, 0, c, 0))              # first receive of the next call: sync
    assert stream.syncs == 3
    t.answer(Exchange(a, 0, None, 0))
    t.answer(Mark("done"))
    assert np.array_equal(c, a)
    with pytest.raises(TypeError, match="not a numpy array"):
        t.answer(Exchange([1, 2], 0, None, 0))
    t.free()
    assert t.comm is None
