"""The statistics' reduction (call/phases.py, reduce_stats) on simulated
ranks: the direct exchange (3 to STATS_DIRECT_RANKS ranks, up to
STATS_DIRECT_BYTES), the two ranks' single exchange and the schedule's steps
beyond.  Every rank gets the same
bits, the float32 sum is the rank-order one (within float32 rounding of the
exact float64 sum), and the wire bytes are what a ring all-reduce sends."""
import numpy as np
import pytest

from dynamiq_mpi import schedules
from dynamiq_mpi.backend import backend_for
from dynamiq_mpi.call.phases import reduce_stats
from dynamiq_mpi.call.workspace import Workspace
from dynamiq_mpi.transports.simulate import SimulatedTransport
from helpers import fresh_seed

SIZES = [2, 3, 4, 5, 8, 9]


def recording(program, seen):
    """``program``, its requests' kinds appended to ``seen``."""
    answer = None
    while True:
        try:
            request = program.send(answer)
        except StopIteration as done:
            return done.value
        seen.append(type(request).__name__)
        answer = yield request


def reduce_on_simulated_ranks(rows, topology="ring", seen=None):
    n = len(rows)
    schedule = schedules.build(topology, n)
    programs = [recording(reduce_stats(rows[r], n, r, schedule, backend_for(rows[r]),
                                       Workspace(), 4096), [] if seen is None else seen)
                for r in range(n)]
    return SimulatedTransport(n).run(programs)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("length", [9, 1000, 4099])
def test_float_statistics_sum_alike_everywhere(n, length):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    # magnitudes over many decades: the order of the float32 additions shows
    rows = [(rng.standard_normal(length) * 10.0 ** rng.integers(-6, 6, length)).astype(np.float32)
            for _ in range(n)]
    results = reduce_on_simulated_ranks(rows)
    first = results[0][0]
    for reduced, _, _ in results:
        assert reduced.dtype == np.float32
        assert reduced.tobytes() == first.tobytes(), f"ranks differ (seed {seed})"
    exact = np.sum([r.astype(np.float64) for r in rows], axis=0)
    scale = np.sum([np.abs(r.astype(np.float64)) for r in rows], axis=0)
    assert np.all(np.abs(first - exact) <= n * 2.0 ** -23 * scale), f"seed {seed}"
    if schedules.stats_direct(n, rows[0].nbytes):
        acc = rows[0].copy()
        for r in rows[1:]:
            np.add(acc, r, out=acc)
        assert first.tobytes() == acc.tobytes(), f"not the rank-order sum (seed {seed})"
    # the wire: what a ring all-reduce of the vector sends, every byte counted
    sent = sum(s for _, s, _ in results)
    assert all(total == sent for _, _, total in results)
    assert sent == 2 * (n - 1) * 4 * length


@pytest.mark.parametrize("n", SIZES)
def test_byte_statistics_reduce_by_maximum(n):
    rng = np.random.default_rng(fresh_seed())
    rows = [rng.integers(0, 256, 777).astype(np.uint8) for _ in range(n)]
    results = reduce_on_simulated_ranks(rows)
    want = np.max(np.stack(rows), axis=0)
    for reduced, _, _ in results:
        assert np.array_equal(reduced, want)


def test_the_direct_exchange_is_two_rounds_of_every_peer():
    """Every rank posts its n - 1 messages of a round in one request."""
    n, seen = 4, []
    rows = [np.full(64, r, dtype=np.float32) for r in range(n)]
    schedule = schedules.build("ring", n)
    program = reduce_stats(rows[1], n, 1, schedule, backend_for(rows[1]), Workspace(), 4096)
    request = next(program)
    while True:
        seen.append(request)
        if type(request).__name__ == "ExchangeAll":
            answer = [type("H", (), {"buffer": x.recv})() for x in request.exchanges]
            for x in request.exchanges:   # a peer's part: its rank in every entry
                x.recv.view(np.float32)[:] = x.source
        else:
            answer = request.handle.buffer
        try:
            request = program.send(answer)
        except StopIteration as done:
            reduced = done.value[0]
            break
    rounds = [r for r in seen if type(r).__name__ == "ExchangeAll"]
    assert len(rounds) == 2
    for r in rounds:
        assert sorted(x.dest for x in r.exchanges) == [0, 2, 3]
        assert sorted(x.source for x in r.exchanges) == [0, 2, 3]
    # rank 1 owns elements 16..31: 0 + 1 + 2 + 3 there
    assert np.all(reduced[16:32] == 6.0)


@pytest.mark.parametrize("n", [3, 4])
def test_large_statistics_take_the_schedule_s_steps(n):
    rng = np.random.default_rng(fresh_seed())
    length = schedules.STATS_DIRECT_BYTES // 4 + 1
    rows = [rng.standard_normal(length).astype(np.float32) for _ in range(n)]
    seen = []
    results = reduce_on_simulated_ranks(rows, seen=seen)
    assert "ExchangeAll" not in seen and seen.count("Exchange") >= n * 2 * (n - 1)
    assert all(r[0].tobytes() == results[0][0].tobytes() for r in results)
    small, seen = [r[:1000] for r in rows], []
    reduce_on_simulated_ranks(small, seen=seen)
    assert seen.count("ExchangeAll") == 2 * n and "Exchange" not in seen
