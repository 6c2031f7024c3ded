"""The width allocation: a pure function of the reduced norms."""
import numpy as np
import pytest

from dynamiq_mpi.codecs.allocation import SLOPE, allocate, record_bits


def norms(rng, m):
    return (10.0 ** rng.uniform(-12, 6, size=m)).astype(np.float32)


def test_paper_rule_and_budget():
    rng = np.random.default_rng()
    F = norms(rng, 5000)
    for b in (3.0, 4.0, 5.0, 6.0, 7.5):
        coords = 5000 * 256
        a = allocate(F, b * coords, 64 * 5000, True)
        assert a.total_bits <= b * coords
        assert a.total_bits >= (b - 0.05) * coords
        z = SLOPE * np.log2(F.astype(np.float64)) + a.u
        expect = np.where(z < 4, 2, np.where(z < 8, 4, 8))
        # the chosen u is a break point: the super-group on it may round either way
        on_edge = (np.abs(z - 4) < 1e-9) | (np.abs(z - 8) < 1e-9)
        assert np.array_equal(a.widths[~on_edge], expect[~on_edge])
        assert np.count_nonzero(on_edge) <= 2
        # widths are monotone in F
        order = np.argsort(F)
        assert np.all(np.diff(a.widths[order]) >= 0)


def test_zero_class_costs_nothing_and_never_binds_when_all_fit():
    F = np.array([0, 0, 1.0, 2.0], np.float32)
    a = allocate(F, 1e9, 64 * 4, True)
    assert list(a.widths) == [0, 0, 8, 8] and not a.binds
    assert a.total_bits == 64 * 4 + 2 * record_bits(8, True)
    a = allocate(F, 1e9, 64 * 4, True, zero_class=False)
    assert list(a.widths[:2]) == [2, 2]   # log2(0) = -inf never upgrades


def test_fixed_and_single_width():
    F = np.ones(100, np.float32)
    a = allocate(F, 5.0 * 25600, 64 * 100, True, variable=False)
    assert set(a.widths) == {4}
    a = allocate(F, 5.0 * 25600, 64 * 100, True, fixed_width=2)
    assert set(a.widths) == {2}


@pytest.mark.parametrize("seed", range(5))
def test_optimal_within_family(seed):
    rng = np.random.default_rng(seed)
    F = norms(rng, 300)
    budget = 5.0 * 300 * 256
    a = allocate(F, budget, 64 * 300, True)
    # any larger u (the next break point) would exceed the budget
    bigger = allocate(F, budget + record_bits(8, True), 64 * 300, True)
    assert bigger.total_bits >= a.total_bits
