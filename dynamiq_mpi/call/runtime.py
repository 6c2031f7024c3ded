"""What one communicator's calls run on: its control plane (a private
duplicate), the transports made on first use, the workspace reused across
calls and the fence of the caller's stream; :meth:`Runtime.drive` answers a
rank program's requests.  A Collective owns one, so does each rail."""
from __future__ import annotations

import time

from ..errors import InvalidInputError
from ..settings import env_text
from ..transports import transport_class
from ..transports.ops import Agree, Route
from .workspace import Workspace


class Runtime:
    """The control plane, transports and workspace of one communicator
    (``lanes`` and ``lane_bytes``: the NCCL transport's, see the Collective)."""

    def __init__(self, comm, lanes, lane_bytes):
        from ..control import as_plane
        self.comm = comm            # what it was made from
        self.host = transport_class("mpi")(as_plane(comm))    # a private duplicate
        self.plane = self.host.plane
        self.rank, self.size = self.host.rank, self.host.size
        self.lanes, self.lane_bytes = lanes, lane_bytes
        self.workspace = Workspace()
        self.nccl = {}              # device -> NCCL transport
        self.mpi_cuda = None
        self.last_metas = None      # the agreement records of the last driven call
        self.last_stream = (None, None)  # (stream pointer, event at the end of the last call)
        self._done_event = None
        self.unrecorded = None      # the last stream, where work came after that event
        self._capture_streams = {}  # device -> a private stream for graph captures

    def drive(self, program, x, profile, want_report, choose):
        """Run one rank program: (result, report).  ``choose(route, records, x,
        explain)``: the planner's (``Routed``, why) for the ``Route`` request."""
        on_device = type(x).__module__.startswith("cupy")
        stream = self.fence_stream() if on_device else None
        t0 = time.perf_counter()
        data, prof, metas, failed, why = self.host, None, None, True, None
        self.last_metas = None
        try:
            request = program.send(None)
            while True:
                if type(request) is Agree:
                    answer = self.host.answer(request)
                    if metas is None:       # the call's records (later ones: flags)
                        metas = self.last_metas = answer
                elif type(request) is Route:
                    answer, why = choose(request, metas, x, want_report)
                    data = self.route(answer.transport, x)
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
            if data is self.mpi_cuda:
                data.end_call(failed)
            if profile and data.profile is not None:
                prof = data.stop_profile()
            if on_device:
                self.record_stream(stream)
        report.control_plane = self.plane.name
        if prof is not None:
            report.phases = _phases(prof, t0)
        if want_report and why is not None:
            report.transport_reason = why
            if getattr(data, "lanes_why", None):
                report.transport_reason += f"; {data.lanes_why}"
        return out, report

    def route(self, transport, x):
        """The transport named ``transport`` for ``x``, made on first use by every rank alike."""
        if transport == "mpi-cuda":
            if self.plane.mpi_comm is None:  # the same on every rank: all raise
                raise InvalidInputError(
                    "transport='mpi-cuda' needs the MPI control plane; this collective runs "
                    "over a torch.distributed group (use transport='auto', 'nccl' or 'mpi')")
            if self.mpi_cuda is None:
                self.mpi_cuda = transport_class("mpi-cuda")(self.plane.mpi_comm)
            return self.mpi_cuda
        if transport != "nccl":
            return self.host
        device = x.device.id
        if device not in self.nccl:
            pair = env_text("DYNAMIQ_NCCL_PAIR_ALLGATHER")
            self.nccl[device] = transport_class("nccl")(self.plane, device, self.lanes,
                                                        self.lane_bytes, pair_allgather=pair == "1")
        return self.nccl[device]

    def fence_stream(self):
        """Workspace buffers are reused in stream order: if the caller's stream
        changed since the last call, wait for the last call's work first: the stream."""
        import cupy
        stream = cupy.cuda.get_current_stream()
        if self.last_stream[1] is not None and self.last_stream[0] != stream.ptr:
            if self.unrecorded is not None:     # (steady calls that recorded no event)
                self.last_stream[1].record(self.unrecorded)
            stream.wait_event(self.last_stream[1])
        return stream

    def record_stream(self, stream, took_workspace=True):
        # one event, re-recorded (a new Event per call costs host time); a call that
        # took no workspace on the last call's stream needs none: stream order
        # follows, and a later switch records it (fence_stream)
        if not took_workspace and self.last_stream[0] == stream.ptr:
            self.unrecorded = stream
            return
        import cupy
        if self._done_event is None:
            self._done_event = cupy.cuda.Event(block=False, disable_timing=True)
        self._done_event.record(stream)
        self.last_stream, self.unrecorded = (stream.ptr, self._done_event), None

    def capture_stream(self, stream):
        """The stream a capture records on: the caller's, or a private one for
        CuPy's legacy default stream, which CUDA refuses to capture."""
        if stream.ptr:
            return stream
        import cupy
        device = cupy.cuda.Device().id
        if device not in self._capture_streams:
            self._capture_streams[device] = cupy.cuda.Stream(non_blocking=True)
        return self._capture_streams[device]

    def free_transports(self):
        """The device transports and the workspace (collective)."""
        for t in self.nccl.values():
            t.free()
        self.nccl.clear()
        if self.mpi_cuda is not None:
            self.mpi_cuda.free()
            self.mpi_cuda = None
        self.workspace.clear()

    def free(self):
        """Everything, the control plane's duplicate last (collective)."""
        self.free_transports()
        self.host.free()


def sync(x):
    """Wait for the caller's stream (device arrays); nothing for host arrays."""
    if type(x).__module__.startswith("cupy"):
        import cupy
        cupy.cuda.get_current_stream().synchronize()


def _phases(prof, t0) -> dict:
    """Per-phase seconds from a profiled call's marks, plus kernel and wire time where measured."""
    marks = [("agreement", t0)] + list(prof.marks)
    phases = {}
    for (name, a), (_, b) in zip(marks, marks[1:]):
        phases[name] = phases.get(name, 0.0) + (b - a)
    phases.pop("done", None)
    phases.update(prof.summary())
    return phases
