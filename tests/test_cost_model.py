"""The cost model (``python -m dynamiq_mpi model``, dynamiq_mpi/cost_model/model.py):
units, the pipeline's arithmetic, edge cases, monotonicity, and its stated
error against the two-GPU measurements in docs/results (docs/cost-model.md;
``python -m research model-check``, research/model_check.py)."""
import json
import math
import os

import pytest

from dynamiq_mpi.__main__ import main
from dynamiq_mpi.cost_model import model as cm
from research import model_check as cc
from research.__main__ import main as research_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "results")


def cluster(nodes=16, k=8, nic=50, nics=None, intra="400GB/s"):
    return cm.Cluster(nodes, k, cm.Link(2e-6, cm.parse_bandwidth(intra)), cm.Link(6e-6, nic * 1e9),
                      nics or k)


@pytest.fixture(scope="module")
def rates():
    return cm.load_rates("h100-final")


def test_units():
    assert cm.parse_bandwidth("400GB/s") == 400e9
    assert cm.parse_bandwidth("200Gb/s") == 25e9
    assert cm.parse_bandwidth("100Gbps") == 12.5e9
    assert cm.parse_bandwidth("25GBps") == 25e9
    assert cm.parse_bandwidth("1GiB/s") == 2 ** 30
    assert cm.parse_bandwidth("25") == 25e9                 # bare: GB/s
    for bad in ("100G", "fast", "10 GB/h"):
        with pytest.raises(ValueError):
            cm.parse_bandwidth(bad)
    assert cm.parse_count("2^28") == cm.parse_count("2**28") == cm.parse_count("1<<28") == 1 << 28
    assert cm.parse_count("268435456") == 1 << 28
    assert cm.parse_count("256Mi") == 1 << 28
    assert cm.parse_count("1e8") == 100_000_000
    for bad in ("2^", "1.5", "lots"):
        with pytest.raises(ValueError):
            cm.parse_count(bad)
    assert cm.parse_time("5us") == pytest.approx(5e-6)
    assert cm.parse_time("2ms") == pytest.approx(2e-3)
    assert cm.parse_time("7") == pytest.approx(7e-6)        # bare: microseconds


def test_rates_file_is_the_bench_output(rates):
    """kernel_rates.json holds what rates_from_kernel_bench extracts from its
    sources, so anyone can rebuild it from docs/results."""
    stored = json.load(open(cm.RATES_FILE))
    for name, s in stored["sets"].items():
        fresh = cm.rates_from_kernel_bench(json.load(open(os.path.join(ROOT, s["source"]))))
        for size, per in s["ns_per_element"].items():
            for key, v in per.items():
                assert fresh["ns_per_element"][size][key] == pytest.approx(v, rel=1e-3), (name, key)
    cal = cc.calibrate_in_call(RESULTS)
    assert cal["factor"] == pytest.approx(stored["in_call_factor"], abs=0.01)


def test_pipeline_is_the_wire_when_kernels_are_free(rates):
    """No kernel time: a ring's 2(n-1) messages per tile, back to back on one link."""
    free = cm.CodecCost("free", 8, 0, False, 0, 0, 0, 0)
    link = cm.Link(1e-5, 1e9)
    for n, tiles in ((2, 1), (5, 1), (4, 3)):
        chunk = 3 * 2 ** 20
        r = cm.data_phase(n, "ring", chunk, free, lambda d: link, chunk / tiles * (1 + 1e-9), 0.0)
        assert r["tiles"] == tiles
        assert r["seconds"] == pytest.approx(2 * (n - 1) * tiles * link.time(chunk / tiles))
    # infinitely fast wire: two ranks run compress, fused step and two decodes in a row
    cost = cm.codec_cost("dynamiq", 5.0, rates, 2 ** 24)
    r = cm.data_phase(2, "ring", 2 ** 24, cost, lambda d: cm.Link(0, 1e30), 1 << 40, 0.0)
    assert r["seconds"] == pytest.approx((cost.compress + cost.dar + 2 * cost.decode) * 2 ** 24)


