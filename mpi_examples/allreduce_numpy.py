"""Compressed all-reduce of NumPy arrays: mpiexec -n 4 python mpi_examples/allreduce_numpy.py"""
import numpy as np
from mpi4py import MPI

import dynamiq_mpi as dq

comm = MPI.COMM_WORLD
rng = np.random.default_rng(comm.rank)
# a gradient whose 256-entry blocks differ in scale by four orders of magnitude
grad = (rng.standard_normal(1 << 21) * np.repeat(10.0 ** rng.uniform(-3, 1, 8192), 256))
grad = grad.astype(np.float32)

total, report = dq.allreduce(grad, codec=dq.DynamiQ(bits=5), topology="ring",
                             return_report=True)

exact = comm.allreduce(grad.astype(np.float64))          # float64 oracle
vnmse = np.sum((total - exact) ** 2) / np.sum(exact ** 2)
if comm.rank == 0:
    print(f"{report.world_size} ranks, {report.length} coordinates: "
          f"{report.bits_per_coord:.3f} bits/coordinate on the wire, vNMSE {vnmse:.2e}")
    # (inputs below 2^21 elements go as BF16, and the report has no widths)
    print("super-groups at 0/2/4/8/16 bits:", report.codec_info.get("widths"))
