"""DynamiQ's optional 16-bit class (raw BF16 super-groups, spec 2.3's option,
the paper's large-scale simulation): exact values, budget, error, report."""
import ml_dtypes
import numpy as np
import pytest

import dynamiq_mpi as dq
from research.scale_sim import LogNormalMixture
from helpers import exact_sum, fresh_seed, vnmse


def _heavy_inputs(rng, n, nsg, heavy, owner):
    """n ranks, nsg super-groups of noise; the `heavy` super-groups are 1e4x
    larger on rank `owner` and exactly zero on every other rank."""
    xs = [rng.standard_normal(nsg * 256).astype(np.float32) for _ in range(n)]
    for r in range(n):
        for g in heavy:
            row = slice(g * 256, (g + 1) * 256)
            xs[r][row] = (1e4 * rng.standard_normal(256)).astype(np.float32) if r == owner else 0
    return xs


@pytest.mark.parametrize("n,topology", [(2, "ring"), (3, "ring"), (4, "ring"), (4, "butterfly")])
def test_sixteen_bit_rows_are_the_bf16_of_their_only_contribution(n, topology):
    """Where one rank alone holds a super-group, every hop rounds the same
    float32 value to BF16 again: the result is that value rounded to nearest
    even (ml_dtypes), bit for bit, on every rank."""
    rng = np.random.default_rng(fresh_seed())
    nsg, heavy = 64, [3, 17, 40, 41]
    owner = int(rng.integers(0, n))
    xs = _heavy_inputs(rng, n, nsg, heavy, owner)
    codec = dq.DynamiQ(bits=8.5, small_input=0, centring=False, bf16_class=True)
    outs, reps = dq.simulate_allreduce(xs, codec=codec, topology=topology, seed=int(rng.integers(99)),
                                       return_reports=True)
    info = reps[0].codec_info
    widths = np.asarray(info["supergroup_widths"])
    assert info["widths"][16] >= 1 and set(np.flatnonzero(widths == 16)) <= set(heavy)
    for g in np.flatnonzero(widths == 16):
        row = slice(g * 256, (g + 1) * 256)
        want = xs[owner][row].astype(ml_dtypes.bfloat16).astype(np.float32)
        for out in outs:
            assert np.array_equal(out[row].view(np.uint32), want.view(np.uint32))
    assert reps[0].bits_per_coord <= 8.5 + 1e-9
    for out in outs[1:]:
        assert np.array_equal(out.view(np.uint32), outs[0].view(np.uint32))


def test_without_the_option_nothing_is_sixteen_bits():
    rng = np.random.default_rng(fresh_seed())
    xs = _heavy_inputs(rng, 2, 32, [5], 0)
    _, reps = dq.simulate_allreduce(xs, codec=dq.DynamiQ(bits=8.5, small_input=0, bf16_class=False),
                                    return_reports=True)
    assert 16 not in reps[0].codec_info["widths"]
    assert 16 not in set(reps[0].codec_info["supergroup_widths"])


def test_sixteen_bit_class_lowers_the_error_of_heavy_tails():
    """The paper's mixture at 8.5 bits, 8 ranks: the heaviest super-groups go
    raw (BF16 re-rounding adds ~2^-18 relative per hop, 8-bit codes far more)."""
    src = LogNormalMixture(1 << 15, seed=int(np.random.default_rng(fresh_seed()).integers(1000)))
    xs = [src.rank_vector(np, r) for r in range(8)]
    exact = exact_sum(xs)
    err = {}
    for bf16 in (False, True):
        codec = dq.DynamiQ(bits=8.5, small_input=0, bf16_class=bf16)
        outs, reps = dq.simulate_allreduce(xs, codec=codec, return_reports=True)
        err[bf16] = vnmse(outs[0], exact)
        assert reps[0].bits_per_coord <= 8.5 + 1e-9
    assert reps[0].codec_info["widths"][16] > 0
    assert err[True] < 0.5 * err[False], err


def test_bf16_class_spelling_and_signature():
    from dynamiq_mpi.codecs import codec_from_string
    codec = codec_from_string("dynamiq:8.5:bf16_class=false")
    assert codec.bf16_class is False
    assert codec.signature() != dq.DynamiQ(bits=8.5).signature()
    assert codec_from_string("dynamiq:8.5:bf16_class=true") == dq.DynamiQ(bits=8.5)


def test_defaults_are_the_hybrid_code_and_the_sixteen_bit_class():
    """Spec 2.3 and 2.7 (2026-11-23): widths {0, 2, 4, 8, 16} and the hybrid
    group scale code by default; the earlier defaults stay reachable."""
    from dynamiq_mpi.codecs import codec_from_string
    codec = dq.DynamiQ()
    assert codec.scale_code == "hybrid" and codec.bf16_class is True
    old = codec_from_string("dynamiq:5:scale_code=ceil:bf16_class=false")
    assert old == dq.DynamiQ(bits=5, scale_code="ceil", bf16_class=False)
    assert old.signature() != dq.DynamiQ(bits=5).signature()
    # the budget floor does not depend on the class (2-bit codes + metadata)
    assert dq.DynamiQ(bits=3).min_bits() == dq.DynamiQ(bits=3, bf16_class=False).min_bits()
