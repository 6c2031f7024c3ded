"""The training simulator (``python -m research train-sim``,
research/train_sim.py): N data-parallel ranks in one process.

At N = 2 its gradients equal a real two-rank job's (``--real`` under
mpiexec: each rank its own process, ``allreduce_gradients`` over MPI) bit
for bit: the final parameters after three steps with DynamiQ at 5 bits on
every bucket (``small_input=0``: quantized, not sent as BF16).  The BF16
reduction follows ``bf16_compress_hook``; the table reads the runs' JSON.
"""
import json

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch", exc_type=ImportError)
pytest.importorskip("transformers", exc_type=ImportError)

from research import train_sim, train_sim_table  # noqa: E402
from helpers import vnmse  # noqa: E402
from test_launchers import _run, mpiexec  # noqa: E402

TINY = ["--preset", "tiny", "--steps", "3", "--quiet"]
CODEC = "dynamiq:5:small_input=0"


def _sim(tmp_path, name, *extra):
    dump, out = tmp_path / f"{name}.npy", tmp_path / f"{name}.json"
    torch.set_num_threads(1)
    record = train_sim.main([*TINY, *extra, "--dump", str(dump), "--json", str(out)])
    return np.load(dump), record


@pytest.mark.parametrize("workload", ["lm", "cls"])
def test_two_simulated_ranks_equal_the_real_two_rank_job(tmp_path, workload, monkeypatch):
    monkeypatch.setenv("DYNAMIQ_CACHE", str(tmp_path / "cache"))   # cls: the pretrained LM
    seed = int(np.random.default_rng().integers(1000))
    work = ["--workload", workload]
    sim, record = _sim(tmp_path, "sim", "--ranks", "2", "--codec", CODEC, "--seed", str(seed),
                       *work)
    _run(mpiexec(2, "-m", "research", "train-sim", *TINY, "--ranks", "2", "--codec", CODEC,
                 "--seed", seed, "--real", "--dump", tmp_path / "real.npy", *work,
                 "--json", tmp_path / "real.json"), "the real two-rank job")
    real = np.load(tmp_path / "real.npy")
    assert np.array_equal(sim.view(np.uint32), real.view(np.uint32)), seed
    assert record["steps"] == json.load(open(tmp_path / "real.json"))["steps"]
    # the compression is real: DynamiQ's parameters differ from the exact mean's
    exact, ex_record = _sim(tmp_path, "fp32", "--ranks", "2", "--codec", "fp32",
                            "--seed", str(seed), *work)
    assert not np.array_equal(sim, exact)
    # 5 bits cannot reach 1e-6 (about 10 bits' worth); a float32 mean of two sits near 1e-14
    assert max(v for _, v in record["vnmse"]) > 1e-6 > max(v for _, v in ex_record["vnmse"])
    assert 4.0 < record["bits_per_coord"] < 5.5


def test_the_classification_workload_reports_accuracy(tmp_path, monkeypatch):
    """cls: a pretrained LM (cached: the second run loads the same weights)
    fine-tuned to tell eight standard-library packages apart."""
    monkeypatch.setenv("DYNAMIQ_CACHE", str(tmp_path / "cache"))
    runs = []
    for name in ("a", "b"):
        _, record = _sim(tmp_path, name, "--ranks", "3", "--codec", "bf16", "--workload", "cls",
                         "--eval-every", "3")
        runs.append(record)
    assert len(list((tmp_path / "cache" / "train_sim").glob("lm_*.pt"))) == 1
    assert runs[0]["steps"] == runs[1]["steps"]
    acc = runs[0]["final_accuracy"]
    assert 0.0 <= acc <= 1.0 and runs[0]["accuracy"][-1] == [3, acc]
    assert runs[0]["final_val_loss"] > 0