def test_tiles_overlap_kernels_with_the_wire(rates):
    """More tiles hide one of kernel and wire behind the other (design.md, tiles)."""
    cost = cm.codec_cost("dynamiq", 5.0, rates, 2 ** 26)
    link = cm.Link(5e-6, 30e9)
    one = cm.data_phase(2, "ring", 2 ** 27, cost, lambda d: link, 1 << 40, 0.0)["seconds"]
    four = cm.data_phase(2, "ring", 2 ** 27, cost, lambda d: link, 2 ** 27 * 4.75 / 8 / 4 + 1, 0.0)
    assert four["tiles"] == 4 and four["seconds"] < one
    assert four["seconds"] >= max(four["wire"], four["kernels"]) * 0.999


def test_edge_cases(rates):
    one_node = cm.predict(cluster(nodes=1), 1 << 26, rates)
    assert one_node["levels_ring"]["seconds"] == one_node["nccl"]["seconds"]      # NCCL's own
    one_gpu = cm.predict(cluster(k=1, nics=1), 1 << 26, rates)
    assert one_gpu["levels_ring"]["seconds"] == one_gpu["flat_ring"]["seconds"]   # the flat call
    alone = cm.predict(cluster(nodes=1, k=1), 1 << 20, rates)
    assert all(math.isfinite(v["seconds"]) and v["seconds"] > 0 for v in alone.values())
    odd = cm.predict(cluster(nodes=3), 1 << 26, rates)
    assert odd["levels_butterfly"]["topology"] == "ring" and "ring" in odd["levels_butterfly"]["note"]
    assert "refuses" in odd["flat_butterfly"]["note"]
    assert cm.predict(cluster(), 0, rates)["nccl"]["seconds"] > 0


@pytest.mark.parametrize("codec", ["dynamiq", "bf16", "mxfp8", "exact"])
def test_monotone(rates, codec):
    def t(key, **kw):
        args = dict(nodes=8, nic=25)
        elements = kw.pop("elements", 1 << 26)
        args.update(kw)
        return cm.predict(cluster(**args), elements, rates, codec=codec)[key]["seconds"]
    for key in ("nccl", "flat_ring", "levels_ring", "levels_butterfly"):
        assert t(key, elements=1 << 24) <= t(key, elements=1 << 26) <= t(key, elements=1 << 28)
        assert t(key, nic=100) <= t(key, nic=25) <= t(key, nic=3)
        assert t(key, nics=8) <= t(key, nics=2) <= t(key, nics=1)
    slow = cluster(nodes=8, nic=3)
    fewer = [cm.predict(slow, 1 << 28, rates, bits=b)["levels_ring"]["seconds"] for b in (3, 5, 8)]
    assert fewer == sorted(fewer)


def test_bytes_on_the_wire(rates):
    """Wire-only, the compressed ring moves 2(n-1)/n of the input at the codec's bits."""
    c = cm.Cluster(4, 1, cm.Link(0, 1e12), cm.Link(0, 1e9), 1)
    r = cm.predict(c, 1 << 24, rates, codec="bf16", topologies=("ring",), host="graph")
    assert r["flat_ring"]["wire"] == pytest.approx(2 * 3 / 4 * (1 << 24) * 2 / 1e9)
    assert r["nccl"]["seconds"] == pytest.approx(c.launch + 2 * 3 / 4 * (1 << 24) * 2 / 1e9)


def test_sanity_points():
    s = cc.sanity_points()
    rail, paper = s.values()
    for label in rail:                  # 8 GPUs, 2 x 200G: the levels ahead of flat and NCCL
        assert rail[label]["levels_ring"] > max(2.0, rail[label]["flat_ring"])
    for label in paper:                 # 2 GPUs, NV4, one NIC: the flat ring ahead
        assert paper[label]["flat_ring"] > paper[label]["levels_ring"] > 2.0


