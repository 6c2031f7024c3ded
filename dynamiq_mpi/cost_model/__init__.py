"""The cost model: predicted time of NCCL's, the flat and the hierarchical
compressed all-reduce on a cluster (``model.py``), its command line
``python -m dynamiq_mpi model`` (``cli.py``, ``io.py``).  Its check against the
recorded measurements is a study, ``research/model_check.py``.  ``hierarchy="auto"`` asks the
model through ``call/prediction.py``."""