def test_bf16_reduction_is_the_bf16_compress_hook():
    rng = np.random.default_rng()
    n = 5
    xs = [rng.standard_normal(1000).astype(np.float32) * 10 ** rng.uniform(-3, 3)
          for _ in range(n)]
    red = train_sim.Reducer("bf16", n, 0, "ring", 1)
    got = red([torch.from_numpy(x) for x in xs]).numpy()
    bf = ml_dtypes.bfloat16
    parts = [(x.astype(bf) / bf(n)).astype(bf).astype(np.float32) for x in xs]
    want = np.sum(np.stack(parts), axis=0, dtype=np.float32).astype(bf).astype(np.float32)
    # (the sum's order: left to right in float32 in both)
    acc = np.zeros(1000, np.float32)
    for p in parts:
        acc += p
    want = acc.astype(bf).astype(np.float32)
    assert np.array_equal(got, want)
    exact = np.mean(np.stack(xs).astype(np.float64), axis=0)
    assert 1e-7 < vnmse(got, exact) < 1e-4
    assert red.take_vnmse() == pytest.approx(vnmse(got, exact), rel=1e-6)


def test_hierarchical_reduction_and_the_table(tmp_path, capsys):
    """Nodes of 2 at N = 4 (levels_simulate) train; the table's ratio is the
    mean final loss over seeds against BF16's, read back from the JSON."""
    paths = []
    for codec, extra in (("bf16", []), (CODEC, ["--node-size", "2"])):
        for seed in (0, 1):
            out = tmp_path / f"{codec.split(':')[0]}{seed}.json"
            train_sim.main([*TINY, "--ranks", "4", "--codec", codec, "--seed", str(seed),
                            "--eval-every", "3", "--json", str(out), *extra])
            paths.append(out)
    rows = train_sim_table.table([str(p) for p in paths], png=str(tmp_path / "curves.png"))
    finals = {p.name: json.load(open(p))["final_val_loss"] for p in paths}
    bf16 = (finals["bf160.json"] + finals["bf161.json"]) / 2
    dq = (finals["dynamiq0.json"] + finals["dynamiq1.json"]) / 2
    row = next(r for r in rows if "nodes of 2" in r["reduction"])
    assert row["seeds"] == [0, 1] and row["paired"] and row["vs_bf16"] == pytest.approx(dq / bf16)
    assert 0 < row["vnmse"] < 0.5
    assert train_sim_table.last_fifth_gain({"evals": [[5, 2.0], [8, 1.9], [10, 1.8]]}) == \
        pytest.approx(0.1 / 1.9)
    assert train_sim_table.last_fifth_gain({"evals": [[10, 1.8]]}) is None
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    assert "nodes of 2" in capsys.readouterr().out


@pytest.mark.parametrize("spec", [CODEC, "mxfp:e2m1", "thc"])
@pytest.mark.parametrize("topology", ["ring", "butterfly"])
def test_the_reducer_gives_simulate_allreduces_bits(spec, topology):
    """The reducer walks the ranks role by role (scale_allreduce) where the
    codec has an adapter, else runs every rank's program: the bits of
    simulate_allreduce either way, and its bits per coordinate."""
    import dynamiq_mpi as dq
    from dynamiq_mpi.codecs import codec_from_string
    rng = np.random.default_rng()
    n, length = 8, int(rng.integers(300, 40_000))
    seed, counter = int(rng.integers(1000)), int(rng.integers(5))
    xs = [(rng.standard_normal(length) * 10 ** rng.uniform(-3, 1)).astype(np.float32)
          for _ in range(n)]
    red = train_sim.Reducer(spec, n, seed, topology, 1)
    red.counter = counter
    got = red([torch.from_numpy(x) for x in xs]).numpy()
    outs, reps = dq.simulate_allreduce(xs, codec=codec_from_string(spec), topology=topology,
                                       op="mean", seed=seed, counter=counter,
                                       return_reports=True)
    assert np.array_equal(got.view(np.uint32), outs[0].view(np.uint32)), (spec, length, seed)
    assert red.bits / red.coords == pytest.approx(reps[0].bits_per_coord, rel=1e-12)
    assert red.take_vnmse() == pytest.approx(vnmse(got, np.mean(np.array(xs, np.float64), 0)),
                                             rel=1e-6)


