"""The machinery of a call, under the public face (``dynamiq_mpi.api``): one
call becomes a plan (``planner``) that a ``runner`` carries out on a
``runtime``; docs/design.md's drawing names every module.  Data flows one
way: api -> call -> (schedules, codecs, transports) -> kernels.
"""
