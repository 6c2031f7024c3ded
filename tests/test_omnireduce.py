"""OmniReduce baseline: the union of local top-k blocks against a brute-force
model, the union's blocks against an independent BF16 ring / butterfly model
built on ml_dtypes casts, zeros elsewhere, and the bits on the wire."""
import ml_dtypes
import numpy as np
import pytest

import dynamiq_mpi as dq
from dynamiq_mpi.codecs.base import StreamLayout, tile_stream
from dynamiq_mpi.codecs.omnireduce import (OmniReduce, choose_threshold, local_k,
                                           priority_bytes)
from helpers import exact_sum, fresh_seed, rank_inputs, vnmse

CASES = [(n, "ring") for n in (2, 3, 4, 8)] + [(n, "butterfly") for n in (2, 4, 8)]


def bits_equal(a, b):
    return np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


def padded_blocks(x):
    nb = -(-x.size // 256)
    return np.pad(x.astype(np.float32), (0, nb * 256 - x.size)).reshape(nb, 256)


def model_union(xs, density):
    """Brute force: for every common local k a priority byte can express, the
    union of the ranks' top-k blocks by l2 norm (ties by index); the largest k
    whose union holds at most density x blocks, else the smallest k."""
    nb = padded_blocks(xs[0]).shape[0]
    orders = []
    for x in xs:
        norms = [float(np.sum(np.square(b.astype(np.float64)))) for b in padded_blocks(x)]
        orders.append(sorted(range(nb), key=lambda j: (-norms[j], j)))
    # rank r of a rank's order is in the top k(t) iff its byte 254 - floor(254 r / nb) >= t
    ks = sorted({sum(1 for r in range(nb) if 254 - (254 * r) // nb >= t) for t in range(1, 255)})
    best = None
    for k in ks:
        union = sorted(set().union(*(o[:k] for o in orders)))
        if len(union) <= density * nb or best is None:
            best = (k, union)
    return best


def children(v, topology):
    """Roles whose partial sums role v receives, in the order they arrive."""
    if topology == "ring":
        return [v - 1] if v else []
    t = 0
    while v >> t & 1:
        t += 1
    return [v - (1 << s) for s in range(t)]


def model_bf16_sum(xs, union, topology):
    """The union's blocks summed along the schedule's tree: BF16 (RNE, ml_dtypes)
    on every message, float32 adds, the sink's BF16 sum decoded everywhere."""
    n = len(xs)
    rows = [padded_blocks(x)[union] for x in xs]
    bf16 = lambda v: v.astype(ml_dtypes.bfloat16).astype(np.float32)
    chunks = tile_stream(StreamLayout([(len(union), 512)]), n, 1 << 40).chunks
    out = np.zeros((len(union), 256), np.float32)
    for c, (a, b) in enumerate(chunks):
        def partial(v):             # role v of chunk c is rank (c + v) mod n
            acc = rows[(c + v) % n][a:b]
            for w in children(v, topology):
                acc = acc + partial(w)
            return bf16(acc)
        out[a:b] = partial(n - 1)
    return out


@pytest.mark.parametrize("n,topology", CASES)
@pytest.mark.parametrize("length", [5003, 256 * 300 - 17])
def test_union_blocks_are_the_bf16_sum_and_others_zero(n, topology, length):
    seed = fresh_seed()
    xs = rank_inputs(seed, n, length)
    outs, reps = dq.simulate_allreduce(xs, codec=OmniReduce(0.5), topology=topology,
                                       return_reports=True)
    for o in outs:
        assert bits_equal(o, outs[0]), f"ranks disagree, seed {seed}"
    k, union = model_union(xs, 0.5)
    info = reps[0].codec_info
    assert info["union"].tolist() == union and info["local_k"] == k, f"seed {seed}"
    nb = -(-length // 256)
    result = np.zeros((nb, 256), np.float32)
    result[union] = model_bf16_sum(xs, union, topology)
    assert bits_equal(outs[0], result.reshape(-1)[:length] + np.float32(0)), f"seed {seed}"
    # density: at most the target (the top priority level alone may exceed it)
    assert info["union_blocks"] == len(union) and info["density"] == len(union) / nb
    assert len(union) <= 0.5 * nb
    # every byte: 256 BF16 values per union block, one priority byte per block
    assert reps[0].bits_per_coord == pytest.approx((16 * 256 * len(union) + 8 * nb) / length,
                                                   rel=1e-12)
    assert reps[0].stats_bytes_total == 2 * (n - 1) * nb
    assert sum(r.bytes_sent for r in reps) == reps[0].wire_bytes_total


def test_union_is_a_union_of_local_top_k_sets_and_tracks_the_target():
    n = 4
    xs = rank_inputs(fresh_seed(), n, 256 * 200, kind="normal")
    for density in (0.1, 0.25, 0.5, 0.9):
        info = dq.simulate_allreduce(xs, codec=OmniReduce(density),
                                     return_reports=True)[1][0].codec_info
        union, k = set(info["union"].tolist()), info["local_k"]
        tops = [set(np.argsort(-np.sum(padded_blocks(x).astype(np.float64) ** 2, axis=1),
                               kind="stable")[:k].tolist()) for x in xs]
        assert union == set().union(*tops)
        # k is the largest common k within the target: one more block each overflows it
        assert len(union) <= density * 200
        more = set().union(*(set(np.argsort(-np.sum(padded_blocks(x).astype(np.float64) ** 2,
                                                    axis=1), kind="stable")[:k + 1].tolist())
                             for x in xs))
        assert len(more) > density * 200


def test_full_density_is_the_bf16_codec():
    xs = rank_inputs(fresh_seed(), 3, 256 * 40)
    for topology in ("ring",):
        ours = dq.simulate_allreduce(xs, codec=OmniReduce(1.0), topology=topology)
        ref = dq.simulate_allreduce(xs, codec=dq.BF16(), topology=topology)
        assert all(bits_equal(a, b) for a, b in zip(ours, ref))


def test_priority_threshold_and_local_k_by_brute_force():
    rng = np.random.default_rng(fresh_seed())
    for m in (1, 2, 7, 254, 255, 1000):
        blocks = rng.standard_normal((m, 256)).astype(np.float32) * rng.uniform(0, 3, (m, 1))
        p = priority_bytes(np, blocks)
        order = np.argsort(-np.sum(blocks.astype(np.float64) ** 2, axis=1), kind="stable")
        assert p[order[0]] == 254 and p.min() >= 1 and np.all(np.diff(p[order].astype(int)) <= 0)
        for t in range(1, 255):
            assert local_k(m, t) == int(np.sum(p >= t))
    counts = np.zeros(256, np.int64)
    counts[[254, 200, 100]] = [3, 4, 5]
    assert choose_threshold(counts, 22, 0.5) == 101     # 3 + 4 <= 11 < 3 + 4 + 5
    assert choose_threshold(counts, 22, 0.1) == 254     # the top level even above the target
    assert choose_threshold(counts, 12, 1.0) == 1


def test_error_shrinks_with_density_and_ties_are_deterministic():
    xs = rank_inputs(fresh_seed(), 4, 256 * 64)
    exact = exact_sum(xs)
    errs = [vnmse(dq.simulate_allreduce(xs, codec=OmniReduce(d))[0], exact)
            for d in (0.125, 0.5, 1.0)]
    assert errs[0] >= errs[1] >= errs[2] and errs[2] < 1e-4
    zeros = [np.zeros(1000, np.float32) for _ in range(3)]
    outs, reps = dq.simulate_allreduce(zeros, codec=OmniReduce(0.5), return_reports=True)
    assert all(not o.any() for o in outs)
    assert reps[0].codec_info["union"].tolist() == [0, 1]      # equal norms: by index


@pytest.mark.parametrize("topology", ["ring", "butterfly"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_raises(topology, bad):
    xs = rank_inputs(fresh_seed(), 4, 1000)
    xs[2][999] = bad
    with pytest.raises(dq.NonFiniteInputError, match="NaN or Inf"):
        dq.simulate_allreduce(xs, codec=OmniReduce(), topology=topology, nonfinite="raise")
    outs, reps = dq.simulate_allreduce(xs, codec=OmniReduce(), topology=topology,
                                       return_reports=True)
    assert all(np.isnan(o).all() and r.nonfinite for o, r in zip(outs, reps))


def test_configuration():
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError):
            OmniReduce(bad)
    assert OmniReduce().signature() == ("omnireduce", 0.5)
    assert OmniReduce(0.25).signature() != OmniReduce().signature()
