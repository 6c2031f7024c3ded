"""Studies built on the library, not part of its API: the error study
(``errorstudy``, ``python -m dynamiq_mpi vnmse``), the large-scale
simulation of the schedules (``scale_sim``, thousands of ranks in one
process) and the gradient-like and real gradient inputs they use
(``gradients``)."""
