"""The width allocation: a pure function of the reduced norms."""
import numpy as np
import pytest

from allocation_ref import allocate
from dynamiq_mpi.codecs.allocation import SLOPE, record_bits


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


@pytest.mark.parametrize("bf16_class", [False, True])
def test_joint_costs_split_one_allocation_into_parts_that_find_it_again(bf16_class):
    """codecs/allocation.joint_costs (a hierarchical call's joint rail
    budget, a reduce-scatter's global one): the parts' costs sum to the
    allocation of all their super-groups, within the whole budget, and a
    part allocated alone with exactly its cost finds the same widths."""
    from dynamiq_mpi.codecs.allocation import joint_costs
    rng = np.random.default_rng()
    sizes = [int(m) for m in rng.integers(1, 400, size=int(rng.integers(2, 9)))]
    parts = [norms(rng, m) for m in sizes]
    for p in parts:
        p[rng.random(p.size) < 0.1] = 0          # zero super-groups send nothing
    stats = [32 * (2 * m + 2) for m in sizes]
    budget = float(rng.uniform(3.0, 8.0)) * 256 * sum(sizes)
    padded = budget + sum(stats)
    costs = joint_costs(parts, budget, padded, stats, True, True, bf16_class)
    whole = allocate(np.concatenate(parts), budget, sum(stats), True,
                     padded_budget_bits=padded, bf16_class=bf16_class)
    assert sum(costs) == whole.total_bits <= budget
    at = 0
    for p, c, sb in zip(parts, costs, stats):
        alone = allocate(p, c + 0.5, sb, True, padded_budget_bits=padded, bf16_class=bf16_class)
        assert np.array_equal(alone.widths, whole.widths[at:at + p.size])
        assert alone.total_bits == c
        at += p.size


def test_capped_joint_costs_keep_every_part_under_its_cap():
    """With caps (the joint rail budget's 1.05 x a rail's even share), the
    threshold search equals a brute force over every candidate threshold
    (tests/helpers.py), no part passes its cap, the total fits, and a part
    planned alone with its cost finds its widths."""
    from dynamiq_mpi.codecs.allocation import joint_costs
    from helpers import capped_joint_costs
    rng = np.random.default_rng()
    for _ in range(4):
        sizes = [int(m) for m in rng.integers(1, 60, size=int(rng.integers(2, 6)))]
        parts = [norms(rng, m) for m in sizes]
        parts[0] *= np.float32(1e4)                 # one part draws the large super-groups
        stats = [32 * (2 * m + 2) for m in sizes]
        bits = float(rng.uniform(3.0, 8.0))
        budget = bits * 256 * sum(sizes)
        padded = budget + sum(stats)
        caps = [1.05 * bits * 256 * m for m in sizes]
        got = joint_costs(parts, budget, padded, stats, True, True, True, caps)
        assert got == capped_joint_costs(parts, stats, budget, padded, caps)
        assert sum(got) <= budget
        floor = [sb + np.count_nonzero(p) * record_bits(2, True) for p, sb in zip(parts, stats)]
        assert all(c <= max(cap, f) for c, cap, f in zip(got, caps, floor))
        for p, c, sb in zip(parts, got, stats):
            assert allocate(p, c + 0.5, sb, True, padded_budget_bits=padded,
                            bf16_class=True).total_bits == c


@pytest.mark.parametrize("bf16_class", [False, True])
def test_joint_costs_on_the_grid_equal_a_brute_force_and_plan_alone(bf16_class):
    """The joint rail budget's rule (joint_costs_on_grid from each part's
    grid_summary): the smallest grid threshold whose total fits, parts under
    their caps; equal to a brute force over every grid value, within the
    budget, each part's cost found again by its own planner, and over the
    draws within 3 % of the exact candidates' spend."""
    from dynamiq_mpi.codecs.allocation import grid_summary, joint_costs, joint_costs_on_grid
    from helpers import capped_joint_costs
    rng = np.random.default_rng()
    spent = [0, 0]          # the grid's and the exact candidates', over the trials
    for trial in range(3):
        sizes = [int(m) for m in rng.integers(1, 50, size=int(rng.integers(2, 6)))]
        parts = [norms(rng, m) for m in sizes]
        parts[0] *= np.float32(1e4)
        for p in parts[1:]:
            p[rng.random(p.size) < 0.2] = 0
        stats = [32 * (2 * m + 2) for m in sizes]
        bits = float(rng.uniform(3.0, 8.0))
        budget = bits * 256 * sum(sizes)
        padded = budget + sum(stats)
        caps = None if trial == 0 else [1.05 * bits * 256 * m for m in sizes]
        summaries = [grid_summary(p, True, bf16_class) for p in parts]
        got = joint_costs_on_grid(summaries, budget, padded, stats, True, bf16_class, caps)
        assert got == capped_joint_costs(parts, stats, budget, padded, caps,
                                         bf16_class=bf16_class, grid=True)
        assert sum(got) <= budget
        exact = joint_costs(parts, budget, padded, stats, True, True, bf16_class, caps)
        # one grid step of a few small parts can leave a few percent unspent
        # (worst 0.930 in 6000 such draws); over three draws, worst 0.987 in 2000
        assert sum(got) >= 0.90 * sum(exact)
        spent[0] += sum(got)
        spent[1] += sum(exact)
        for p, c, sb in zip(parts, got, stats):
            assert allocate(p, c + 0.5, sb, True, padded_budget_bits=padded,
                            bf16_class=bf16_class).total_bits == c
    assert spent[0] >= 0.97 * spent[1]
