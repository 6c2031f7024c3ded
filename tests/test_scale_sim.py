"""The scale simulator (research/scale_sim.py): bit for bit
simulate_allreduce at small n, memory independent of n, its sources."""
import tracemalloc

import numpy as np
import pytest

import dynamiq_mpi as dq
from dynamiq_mpi.codecs.base import Codec
from dynamiq_mpi.errors import NonFiniteInputError
from dynamiq_mpi.bench.gradients import gradient_like
from research import scale_sim
from research.scale_sim import ArraySource, LogNormalMixture, scale_allreduce, supports

from helpers import exact_sum, fresh_seed, rank_inputs

CODECS = {
    "dynamiq:5": dq.DynamiQ(bits=5, small_input=0),
    "dynamiq:3.5 flat": dq.DynamiQ(bits=3.5, small_input=0, centring=False, hierarchical=False),
    "dynamiq:5.5 ablation": dq.DynamiQ(bits=5.5, small_input=0, uniform=True,
                                       variable_width=False, correlated=False, zero_class=False),
    "dynamiq:5 small-input": dq.DynamiQ(bits=5),          # hands these lengths to BF16
    "dynamiq:9 bf16 class": dq.DynamiQ(bits=9, small_input=0),
    "dynamiq:5 ceil, no 16-bit class": dq.DynamiQ(bits=5, small_input=0, scale_code="ceil",
                                                  bf16_class=False),
    "bf16": dq.BF16(),
    "exact": dq.Exact(),
    "mxfp:e4m3": dq.MXFP("e4m3"),
    "mxfp:e3m2": dq.MXFP("e3m2"),
    "mxfp:e2m1": dq.MXFP("e2m1"),
    "thc": dq.THC(),
    "thc:4 levels, blocks <= 2^10": dq.THC(levels=4, max_block_log2=10),
    "omnireduce": dq.OmniReduce(),
    "omnireduce:0.2": dq.OmniReduce(density=0.2),
}
# The baselines whose plans read other local values than the input (THC: the
# rotated input, a Hadamard block spanning rows of several ranks at one role;
# OmniReduce: the union blocks only).  THC's default blocks (up to 2^23) split
# a length by its binary expansion; max_block_log2 = 9 or 10 gives many
# blocks of one size.
BASELINES = {
    "thc": dq.THC(),
    "thc:4 levels, blocks <= 2^10": dq.THC(levels=4, max_block_log2=10),
    "thc:agg_bits 12, blocks <= 2^9, rotation seed 3": dq.THC(agg_bits=12, max_block_log2=9,
                                                              rotation_seed=3),
    "omnireduce": dq.OmniReduce(),
    "omnireduce:0.2": dq.OmniReduce(density=0.2),
    "omnireduce:1.0": dq.OmniReduce(density=1.0),
}


def _same_bits(a, b):
    return np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


def _check(source, n, codec, topology, seed, counter=0, op="sum"):
    xs = [source.rank_vector(np, r) for r in range(n)]
    outs, reps = dq.simulate_allreduce(xs, codec=codec, topology=topology, seed=seed,
                                       counter=counter, op=op, return_reports=True)
    res = scale_allreduce(source, n, codec=codec, topology=topology, seed=seed, counter=counter,
                          op=op)
    assert _same_bits(res.out, outs[0]), (n, codec, topology, source.length, op, seed, counter)
    assert res.bits_per_coord == pytest.approx(reps[0].bits_per_coord, rel=1e-12)
    assert res.wire_bytes_total == reps[0].wire_bytes_total
    ref = exact_sum(xs) / (n if op == "mean" else 1)
    assert np.allclose(res.exact / (n if op == "mean" else 1), ref, rtol=1e-12, atol=0)
    err = float(np.sum((outs[0].astype(np.float64) - ref) ** 2) / np.sum(ref ** 2))
    assert res.vnmse == pytest.approx(err, rel=1e-9)
    return res


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("topology", ["ring", "butterfly"])
@pytest.mark.parametrize("name", sorted(CODECS))
def test_bit_identical_to_simulate_allreduce_synthetic(n, topology, name):
    seed = fresh_seed()
    source = LogNormalMixture(9 * 256 * 3 + 37, seed=seed % 1000)   # a partial super-group
    _check(source, n, CODECS[name], topology, seed, counter=seed % 5)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("topology", ["ring", "butterfly"])
@pytest.mark.parametrize("name", ["dynamiq:5", "bf16", "exact", "mxfp:e4m3", "thc",
                                  "omnireduce"])
def test_bit_identical_to_simulate_allreduce_zero_supergroups(n, topology, name):
    # gradient_like: an embedding table whose rows are zero on every rank (0-bit class)
    seed = fresh_seed()
    source = ArraySource([gradient_like(12 * 1024 + 100, r, seed=seed % 997) for r in range(n)])
    res = _check(source, n, CODECS[name], topology, seed, op="mean" if n == 4 else "sum")
    if name == "dynamiq:5":
        assert res.codec_info["widths"][0] > 0     # the 0-bit class was exercised