def test_error_on_the_recorded_measurements():
    """The statement of docs/cost-model.md: from 2^24 elements, the two-GPU runs
    of 2026-11-24 (the code whose kernel rates the model holds) are predicted
    within 25 % but for one row, with a mean error below 10 %; the link
    parameters come from NCCL's rows only."""
    res = cc.check(RESULTS)
    rows = [r for r in res["rows"] if r["current_code"] and r["elements"] >= 1 << 24]
    assert {r["link"] for r in rows} == {"nvlink", "shm", "sockets"}
    errors = [abs(r["error"]) for r in rows]
    assert len(rows) >= 38
    assert sum(e <= 0.25 for e in errors) >= len(rows) - 1
    assert sum(errors) / len(errors) < 0.10
    assert max(errors) < 0.40


def test_subcommand(tmp_path, capsys):
    out = tmp_path / "p.json"
    main(["model", "--nodes", "16", "--gpus-per-node", "8", "--intra", "400GB/s", "--inter",
          "50GB/s", "--nics-per-node", "8", "--elements", "2^28", "--bits", "5", "--json", str(out)])
    text = capsys.readouterr().out
    assert "NCCL BF16 ring" in text and "levels ring" in text and "flat butterfly" in text
    doc = json.loads(out.read_text())
    assert doc["inputs"]["elements"] == 1 << 28 and doc["inputs"]["nic_GBps"] == 50
    assert set(doc["prediction"]) == {"nccl", "flat_ring", "flat_butterfly", "levels_ring",
                                      "levels_butterfly"}
    sweep = tmp_path / "s.json"
    main(["model", "--sweep", "inter=100Gb/s,400Gb/s", "--topology", "ring", "--json", str(sweep)])
    rows = json.loads(sweep.read_text())["rows"]
    assert [r["value"] for r in rows] == ["100Gb/s", "400Gb/s"]
    assert rows[0]["levels_ring"]["speedup"] > rows[1]["levels_ring"]["speedup"]
    research_main(["model-check", "--json", str(tmp_path / "c.json")])
    check = json.loads((tmp_path / "c.json").read_text())
    assert check["check"]["rows"] and check["sanity"]


