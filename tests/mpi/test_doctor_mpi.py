"""``dynamiq_mpi.doctor`` inside an MPI job: rank 0 gathers every rank's host."""
import pytest
from mpi4py import MPI

from dynamiq_mpi import doctor

comm = MPI.COMM_WORLD


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
