"""``dynamiq_mpi.bench.doctor`` inside an MPI job: rank 0 gathers every rank's host."""
import pytest
from mpi4py import MPI

from dynamiq_mpi.bench import doctor

# The same at every world size above 4: not run again at 6 and 8 ranks (CI time).
pytestmark = pytest.mark.max_size(4)

comm = MPI.COMM_WORLD
if comm.size > 3:
    # the doctor imports torch, which the suite imports only at sizes 2 and 3
    # (tests/mpi/test_torch_mpi.py): costly on 4+ ranks sharing CI's cores
    pytest.skip("the doctor's MPI test runs at world sizes 2..3", allow_module_level=True)


@pytest.mark.mpi(min_size=2)
def test_doctor_lists_every_rank():
    found = doctor.collect()
    assert found["launcher"].startswith("mpiexec")
    assert found["control_plane"] == f"mpi ({comm.size} ranks)"
    if comm.rank == 0:
        assert len(found["ranks"]) == comm.size
        text = doctor.render(found)
        assert f"ranks: {comm.size}" in text and f"rank {comm.size - 1}: " in text
    assert found["mpi"]["cuda_aware"].split(" ")[0] in ("yes", "no", "unknown")