def test_map(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "map.png"
    research_main(["model-map", str(png)])
    assert png.stat().st_size > 10_000
    data = json.loads(png.with_suffix(".json").read_text())
    assert {g["best"] for g in data["winner"]} >= {"nccl", "levels_ring"}


def _check_tool():
    from research import model_check_runs
    return model_check_runs


def test_error_from_2_20_at_two_and_four_ranks():
    """The statement of docs/cost-model.md, "Predicted against measured": from
    2^20 elements at two and four ranks (research/model_check_runs.py), every
    two-rank row within 25 % but the four NVLink rows of bench_defaults_nvlink
    (the same calls took 672-680 us in bench_paths minutes earlier); every
    four-rank shared-memory row predicted more than 25 % too fast (the model's
    open gap there); outside those, only three four-rank socket rows of the
    statistics A/B; mean error under 12 % without the shared-memory four-rank
    rows; and docs/results/cost_model_check_2026-11-28.json is what the tool
    computes."""
    res = _check_tool().check(RESULTS)
    rows = [r for r in res["rows"] if r["elements"] >= 1 << 20 and not r["in_sample"]]
    assert {(r["link"], r["ranks"]) for r in rows} >= {("nvlink", 2), ("shm", 2), ("sockets", 2),
                                                      ("nvlink", 4), ("sockets", 4), ("shm", 4)}
    shm4 = [r for r in rows if (r["link"], r["ranks"]) == ("shm", 4)]
    assert len(shm4) == 12 and all(r["error"] < -0.25 for r in shm4)
    rest = [r for r in rows if r not in shm4]
    outside = [r for r in rest if abs(r["error"]) > 0.25]
    assert len(rows) >= 86 and len(outside) <= 7
    assert all(r["run"] == "bench_defaults_nvlink_h200x2_2026-11-24.json"
               or (r["ranks"], r["link"], r["run"].startswith("stats_direct_ab_h200x4"))
               == (4, "sockets", True) for r in outside)
    assert sum(abs(r["error"]) for r in rest) / len(rest) < 0.12
    assert 80 <= res["host_per_message_4_ranks_us"] <= 120      # fitted to the BF16 rows
    stored = json.load(open(os.path.join(RESULTS, "cost_model_check_2026-11-28.json")))
    assert len(stored["rows"]) == len(res["rows"])
    for a, b in zip(stored["rows"], res["rows"]):
        assert (a["run"], a["elements"], a["measured_us"]) == (b["run"], b["elements"],
                                                               b["measured_us"])
        assert a["predicted_us"] == pytest.approx(b["predicted_us"], rel=1e-6)


def test_eager_host_gates_the_device(rates):
    """A message and its kernel run no earlier than the host issues them: with a
    slow host the eager call takes the host's time, with a free host the device's."""
    link = cm.Link(5e-6, 100e9)
    slow = dict(rates, host_us=dict(rates["host_us"], per_hop=500.0))
    cost = lambda te: cm.codec_cost("dynamiq", 5.0, rates, te)      # noqa: E731
    fast = cm.compressed_allreduce(4, 1 << 22, cost, lambda d: link, rates, "ring", "eager")
    host_bound = cm.compressed_allreduce(4, 1 << 22, cost, lambda d: link, slow, "ring", "eager")
    # six data messages and the statistics' two rounds (the ring's six steps before)
    assert host_bound["seconds"] >= host_bound["host"] > 8 * 500e-6
    steps = cm.compressed_allreduce(4, 1 << 22, cost, lambda d: link, slow, "ring", "eager",
                                    stats_direct=(2, 0))
    assert steps["host"] > 12 * 500e-6 and steps["seconds"] > host_bound["seconds"]
    assert fast["seconds"] < host_bound["seconds"]
    graph = cm.compressed_allreduce(4, 1 << 22, cost, lambda d: link, slow, "ring", "graph")
    assert graph["seconds"] == pytest.approx(max(50e-6, graph["device"]))


def test_rounds_pay_one_latency_each(rates):
    """A latency-bound link: the doubling's all-gather (two rounds at four
    ranks instead of three) and the butterfly's grouped levels each save
    about one message's latency per round saved; a fast link sees almost no
    difference; the recorded-run mode (no rounds) is the old step-by-step
    schedule."""
    slow = cm.Link(370e-6, 11.3e9)
    cost = lambda te: cm.codec_cost("dynamiq", 5.0, rates, te)      # noqa: E731

    def call(topology, gather, grouped=True, link=slow, n=4):
        return cm.compressed_allreduce(n, 1 << 22, cost, lambda d: link, rates, topology,
                                       "graph", gather=gather, grouped=grouped)

    ring, dbl = call("ring", "ring"), call("ring", "doubling")
    assert (ring["rounds"], dbl["rounds"]) == (6, 5) and ring["hops"] == dbl["hops"]
    assert ring["seconds"] - dbl["seconds"] == pytest.approx(370e-6, rel=0.1)
    bfly, seq = call("butterfly", "doubling"), call("butterfly", "doubling", grouped=False)
    assert (bfly["rounds"], seq["rounds"]) == (4, 5)
    assert seq["seconds"] - bfly["seconds"] == pytest.approx(370e-6, rel=0.15)
    fast = cm.Link(2e-6, 400e9)
    a, b = call("ring", "ring", link=fast), call("ring", "doubling", link=fast)
    assert abs(a["seconds"] - b["seconds"]) < 0.02 * a["seconds"]
    eight = call("ring", "ring", n=8)["rounds"], call("ring", "doubling", n=8)["rounds"]
    assert eight == (14, 10)