@pytest.mark.parametrize("workload", ["lm", "cls"])
def test_batched_gradients_equal_the_per_rank_loop(tmp_path, workload, monkeypatch):
    """--batched (torch.func.vmap over the ranks) trains as the loop of
    per-rank backward passes does, up to float rounding: the same losses and
    parameters (to 1e-3 of their move, in norm) after three steps with the
    exact mean, and every rank's gradient of a step equal to its own
    backward pass's.  With DynamiQ a rounding difference may move a
    coordinate across a quantization step, and AdamW turns a tiny gradient's
    flipped sign into a full-size step, so there only the losses (to 1e-3)
    and the error along the run are compared."""
    monkeypatch.setenv("DYNAMIQ_CACHE", str(tmp_path / "cache"))
    seed = int(np.random.default_rng().integers(1000))
    args = train_sim.parse_args([*TINY, "--ranks", "3", "--seed", str(seed), "--workload", workload])
    work = train_sim.make_workload(args, torch.device("cpu"))
    names = [name for name, _ in work.model.named_parameters()]
    _, grads = train_sim._batched_grads(work, work.model, names, 1, 3, 2, torch.device("cpu"))
    for r in range(3):
        work.model.zero_grad(set_to_none=True)
        work.loss(1, r, 3).backward()
        for name, p in work.model.named_parameters():
            scale = float(p.grad.abs().max())
            assert torch.allclose(grads[name][r], p.grad, rtol=1e-4, atol=1e-5 * scale), name
    for codec, params_tol, loss_tol in (("fp32", 1e-3, 1e-5), (CODEC, None, 1e-3)):
        args = ["--ranks", "3", "--codec", codec, "--seed", str(seed), "--workload", workload]
        loop, loop_rec = _sim(tmp_path, "loop", *args)
        batched, batched_rec = _sim(tmp_path, "batched", *args, "--batched",
                                    "--rank-chunk", "2")
        assert batched_rec["config"]["batched"] and not loop_rec["config"]["batched"]
        moved = np.linalg.norm(loop - _sim(tmp_path, "start", *args, "--steps", "0")[0])
        if params_tol is not None:
            # The vector's norm, not its largest coordinate: AdamW divides each
            # coordinate by its own gradient's size, so one whose gradient is
            # near eps turns a rounding difference into a visible step (seed
            # 400: 3e-3 of the largest move in 2 of 26720 coordinates; 4e-5 of
            # the norm, the largest of 160 seeds 5e-5).
            assert np.linalg.norm(batched - loop) < params_tol * moved, (codec, seed)
        assert np.allclose([v for _, v in batched_rec["steps"]],
                           [v for _, v in loop_rec["steps"]], rtol=loss_tol, atol=0)
        if codec == CODEC:
            err = [np.mean([v for _, v in r["vnmse"]]) for r in (loop_rec, batched_rec)]
            assert 0.5 < err[1] / err[0] < 2.0 and err[0] > 1e-6, err
        assert not np.array_equal(batched, _sim(tmp_path, "other", *args, "--batched",
                                                "--seed", str(seed + 1))[0])


def test_batched_refuses_a_real_job(capsys):
    with pytest.raises(SystemExit):
        train_sim.main([*TINY, "--ranks", "1", "--real", "--batched"])
    assert "--batched simulates ranks" in capsys.readouterr().err


