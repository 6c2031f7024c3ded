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


@pytest.mark.parametrize("gather", schedules.GATHERS)
@pytest.mark.parametrize("topology,n", [("ring", n) for n in range(1, 10)] +
                         [("butterfly", n) for n in (1, 2, 4, 8, 16, 32)])
def test_every_sink_gets_every_contribution(topology, n, gather):
    s = schedules.build(topology, n, gather)
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


@pytest.mark.parametrize("topology,n,gather", [("ring", 5, "ring"), ("butterfly", 8, "ring")] +
                         [("ring", n, "doubling") for n in range(2, 18)] +
                         [("butterfly", 16, "doubling")])
def test_all_gather_delivers_every_chunk_once(topology, n, gather):
    s = schedules.build(topology, n, gather)
    assert s.gather == gather
    assert all([list(g) for g in s.rounds[r]] == schedules.rounds(s.steps[r]) for r in range(n))
    have = {r: {s.owned_chunk(r)} for r in range(n)}
    gathers = {r: schedules.rounds([st for st in s.steps[r] if st.phase == GATHER])
               for r in range(n)}
    n_rounds = len(gathers[0])
    assert n_rounds == (n - 1 if gather == "ring" else (n - 1).bit_length())
    for i in range(n_rounds):
        moves = []
        for r in range(n):
            group = gathers[r][i]
            # a round's steps share their peers and send only what the rank held before it
            assert len({(st.dest, st.source) for st in group}) == 1
            assert all(st.send_chunk in have[r] for st in group)
            moves += [(st.dest, st.send_chunk) for st in group]
        for r in range(n):
            arriving = sorted(c for d, c in moves if d == r)
            assert arriving == sorted(st.recv_chunk for st in gathers[r][i])
        for d, c in moves:
            assert c not in have[d]
            have[d].add(c)
    assert all(have[r] == set(range(n)) for r in range(n))
    # the engine sends each finished tile straight into the first all-gather
    # step: that step must send the chunk the rank is the sink of, alone in its round
    for r in range(n):
        assert s.steps[r][n - 1].send_chunk == s.owned_chunk(r)
        assert len(gathers[r][0]) == 1


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_butterfly_levels_are_rounds_with_one_peer(n):
    s = schedules.build("butterfly", n)
    for r in range(n):
        groups = schedules.rounds([st for st in s.steps[r] if st.phase == REDUCE])
        assert [len(g) for g in groups] == [n >> (k + 1) for k in range((n - 1).bit_length())]
        for g in groups:
            assert len({(st.dest, st.source) for st in g}) == 1
            # nothing received in a round is sent in it
            assert not {st.recv_chunk for st in g} & {st.send_chunk for st in g}


def test_unknown_gather_is_refused():
    with pytest.raises(ValueError, match="unknown all-gather"):
        schedules.build("ring", 4, "tree")


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
