"""Every example and README command as a user types it: the library's
defaults, none of the suite's ``DYNAMIQ_*`` settings (tests/conftest.py sets
``DYNAMIQ_PATH=compressed`` for the other tests), launched by torchrun,
mpiexec or Lightning's own launcher on the CPU (gloo)."""
from __future__ import annotations

import ast
import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch", exc_type=ImportError)

from test_launchers import HERE, _run, mpiexec, results, torchrun  # noqa: E402

EXAMPLES = HERE.parent / "mpi_examples"


def test_torchrun_ddp_example_with_defaults():
    """The README's first command: every step prints its buckets' paths,
    bits and vNMSE (path="auto" runs plain, BF16 and compressed steps in its
    first steps); the ranks end identical."""
    out = _run(torchrun(2, EXAMPLES / "torchrun_ddp.py"), "torchrun_ddp.py", defaults=True)
    assert out.count("bits/coordinate") == 5, out
    assert "native" in out and "plain" in out       # the first steps of the schedule
    assert "over the torch control plane" in out
    assert "parameters identical on every rank: True" in out


def test_torchrun_fsdp_example_with_defaults():
    out = _run(torchrun(2, EXAMPLES / "torchrun_fsdp.py"), "torchrun_fsdp.py", defaults=True)
    assert out.count("bits/coordinate") == 5, out
    assert "FSDP2 over the torch control plane" in out


def test_mpiexec_ddp_example_with_defaults():
    out = _run(mpiexec(2, EXAMPLES / "ddp_hook_example.py"), "ddp_hook_example.py",
               defaults=True)
    assert out.count("bits/coordinate") == 5, out
    assert "parameters identical on every rank: True" in out


def test_numpy_example_as_the_readme_launches_it():
    out = _run(mpiexec(4, EXAMPLES / "allreduce_numpy.py"), "allreduce_numpy.py", defaults=True)
    line = next(ln for ln in out.splitlines() if "bits/coordinate on the wire" in ln)
    assert line.startswith("4 ranks, 2097152 coordinates")
    vnmse = float(line.rsplit("vNMSE", 1)[1])
    assert 0 < vnmse < 0.01, line


def test_readme_bench_command_small():
    """The README's bench command at sizes a CPU runs in seconds."""
    out = _run(mpiexec(2, "-m", "dynamiq_mpi", "bench", "-b", "64K", "-e", "256K", "-f", "2",
                       "--codec", "dynamiq:5,bf16", "--topology", "ring,butterfly",
                       "--breakdown"), "dynamiq_mpi bench", defaults=True)
    assert "busbw" in out and "dynamiq" in out and "butterfly" in out


def test_lightning_with_its_own_launcher(tmp_path):
    pytest.importorskip("lightning", exc_type=ImportError)
    example = EXAMPLES / "lightning_ddp.py"
    _run([sys.executable, example, "--out", tmp_path / "hook"], "Lightning with the hook",
         defaults=True)
    _run([sys.executable, example, "--no-hook", "--out", tmp_path / "plain"], "plain Lightning",
         defaults=True)
    hook, plain = results(tmp_path / "hook", 2), results(tmp_path / "plain", 2)
    assert np.array_equal(hook[0]["params"], hook[1]["params"]), "ranks diverged"
    assert np.array_equal(plain[0]["params"], plain[1]["params"])
    initial = plain[0]["initial"]
    assert np.array_equal(hook[0]["initial"], initial)
    moved = np.linalg.norm(plain[0]["params"] - initial)
    assert moved > 0
    # 5-bit gradients: the trajectories stay close (plain DDP's own move as the scale)
    assert np.linalg.norm(hook[0]["params"] - plain[0]["params"]) < 0.2 * moved


def test_lightning_gpu_route_is_lightnings_own_strategy():
    """On CUDA the example hands the hook to ``DDPStrategy(ddp_comm_hook=...)``
    (run where there are GPUs); on the CPU, where that strategy registers no
    hook, to the callback the test above runs."""
    pytest.importorskip("lightning", exc_type=ImportError)
    from helpers import load_example
    import dynamiq_mpi.torch as dqt
    example = load_example("lightning_ddp")
    state = dqt.HookState()
    accelerator, strategy, callbacks = example.strategy_and_callbacks(state, cuda=True)
    assert accelerator == "gpu" and callbacks == []
    assert isinstance(strategy, example.DDPStrategy)
    assert strategy._ddp_comm_hook is dqt.ddp_comm_hook and strategy._ddp_comm_state is state
    accelerator, strategy, callbacks = example.strategy_and_callbacks(state, cuda=False)
    assert (accelerator, strategy) == ("cpu", "ddp")
    assert [type(c).__name__ for c in callbacks] == ["RegisterHook"]


