"""The cost model: predicted time of NCCL's, the flat and the hierarchical
compressed all-reduce on a cluster (``model.py``), its command ``python -m
dynamiq_mpi model`` (``io.py``); ``hierarchy="auto"`` asks it
through ``call/prediction.py``."""