def test_a_run_writes_its_curve_as_it_goes_and_reduces_on_the_host(tmp_path, monkeypatch):
    """The JSON is rewritten at every evaluation (``partial``), so a run cut
    short keeps its curve; --reduce-on host gives the device route's bits."""
    seen = []
    real_write = train_sim._write
    monkeypatch.setattr(train_sim, "_write", lambda p, r: (seen.append(json.loads(json.dumps(r))),
                                                           real_write(p, r)))
    a, rec = _sim(tmp_path, "a", "--ranks", "3", "--codec", CODEC, "--eval-every", "1")
    assert [r.get("partial") for r in seen] == [True, True, None]
    assert [len(r["evals"]) for r in seen] == [1, 2, 3] and "final_val_loss" not in seen[0]
    b, _ = _sim(tmp_path, "b", "--ranks", "3", "--codec", CODEC, "--eval-every", "1",
                "--reduce-on", "host")
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("workload", ["lm", "cls"])
def test_a_run_stopped_and_resumed_is_the_run_never_stopped(tmp_path, workload, monkeypatch):
    """--max-seconds 0 stops after every step; the same command with
    --checkpoint goes on from there: the parameters, the curves and the bits
    counted end as a run of all its steps at once (the codec's call counter
    and AdamW's moments carried over)."""
    monkeypatch.setenv("DYNAMIQ_CACHE", str(tmp_path / "cache"))
    seed = str(int(np.random.default_rng().integers(1000)))
    run = ["--ranks", "3", "--codec", CODEC, "--seed", seed, "--workload", workload,
           "--steps", "5", "--eval-every", "2"]
    whole, whole_rec = _sim(tmp_path, "whole", *run)
    ckpt = str(tmp_path / "run.ckpt")
    part = [*TINY, *run, "--checkpoint", ckpt, "--max-seconds", "0",
            "--dump", str(tmp_path / "part.npy"), "--json", str(tmp_path / "part.json")]
    parts = [train_sim.main(part) for _ in range(2)]
    # the table shows a run cut short by its last evaluation: loss@step
    row, = train_sim_table.table([str(tmp_path / "part.json")])
    assert row["final"] is None and row["partial"] == (2, parts[1]["evals"][-1][1])
    parts += [train_sim.main(part) for _ in range(3)]
    assert [len(r["steps"]) for r in parts] == [1, 2, 3, 4, 5]
    assert [len(r["evals"]) for r in parts] == [0, 1, 1, 2, 3]
    assert [r.get("partial") for r in parts] == [True] * 4 + [None]
    assert json.load(open(tmp_path / "part.json")).get("partial") is None
    resumed = np.load(tmp_path / "part.npy")
    assert np.array_equal(whole.view(np.uint32), resumed.view(np.uint32)), seed
    keys = ("steps", "evals", "vnmse", "bits_per_coord", "final_val_loss")
    for key in keys + (("accuracy", "final_accuracy") if workload == "cls" else ()):
        assert parts[-1][key] == whole_rec[key], key
    assert [s["first_step"] for s in parts[-1]["segments"]] == [0, 1, 2, 3, 4]
    # another run's checkpoint is refused, naming what differs
    with pytest.raises(SystemExit, match="another run's: codec differ"):
        _sim(tmp_path, "other", *[a if a != CODEC else "bf16" for a in run],
             "--checkpoint", ckpt)


def test_a_checkpoint_from_another_device_is_refused(tmp_path):
    """The GPU trains under BF16 autocast: a CPU checkpoint must not go on
    there (nor the reverse), whatever else matches."""
    ckpt = str(tmp_path / "run.ckpt")
    run = [*TINY, "--ranks", "2", "--codec", "bf16", "--eval-every", "1", "--checkpoint", ckpt,
           "--max-seconds", "0", "--json", str(tmp_path / "run.json")]
    train_sim.main(run)
    state = torch.load(ckpt, weights_only=True)
    state["record"]["config"]["device"] = "NVIDIA H100 80GB HBM3"
    torch.save(state, ckpt)
    with pytest.raises(SystemExit, match="another run's: device differ"):
        train_sim.main(run)


