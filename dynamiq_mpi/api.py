"""Public entry points: :func:`allreduce`, :class:`Collective` and
:func:`simulate_allreduce`."""
from __future__ import annotations

import os
import threading
import time

from .codecs.base import DEFAULT_TILE_BYTES, signature_of
from .codecs import DEFAULT_CODEC
from .call import native
from .backend import backend_for
from .errors import InvalidInputError
from .call.engine import CallSpec, check_nonfinite, default_layout, rank_program
from .call.paths import PathChooser, default_path, size_class
from .transports import TRANSPORTS, explain_transport
from .transports.ops import Agree, Route
from .transports.simulate import SimulatedTransport
from .call.graphs import GraphCalls, SteadyCompressed, default_graphs
from .settings import env_choice
from .call.hierarchy import NodeCalls, default_node_size
from .call.workspace import FRESH, Workspace


_DEFAULT_CODEC = DEFAULT_CODEC


def _check_transport(transport):
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")


class Collective(GraphCalls, NodeCalls):
    """A communicator's compressed all-reduce.

    ``comm``: an mpi4py communicator, a ``torch.distributed`` process group
    (the torch control plane: torchrun, Lightning, ``mp.spawn``), or None for
    the launcher's default (``control.default_comm``: ``MPI.COMM_WORLD`` in a
    job started by mpiexec, else torch.distributed's default group when it is
    initialised; a job whose launcher says it has several processes but that
    has neither is an error on every rank, never a world of one).
    ``control_plane`` says which ("mpi" or "torch").

    Owns a private duplicate of ``comm``, the per-communicator call counter
    that keys the generator (successive calls with the same seed draw fresh
    randomness), reusable workspace, and - created on the first call that uses
    it - one NCCL communicator per lane for device arrays.  Calls are
    serialised by a lock, so DDP hooks on other threads may share it.  Every
    rank must make the same sequence of calls.

    ``transport``: "auto" (for device arrays: NCCL when usable on every rank,
    else a CUDA-aware MPI when every rank has one, else host-staged MPI),
    "nccl", "mpi-cuda" (device buffers handed to a CUDA-aware MPI; see
    docs/cuda_aware_mpi.md) or "mpi".  ``report.transport`` says which ran and
    ``report.transport_reason`` why.  ``tile_bytes``: bytes of
    compressed stream per message (the pipeline's unit).  ``lanes``: NCCL
    communicators (and streams) one large message is split over (default
    ``$DYNAMIQ_NCCL_LANES``, else "auto": 4 where NCCL links the ranks through
    shared memory, 1 elsewhere; ``report.transport_reason`` says which;
    ``$DYNAMIQ_NCCL_LANE_BYTES`` sets the smallest slice a lane gets).
    ``DYNAMIQ_NCCL_PAIR_ALLGATHER=1`` makes a two-rank exchange one NCCL
    all-gather (measured slower here, docs/benchmarks.md 2.0f).

    ``path``: "auto" (default, or ``$DYNAMIQ_PATH``): per class of calls
    (size as a power of two, dtype, codec, ...) the collective times the
    compressed path and the transport's own all-reduce (NCCL's BF16 one for
    device arrays, MPI's for host arrays) on the first calls, agrees on the
    result across ranks and keeps the faster (paths.py); "compressed" or
    "native" force one.  ``report.path`` and ``report.path_reason`` say
    which ran and why; :meth:`path_decisions` lists the classes decided.

    ``nonfinite``: "propagate" (default; NCCL's semantics: a NaN or Inf on
    any rank gives NaN on every rank, ``report.nonfinite`` is True, nothing
    is raised) or "raise" (``NonFiniteInputError`` / ``SumOverflowError``
    on every rank, before any data byte moves).

    ``hierarchy``: "flat" (default, or ``$DYNAMIQ_HIERARCHY``: one ring or
    butterfly over all ranks) or "nodes" (hierarchy.py: uncompressed inside
    a node, one compressed rail per local rank across nodes);
    ``report.hierarchy`` and ``report.levels`` say what ran.  ``node_size``
    (or ``$DYNAMIQ_NODE_SIZE``): consecutive ranks form nodes of that size
    (to emulate a cluster on one host); default: the ranks that share a host.

    ``graphs``: replay steady compressed calls over NCCL as CUDA graphs
    (graphs.py): a call with ``out=`` whose every argument, buffer and stream
    repeats one made before is captured on its second occurrence and
    replayed from then on, for one digest exchange and a graph launch of host
    time.  Default ``$DYNAMIQ_GRAPHS`` ("1" on), else off: the capture of NCCL
    point-to-point is not yet measured on two GPUs here (docs/design.md).
    :meth:`graph_stats` says what was captured.
    """

    def __init__(self, comm=None, transport: str = "auto", tile_bytes: int = DEFAULT_TILE_BYTES,
                 lanes: int | str | None = None, path: str | None = None,
                 nonfinite: str = "propagate", graphs: bool | None = None,
                 hierarchy: str | None = None, node_size: int | None = None):
        from .control import as_plane, default_comm
        if comm is None:
            comm = default_comm()
        _check_transport(transport)
        check_nonfinite(nonfinite)
        self.path = default_path(path)
        self.hierarchy = default_hierarchy(hierarchy)
        self.node_size = default_node_size(node_size)
        self._levels = None          # hierarchy.Levels, made by the first "nodes" call
        self._layout = None          # the nodes found for hierarchy="auto"
        self._auto = None            # whether "auto" may use nodes (decided once)
        self.nonfinite = nonfinite
        self.layout = default_layout()
        self.graphs = default_graphs(graphs)
        from .transports.mpi_host import HostTransport
        self.parent = comm
        self.transport = transport
        self.tile_bytes = int(tile_bytes)
        if lanes is None:
            lanes = os.environ.get("DYNAMIQ_NCCL_LANES", "auto")
        if lanes != "auto":
            try:
                lanes = int(lanes)
            except (TypeError, ValueError):
                lanes = 0
            if lanes < 1:
                raise ValueError(f"lanes must be a positive integer or 'auto', got {lanes!r}")
        self.lanes = lanes
        lane_bytes = os.environ.get("DYNAMIQ_NCCL_LANE_BYTES")
        if lane_bytes is not None and not (lane_bytes.strip().isdigit() and int(lane_bytes) > 0):
            raise ValueError("DYNAMIQ_NCCL_LANE_BYTES must be a positive number of bytes, "
                             f"got {lane_bytes!r}")
        self.lane_bytes = int(lane_bytes) if lane_bytes is not None else None
        self._host = HostTransport(as_plane(comm))    # a private duplicate
        self._plane = self._host.plane
        self.control_plane = self._plane.name
        self.rank, self.size = self._host.rank, self._host.size
        self._nccl = {}
        self._gpu_sharing = {}      # device -> which ranks share a GPU ('' : none), asked once
        self._route_why = ""        # why this call's transport differs from the agreed one
        self._mpi_cuda = None
        self._counter = 0
        self._lock = threading.Lock()
        self._workspace = Workspace()
        self._last_stream = None     # (stream pointer, event at the end of the last call)
        self._done_event = None
        self._paths = PathChooser(self._plane)
        self._hierarchies = PathChooser(self._plane, options=("nodes", "flat"))
        self._steady = {}            # steady native calls (native.SteadyNative) by their key
        self._graphs = {}            # steady compressed calls (graphs.SteadyCompressed) by graph_key
        self._last_metas = None

    @property
    def counter(self) -> int:
        """Calls made so far (keys the generator); restore it to resume a run."""
        return self._counter

    @counter.setter
    def counter(self, value: int):
        if int(value) < 0:
            raise ValueError("counter must be non-negative")
        with self._lock:
            self._counter = int(value)

    def allreduce(self, x, *, codec=None, topology="ring", op="sum", seed=0, out=None,
                  transport=None, tile_bytes=None, return_report=False, profile=False,
                  path=None, nonfinite=None, hierarchy=None):
        """All-reduce ``x`` (see :func:`allreduce`).  ``profile=True``
        synchronises at every phase boundary and puts the per-phase times into
        ``report.phases`` (slower: for breakdowns, not for production).
        ``path``, ``nonfinite`` and ``hierarchy`` override the collective's
        (see the class)."""
        codec = _DEFAULT_CODEC if codec is None else codec
        transport = self.transport if transport is None else transport
        nonfinite = self.nonfinite if nonfinite is None else nonfinite
        requested = self.path if path is None else default_path(path)
        tile_bytes = self.tile_bytes if tile_bytes is None else tile_bytes
        hierarchy = self.hierarchy if hierarchy is None else default_hierarchy(hierarchy)
        with self._lock:
            counter = self._counter
            self._counter += 1
            call = dict(codec=codec, topology=topology, op=op, seed=seed, counter=counter,
                        transport=transport, tile_bytes=tile_bytes, path=requested,
                        nonfinite=nonfinite)
            key, why, timed = None, "", False
            if hierarchy == "auto":
                hierarchy, key, why, timed = self._choose_hierarchy(x, call)
            want = return_report or timed
            if timed:
                _sync(x)
                t0 = time.perf_counter()
            if hierarchy == "nodes" and self.size > 1:
                out, report = self._run_nodes("allreduce", x, out, return_report=want, **call)
            else:
                out, report = self._allreduce_flat(x, out, want, profile, **call)
            if timed:
                _sync(x)
                if not report.nonfinite:
                    self._hierarchies.record(key, hierarchy, time.perf_counter() - t0,
                                             hierarchy)
            if report is not None and why:
                report.hierarchy_reason = why
        return (out, report) if return_report else out

    def _allreduce_flat(self, x, out, return_report, profile, *, codec, topology, op, seed,
                        counter, transport, tile_bytes, path, nonfinite):
        """One flat call: (result, report or None)."""
        requested = path
        steady_key = None
        if requested != "compressed" and not (return_report or profile):
            # a call like one agreed before on the native path (for "auto":
            # its class decided native): no engine, no path choice
            try:
                steady_key = native.steady_key(x, out, codec, topology, op, seed,
                                               transport, tile_bytes, nonfinite, requested)
                steady = self._steady.get(steady_key)
            except Exception:   # not an array, unhashable arguments: the engine
                steady_key = steady = None      # reports them to every rank
            if steady is not None:
                return self._run_steady(steady, x, out, counter, op), None
        graph_key = None
        if self.graphs and out is not None and requested != "native" and not (
                return_report or profile):
            graph_key = self._graph_key(x, out, codec, topology, op, seed, transport,
                                        tile_bytes, nonfinite, requested)
            entry = self._graphs.get(graph_key) if graph_key is not None else None
            if entry is not None and not entry.failed and self._run_graph(
                    entry, x, out, codec, topology, op, seed, counter, transport,
                    tile_bytes, nonfinite):
                return out, None
        key, chosen, why, timed = self._choose_path(x, codec, topology, op, transport,
                                                    requested)
        spec = CallSpec(codec, topology, op, seed, counter, transport, tile_bytes,
                        path=chosen, nonfinite=nonfinite, layout=self.layout)
        if chosen != "native" or timed or nonfinite == "raise":
            steady_key = None       # (a steady native call checks no NaN)
        program = rank_program(self.rank, self.size, x, spec, out, self._workspace,
                               detailed_report=return_report)
        if timed:
            _sync(x)
            t0 = time.perf_counter()
        out, report = self._drive(program, x, profile, return_report or timed)
        if timed:
            _sync(x)
            if not report.nonfinite:
                self._paths.record(key, chosen, time.perf_counter() - t0, report.path,
                                   report.path_reason)
        if not report.path_reason:
            report.path_reason = why
        if steady_key is not None and report.path == "native" and self._last_metas:
            if len(self._steady) > 64:
                self._steady.clear()
            self._steady[steady_key] = native.SteadyNative(
                self._last_metas[self.rank], codec, report.transport,
                report.codec_info["wire"], backend_for(x))
        if (graph_key is not None and not timed and report.path == "compressed"
                and report.sync_free and report.transport == "nccl" and self._last_metas
                and graph_key not in self._graphs):
            if len(self._graphs) >= 64:
                self._free_graphs()
            self._graphs[graph_key] = SteadyCompressed(self._last_metas[self.rank], "nccl")
        return out, (report if return_report else None)

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

    def reduce_scatter(self, x, *, codec=None, topology="ring", op="sum", seed=0, out=None,
                       transport=None, tile_bytes=None, return_report=False, profile=False,
                       nonfinite=None, hierarchy=None):
        """Reduce-scatter ``x`` (see :func:`reduce_scatter`); always compressed
        (``path`` does not apply).  Shares the call counter with
        :meth:`allreduce`.  ``hierarchy="nodes"``: hierarchy.py."""
        from .call.engine_rs import rank_program_rs
        codec = _DEFAULT_CODEC if codec is None else codec
        transport = self.transport if transport is None else transport
        nonfinite = self.nonfinite if nonfinite is None else nonfinite
        hierarchy = self.hierarchy if hierarchy is None else default_hierarchy(hierarchy)
        with self._lock:
            counter = self._counter
            self._counter += 1
            if hierarchy == "nodes" and self.size > 1:
                out, report = self._run_nodes(
                    "reduce_scatter", x, out, codec=codec, topology=topology, op=op, seed=seed,
                    counter=counter, transport=transport,
                    tile_bytes=self.tile_bytes if tile_bytes is None else tile_bytes,
                    path="compressed", nonfinite=nonfinite, return_report=return_report)
                return (out, report) if return_report else out
            spec = CallSpec(codec, topology, op, seed, counter, transport,
                            self.tile_bytes if tile_bytes is None else tile_bytes,
                            nonfinite=nonfinite, layout=self.layout)
            program = rank_program_rs(self.rank, self.size, x, spec, out, self._workspace,
                                      detailed_report=return_report)
            out, report = self._drive(program, x, profile, return_report)
        return (out, report) if return_report else out

    def _choose_path(self, x, codec, topology, op, transport, requested):
        """(class key, path, why, timed) of this call, from local facts only
        (every rank has the same ones when the call is valid; an invalid one
        fails agreement on every rank whatever the path)."""
        if requested != "auto" or self.size == 1:
            return None, requested if self.size > 1 else "compressed", "requested", False
        module = type(x).__module__
        on_device = module.startswith("cupy")
        dtype = getattr(x, "dtype", None)
        length = getattr(x, "size", 0)
        if on_device:
            from .transports.nccl import nccl_status
            can_native = transport in ("auto", "nccl") and nccl_status()[0]
        else:
            can_native = transport in ("auto", "mpi") and module.startswith("numpy")
        key = ("gpu" if on_device else "cpu", str(dtype), size_class(length), signature_of(codec),
               topology, transport, op)
        path, why, timed = self._paths.choose(key, requested, getattr(codec, "auto_path", False),
                                              can_native, getattr(codec, "name", ""))
        return key, path, why, timed

    def path_decisions(self) -> dict:
        """{(backend, dtype, log2 size, codec, topology, transport, op): (path,
        why)} for the classes of calls ``path="auto"`` has decided."""
        return self._paths.decisions()

    def forget_paths(self):
        """Measure every class of calls again (all ranks must call it alike)."""
        with self._lock:
            self._paths.forget()
            self._steady.clear()        # their path came from the choices just forgotten
            self._free_graphs()

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
                from .transports.mpi_cuda import MPICudaTransport
                self._mpi_cuda = MPICudaTransport(self._plane.mpi_comm)
            return self._mpi_cuda
        if transport != "nccl":
            return self._host
        device = x.device.id
        if device not in self._nccl:          # every rank gets here in the same call
            from .transports.nccl import NCCLTransport, ranks_sharing_a_gpu
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
            pair = os.environ.get("DYNAMIQ_NCCL_PAIR_ALLGATHER")
            self._nccl[device] = NCCLTransport(self._plane, device, self.lanes,
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

    def free(self):
        """Release the NCCL communicators and the control plane's duplicate."""
        with self._lock:
            for t in self._nccl.values():
                t.free()
            self._nccl.clear()
            if self._mpi_cuda is not None:
                self._mpi_cuda.free()
                self._mpi_cuda = None
            self._free_graphs()
            self._workspace.clear()
            if self._levels is not None:
                self._levels.free()
                self._levels = None
            self._host.free()


def default_hierarchy(value=None) -> str:
    """``value``, else ``$DYNAMIQ_HIERARCHY``, else "flat"."""
    from .call.hierarchy import HIERARCHIES
    return env_choice(value, "DYNAMIQ_HIERARCHY", HIERARCHIES, "hierarchy", default="flat")


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


_collectives = {}
_collectives_lock = threading.Lock()


def collective_for(comm=None) -> Collective:
    """The library's cached :class:`Collective` of ``comm`` (an mpi4py
    communicator or a torch.distributed group; None: the launcher's default,
    see :class:`Collective`)."""
    if comm is None:
        from .control import default_comm
        comm = default_comm()
    with _collectives_lock:
        entry = _collectives.get(id(comm))
        if entry is None or entry.parent is not comm:
            entry = _collectives[id(comm)] = Collective(comm)
        return entry


def allreduce(x, *, codec=None, topology="ring", op="sum", comm=None, seed=0, out=None,
              transport="auto", return_report=False, path=None, nonfinite="propagate",
              hierarchy=None):
    """Compressed all-reduce of ``x`` over ``comm`` (an mpi4py communicator or a
    torch.distributed process group; default: the launcher's, see :class:`Collective`).

    Every rank passes an array of the same length and dtype (float32, bfloat16,
    float16 or float64; NumPy or CuPy; any C-contiguous shape) and gets back an
    array of that shape and dtype holding the same estimate of the sum (or
    mean) on every rank, bit for bit: a new one, or ``out`` (which may be ``x``
    itself).  CuPy arrays run on the current CuPy stream and the result is
    valid in its order.  With ``return_report=True`` returns ``(result, Report)``.

    ``path``: "auto" (default, or ``$DYNAMIQ_PATH``) takes, per class of
    calls, whichever of the compressed path and the transport's own
    all-reduce (NCCL's BF16 one, MPI's) the collective measured faster;
    "compressed" / "native" force one (see :class:`Collective`).
    ``nonfinite``: "propagate" (NCCL's semantics: NaN/Inf on any rank gives a
    NaN output on every rank and ``report.nonfinite``) or "raise"
    (``NonFiniteInputError`` on every rank).
    ``hierarchy``: "flat" (default) or "nodes" (see :class:`Collective`).
    """
    return collective_for(comm).allreduce(x, codec=codec, topology=topology, op=op, seed=seed,
                                          out=out, transport=transport,
                                          return_report=return_report, path=path,
                                          nonfinite=nonfinite, hierarchy=hierarchy)


def reduce_scatter(x, *, codec=None, topology="ring", op="sum", comm=None, seed=0, out=None,
                   transport="auto", return_report=False, nonfinite="propagate",
                   hierarchy=None):
    """Compressed reduce-scatter of ``x`` over ``comm`` (as in :func:`allreduce`).

    Every rank passes a C-contiguous array of the same length (divisible by the
    number of ranks n, else every rank raises ``InvalidInputError``) and dtype;
    rank r gets a new flat array (or ``out``: any contiguous array of that
    size) of ``len(x) / n`` elements: coordinates ``[r len/n, (r+1) len/n)``
    of the sum (or mean), estimated by the reduce-scatter half of the ring
    (or butterfly) with ``codec``.  ``nonfinite`` as in :func:`allreduce`.
    Each rank's chunk is planned on its own (a DynamiQ threshold per chunk:
    every message carries about the same bytes; docs/design.md).
    """
    return collective_for(comm).reduce_scatter(x, codec=codec, topology=topology, op=op,
                                               seed=seed, out=out, transport=transport,
                                               return_report=return_report,
                                               nonfinite=nonfinite, hierarchy=hierarchy)


def simulate_allreduce(xs, *, codec=None, topology="ring", op="sum", seed=0, counter=0,
                       tile_bytes=DEFAULT_TILE_BYTES, return_reports=False,
                       nonfinite="propagate", layout=None):
    """Run the all-reduce of ``len(xs)`` ranks in this process (rank r passes
    ``xs[r]``; always the compressed path).  Returns the list of every rank's
    output (and reports).  ``layout``: see :func:`default_layout`."""
    codec = _DEFAULT_CODEC if codec is None else codec
    n = len(xs)
    spec = CallSpec(codec, topology, op, seed, counter, "auto", tile_bytes,
                    nonfinite=nonfinite, layout=default_layout(layout))
    results = SimulatedTransport(n).run(
        [rank_program(r, n, xs[r], spec, None, FRESH, return_reports) for r in range(n)])
    outs = [r[0] for r in results]
    return (outs, [r[1] for r in results]) if return_reports else outs
