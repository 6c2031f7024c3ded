"""The collective's options given to the torch adapter's states (not through
``DYNAMIQ_*`` variables) reach the calls: ``hierarchy="nodes"`` with nodes of
one rank runs the hierarchical call for the DDP hook's state and for FSDP2's
``ReduceScatter``, and gives the exact mean with the Exact codec."""
import os

import numpy as np
import pytest
from mpi4py import MPI

comm = MPI.COMM_WORLD
if comm.size != 2:      # the options do not depend on the size; torch on many ranks is slow
    pytest.skip("the torch option tests run at world size 2", allow_module_level=True)

torch = pytest.importorskip("torch", exc_type=ImportError)

import dynamiq_mpi as dq  # noqa: E402
import dynamiq_mpi.torch as dqt  # noqa: E402

# The same at every world size above 4: not run again at 6 and 8 ranks (CI time).
pytestmark = pytest.mark.max_size(4)


@pytest.fixture(autouse=True)
def no_hierarchy_from_the_environment(monkeypatch):
    for name in ("DYNAMIQ_HIERARCHY", "DYNAMIQ_NODE_SIZE"):
        monkeypatch.delenv(name, raising=False)


def _rank_tensor(n):
    return torch.full((n,), float(comm.rank + 1))


@pytest.mark.mpi(min_size=2)
def test_hook_state_runs_the_hierarchy_it_was_given():
    state = dqt.HookState(codec=dq.Exact(), comm=comm, path="compressed", hierarchy="nodes",
                          node_size=1)
    t = _rank_tensor(4096)
    state.allreduce_(t)
    mean = (comm.size + 1) / 2
    assert np.allclose(t.numpy(), mean)
    assert state.last_report.hierarchy == "nodes"
    flat = dqt.HookState(codec=dq.Exact(), comm=comm, path="compressed")
    flat.allreduce_(_rank_tensor(4096))
    assert flat.last_report.hierarchy == "flat"


@pytest.mark.mpi(min_size=2)
def test_reduce_scatter_runs_the_hierarchy_it_was_given():
    n = 1024 * comm.size
    rs = dqt.ReduceScatter(codec=dq.Exact(), comm=comm, reports=True, hierarchy="nodes",
                           node_size=1)
    out = torch.empty(n // comm.size)
    rs.reduce_scatter_(out, _rank_tensor(n), op="sum")
    assert np.allclose(out.numpy(), comm.size * (comm.size + 1) / 2)
    assert rs.last_report.hierarchy == "nodes"
