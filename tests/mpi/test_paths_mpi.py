"""The path of a call (paths.py, native.py) and NCCL's non-finite semantics,
under mpiexec on host arrays: the native path (MPI's own all-reduce) against
a float64 oracle, the choice forced either way or measured, agreed and
reported on every rank, and NaN/Inf propagated or raised on every rank.

Run: mpiexec -n 3 python -m pytest --with-mpi --only-mpi tests/mpi/test_paths_mpi.py
"""
import numpy as np
import pytest
from mpi4py import MPI

import dynamiq_mpi as dq
from dynamiq_mpi.backend import BFLOAT16
from dynamiq_mpi.call.paths import measuring_calls

from helpers import fresh_seed, shared_seed

comm = MPI.COMM_WORLD
N = comm.size
LAST = N - 1


def my_input(seed, length, dtype=np.float32):
    rng = np.random.default_rng([seed, comm.rank])
    return rng.standard_normal(length).astype(dtype)


def same_on_every_rank(a) -> bool:
    blobs = comm.allgather(np.ascontiguousarray(a).tobytes())
    return all(b == blobs[0] for b in blobs)


def exact_sum(x):
    return comm.allreduce(x.astype(np.float64), op=MPI.SUM)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, BFLOAT16, np.float16],
                         ids=["float32", "float64", "bfloat16", "float16"])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_native_path_is_mpis_sum_in_the_callers_dtype(dtype, op):
    seed = shared_seed(comm)
    x = my_input(seed, 4099, dtype)
    coll = dq.Collective(comm, path="native")
    out, rep = coll.allreduce(x, op=op, return_report=True)
    coll.free()
    assert rep.path == "native" and rep.path_reason == "requested"
    assert out.dtype == x.dtype and out.shape == x.shape
    want = exact_sum(x) / (N if op == "mean" else 1)
    # float32 (float64) on the wire: n roundings of the wire dtype, then the
    # caller's dtype's own rounding
    wire_eps = 2.0 ** -52 if dtype == np.float64 else 2.0 ** -23
    own_eps = {np.dtype(np.float16): 2.0 ** -10, BFLOAT16: 2.0 ** -7}.get(np.dtype(dtype), 0)
    scale = np.abs(np.stack(comm.allgather(x.astype(np.float64)))).sum(axis=0)
    bound = N * wire_eps * scale / (N if op == "mean" else 1) + own_eps * np.abs(want) + 1e-30
    err = np.abs(out.astype(np.float64) - want)
    assert np.all(err <= bound), f"max excess {np.max(err - bound)} (seed {seed})"
    assert same_on_every_rank(out), f"ranks differ (seed {seed})"
    assert rep.bits_per_coord == 8 * (8 if dtype == np.float64 else 4)


@pytest.mark.mpi(min_size=2)
def test_native_exact_keeps_float32_and_dynamiq_compressed_differs():
    seed = shared_seed(comm)
    x = my_input(seed, 3 * 256 * 40)
    native = dq.allreduce(x, codec=dq.DynamiQ(small_input=0), path="native")
    compressed, rep = dq.allreduce(x, codec=dq.DynamiQ(small_input=0), path="compressed",
                                   return_report=True)
    assert rep.path == "compressed" and rep.bits_per_coord <= 5.0
    want = exact_sum(x)
    e_native = np.sum((native - want) ** 2) / np.sum(want ** 2)
    e_comp = np.sum((compressed - want) ** 2) / np.sum(want ** 2)
    assert e_native < 1e-12 < e_comp < 0.1, (e_native, e_comp)