def test_hf_trainer_example_with_defaults(tmp_path):
    """Transformers' Trainer wraps the model in DDP; the example's callback
    registers the hook on ``trainer.model_wrapped`` and every step's buckets
    go through it."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")          # Trainer's own requirement
    out = _run(torchrun(2, EXAMPLES / "hf_trainer.py", "--steps", "6", "--out", tmp_path),
               "hf_trainer.py", defaults=True)
    line = next(ln for ln in out.splitlines() if ln.startswith("Trainer, 2 ranks"))
    assert "over the torch control plane: 6 steps, 6 buckets through the DynamiQ hook" in line
    assert "parameters identical on every rank: True" in out


def test_accelerate_example_with_defaults():
    pytest.importorskip("accelerate")
    out = _run(torchrun(2, EXAMPLES / "accelerate_ddp.py", "--steps", "6"), "accelerate_ddp.py",
               defaults=True)
    line = next(ln for ln in out.splitlines() if ln.startswith("Accelerate, 2 processes"))
    paths = ast.literal_eval(line.rsplit("hook: ", 1)[1])     # {path: buckets}
    assert sum(paths.values()) == 6, line
    assert "parameters identical on every rank: True" in out


def test_fsdp2_bf16_example_with_defaults():
    """FSDP2 with BF16 parameters and float32 reduction: every parameter
    group's gradient goes through the ReduceScatter each step."""
    pytest.importorskip("transformers")
    out = _run(torchrun(2, EXAMPLES / "fsdp2_bf16.py", "--steps", "5"), "fsdp2_bf16.py",
               defaults=True)
    steps = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert len(steps) == 5 and all("3 reduce-scatter(s)" in ln for ln in steps), out
    assert "FSDP2 with BF16 parameters over the torch control plane, 2 ranks" in out


def test_hsdp_example_with_defaults():
    """HSDP with BF16 parameters, 2 replicas (of one shard each: two processes
    on the CI machine; 2 x 2 shards run in test_launchers and on GPUs): every
    FSDP module's replica all-reduce goes through dqt.HSDP each step, and each
    shard ends the same on both replicas."""
    pytest.importorskip("transformers")
    out = _run(torchrun(2, EXAMPLES / "hsdp.py", "--steps", "4", "--shard", "1"), "hsdp.py",
               defaults=True)
    steps = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert len(steps) == 4 and all("3 replica all-reduce(s)" in ln for ln in steps), out
    assert ("HSDP, 2 replicas x 1 shards over the torch control plane, 3 FSDP modules "
            "hooked; shards identical across replicas: True") in out


def test_train_lm_under_torchrun_with_ddp_defaults(tmp_path):
    """The training example as torchrun launches it, DDP's own bucket size,
    our hook's defaults: each step records the hook's buckets and paths."""
    pytest.importorskip("transformers")
    out_json = tmp_path / "run.json"
    _run(torchrun(2, EXAMPLES / "train_lm.py", "--tiny", "--steps", "6", "--no-progress",
                  "--json", out_json), "train_lm.py", defaults=True)
    run = json.loads(out_json.read_text())
    assert run["config"]["world_size"] == 2 and run["config"]["bucket_cap_mb"] is None
    hooks = [s["hook"] for s in run["steps"]]
    assert all(h["buckets"] >= 1 and sum(h["paths"].values()) == h["buckets"] for h in hooks)
    assert hooks[0]["paths"] == {"native": hooks[0]["buckets"]}     # path="auto"'s first step


