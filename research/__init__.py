"""Studies built on the library, not installed with it: the error study
(``errorstudy``), the large-scale simulation of the schedules (``scale_sim``,
``scale_levels``: thousands of ranks in one process), the training simulator
(``train_sim``), the workloads and corpus they train on, and the CUDA kernel
benchmark (``kernels``).  Run from the repository root: ``python -m research
{vnmse,train-sim,schedule,kernels}``.

They import the public API (``dynamiq_mpi``) and the interfaces design.md
declares for studies (``tests/test_layers.py`` keeps that so)."""
