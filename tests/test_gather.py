"""The all-gather by recursive doubling forwards the same compressed bytes as
the ring: every rank's output is the same bits under both schedules, for
every codec, topology and rank count, with the same wire bytes (and near
an exact float64 sum, fresh inputs each run); the ring is the default,
``$DYNAMIQ_GATHER`` or ``gather=`` choose."""
import numpy as np
import pytest

import dynamiq_mpi as dq
from dynamiq_mpi import schedules

from .helpers import fresh_seed, rank_inputs

CODECS = {     # codec, the largest relative error against the exact sum
    "dynamiq5": (lambda: dq.DynamiQ(bits=5, small_input=0), 0.5),
    "dynamiq4": (lambda: dq.DynamiQ(bits=4, small_input=0), 0.8),
    "exact": (lambda: dq.Exact(), 1e-6),
    "bf16": (lambda: dq.BF16(), 0.02),
    "mxfp8": (lambda: dq.MXFP(), 0.2),
    "thc": (lambda: dq.THC(), 1.0),
    "omnireduce": (lambda: dq.OmniReduce(), 1.0),
}


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("topology,n", [("ring", 3), ("ring", 5), ("ring", 7), ("ring", 9),
                                        ("butterfly", 4), ("butterfly", 8)])
def test_doubling_and_ring_give_the_same_bits(codec, topology, n):
    seed = fresh_seed()
    xs = rank_inputs(seed, n, 3000 + 17 * n)   # (from 9 ranks the statistics take the schedule)
    runs = {}
    for gather in schedules.GATHERS:
        outs, reports = dq.simulate_allreduce(
            [x.copy() for x in xs], codec=CODECS[codec][0](), topology=topology, seed=seed,
            tile_bytes=512, return_reports=True, gather=gather)
        assert all(r.gather == gather for r in reports)
        runs[gather] = (outs, reports)
    (ring, ring_rep), (dbl, dbl_rep) = runs["ring"], runs["doubling"]
    for a, b in zip(ring, dbl):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"seed {seed}"
    assert [r.wire_bytes_total for r in ring_rep] == [r.wire_bytes_total for r in dbl_rep]
    assert sum(r.bytes_sent for r in ring_rep) == sum(r.bytes_sent for r in dbl_rep)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    err = np.linalg.norm(dbl[0] - exact) / np.linalg.norm(exact)
    assert err < CODECS[codec][1], (codec, err, seed)
    assert all(np.array_equal(dbl[0], o) for o in dbl[1:])     # every rank alike


def test_the_ring_is_the_default_and_the_report_says_which_ran(monkeypatch):
    xs = rank_inputs(fresh_seed(), 4, 4096)
    _, reports = dq.simulate_allreduce(xs, codec=dq.DynamiQ(small_input=0),
                                       return_reports=True)
    assert {r.gather for r in reports} == {"ring"}
    monkeypatch.setenv("DYNAMIQ_GATHER", "doubling")
    _, reports = dq.simulate_allreduce(xs, codec=dq.DynamiQ(small_input=0),
                                       return_reports=True)
    assert {r.gather for r in reports} == {"doubling"}
    _, reports = dq.simulate_reduce_scatter(xs, codec=dq.DynamiQ(small_input=0),
                                            return_reports=True)
    assert {r.gather for r in reports} == {""}          # no all-gather half


def test_a_bad_gather_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="gather must be one of"):
        dq.simulate_allreduce(rank_inputs(1, 3, 100), gather="tree")
    monkeypatch.setenv("DYNAMIQ_GATHER", "auto")
    with pytest.raises(ValueError, match=r"gather must be one of .*DYNAMIQ_GATHER"):
        dq.simulate_allreduce(rank_inputs(1, 3, 100))


def test_the_agreement_names_any_field_in_which_ranks_differ():
    from dynamiq_mpi.call.phases import check_agreement
    base = {"error": None, "length": 8, "can": {"nccl": True}}
    check_agreement([dict(base), dict(base, can={"nccl": False})])     # capabilities may differ
    with pytest.raises(dq.InputMismatchError, match="disagree on gather"):
        check_agreement([dict(base, gather="ring"), dict(base, gather="doubling")])
    with pytest.raises(dq.InputMismatchError, match="disagree on something_new"):
        check_agreement([dict(base, something_new=1), dict(base, something_new=2)])