def test_max_seconds_needs_a_checkpoint(capsys):
    with pytest.raises(SystemExit):
        train_sim.main([*TINY, "--max-seconds", "10"])
    assert "give --checkpoint" in capsys.readouterr().err


def test_the_cells_script_resumes_a_queue(tmp_path, monkeypatch):
    """research/scripts/train_sim_cells.sh: with MAX_SECONDS=0 each call takes
    every run one step further from its checkpoint, a complete run is then
    skipped ("have"), and a run that could not end by END_AT is not started."""
    import os
    import subprocess
    import sys
    import time
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "research", "scripts", "train_sim_cells.sh")
    out = tmp_path / "cells"
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(out), PRESET="tiny", STEPS="2",
               MAX_SECONDS="0", TRAIN_ARGS="--eval-every 1", RUNS="2/dynamiq/ring/1/0",
               DYNAMIQ_CACHE=str(tmp_path / "cache"))
    logs = [subprocess.run(["bash", script], env=env, capture_output=True, text=True,
                           timeout=300).stdout for _ in range(3)]
    name = "lm_tiny_n2_dynamiq-5-small_input-0_ring_k1_s0_t2"     # steps not the preset's
    assert f"{name}: stopped at step 1" in logs[0], logs[0]
    assert f"{name}: " in logs[1] and "stopped" not in logs[1], logs[1]
    assert f"have {name}" in logs[2], logs[2]
    record = json.load(open(out / f"{name}.json"))
    assert "partial" not in record and len(record["steps"]) == 2
    assert [s["first_step"] for s in record["segments"]] == [0, 1]
    assert not (out / f"{name}.ckpt").exists()          # removed once the run ends
    late = dict(env, OUT=str(tmp_path / "late"), END_AT=str(int(time.time()) + 60),
                RUNS="2/dynamiq/ring/1/0/lm/3/1")           # a run's own steps and batch
    log = subprocess.run(["bash", script], env=late, capture_output=True, text=True,
                         timeout=300).stdout
    assert "skipped (deadline): 2/dynamiq/ring/1/0/lm/3/1" in log, log


MPS_STAND_IN = """#!/bin/bash
# nvidia-cuda-mps-control's stand-in: logs "start" (-d) or the command read
# from stdin, and whether the table was written by then
[ -d "$CUDA_MPS_PIPE_DIRECTORY" ] || { echo "no pipe directory" >> "$MPS_LOG"; exit 3; }
if [ "$1" = -d ]; then echo start >> "$MPS_LOG"; exit "${MPS_START_RC:-0}"; fi
read -r command
echo "$command $([ -s "$OUT_DIR/table.txt" ] && echo after-table)" >> "$MPS_LOG"
"""


