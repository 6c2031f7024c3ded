"""Schedules are plain data: check them by simulating who holds what."""
import pytest

from dynamiq_mpi import schedules
from dynamiq_mpi.schedules import GATHER, REDUCE


def contributions_after_reduce(s):
    """Replay the reduce-scatter on sets: which ranks' data each partial holds."""
    n = s.size
    held = {(r, c): {r} for r in range(n) for c in range(n)}   # local contribution
    sent = {(r, c): False for r in range(n) for c in range(n)}
    n_reduce = sum(1 for st in s.steps[0] if st.phase == REDUCE)
    for i in range(n_reduce):
        msgs = {}
        for r in range(n):
            st = s.steps[r][i]
            assert st.phase == REDUCE
            assert not sent[(r, st.send_chunk)], "a rank sends a chunk twice"
            sent[(r, st.send_chunk)] = True
            msgs[(r, st.dest)] = (st.send_chunk, set(held[(r, st.send_chunk)]))
        for r in range(n):
            st = s.steps[r][i]
            chunk, data = msgs[(st.source, r)]
            assert chunk == st.recv_chunk, "sender and receiver disagree on the chunk"
            assert not sent[(r, chunk)], "received a partial sum after sending the chunk"
            assert not (held[(r, chunk)] & data), "a contribution counted twice"
            held[(r, chunk)] |= data
    return held, sent


@pytest.mark.parametrize("topology,n", [("ring", n) for n in range(1, 10)] +
                         [("butterfly", n) for n in (1, 2, 4, 8, 16, 32)])
def test_every_sink_gets_every_contribution(topology, n):
    s = schedules.build(topology, n)
    assert all(len(steps) == 2 * (n - 1) for steps in s.steps)
    held, sent = contributions_after_reduce(s)
    for r in range(n):
        own = s.owned_chunk(r)
        assert held[(r, own)] == set(range(n))
        assert not sent[(r, own)]
        # every other chunk was sent exactly once: one quantization event per (rank, chunk)
        assert all(sent[(r, c)] for c in range(n) if c != own)
    # events: distinct roles per chunk, the sink has role n - 1
    for c in range(n):
        assert sorted(s.event(r, c) for r in range(n)) == list(range(n))
        sink = [r for r in range(n) if s.owned_chunk(r) == c][0]
        assert s.event(sink, c) == n - 1


@pytest.mark.parametrize("topology,n", [("ring", 5), ("butterfly", 8)])
def test_all_gather_delivers_every_chunk_once(topology, n):
    s = schedules.build(topology, n)
    have = {r: {s.owned_chunk(r)} for r in range(n)}
    for i in range(n - 1, 2 * (n - 1)):
        moves = []
        for r in range(n):
            st = s.steps[r][i]
            assert st.phase == GATHER and st.send_chunk in have[r]
            moves.append((st.dest, st.send_chunk))
        for r in range(n):
            assert s.steps[r][i].recv_chunk in {c for d, c in moves if d == r}
        for d, c in moves:
            assert c not in have[d]
            have[d].add(c)
    assert all(have[r] == set(range(n)) for r in range(n))
    # the engine sends each finished tile straight into the first all-gather
    # step: that step must send the chunk the rank is the sink of
    for r in range(n):
        assert s.steps[r][n - 1].send_chunk == s.owned_chunk(r)


def test_butterfly_depth_is_log_n():
    # each coordinate is quantized log2(n) + 1 times along its path to the sink
    n = 16
    s = schedules.build("butterfly", n)
    dists = sorted({min((st.dest - r) % n, n) for r in range(n) for st in s.steps[r]
                    if st.phase == REDUCE})
    assert dists == [1, 2, 4, 8]


def test_unsupported_sizes():
    with pytest.raises(schedules.TopologyError, match="power-of-two"):
        schedules.build("butterfly", 6)
    with pytest.raises(schedules.TopologyError, match="unknown topology"):
        schedules.build("tree", 4)


def test_describe_prints_every_step():
    from research.__main__ import describe
    text = describe(schedules.build("ring", 3))
    assert text.count("\n") == 3 * 4
