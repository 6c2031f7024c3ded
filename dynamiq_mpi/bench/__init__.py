"""The benchmark ``python -m dynamiq_mpi bench`` (``collective``): the
all-reduce against NCCL's or MPI's own, per size and path; a table and JSON."""
from .collective import add_arguments, parse_size, print_table, run, sizes_from

__all__ = ["add_arguments", "parse_size", "print_table", "run", "sizes_from"]