@pytest.mark.mpi(min_size=2)
def test_auto_measures_both_paths_then_keeps_one_agreed_choice():
    coll = dq.Collective(comm, path="auto")
    seed = fresh_seed()
    calls = measuring_calls(False)     # host arrays never replay
    paths = []
    for i in range(calls + 3):
        x = my_input(seed + i, 5000)
        out, rep = coll.allreduce(x, return_report=True)
        paths.append(rep.path)
        assert same_on_every_rank(out)
        if i < calls:
            assert "measuring" in rep.path_reason, rep.path_reason
    assert paths[:calls] == ["compressed", "native"] * (calls // 2), paths
    chosen = paths[calls]
    assert paths[calls:] == [chosen] * 3
    assert all(p == [chosen] for p in comm.allgather([chosen]))
    decisions = coll.path_decisions()
    assert len(decisions) == 1
    (key, (path, why)), = decisions.items()
    assert path == chosen and "measured compressed" in why and key[2] == 12   # 2^12 <= 5000
    assert len(set(comm.allgather(why))) == 1
    # another size class measures anew; forget_paths measures again
    _, rep = coll.allreduce(my_input(seed, 100), return_report=True)
    assert "measuring" in rep.path_reason
    coll.forget_paths()
    assert coll.path_decisions() == {}
    coll.free()


@pytest.mark.mpi(min_size=2)
def test_auto_leaves_baselines_compressed_and_forcing_works(monkeypatch):
    coll = dq.Collective(comm, path="auto")
    x = my_input(fresh_seed(), 3000)
    for _ in range(3):
        _, rep = coll.allreduce(x, codec=dq.MXFP("e4m3"), return_report=True)
        assert rep.path == "compressed" and "runs compressed" in rep.path_reason
    _, rep = coll.allreduce(x, codec=dq.MXFP("e4m3"), path="native", return_report=True)
    assert rep.path == "native"
    coll.free()
    monkeypatch.setenv("DYNAMIQ_PATH", "native")
    coll = dq.Collective(comm)
    assert coll.path == "native"
    _, rep = coll.allreduce(x, return_report=True)
    assert rep.path == "native"
    coll.free()
    monkeypatch.setenv("DYNAMIQ_PATH", "fastest")
    with pytest.raises(ValueError, match="DYNAMIQ_PATH"):
        dq.Collective(comm)


@pytest.mark.mpi(min_size=2)
def test_ranks_asking_different_paths_all_raise():
    x = my_input(fresh_seed(), 2000)
    path = "native" if comm.rank == LAST else "compressed"
    with pytest.raises(dq.InputMismatchError, match="path") as info:
        dq.allreduce(x, path=path)
    assert len(set(comm.allgather(str(info.value)))) == 1


# ------------------------------------------------------------- non-finite input
CODECS = [dq.DynamiQ(bits=5, small_input=0), dq.DynamiQ(bits=5), dq.BF16(), dq.Exact(),
          dq.MXFP("e4m3"), dq.THC(), dq.OmniReduce()]
CODEC_IDS = ["dynamiq", "dynamiq-small-as-bf16", "bf16", "exact", "mxfp8", "thc", "omnireduce"]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec", CODECS, ids=CODEC_IDS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("path", ["compressed", "native"])
def test_nonfinite_propagates_identically_to_every_rank(codec, bad, path):
    x = my_input(shared_seed(comm), 256 * 12)
    where = 517
    if comm.rank == LAST:
        x[where] = bad
    before = x.copy()
    out, rep = dq.allreduce(x, codec=codec, path=path, return_report=True)
    assert np.array_equal(x, before, equal_nan=True)           # the input is untouched
    assert same_on_every_rank(out)
    assert not np.isfinite(out[where]), out[where]              # at least where it was
    assert rep.nonfinite is True and rep.path == path
    flags = comm.allgather(rep.nonfinite)
    assert all(flags)
    # the communicator still works, and a finite call says so
    y = my_input(shared_seed(comm), 256 * 12)
    out, rep = dq.allreduce(y, codec=codec, path=path, return_report=True)
    assert np.all(np.isfinite(out)) and rep.nonfinite is False


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec", [dq.DynamiQ(bits=5, small_input=0), dq.DynamiQ(bits=5)],
                         ids=["dynamiq", "dynamiq-small-as-bf16"])
def test_nonfinite_raise_is_the_same_error_on_every_rank(codec):
    x = my_input(shared_seed(comm), 256 * 12)
    if comm.rank == LAST:
        x[5] = np.inf
    keep = x.copy()
    with pytest.raises(dq.NonFiniteInputError, match="NaN or Inf") as info:
        dq.allreduce(x, codec=codec, out=x, nonfinite="raise")
    assert len(set(comm.allgather(str(info.value)))) == 1
    assert np.array_equal(x, keep)                              # nothing written


