"""The benchmark command under mpiexec on host arrays (MPI reference row):
every row present, honest bits, no rank disagrees, the table and JSON written."""
import json
import os
import tempfile

import pytest
from mpi4py import MPI

from dynamiq_mpi.__main__ import main

# The same at every world size above 4: not run again at 6 and 8 ranks (CI time).
pytestmark = pytest.mark.max_size(4)

comm = MPI.COMM_WORLD
N = comm.size


@pytest.mark.mpi(min_size=2)
def test_bench_command_runs_on_host_arrays(capsys):
    folder = comm.bcast(tempfile.mkdtemp(prefix="bench_") if comm.rank == 0 else None)
    path = os.path.join(folder, "bench.json")
    topologies = "ring,butterfly"
    main(["bench", "--array", "numpy", "--sizes", "64K,2M", "--codec",
          "dynamiq:5,dynamiq:5:small_input=0,bf16", "--topology", topologies,
          "--paths", "compressed", "-w", "1", "-n", "2", "--rounds", "2", "--breakdown",
          "--json", path])
    comm.Barrier()
    with open(path) as f:
        data = json.load(f)
    rows = data["rows"]
    pow2 = N & (N - 1) == 0
    per_size = 1 + 3 * (2 if pow2 else 1)
    assert len(rows) == 2 * per_size
    assert all(r["wrong"] == 0 for r in rows)
    ref = [r for r in rows if r["transport"] == "mpi" and r["topology"] == "-"]
    assert len(ref) == 2 and all(r["bits"] == 16.0 for r in ref)
    for r in rows:
        assert r["time_us"] > 0 and r["algbw"] > 0 and r["vnmse"] < 0.05
        if r["codec"] == "dynamiq:5:small_input=0":
            assert 4.9 <= r["bits"] <= 5.0 and not r["fallback"]
            assert {"agreement", "statistics", "plan", "reduce-scatter", "all-gather",
                    "finish"} <= set(r["phases_us"])
        if r["codec"] == "dynamiq:5" and r["count"] < (1 << 21):
            assert r["fallback"] and r["bits"] == pytest.approx(16.0)
    assert data["meta"]["ranks"] == N and data["meta"]["args"]["rounds"] == 2
    out = capsys.readouterr().out
    if comm.rank == 0:
        assert "#wrong" in out and "speedup" in out and "breakdown" in out


@pytest.mark.mpi(min_size=2)
def test_bench_shows_both_paths_and_the_one_chosen(capsys):
    folder = comm.bcast(tempfile.mkdtemp(prefix="bench_") if comm.rank == 0 else None)
    path = os.path.join(folder, "bench.json")
    main(["bench", "--array", "numpy", "--sizes", "256K", "--codec", "dynamiq:5,mxfp:e4m3",
          "-w", "1", "-n", "2", "--json", path])
    comm.Barrier()
    with open(path) as f:
        rows = json.load(f)["rows"]
    dq_rows = {r["path"]: r for r in rows if r["codec"] == "dynamiq:5"}
    assert set(dq_rows) == {"compressed", "native", "auto"}
    assert dq_rows["compressed"]["ran"] == "compressed" and dq_rows["native"]["ran"] == "native"
    auto = dq_rows["auto"]
    assert auto["ran"] in ("compressed", "native") and "measured" in auto["path_reason"]
    assert [r["path"] for r in rows if r["codec"] == "mxfp:e4m3"] == ["compressed"]
    assert all(r["wrong"] == 0 for r in rows)
    out = capsys.readouterr().out
    if comm.rank == 0:
        assert f"auto->{auto['ran']}" in out and "# path of dynamiq:5" in out
