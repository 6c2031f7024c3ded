"""The comparison of mpi_examples/time_to_loss.py on made-up runs whose
answer is known: training time as the sum of step times (an error-measuring
step counted as the median step), the first evaluation at or below the
baseline's mean final loss, the speed-up, the paired loss gap and the bound."""
import importlib.util
import statistics
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "time_to_loss", Path(__file__).resolve().parents[1] / "mpi_examples" / "time_to_loss.py")
ttl = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(ttl)


def fake_run(codec, seed, step_ms, losses, measured=(), compute_ms=100.0):
    """``2 len(losses)`` steps of ``step_ms`` each (a measured step takes
    5 s), an evaluation every second step with ``losses``."""
    n = 2 * len(losses)
    steps = [{"step": i, "step_ms": 5000.0 if i in measured else step_ms,
              "measured": i in measured} for i in range(n)]
    evals = [{"step": 2 * (k + 1), "val_loss": v} for k, v in enumerate(losses)]
    return {"config": {"world_size": 4, "batch": 8, "seq_len": 512, "n_params": 8e8,
                       "steps": n, "device": "test", "preset": "0.8b", "bucket_cap_mb": None},
            "steps": steps, "evals": evals,
            "vnmse": [{"step": 0, "vnmse": 1e-3 * (seed + 1)}],
            "summary": {"codec": codec, "seed": seed, "final_val_loss": losses[-1],
                        "step_ms": step_ms, "compute_ms": compute_ms,
                        "bits_per_coord": 5.0}}


def test_training_time_replaces_measured_steps_by_the_median():
    run = fake_run("bf16", 0, 300.0, [5, 4, 3, 2, 1], measured=(0, 5))
    assert ttl.training_times(run) == pytest.approx([0.3 * (i + 1) for i in range(10)])


def test_reach_speedup_gap_and_bound():
    base = [fake_run("bf16", 0, 300.0, [5, 4, 3, 2.0, 1.00]),
            fake_run("bf16", 1, 300.0, [5, 4, 3, 2.2, 1.20])]
    ours = [fake_run("dq", 0, 150.0, [5, 4, 3, 1.05, 1.02]),      # reaches 1.1 at step 8
            fake_run("dq", 1, 150.0, [5, 4, 3, 1.15, 1.10])]
    res = ttl.report(base + ours, baseline="bf16")
    assert res["target_val_loss"] == pytest.approx(1.1)
    b, o = res["codecs"]["bf16"], res["codecs"]["dq"]
    assert b["reach"] == {"step": 10, "training_s": pytest.approx(3.0)}
    assert o["reach"] == {"step": 8, "training_s": pytest.approx(1.2)}
    assert o["speedup_reach"] == pytest.approx(3.0 / 1.2)
    assert o["reach_per_seed"] == [{"step": 8, "training_s": pytest.approx(1.2)},
                                   {"step": 10, "training_s": pytest.approx(1.5)}]
    assert o["paired_gaps"] == pytest.approx([0.02, 1.10 / 1.20 - 1])
    assert o["loss_allowance"] == pytest.approx(
        max(0.005, 2 * statistics.stdev([1.0, 1.2]) / 1.1))
    # compute 100 ms, BF16 exposes 200 ms: (100 + 200) / (100 + 200 * 5 / 16)
    assert res["bound"]["speedup_bound"] == pytest.approx(300 / (100 + 62.5))
    assert o["tokens_per_s"] == pytest.approx(4 * 8 * 512 / 0.150)
    assert [v["vnmse"] for v in o["vnmse"]] == pytest.approx([1.5e-3])


