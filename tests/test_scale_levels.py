"""The hierarchical all-reduce on simulated ranks (dynamiq_mpi/studies/scale_levels.py):
bit for bit a reference built here from the definition's three steps, the
flat study at node size 1, lower error than flat where shards are alike,
memory independent of the number of ranks."""
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

import dynamiq_mpi as dq
from dynamiq_mpi.studies.scale_levels import (NodeShardSource, levels_allreduce,
                                              levels_simulate)
from dynamiq_mpi.studies.scale_sim import ArraySource, LogNormalMixture, scale_allreduce

from helpers import exact_sum, fresh_seed, rank_inputs, vnmse

BF16_DTYPE = np.dtype(ml_dtypes.bfloat16)

CODECS = {
    "dynamiq:5": dq.DynamiQ(bits=5, small_input=0),
    "dynamiq:8.25": dq.DynamiQ(bits=8.25, small_input=0),
    "bf16": dq.BF16(),
    "mxfp:e4m3": dq.MXFP("e4m3"),
}

# (nodes N, node size K, length): 2x2, 2x4, 4x2, 3x2 and the 1xN, Nx1 edges;
# primes, lengths not divisible by K, shards that start inside a row of 32
# (so a source row holds two nodes' elements), empty shards (K > length).
SHAPES = [(2, 2, 2053), (2, 4, 1000), (4, 2, 5 * 256 + 37), (3, 2, 1031), (1, 4, 777),
          (4, 1, 1301), (2, 4, 3), (3, 2, 1), (2, 2, 0), (4, 2, 4099)]


def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        a.view(np.uint8), b.view(np.uint8))