def test_lm_bench_alternates_configurations_in_one_job(tmp_path):
    """mpi_examples/lm_bench.py (tiny, CPU): every configuration at every
    bucket cap, in rounds; steps, compute probes, exposed communication and
    the ratios to plain DDP and the BF16 hook in the table and the JSON."""
    pytest.importorskip("transformers")
    out_json = tmp_path / "bench.json"
    out = _run(torchrun(2, EXAMPLES / "lm_bench.py", "--tiny", "--rounds", "2", "--steps", "2",
                        "--bucket-caps", "default,0.01", "--min-probes", "4", "--auto-rounds", "1",
                        "--no-progress",
                        "--json", out_json), "lm_bench.py", defaults=True)
    res = json.loads(out_json.read_text())
    rows = res["rows"]
    assert [(r["config"], r["bucket_cap_mb"]) for r in rows] == [
        (c, cap) for cap in (None, 0.01) for c in ("fp32", "bf16", "ours")]
    assert len(res["probes_ms"]) >= 4
    for r in rows:
        assert len(r["steps_ms"]) == 4 and r["step_ms"] > 0
        assert r["exposed_ms"] == pytest.approx(r["step_ms"] - r["compute_ms"])
        assert r["step_vs_bf16"] == pytest.approx(
            r["step_ms"] / next(x["step_ms"] for x in rows if x["config"] == "bf16"
                                and x["bucket_cap_mb"] == r["bucket_cap_mb"]))
    ours = [r for r in rows if r["config"] == "ours"]
    assert all(list(r["paths"]) == ["step"] for r in ours)
    assert all(h["buckets"] >= 1 for r in ours for h in r["hook"])
    assert "exposed vs bf16" in out and "ours" in out


def test_lm_bench_python_hook_floor_and_held_paths(tmp_path):
    """lm_bench's fp32-hook (torch's allreduce_hook: what any Python comm hook
    costs over plain DDP) and ours held on one path: every step of
    ``ours:plain`` takes the plain path, from the first."""
    pytest.importorskip("transformers")
    out_json = tmp_path / "bench.json"
    _run(torchrun(2, EXAMPLES / "lm_bench.py", "--tiny", "--rounds", "1", "--steps", "2",
                  "--warmup", "0", "--bucket-caps", "default", "--min-probes", "2",
                  "--no-progress", "--configs", "fp32,fp32-hook,ours:plain", "--json", out_json),
         "lm_bench.py", defaults=True)
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["config"] for r in rows] == ["fp32", "fp32-hook", "ours:plain"]
    assert all(len(r["steps_ms"]) == 2 for r in rows)
    assert rows[0]["comm_hook"] is None                     # plain DDP: no hook
    assert "allreduce_hook" in rows[1]["comm_hook"]         # torch's own, as DDP logs it
    assert rows[1]["hook"] == [None, None]                  # no statistics of ours
    assert "ddp_comm_hook" in rows[2]["comm_hook"]
    assert rows[2]["paths"] == {}                           # held: path="auto" never ran
    held = rows[2]["hook"]      # its first steps (no warm-up): plain from the first
    assert all(set(h["paths"]) == {"plain"} and h["paths"]["plain"] == h["buckets"] for h in held)
    bad = subprocess.run([sys.executable, EXAMPLES / "lm_bench.py", "--tiny", "--fsdp",
                          "--configs", "fp32-hook"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "fp32-hook is a DDP comm hook" in bad.stderr
    bad = subprocess.run([sys.executable, EXAMPLES / "lm_bench.py", "--tiny", "--fsdp",
                          "--configs", "ours:64"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "FSDP2 fuses nothing" in bad.stderr


def test_time_to_loss_trains_every_codec_then_reports(tmp_path):
    """mpi_examples/time_to_loss.py (tiny, CPU, torchrun): one run per codec
    and seed, the comparison as a table and JSON; run again, the finished
    runs are kept, not trained again."""
    pytest.importorskip("transformers")
    out, res_json = tmp_path / "runs", tmp_path / "ttl.json"
    cmd = [sys.executable, EXAMPLES / "time_to_loss.py", "run", "--nproc", "2",
           "--preset", "tiny", "--steps", "4", "--codecs", "bf16,dynamiq:5", "--seeds", "0",
           "--reference", "", "--eval-every", "2", "--probe-every", "2", "--device", "cpu",
           "--out", out, "--json", res_json]
    text = _run(list(map(str, cmd)), "time_to_loss.py run", defaults=True)
    assert sorted(p.name for p in out.iterdir()) == ["run_bf16_s0.json", "run_dynamiq5_s0.json"]
    res = json.loads(res_json.read_text())
    assert set(res["codecs"]) == {"bf16", "dynamiq:5"} and res["world_size"] == 2
    bf16 = res["codecs"]["bf16"]
    assert res["target_val_loss"] == bf16["final_val_mean"]
    assert bf16["reach"]["step"] == 4 and bf16["speedup_reach"] == 1.0
    assert [p["step"] for p in bf16["mean_curve"]] == [2, 4]
    assert "can at most be" in text
    again = _run(list(map(str, cmd)), "time_to_loss.py run again", defaults=True)
    assert again.count("kept") == 2