@pytest.mark.mpi(min_size=2)
def test_overflowing_sum_propagates_as_nan():
    x = np.full(512, np.float32(3.0e38), dtype=np.float32)
    out, rep = dq.allreduce(x, codec=dq.DynamiQ(small_input=0), return_report=True)
    assert rep.nonfinite and np.isnan(out).all() and same_on_every_rank(out)
    assert "SumOverflowError" in rep.codec_info["nonfinite"]


@pytest.mark.mpi(min_size=2)
def test_bad_nonfinite_and_path_arguments_are_clear_errors():
    x = my_input(1, 100)
    with pytest.raises(ValueError, match="nonfinite"):
        dq.Collective(comm, nonfinite="ignore")
    with pytest.raises(ValueError, match="path"):
        dq.allreduce(x, path="fast")
    with pytest.raises(dq.InvalidInputError, match="nonfinite"):
        dq.allreduce(x, nonfinite="ignore")


# ------------------------------------------------------------- steady native calls
@pytest.mark.mpi(min_size=2)
def test_steady_native_calls_are_correct_and_every_mismatch_raises_everywhere():
    """After one agreed native call, the same call skips the engine (one
    digest exchange, native.SteadyNative): the sums stay right with new data,
    and a rank that changes its length, its dtype or passes bad input makes
    every rank raise, whether its call is steady or not."""
    coll = dq.Collective(comm, path="native")
    seed = shared_seed(comm)
    out = np.empty(3001, np.float32)
    for i in range(4):
        x = my_input(seed + i, 3001)
        got = coll.allreduce(x, out=out, op="mean")
        assert got is out
        want = exact_sum(x) / N
        assert np.max(np.abs(out - want)) <= 4 * N * 2.0 ** -23 * np.max(np.abs(want)) + 1e-30
        assert same_on_every_rank(out)
    assert len(coll._runner.planner.steady) == 1
    x = my_input(seed, 3001)
    longer = my_input(seed, 3002)
    with pytest.raises(dq.InputMismatchError, match="length") as info:
        coll.allreduce(longer if comm.rank == LAST else x, out=None if comm.rank == LAST else out,
                       op="mean")
    assert len(set(comm.allgather(str(info.value)))) == 1
    with pytest.raises(dq.InputMismatchError, match="dtype"):
        coll.allreduce(x.astype(np.float64) if comm.rank == LAST else x, op="mean")
    strided = np.zeros(6002, np.float32)[::2]
    with pytest.raises(dq.InvalidInputError, match="C-contiguous"):
        coll.allreduce(strided if comm.rank == LAST else x, op="mean")
    with pytest.raises(dq.InputMismatchError, match="op"):
        coll.allreduce(x, op="sum" if comm.rank == LAST else "mean")
    # still usable, and steady again
    coll.allreduce(x, out=out, op="mean")
    assert np.allclose(out, exact_sum(x) / N, rtol=1e-5, atol=1e-6)
    coll.free()


@pytest.mark.mpi(min_size=2)
def test_steady_native_2d_and_1d_agree_and_a_shape_mismatch_raises_everywhere():
    """A steady call uses a 1-D array as is and reshapes a 2-D one: the same
    sums; a rank whose 2-D shape holds another length makes every rank raise."""
    coll = dq.Collective(comm, path="native")
    x = my_input(shared_seed(comm), 2048)
    for i in range(3):              # the first call agrees, the later ones are steady
        flat = coll.allreduce(x, out=np.empty(2048, np.float32))
        square = coll.allreduce(x.reshape(32, 64), out=np.empty((32, 64), np.float32))
        new = coll.allreduce(x.reshape(32, 64), op="mean")
        assert np.array_equal(flat, square.reshape(-1)) and new.shape == (32, 64)
        assert np.array_equal(new.reshape(-1), (flat / N).astype(np.float32))
    assert len(coll._runner.planner.steady) == 3
    with pytest.raises(dq.InputMismatchError) as info:
        coll.allreduce(my_input(1, 33 * 64).reshape(33, 64) if comm.rank == LAST
                       else x.reshape(32, 64), op="mean")
    assert len(set(comm.allgather(str(info.value)))) == 1
    coll.free()