@pytest.mark.parametrize("mps", ["starts", "fails to start"])
def test_the_device_script_shares_the_gpu_through_mps_and_stops_it(tmp_path, mps):
    """tools/device/train_sim.sh on the CPU, nvidia-cuda-mps-control stood in
    for: MPS is started, checked by a 3-step run and stopped once the table
    is written; where it does not start it is stopped at once and the runs
    go on without it.  Either way the runs come back as the archive's parts
    (and nothing else of them), the table beside them."""
    import os
    import subprocess
    import sys
    import tarfile
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    stand_in = tmp_path / "bin" / "nvidia-cuda-mps-control"
    stand_in.parent.mkdir()
    stand_in.write_text(MPS_STAND_IN)
    stand_in.chmod(0o755)
    out, log = tmp_path / "out", tmp_path / "mps.log"
    env = {k: v for k, v in os.environ.items()      # none of the script's own settings
           if k not in ("MPS", "HOST_RUNS", "STEPS", "JOBS", "TRAIN_ARGS", "STATE", "WORKLOAD")}
    env = dict(env, PATH=f"{stand_in.parent}:{os.environ['PATH']}", PYTHON=sys.executable,
               DEVICE="cpu", PRESET="tiny", RUNS="2/bf16/ring/1/0/lm/2", OUT=str(out),
               OUT_DIR=str(out), MPS_LOG=str(log), DEADLINE="600",
               MPS_START_RC="0" if mps == "starts" else "1",
               CUDA_MPS_PIPE_DIRECTORY=str(tmp_path / "pipe"),
               CUDA_MPS_LOG_DIRECTORY=str(tmp_path / "mps_logs"),
               DYNAMIQ_CACHE=str(tmp_path / "cache"))
    run = subprocess.run(["bash", os.path.join(root, "tools", "device", "train_sim.sh")],
                         env=env, cwd=root, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout + run.stderr
    if mps == "starts":
        assert "CUDA MPS on" in run.stdout, run.stdout
        assert log.read_text().split("\n") == ["start", "quit after-table", ""]
    else:
        assert "CUDA MPS off (did not start)" in run.stdout, run.stdout
        assert log.read_text().split("\n") == ["start", "quit ", ""]
    assert "bf16" in (out / "table.txt").read_text()
    assert sorted(p.name for p in out.iterdir()) == [
        "device_runs.log", "table.txt", "train_sim_curves.png", "train_sim_runs.tgz.part-aa"]
    with tarfile.open(out / "train_sim_runs.tgz.part-aa") as archive:
        name = "lm_tiny_n2_bf16_ring_k1_s0_t2.json"
        record = json.load(archive.extractfile(f"./{name}"))
    assert len(record["steps"]) == 2 and "partial" not in record


def test_the_table_keeps_run_lengths_and_batches_apart(tmp_path):
    """Runs of another length or batch are other rows, each compared with the
    BF16 of its own length and batch; the last fifth is read off the seeds'
    mean curve (and the worst seed)."""
    rng = np.random.default_rng()

    def record(codec, seed, steps, batch, curve):
        cfg = dict(ranks=4, codec=codec, topology="ring", node_size=1, seed=seed,
                   workload="lm", steps=steps, batch=batch)
        evals = [[s, v] for s, v in curve]
        return dict(config=cfg, evals=evals, vnmse=[[1, 0.0]], final_val_loss=evals[-1][1],
                    bits_per_coord=None if codec == "bf16" else 5.0)
    base = float(rng.uniform(1.0, 2.0))
    runs = [record("bf16", 0, 10, 4, [(8, base * 1.1), (10, base)]),
            record("bf16", 1, 10, 4, [(8, base * 1.3), (10, base * 1.2)]),
            record("bf16", 0, 10, 8, [(8, base), (10, base * 0.5)]),
            record("dynamiq:5", 0, 10, 4, [(8, base), (10, base * 1.05)]),
            record("dynamiq:5", 0, 20, 4, [(16, base), (20, base)])]
    path = tmp_path / "runs.json"
    path.write_text(json.dumps({"runs": runs}))
    rows = {(r["reduction"], r["length"], r["batch"]): r for r in train_sim_table.table([str(path)])}
    assert set(rows) == {("bf16", 10, 4), ("bf16", 10, 8), ("dynamiq:5 ring", 10, 4),
                         ("dynamiq:5 ring", 20, 4)}
    bf16 = rows[("bf16", 10, 4)]
    assert bf16["final"] == pytest.approx(base * 1.1)
    assert bf16["last_fifth_mean"] == pytest.approx(1 - 1.1 / 1.2)      # the mean curve's
    assert bf16["last_fifth"] == pytest.approx(1 - 1 / 1.1)             # the worst seed's
    assert rows[("bf16", 10, 8)]["last_fifth"] == pytest.approx(0.5)
    assert rows[("dynamiq:5 ring", 10, 4)]["vs_bf16"] == pytest.approx(1.05)   # seed 0's BF16
    assert rows[("dynamiq:5 ring", 20, 4)]["vs_bf16"] is None           # no BF16 of 20 steps
