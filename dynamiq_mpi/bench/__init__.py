"""Benchmarks: ``collective`` (``python -m dynamiq_mpi bench``: the
all-reduce against NCCL's or MPI's own, per size and path) and ``kernels``
(``python -m dynamiq_mpi kernels``: the CUDA kernels against the GPU's copy
roofline).  Both print a table and write JSON."""
from .collective import add_arguments, parse_size, print_table, run, sizes_from

__all__ = ["add_arguments", "parse_size", "print_table", "run", "sizes_from"]