def test_paired_gaps_mean_standard_error_and_seeds_to_resolve():
    gaps = [0.0101, 0.0072, 0.0111]
    got = ttl._paired_summary(gaps)
    sd = statistics.stdev(gaps)
    assert got["paired_gap_mean"] == pytest.approx(statistics.mean(gaps))
    assert got["paired_gap_se"] == pytest.approx(sd / 3 ** 0.5)
    need = (2 * sd / statistics.mean(gaps)) ** 2            # 2 s.e. = |mean| at this many
    assert got["seeds_to_resolve"] == max(2, -(-need // 1))
    wide = ttl._paired_summary([-0.0112, 0.0083, 0.0140])   # a wide spread needs many
    assert wide["seeds_to_resolve"] > 40
    assert ttl._paired_summary([0.01])["paired_gap_se"] is None
    assert ttl._paired_summary([])["paired_gap_mean"] is None
    res = ttl.report([fake_run("bf16", 0, 300.0, [5, 4, 3, 2, 1.0]),
                      fake_run("bf16", 1, 300.0, [5, 4, 3, 2, 2.0]),
                      fake_run("dq", 0, 150.0, [5, 4, 3, 2, 1.01]),
                      fake_run("dq", 1, 150.0, [5, 4, 3, 2, 2.04])])
    o = res["codecs"]["dq"]
    assert o["paired_gap_mean"] == pytest.approx(0.015)
    assert o["paired_gap_se"] == pytest.approx(statistics.stdev([0.01, 0.02]) / 2 ** 0.5)


def test_a_codec_that_never_gets_there_has_no_time():
    res = ttl.report([fake_run("bf16", 0, 300.0, [5, 4, 3, 2, 1.0]),
                      fake_run("dq", 0, 150.0, [5, 4, 3, 2, 1.01])])
    assert res["codecs"]["dq"]["reach"] is None and "speedup_reach" not in res["codecs"]["dq"]
    assert res["codecs"]["dq"]["reach_1pct"]["step"] == 10


def test_bad_reference_and_empty_lists_are_refused():
    with pytest.raises(SystemExit, match="CODEC:SEED"):
        ttl.planned_runs(["bf16"], [0], ["fp32"])
    with pytest.raises(SystemExit, match="--codecs is empty"):
        ttl._pairs(" , ", "codecs")
    assert ttl.planned_runs(["bf16", "dq"], [0, 1], ["fp32:0"]) == [
        ("bf16", 0), ("dq", 0), ("bf16", 1), ("dq", 1), ("fp32", 0)]


def test_run_tags_are_file_name_safe_and_keep_the_old_names():
    assert ttl.run_tag("dynamiq:5", 2) == "dynamiq5_s2"
    assert ttl.run_tag("bf16", 0) == "bf16_s0"
    tag = ttl.run_tag("dynamiq:5:centring=false", 1)
    assert tag == "dynamiq5centring-false_s1"
    assert ttl.run_tag("dynamiq:5:centring=true", 1) != tag


def test_a_codec_with_more_steps_is_a_row_of_its_own_without_a_loss_gap():
    base = [fake_run("bf16", 0, 300.0, [5, 4, 3, 2, 1.00])]
    same = [fake_run("dq", 0, 150.0, [5, 4, 3, 2, 1.02])]                  # never reaches 1.0
    longer = [fake_run("dq", 0, 160.0, [5, 4, 3, 2, 1.01, 0.99, 0.97])]  # reaches it at step 12
    res = ttl.report(longer + base + same, baseline="bf16")
    assert res["steps"] == 10 and set(res["codecs"]) == {"bf16", "dq", "dq@14"}
    row = res["codecs"]["dq@14"]
    assert row["steps"] == 14 and row["reach"] == {"step": 12, "training_s": pytest.approx(1.92)}
    assert row["speedup_reach"] == pytest.approx(3.0 / 1.92)
    assert "loss_gap" not in row and "paired_gaps" not in row      # not at equal steps
    assert res["codecs"]["dq"]["paired_gaps"] == pytest.approx([0.02])
    assert res["codecs"]["dq"]["reach"] is None


def test_step_budgets_in_codec_specs():
    assert ttl.split_steps("dynamiq:5@330", 300) == ("dynamiq:5", 330)
    assert ttl.split_steps("bf16", 300) == ("bf16", 300)
    for bad in ("dynamiq:5@", "dynamiq:5@0", "@330", "dynamiq:5@3x"):
        with pytest.raises(SystemExit, match="CODEC@STEPS"):
            ttl.split_steps(bad, 300)
    assert ttl.run_tag("dynamiq:5@330", 1) == "dynamiq5_n330_s1"
    assert ttl.run_tag("dynamiq:5@330", 1) != ttl.run_tag("dynamiq:5", 1)


def test_a_seed_run_twice_is_refused():
    runs = [fake_run("bf16", 0, 300.0, [5, 4, 3, 2, 1.0]),
            fake_run("bf16", 0, 310.0, [5, 4, 3, 2, 1.1])]
    with pytest.raises(SystemExit, match="more than one run at seed"):
        ttl.report(runs)
