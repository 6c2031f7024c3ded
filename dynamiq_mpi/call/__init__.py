"""The machinery of a call, under the public face (``dynamiq_mpi.api``):

* ``phases`` - the phases of a call and the one skeleton that runs them;
  ``engine`` - the all-reduce's table over it (agreement, statistics, plan,
  reduce-scatter and all-gather over a schedule, or the native path);
  ``engine_rs`` - the reduce-scatter's;
* ``wire`` - the native path's wire dtype and casts;
* ``paths`` - the measured choice between the compressed and the native
  path (and between flat and nodes);
* ``native`` - steady native calls (one digest exchange, no engine);
* ``graphs`` - steady compressed calls replayed as CUDA graphs;
* ``hierarchy`` - the hierarchical call (nodes and rails);
* ``planner`` - one call -> a plan; ``runner`` - a plan carried out on a
  ``runtime`` (control plane, transports, workspace);
* ``workspace`` - reusable buffers.

Data flows one way: api -> call -> (schedules, codecs, transports) -> kernels.
"""