@pytest.mark.parametrize("topology,n", [("ring", 2), ("ring", 3), ("ring", 5), ("ring", 8),
                                        ("butterfly", 2), ("butterfly", 4), ("butterfly", 8),
                                        ("butterfly", 16)])
@pytest.mark.parametrize("name", sorted(BASELINES))
def test_baselines_bit_identical_to_simulate_allreduce(topology, n, name):
    """THC and OmniReduce on fresh heavy-tailed inputs (block scales over
    seven decades: OmniReduce's priorities and THC's ranges differ across
    blocks and ranks), lengths not multiples of 256, sum and mean."""
    seed = fresh_seed()
    codec = BASELINES[name]
    for length in (300 + seed % 200, 6 * 1024 + 37 + seed % 211):   # 2 and 25 rows of 256
        source = ArraySource(rank_inputs(seed, n, length))
        for op in ("sum", "mean"):
            _check(source, n, codec, topology, seed % 100003, counter=1 + seed % 5, op=op)


def test_thc_with_given_statistics():
    # statistics handed in (no statistics pass): the adapter rotates every rank itself
    seed = fresh_seed()
    source = ArraySource(rank_inputs(seed, 4, 3000))
    codec = BASELINES["thc:4 levels, blocks <= 2^10"]
    keys = scale_sim.call_keys(seed % 1000, 2)
    sim = scale_sim._Sim(source, 4, codec, "ring", scale_sim.DEFAULT_TILE_BYTES, np,
                         scale_sim._Progress(0, "", False), keys)
    stats = scale_sim._adapter_for(codec).reduce_stats(sim)
    given = scale_allreduce(source, 4, codec=codec, seed=seed % 1000, counter=2, statistics=stats)
    own = scale_allreduce(source, 4, codec=codec, seed=seed % 1000, counter=2)
    assert _same_bits(given.out, own.out), seed


@pytest.mark.parametrize("name", [k for k in sorted(BASELINES) if k.startswith("thc")])
def test_thc_statistics_pass_rotates_chunks_of_ranks_as_each_rank_alone(name, monkeypatch):
    """The statistics pass rotates a chunk of ranks at once: the rotated
    vectors and the reduced range bytes are those of THC.local_stats rank by
    rank, with chunks of 32 (the default), 4 and 1 rows and n not a multiple
    of them, lengths that need padding, one rank non-finite (range byte 255)
    and one whose rotation overflows (254)."""
    seed = fresh_seed()
    codec = BASELINES[name]
    backend = scale_sim.backend_for(np.zeros(1, dtype=np.float32))
    for n, length, chunk in ((37, 6 * 1024 + 37 + seed % 211, 32), (9, 300 + seed % 200, 4),
                             (3, 2 * 1024 + 1 + seed % 97, 1), (6, 4 * 256, 4)):
        xs = rank_inputs(seed + n, n, length)
        if n == 9:
            xs[4][seed % length] = np.inf if seed % 2 else np.nan
            xs[7][:] = np.float32(3e38)
        keys = scale_sim.call_keys(seed % 1000, 1 + seed % 5)
        alone = [codec.local_stats(x, backend, scale_sim.FRESH, keys=keys) for x in xs]
        monkeypatch.setattr(scale_sim, "THC_CHUNK_ROWS", chunk)
        adapter = scale_sim._adapter_for(codec)
        sim = scale_sim._Sim(ArraySource(xs), n, codec, "ring", scale_sim.DEFAULT_TILE_BYTES,
                             np, scale_sim._Progress(0, "", False), keys)
        reduced, nbytes = adapter.reduce_stats(sim)
        assert _same_bits(adapter._rotated, np.stack([state[0] for _, state in alone])), (seed, n)
        assert np.array_equal(reduced, np.max(np.stack([st for st, _ in alone]), axis=0))
        assert reduced.dtype == np.uint8 and nbytes == alone[0][0].nbytes
        if n == 9:
            assert reduced.max() == 255 and alone[7][0].max() == 254


def test_tile_size_and_more_ranks_than_records():
    # n larger than the number of super-groups: most chunks are empty
    source = LogNormalMixture(5 * 256, seed=3)
    for codec in (CODECS["dynamiq:5"], CODECS["mxfp:e4m3"], CODECS["bf16"], CODECS["thc"],
                  CODECS["omnireduce"]):
        res = _check(source, 16, codec, "ring", seed=11)
        small = scale_allreduce(source, 16, codec=codec, seed=11, tile_bytes=300)
        assert _same_bits(small.out, res.out)
    _check(source, 16, CODECS["dynamiq:5"], "butterfly", seed=12)


