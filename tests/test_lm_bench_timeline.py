"""lm_bench's reading of a profiled step: where the compute stream waits,
split by what the other streams run meanwhile."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "mpi_examples"))
import lm_bench  # noqa: E402


def test_idle_time_is_split_by_the_other_streams_kernels():
    kernels = [(7, "compute", 0.0, 10.0), (7, "compute", 20.0, 30.0), (7, "copy", 35.0, 36.0),
               (9, "all-gather", 5.0, 25.0), (11, "send/recv", 22.0, 40.0),
               (11, "codec", 12.0, 14.0)]
    got = lm_bench.compute_stream_idle(kernels)
    assert got["window_ms"] == 40.0 and got["busy_ms"] == 21.0 and got["idle_ms"] == 19.0
    assert got["idle_while_ms"] == pytest.approx(
        {"all-gather": 8.0, "all-gather+codec": 2.0, "send/recv": 9.0})


def test_the_compute_stream_is_the_one_with_most_compute_and_gaps_with_nothing_count():
    kernels = [(3, "compute", 0.0, 1.0), (5, "compute", 0.0, 4.0), (5, "compute", 6.0, 10.0),
               (3, "all-reduce", 4.5, 5.0)]
    got = lm_bench.compute_stream_idle(kernels)
    assert got["busy_ms"] == 8.0 and got["idle_ms"] == 2.0
    assert got["idle_while_ms"] == pytest.approx({"all-reduce": 0.5, "nothing": 1.5})


def test_random_timelines_conserve_the_idle_time():
    rng = random.Random(0)
    for _ in range(50):
        kernels = []
        for _ in range(rng.randint(1, 30)):
            a = rng.uniform(0, 100)
            kernels.append((rng.choice([1, 2, 3]), rng.choice(["compute", "all-gather", "codec"]),
                            a, a + rng.uniform(0.01, 10)))
        got = lm_bench.compute_stream_idle(kernels)
        if not got:
            assert all(k != "compute" for _, k, _, _ in kernels)
            continue
        assert got["busy_ms"] + got["idle_ms"] == pytest.approx(got["window_ms"])
        assert sum(got["idle_while_ms"].values()) == pytest.approx(got["idle_ms"])


def test_nccl_kernels_are_named_by_collective():
    kind = lm_bench._timeline_kind
    assert kind("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "all-gather"
    assert kind("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(x)") == "reduce-scatter"
    assert kind("ncclDevKernel_SendRecv(x)") == "send/recv"
    assert kind("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)") == "all-reduce"
    assert kind("k_dq_encode_tile") == "codec"
    assert kind("ampere_bf16_s16816gemm") == "compute"


def test_empty_and_zero_length_kernels():
    assert lm_bench.compute_stream_idle([]) == {}
    got = lm_bench.compute_stream_idle([(1, "compute", 0.0, 2.0), (1, "compute", 2.0, 2.0),
                                        (2, "all-gather", 2.0, 2.0), (1, "compute", 3.0, 4.0)])
    assert got["busy_ms"] == 3.0 and got["idle_ms"] == 1.0
    assert got["idle_while_ms"] == pytest.approx({"nothing": 1.0})


class _Range:
    def __init__(self, start, end):
        self.start, self.end = start, end


class _Event:
    def __init__(self, name, stream, start_us, end_us, device="cuda", annotation=False):
        self.name, self.device_resource_id = name, stream
        self.time_range = _Range(start_us, end_us)
        self.device_type, self.is_user_annotation = device, annotation


def test_the_timeline_keeps_device_kernels_and_leaves_out_annotation_ranges():
    """The profiler lays a record_function's range on the stream of its
    kernels too: counted as a kernel, it would hide the gaps inside it."""
    events = [_Event("ampere_bf16_gemm", 7, 0, 1000), _Event("ampere_bf16_gemm", 7, 3000, 4000),
              _Event("FSDP::post_backward_reduce (layers.0)", 7, 0, 4000, annotation=True),
              _Event("ncclDevKernel_SendRecv(x)", 9, 1500, 2500),
              _Event("aten::mm", 0, 0, 4000, device="cpu")]
    timeline = lm_bench.kernel_timeline(events, "cuda")
    assert timeline == [(7, "compute", 0.0, 1.0), (7, "compute", 3.0, 4.0),
                        (9, "send/recv", 1.5, 2.5)]
    got = lm_bench.compute_stream_idle(timeline)
    assert got["idle_while_ms"] == pytest.approx({"nothing": 1.0, "send/recv": 1.0})


def test_host_ranges_group_named_ranges_by_name_without_the_module():
    events = [_Event("FSDP::post_backward_reduce (layers.0)", 1, 0, 2000, device="cpu",
                     annotation=True),
              _Event("FSDP::post_backward_reduce (layers.1)", 1, 3000, 3500, device="cpu",
                     annotation=True),
              _Event("DistributedDataParallel.forward", 1, 0, 9000, device="cpu",
                     annotation=True),
              _Event("aten::mm", 1, 0, 50000, device="cpu"),                # an operator
              _Event("FSDP::post_backward_reduce (layers.0)", 7, 0, 2000, annotation=True)]
    got = lm_bench.host_ranges(events, "cpu")
    assert list(got) == ["DistributedDataParallel.forward", "FSDP::post_backward_reduce"]
    assert got["FSDP::post_backward_reduce"] == {"ms": 2.5, "count": 2}
    assert lm_bench.host_ranges(events, "cpu", top=1) == {
        "DistributedDataParallel.forward": {"ms": 9.0, "count": 1}}