@pytest.mark.mpi(min_size=2)
def test_auto_steady_calls_follow_the_decision_and_forget_paths():
    """path="auto": once a class is decided native, its calls go steady (no
    engine, no path choice) and stay right; forget_paths() drops them, so the
    class is measured again."""
    coll = dq.Collective(comm, path="auto")     # (the suite's default is "compressed")
    codec = dq.DynamiQ(bits=5)
    seed = shared_seed(comm)
    out = np.empty(5000, np.float32)
    whys = []
    for i in range(12):
        x = my_input(seed + i, 5000)
        _, rep = coll.allreduce(x, codec=codec, out=out, op="sum", return_report=True)
        whys.append(rep.path_reason)
        assert same_on_every_rank(out)
    decided = coll.path_decisions()
    assert len(decided) == 1
    path = next(iter(decided.values()))[0]
    for i in range(3):                      # no report asked: steady when native
        x = my_input(seed + 100 + i, 5000)
        coll.allreduce(x, codec=codec, out=out, op="sum")
        want = exact_sum(x)
        if path == "native":
            assert np.max(np.abs(out - want)) <= 4 * N * 2.0 ** -23 * np.max(np.abs(want)) + 1e-30
        assert same_on_every_rank(out)
    assert len(coll._runner.planner.steady) == (1 if path == "native" else 0)
    coll.forget_paths()
    assert not coll._runner.planner.steady and not coll.path_decisions()
    _, rep = coll.allreduce(my_input(seed, 5000), codec=codec, out=out, op="sum",
                            return_report=True)
    assert "measuring" in rep.path_reason, rep.path_reason
    coll.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path", ["auto", "native"])
def test_a_non_array_on_one_rank_raises_on_every_rank_on_every_path(path):
    """A rank passing something that is no array (here a list) makes every
    rank raise the same clear error, also on the paths that look a steady
    call up first (no rank is left waiting)."""
    coll = dq.Collective(comm, path=path)
    x = my_input(shared_seed(comm), 4096)
    for _ in range(8):                          # let "auto" decide, then go steady
        coll.allreduce(x, codec=dq.DynamiQ(bits=5), op="sum")
    bad = x.tolist() if comm.rank == LAST else x
    with pytest.raises(dq.InvalidInputError) as info:
        coll.allreduce(bad, codec=dq.DynamiQ(bits=5), op="sum")
    assert len(set(comm.allgather(str(info.value)))) == 1, str(info.value)
    coll.allreduce(x, codec=dq.DynamiQ(bits=5), op="sum")     # still usable
    coll.free()


@pytest.mark.mpi(min_size=2)
def test_a_steady_signature_resolves_once_to_its_plan():
    """call/planner.py: the first native call runs the engine and leaves a
    steady plan; the same signature then resolves to it (no engine, no path
    choice); a report, another length or a flat-vs-nodes hierarchy resolve
    anew."""
    coll = dq.Collective(comm, path="native", node_size=1)
    routes = []
    resolve = coll._runner.planner.plan_allreduce

    def spy(*args, **kwargs):
        plan = resolve(*args, **kwargs)
        routes.append(plan.route)
        return plan
    coll._runner.planner.plan_allreduce = spy
    x = np.arange(1000, dtype=np.float32) * (comm.rank + 1)
    outs = [coll.allreduce(x) for _ in range(3)]
    coll.allreduce(x, return_report=True)
    coll.allreduce(x[:999].copy())
    coll.allreduce(x, hierarchy="nodes")
    assert routes == ["engine", "steady", "steady", "engine", "engine", "levels"]
    want = np.arange(1000, dtype=np.float64) * (N * (N + 1) / 2)
    for out in outs:
        assert np.array_equal(out, want.astype(np.float32))
    coll.free()


@pytest.mark.mpi(min_size=2)
def test_free_releases_the_choosers_duplicated_communicators():
    """class_choice() and step_choice() agree over duplicates of the
    collective's communicator; free() releases them with the rest."""
    coll = dq.Collective(comm)
    classes = coll.class_choice()
    steps = coll.step_choice(("a", "b"), lambda mark: 0.0, rounds=1)
    assert coll.class_choice() is classes and coll.step_choice(("x",), None, rounds=9) is steps
    planes = [classes.plane, steps.plane]
    assert all(p.mpi_comm is not None and p.mpi_comm != comm for p in planes)
    coll.free()
    assert all(p.mpi_comm is None for p in planes)