def test_memory_does_not_grow_with_ranks():
    source = LogNormalMixture(1 << 15, seed=1)
    codec = CODECS["dynamiq:5"]
    peaks = {}
    for topology in ("ring", "butterfly"):
        for n in (8, 64):
            scale_allreduce(source, 2, codec=codec, topology=topology)   # warm caches
            tracemalloc.start()
            scale_allreduce(source, n, codec=codec, topology=topology)
            peaks[topology, n] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    vector = source.length * 4
    for topology in ("ring", "butterfly"):
        assert peaks[topology, 64] < 1.3 * peaks[topology, 8], peaks
        assert peaks[topology, 64] < 30 * vector, peaks       # a few vectors, not n of them


def test_sources():
    src = LogNormalMixture(3 * 256 + 40, seed=5)
    ranks = np.array([3, 0, 7, 7])
    a = src.rows(np, ranks, 256)
    b = src.rows(np, np.repeat(ranks, 8)[:-(-src.length // 32)], 32)
    assert _same_bits(a, b)                                   # rows of any size agree
    for k, r in enumerate(ranks):
        whole = src.rank_vector(np, int(r))
        assert _same_bits(a[k * 256:(k + 1) * 256], whole[k * 256:(k + 1) * 256])
    assert not np.array_equal(src.rank_vector(np, 0), src.rank_vector(np, 1))
    again = LogNormalMixture(src.length, seed=5)
    assert _same_bits(src.rank_vector(np, 2), again.rank_vector(np, 2))
    # coordinates ~ N(0, M_j^2 / 256): normalised values have unit variance, mean 0
    big = LogNormalMixture(1 << 16, seed=9)
    z = big.rank_vector(np, 4).astype(np.float64).reshape(-1, 256) / (big.magnitude[:, None] / 16)
    assert abs(z.mean()) < 0.02 and abs(z.std() - 1) < 0.02
    assert abs(np.mean(z ** 4) - 3) < 0.1                     # normal kurtosis
    xs = [np.arange(10, dtype=np.float32) + r for r in range(3)]
    s = ArraySource(xs)
    assert _same_bits(s.rows(np, np.array([2]), 256), xs[2])
    with pytest.raises(ValueError):
        scale_allreduce(s, 4, codec=dq.Exact())


def test_edges():
    src = LogNormalMixture(1000, seed=2)
    one = scale_allreduce(src, 1, codec=CODECS["dynamiq:5"])
    assert _same_bits(one.out, src.rank_vector(np, 0)) and one.vnmse == 0.0

    assert supports(dq.Exact()) and supports(dq.MXFP("e5m2"))
    assert supports(dq.THC()) and supports(dq.OmniReduce())

    class Unknown(Codec):
        name = "unknown"
    assert not supports(Unknown())
    with pytest.raises(NotImplementedError):
        scale_allreduce(src, 2, codec=Unknown())
    with pytest.raises(dq.TopologyError):
        scale_allreduce(src, 6, codec=dq.Exact(), topology="butterfly")
    xs = [src.rank_vector(np, r) for r in range(4)]
    xs[2][17] = np.nan
    for codec in (CODECS["dynamiq:5"], CODECS["mxfp:e4m3"], CODECS["thc"],
                  CODECS["omnireduce"]):
        with pytest.raises(NonFiniteInputError):
            dq.simulate_allreduce(xs, codec=codec, nonfinite="raise")
        assert all(np.isnan(o).all() for o in dq.simulate_allreduce(xs, codec=codec))
        with pytest.raises(NonFiniteInputError):
            scale_allreduce(ArraySource(xs), 4, codec=codec)


def test_progress_lines(capsys, monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_tqdm(name, *a, **k):
        if name == "tqdm":
            raise ImportError(name)
        return real_import(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    scale_allreduce(LogNormalMixture(2048, seed=1), 16, codec=CODECS["dynamiq:5"], progress=True)
    err = capsys.readouterr().err
    assert "32/32 roles" in err


def test_detailed_report_gives_the_widths_of_simulate_allreduce():
    """scale_allreduce(detailed=True): the codec's detailed report, DynamiQ's
    per-super-group widths included (research/scripts/ring_class_share.py uses them)."""
    source = LogNormalMixture(40 * 256, seed=3)
    xs = [source.rank_vector(np, r) for r in range(4)]
    codec = dq.DynamiQ(bits=7, small_input=0)
    _, reps = dq.simulate_allreduce(xs, codec=codec, seed=1, return_reports=True)
    res = scale_allreduce(source, 4, codec=codec, seed=1, detailed=True)
    assert list(res.codec_info["supergroup_widths"]) == list(reps[0].codec_info["supergroup_widths"])
    assert "supergroup_widths" not in scale_allreduce(source, 4, codec=codec, seed=1).codec_info