def reference(xs, node_size, codec, topology, seed, counter):
    """The definition, step by step, with NumPy and simulate_allreduce only:
    (out, wire bytes of the rail level, bits per coordinate)."""
    n, dtype = len(xs), np.asarray(xs[0]).dtype
    nodes, length = n // node_size, np.asarray(xs[0]).size
    # 1. in-node sums, left to right in local-rank order, each add rounded to the dtype
    sums = []
    for j in range(nodes):
        s = np.asarray(xs[j * node_size], dtype=np.float32)
        for t in range(1, node_size):
            s = (s + np.asarray(xs[j * node_size + t], dtype=np.float32)).astype(dtype)
            s = s.astype(np.float32)
        sums.append(s.astype(dtype))
    # 2. K shards of ceil(L / K)
    m = -(-length // node_size)
    out = np.zeros(length, dtype=dtype)
    wire = 0
    rail_topo = "ring" if topology == "butterfly" and nodes & (nodes - 1) else topology
    for l in range(node_size):
        a, b = min(length, l * m), min(length, (l + 1) * m)
        if a == b:
            continue
        # 3. the flat all-reduce of the shard over the nodes, the call's seed and counter
        outs, reps = dq.simulate_allreduce([s[a:b] for s in sums], codec=codec,
                                           topology=rail_topo, seed=seed, counter=counter,
                                           return_reports=True)
        out[a:b] = outs[0]                                 # 4. concatenated
        wire += reps[0].wire_bytes_total
    bits = wire * 8.0 / (2 * (nodes - 1) * length) if nodes > 1 and length else 0.0
    return out, wire, bits, rail_topo


def _source(kind, n, length, seed):
    if kind == "lognormal":
        return LogNormalMixture(length, seed=seed % 10007)
    return ArraySource(rank_inputs(seed, n, length) if length else [np.zeros(0)] * n)


@pytest.mark.parametrize("topology", ["ring", "butterfly"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "%dx%d_L%d" % s)
@pytest.mark.parametrize("name", sorted(CODECS))
def test_bit_identical_to_the_three_steps(shape, topology, name):
    nodes, k, length = shape
    n, seed = nodes * k, fresh_seed()
    counter = seed % 7
    source = _source("lognormal" if seed % 2 else "arrays", n, length, seed)
    xs = [source.rank_vector(np, r) for r in range(n)]
    ref, wire, bits, rail_topo = reference(xs, k, CODECS[name], topology, seed, counter)
    res = levels_allreduce(source, n, k, codec=CODECS[name], topology=topology, seed=seed,
                           counter=counter)
    assert _same_bits(res.out, ref), (shape, topology, name, seed)
    assert res.wire_bytes_total == wire
    assert res.bits_per_coord == pytest.approx(bits, rel=1e-12)
    assert (res.nodes, res.rail_topology) == (nodes, rail_topo)
    if length:
        assert np.allclose(res.exact, exact_sum(xs), rtol=1e-12, atol=0)
        assert res.vnmse == pytest.approx(vnmse(ref, exact_sum(xs)), rel=1e-9)
    # the in-memory path (the study's for codecs without a scale adapter) agrees
    again = levels_simulate(xs, k, codec=CODECS[name], topology=topology, seed=seed,
                            counter=counter)
    assert _same_bits(again.out, ref) and again.wire_bytes_total == wire


@pytest.mark.parametrize("shape", [(2, 2, 1009), (3, 2, 2000), (2, 4, 4099)],
                         ids=lambda s: "%dx%d_L%d" % s)
@pytest.mark.parametrize("codec", [dq.THC(), dq.DynamiQ(bits=5, small_input=0)],
                         ids=["thc", "dynamiq:5"])
@pytest.mark.parametrize("dtype", [np.float32, BF16_DTYPE], ids=["float32", "bfloat16"])
def test_simulate_path_any_codec_and_bfloat16(shape, codec, dtype):
    """levels_simulate: THC (no scale adapter) and bfloat16 inputs, whose
    in-node sums round to bfloat16 after every add."""
    nodes, k, length = shape
    seed = fresh_seed()
    xs = rank_inputs(seed, nodes * k, length, dtype=dtype)
    for topology in ("ring", "butterfly"):
        ref, wire, bits, _ = reference(xs, k, codec, topology, seed, 3)
        res = levels_simulate(xs, k, codec=codec, topology=topology, seed=seed, counter=3)
        assert _same_bits(res.out, ref), (shape, topology, seed)
        assert res.wire_bytes_total == wire
        assert res.bits_per_coord == pytest.approx(bits, rel=1e-12)


def test_bfloat16_in_node_sum_rounds_after_every_add():
    # 1 + 2^-8 + 2^-8: bfloat16 rounds each add back to 1 (ties to even);
    # one rounding of the float32 sum would give 1 + 2^-7
    xs = [np.full(300, v, dtype=BF16_DTYPE) for v in (1.0, 2.0 ** -8, 2.0 ** -8)]
    res = levels_simulate(xs, 3, codec=dq.Exact())
    assert np.all(res.out.astype(np.float32) == 1.0)


@pytest.mark.parametrize("topology", ["ring", "butterfly"])
@pytest.mark.parametrize("name", ["dynamiq:5", "mxfp:e4m3", "bf16"])
def test_node_size_one_is_the_flat_study(topology, name):
    seed = fresh_seed()
    source = LogNormalMixture(3 * 256 * 5 + 11, seed=seed % 1000)
    flat = scale_allreduce(source, 8, codec=CODECS[name], topology=topology, seed=seed,
                           counter=2)
    lv = levels_allreduce(source, 8, 1, codec=CODECS[name], topology=topology, seed=seed,
                          counter=2)
    assert _same_bits(lv.out, flat.out)
    assert lv.wire_bytes_total == flat.wire_bytes_total
    assert lv.bits_per_coord == flat.bits_per_coord and lv.vnmse == flat.vnmse
    assert lv.codec_info == flat.codec_info


@pytest.mark.parametrize("topology", ["ring", "butterfly"])
def test_levels_cut_the_error_where_shards_are_alike(topology):
    """16 ranks as 4 nodes of 4, the paper's synthetic gradient at 5 bits:
    4 re-quantizations of node sums instead of 16 of single inputs.  (Measured
    over 16 seeds: ring 0.24-0.31x flat, butterfly 0.51-0.65x.)"""
    seed = fresh_seed()
    source = LogNormalMixture(1 << 16, seed=seed % 100003)
    xs = [source.rank_vector(np, r) for r in range(16)]
    exact = exact_sum(xs)
    codec = CODECS["dynamiq:5"]
    flat = scale_allreduce(source, 16, codec=codec, topology=topology, seed=seed)
    lv = levels_allreduce(source, 16, 4, codec=codec, topology=topology, seed=seed)
    e_flat, e_lv = vnmse(flat.out, exact), vnmse(lv.out, exact)
    assert e_lv <= (0.5 if topology == "ring" else 0.9) * e_flat, (seed, e_lv, e_flat)
    assert abs(lv.bits_per_coord - flat.bits_per_coord) < 0.05


def test_node_shard_source_rows():
    """Rail rows are node sums of the right ranks' elements, for rows of 32
    and 256 and shards that start anywhere (two nodes in one source row)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    length, k = 3001, 3
    for source in (LogNormalMixture(length, seed=seed % 1000),
                   ArraySource(rank_inputs(seed, 12, length))):
        xs = np.stack([source.rank_vector(np, r) for r in range(12)])
        for start, stop in ((0, 1001), (1001, 2002), (2002, 3001), (37, 38), (1000, 3001)):
            src = NodeShardSource(source, k, start, stop)
            for row in (32, 256):
                nrows = -(-src.length // row)
                nodes = rng.integers(0, 4, size=nrows)
                got, got64 = src.rows_with_exact(np, nodes, row)
                node_of = np.repeat(nodes, row)[:src.length]
                idx = np.arange(start, stop)
                want = xs[node_of * k, idx].copy()
                for t in range(1, k):
                    want += xs[node_of * k + t, idx]
                assert _same_bits(got, want) and _same_bits(src.rows(np, nodes, row), want)
                want64 = sum(xs[node_of * k + t, idx].astype(np.float64) for t in range(k))
                assert np.array_equal(got64, want64)
        whole = source.span(np, np.arange(5) % 4, 256, 2)
        assert _same_bits(whole, np.concatenate([xs[r, (2 + i) * 256:(3 + i) * 256]
                                                 for i, r in enumerate(np.arange(5) % 4)])
                          [:length - 512])


def test_memory_does_not_grow_with_ranks():
    source = LogNormalMixture(1 << 15, seed=1)
    codec = CODECS["dynamiq:5"]
    peaks = {}
    for topology in ("ring", "butterfly"):
        for n in (16, 128):
            levels_allreduce(source, 8, 4, codec=codec, topology=topology)   # warm caches
            tracemalloc.start()
            levels_allreduce(source, n, 4, codec=codec, topology=topology)
            peaks[topology, n] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    vector = source.length * 4
    for topology in ("ring", "butterfly"):
        assert peaks[topology, 128] < 1.3 * peaks[topology, 16], peaks
        assert peaks[topology, 128] < 30 * vector, peaks


def test_bad_shapes_and_butterfly_fallback():
    source = LogNormalMixture(2000, seed=4)
    with pytest.raises(ValueError, match="nodes of 4"):
        levels_allreduce(source, 6, 4, codec=dq.Exact())
    with pytest.raises(ValueError):
        levels_allreduce(source, 4, 0, codec=dq.Exact())
    with pytest.raises(dq.TopologyError):
        levels_allreduce(source, 4, 2, codec=dq.Exact(), topology="tree")
    # 6 nodes of 2: the butterfly runs the ring on the rail level, never an error
    res = levels_allreduce(source, 12, 2, codec=CODECS["dynamiq:5"], topology="butterfly")
    ring = levels_allreduce(source, 12, 2, codec=CODECS["dynamiq:5"], topology="ring")
    assert res.rail_topology == "ring" and res.topology == "butterfly"
    assert _same_bits(res.out, ring.out)
    mean = levels_allreduce(source, 4, 2, codec=CODECS["dynamiq:5"], op="mean")
    total = levels_allreduce(source, 4, 2, codec=CODECS["dynamiq:5"])
    assert _same_bits(mean.out, total.out / np.float32(4))
    assert mean.vnmse == pytest.approx(total.vnmse, rel=1e-6)
