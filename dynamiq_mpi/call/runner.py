"""The runner of a Collective's calls: carries out the plans of
planner.py (a mixin of :class:`~dynamiq_mpi.Collective`, with the graph
route of graphs.py and the level route of hierarchy.py): the engine's
program driven over the transports, a steady native call, a graph replay,
the hierarchical call; the transports made on first use; the caller's
stream fenced around device calls."""
from __future__ import annotations

import time

from ..backend import backend_for
from ..errors import InvalidInputError
from ..settings import env_text
from ..transports import explain_transport, transport_class
from ..transports.ops import Agree, Route
from .engine import rank_program
from .graphs import GraphCalls
from .hierarchy import NodeCalls
from .phases import CallSpec


class CallRunner(GraphCalls, NodeCalls):
    """Runs plans (see planner.py) on the Collective's state: its control
    plane, transports, workspace and planner."""

    def _run_allreduce(self, plan, x, out, want_report, profile, call):
        """One all-reduce by its plan: (result, report or None)."""
        if plan.route == "levels":
            return self._run_nodes("allreduce", x, out, return_report=want_report, **call)
        if plan.route == "steady":
            return self._run_steady(plan.steady, x, out, call["counter"], call["op"]), None
        if plan.route == "graph":       # (a failed capture runs the agreed call eagerly)
            self._run_graph(plan.steady, x, out, call["codec"], call["topology"], call["op"],
                            call["seed"], call["counter"], call["transport"], call["tile_bytes"],
                            call["nonfinite"])
            return out, None
        return self._run_engine(plan, x, out, want_report, profile, call)

    def _run_reduce_scatter(self, nodes, x, out, want_report, profile, call):
        """One reduce-scatter (always compressed): the hierarchical call, or
        the engine's reduce-scatter program."""
        if nodes:
            return self._run_nodes("reduce_scatter", x, out, path="compressed",
                                   return_report=want_report, **call)
        from .engine_rs import rank_program_rs
        spec = CallSpec(call["codec"], call["topology"], call["op"], call["seed"],
                        call["counter"], call["transport"], call["tile_bytes"],
                        nonfinite=call["nonfinite"], layout=self.layout)
        program = rank_program_rs(self.rank, self.size, x, spec, out, self._workspace,
                                  detailed_report=want_report)
        return self._drive(program, x, profile, want_report)

    def _run_engine(self, plan, x, out, want_report, profile, call):
        spec = CallSpec(call["codec"], call["topology"], call["op"], call["seed"],
                        call["counter"], call["transport"], call["tile_bytes"], path=plan.path,
                        nonfinite=call["nonfinite"], layout=self.layout,
                        plan_hook=self._plan_hook)
        program = rank_program(self.rank, self.size, x, spec, out, self._workspace,
                               detailed_report=want_report)
        if plan.timed:
            _sync(x)
            t0 = time.perf_counter()
        out, report = self._drive(program, x, profile, want_report or plan.timed)
        if plan.timed:
            _sync(x)
            self._planner.record_path(plan, time.perf_counter() - t0, report)
        if not report.path_reason:
            report.path_reason = plan.why
        meta = self._last_metas[self.rank] if self._last_metas else None
        self._planner.remember(self, plan, report, meta, call["codec"], backend_for(x))
        return out, (report if want_report else None)

    def _run_steady(self, steady, x, out, counter, op):
        on_device = steady.backend.name == "gpu"
        if on_device:
            self._fence_stream()
        try:
            return steady.run(self._plane, self._route, x, out, counter, op, self.size,
                              self._workspace)
        finally:
            if on_device:
                self._record_stream()

    # -- driving one call ------------------------------------------------------
    def _drive(self, program, x, profile, want_report=True):
        on_device = type(x).__module__.startswith("cupy")
        if on_device:
            self._fence_stream()
        t0 = time.perf_counter()
        data, prof, metas, failed = self._host, None, None, True
        self._last_metas = None
        self._route_why = ""
        try:
            request = program.send(None)
            while True:
                if isinstance(request, Agree):
                    answer = self._host.answer(request)
                    if metas is None:       # the call's records (later ones: flags)
                        metas = self._last_metas = answer
                elif isinstance(request, Route):
                    data = self._route(request.transport, x)
                    answer = data.name
                    if profile:
                        data.start_profile(device=on_device)
                else:
                    answer = data.answer(request)
                request = program.send(answer)
        except StopIteration as done:
            out, report = done.value
            failed = False
            if on_device and hasattr(data, "join"):
                data.join()     # no lane still sends from a buffer the next call rewrites
        finally:
            if data is self._mpi_cuda:
                data.end_call(failed)
            if profile and data.profile is not None:
                prof = data.stop_profile()
            if on_device:
                self._record_stream()
        report.control_plane = self.control_plane
        if prof is not None:
            report.phases = _phases(prof, t0)
        if want_report and metas is not None and len(metas) == self.size:
            # the why of the choice the engine made from the same records
            report.transport_reason = (self._route_why or
                                       explain_transport(metas[0]["transport"], metas)[1])
            if getattr(data, "lanes_why", None):
                report.transport_reason += f"; {data.lanes_why}"
        return out, report

    def _route(self, transport, x):
        if transport == "mpi-cuda":
            if self._plane.mpi_comm is None:  # the same on every rank: all raise
                raise InvalidInputError(
                    "transport='mpi-cuda' needs the MPI control plane; this collective runs "
                    "over a torch.distributed group (use transport='auto', 'nccl' or 'mpi')")
            if self._mpi_cuda is None:        # every rank gets here in the same call
                self._mpi_cuda = transport_class("mpi-cuda")(self._plane.mpi_comm)
            return self._mpi_cuda
        if transport != "nccl":
            return self._host
        device = x.device.id
        if device not in self._nccl:          # every rank gets here in the same call
            from ..transports.nccl import ranks_sharing_a_gpu
            shared = self._gpu_sharing.get(device)
            if shared is None:
                shared = self._gpu_sharing[device] = ranks_sharing_a_gpu(self._plane, device)
            if shared:          # the same answer on every rank: all raise or all stage
                requested = self._last_metas[0]["transport"] if self._last_metas else "auto"
                if requested == "nccl":
                    raise InvalidInputError(f"transport='nccl' is not usable: NCCL needs one GPU "
                                            f"per rank ({shared}); use transport='mpi' or 'auto'")
                self._route_why = (f"auto: NCCL needs one GPU per rank ({shared}): device "
                                   "buffers staged through host memory")
                return self._host
            pair = env_text("DYNAMIQ_NCCL_PAIR_ALLGATHER")
            self._nccl[device] = transport_class("nccl")(self._plane, device, self.lanes,
                                                         self.lane_bytes, pair_allgather=pair == "1")
        return self._nccl[device]

    def _fence_stream(self):
        """Workspace buffers are reused in stream order: if the caller's stream
        changed since the last call, wait for the last call's work first."""
        import cupy
        stream = cupy.cuda.get_current_stream()
        if self._last_stream is not None and self._last_stream[0] != stream.ptr:
            stream.wait_event(self._last_stream[1])

    def _record_stream(self):
        # one event, re-recorded: the next call's wait is enqueued before
        # this event is recorded again (a new Event per call costs host time)
        import cupy
        stream = cupy.cuda.get_current_stream()
        if self._done_event is None:
            self._done_event = cupy.cuda.Event(block=False, disable_timing=True)
        self._done_event.record(stream)
        self._last_stream = (stream.ptr, self._done_event)

    def _free_calls(self):
        """The transports, graphs, workspace and level planes (collective)."""
        # graphs first: a captured NCCL call holds a reference on its
        # communicator, and ncclCommDestroy waits until every graph that
        # holds one is gone (it hung at 2 and 4 ranks on H100s)
        self._free_graphs()
        for t in self._nccl.values():
            t.free()
        self._nccl.clear()
        if self._mpi_cuda is not None:
            self._mpi_cuda.free()
            self._mpi_cuda = None
        self._workspace.clear()
        if self._levels is not None:
            self._levels.free()
            self._levels = None


def _sync(x):
    """Wait for the caller's stream (device arrays); nothing for host arrays."""
    if type(x).__module__.startswith("cupy"):
        import cupy
        cupy.cuda.get_current_stream().synchronize()


def _phases(prof, t0) -> dict:
    """Per-phase seconds from the marks of a profiled call (phases are
    serialised by the profiling), plus kernel and wire time where measured."""
    marks = [("agreement", t0)] + list(prof.marks)
    phases = {}
    for (name, a), (_, b) in zip(marks, marks[1:]):
        phases[name] = phases.get(name, 0.0) + (b - a)
    phases.pop("done", None)
    phases.update(prof.summary())
    return phases
