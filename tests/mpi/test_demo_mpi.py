"""``python -m dynamiq_mpi demo`` (``make demo``) under mpiexec: every codec
row runs its own compressed path (not the native all-reduce that
``path="auto"`` may pick), within its budget, identical on every rank, with
the error each codec should have."""
import json
import os
import tempfile

import pytest
from mpi4py import MPI

from dynamiq_mpi.__main__ import main

comm = MPI.COMM_WORLD


@pytest.mark.mpi(min_size=2)
def test_demo_rows_are_the_codecs_compressed_paths():
    folder = comm.bcast(tempfile.mkdtemp(prefix="dq_demo_") if comm.rank == 0 else None)
    path = os.path.join(folder, "demo.json")
    main(["demo", "--length", str(1 << 16), "--json", path])
    comm.Barrier()
    rows = {(r["codec"], r["topology"]): r for r in json.load(open(path))}
    ran = [r for r in rows.values() if r["bits_per_coord"] is not None]
    assert ran and all(r["identical"] for r in ran)
    for (codec, topo), r in rows.items():
        if r["bits_per_coord"] is None:
            continue
        if codec == "exact":
            assert r["bits_per_coord"] == 32.0 and r["vnmse"] < 1e-12
        elif codec == "bf16":
            assert r["bits_per_coord"] == 16.0 and 1e-7 < r["vnmse"] < 1e-4
        else:                        # "dynamiq b=B": compressed within its budget
            bits = float(codec.split("=")[1])
            assert r["bits_per_coord"] <= bits + 1e-9, (codec, topo, r)
            assert 0 < r["vnmse"] < 0.5, (codec, topo, r)
