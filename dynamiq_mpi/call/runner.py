"""The runner of one communicator's calls: a plan of planner.py carried out
on a runtime (runtime.py) by one of its routes - the engine's program, a
steady native call (native.py), a graph replay (graphs.py) or the
hierarchical call (hierarchy.py) - and what the call taught remembered.
The parts are held, not inherited: a :class:`~dynamiq_mpi.Collective` owns
one runner, and so does each rail of a hierarchical call (a flat one)."""
from __future__ import annotations

import time

from ..backend import backend_for
from .engine import rank_program
from .graphs import GraphCalls, graph_stats
from .hierarchy import NodeCalls
from .phases import CallSpec, decode_into_output, default_gather
from .planner import CallPlanner
from .runtime import Runtime, sync


class CallRunner:
    """Plans and runs the calls of one runtime.  ``layout``: the codecs'
    (phases.default_layout); ``graphs``: replay steady compressed calls as
    CUDA graphs (``agree_replays``: each with a digest exchange);
    ``node_size``, ``rail_budget`` and ``links``: the hierarchy's (see the
    Collective)."""

    def __init__(self, runtime: Runtime, layout, graphs: bool, node_size=None,
                 rail_budget="joint", links=None, decode_into=None, gather=None,
                 agree_replays=True):
        self.runtime = runtime
        # every CallSpec's layout, decode_into and gather (read once, as the layout)
        self.settings = dict(layout=layout, decode_into=decode_into_output()
                             if decode_into is None else decode_into,
                             gather=default_gather(gather))

        def make_rail(plane):           # a rail is flat, on a runtime of its own
            return CallRunner(Runtime(plane, runtime.lanes, runtime.lane_bytes), layout,
                              graphs, decode_into=self.settings["decode_into"],
                              gather=self.settings["gather"])
        self.nodes = NodeCalls(runtime, layout, node_size, rail_budget, links, make_rail,
                               self.settings["gather"])
        self.graphs = GraphCalls(runtime, self.settings, agree_replays)
        self.planner = CallPlanner(runtime.plane, runtime.size, graphs, links,
                                   self.nodes.auto_layout, runtime.comm, self.settings["gather"])
        self.last_bits = None       # Report.bits_per_coord of the last call, reported or not

    def allreduce(self, x, out, call, hierarchy, want_report, profile, plan_hook=None):
        """One all-reduce (``call``: its normalised arguments, counter
        included): (result, report or None).  ``plan_hook``: a rail's joint
        budget (rail_budget.py)."""
        plan = self.planner.plan_allreduce(x, out, call, hierarchy, want_report, profile)
        if plan.route == "steady":      # (its bits: the engine call's that made the plan)
            self.last_bits, rt = plan.steady.bits, self.runtime
            stream = rt.fence_stream() if plan.steady.on_device else None
            try:
                return plan.steady.run(rt, x, out, call), None
            finally:
                if stream is not None:      # (only a cast takes a workspace buffer)
                    rt.record_stream(stream, took_workspace=plan.steady.casts)
        timed = plan.hierarchy_timed
        if timed:
            sync(x)
            t0 = time.perf_counter()
        out, report = self._run_allreduce(plan, x, out, want_report or timed, profile, call,
                                          plan_hook)
        if timed:
            sync(x)
            self.planner.record_hierarchy(plan, time.perf_counter() - t0, report)
        if report is not None and plan.hierarchy_why:
            report.hierarchy_reason = plan.hierarchy_why
        return out, report

    def _run_allreduce(self, plan, x, out, want_report, profile, call, plan_hook):
        if plan.route == "levels":
            out, report = self.nodes.run("allreduce", x, out, return_report=want_report, **call)
            self.last_bits = None if report is None else report.bits_per_coord
            return out, report
        if plan.route == "graph":       # (a failed capture runs the agreed call eagerly)
            self.last_bits = plan.steady.bits       # as the engine call that made the plan
            if plan.timed:
                sync(x)
                t0 = time.perf_counter()
            captured = self.graphs.run(plan.steady, x, out, call)
            if plan.timed:
                sync(x)
                self.planner.record_replay(plan, time.perf_counter() - t0 - captured)
            return out, None
        return self._run_engine(plan, x, out, want_report, profile, call, plan_hook)

    def reduce_scatter(self, x, out, call, hierarchy, want_report, profile):
        """One reduce-scatter (always compressed) by its plan: the
        hierarchical call, or the engine's reduce-scatter program."""
        plan = self.planner.plan_reduce_scatter(x, out, call, hierarchy, want_report, profile)
        if plan.route == "levels":
            return self.nodes.run("reduce_scatter", x, out, path="compressed",
                                  return_report=want_report, **call)
        if plan.route == "graph":
            self.graphs.run(plan.steady, x, out, call)
            self.last_bits = plan.steady.bits
            return out, None
        from .engine_rs import rank_program_rs
        rt = self.runtime
        spec = CallSpec(call["codec"], call["topology"], call["op"], call["seed"],
                        call["counter"], call["transport"], call["tile_bytes"],
                        nonfinite=call["nonfinite"], **self.settings)
        program = rank_program_rs(rt.rank, rt.size, x, spec, out, rt.workspace,
                                  detailed_report=want_report)
        out, report = rt.drive(program, x, profile, want_report, self.planner.route)
        self._remember(plan, report, call, x)
        return out, report

    def _run_engine(self, plan, x, out, want_report, profile, call, plan_hook):
        rt = self.runtime
        spec = CallSpec(call["codec"], call["topology"], call["op"], call["seed"],
                        call["counter"], call["transport"], call["tile_bytes"], path=plan.path,
                        nonfinite=call["nonfinite"], plan_hook=plan_hook, **self.settings)
        program = rank_program(rt.rank, rt.size, x, spec, out, rt.workspace,
                               detailed_report=want_report)
        if plan.timed:
            sync(x)
            t0 = time.perf_counter()
        out, report = rt.drive(program, x, profile, want_report or plan.timed,
                               self.planner.route)
        if plan.timed:
            sync(x)
            self.planner.record_path(plan, time.perf_counter() - t0, report)
        if not report.path_reason:
            report.path_reason = plan.why
        self._remember(plan, report, call, x)
        return out, (report if want_report else None)

    def _remember(self, plan, report, call, x):
        """What an engine call taught the planner (its steady or graph plan)."""
        rt = self.runtime
        self.last_bits = report.bits_per_coord
        meta = rt.last_metas[rt.rank] if rt.last_metas else None
        self.planner.remember(plan, report, meta, call["codec"], backend_for(x))

    def graph_stats(self) -> dict:
        return graph_stats(list(self.planner.graphs.values()))

    def forget_paths(self):
        self.planner.forget_paths()

    def free(self):
        """Everything, collectively: graphs first (a captured NCCL call holds its
        communicator: ncclCommDestroy waits for every such graph), then the
        transports, workspace, level planes and the control plane's duplicate."""
        self.planner.free_graphs()
        self.planner.free_choices()
        self.runtime.free_transports()
        self.nodes.free()
        self.runtime.free()
