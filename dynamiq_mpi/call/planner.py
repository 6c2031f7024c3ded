"""One call planner: every decision about how a call runs, in one place
(docs/design.md, "The path of a call").

A call's signature (its arguments, buffers and stream, less the counter)
resolves to a :class:`Plan`:

* ``hierarchy``: "flat" or "nodes" ("auto": measured per class of calls,
  agreed by all ranks, seeded by the cost model: prediction.py);
* ``route``: "levels" (hierarchy.py), "steady" (a native call agreed
  before: native.py), "graph" (a steady compressed call replayed as a CUDA
  graph: graphs.py) or "engine";
* ``path`` for the engine: "compressed" or "native" (measured per class),
  its reason and whether this call is timed;
* the choices a caller times itself: per class (``class_choice``) and by
  whole steps (``step_choice``);
* the transport, once the ranks agreed, and the path the engine runs on it
  (:meth:`CallPlanner.route`, :func:`resolve_path`).

Steady signatures keep their plan (a steady native plan, or a graph plan),
and the next call of that signature resolves to it without the path choice
or the engine.  The runner (runner.py) carries plans out.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..codecs.base import signature_of
from ..control import as_plane
from ..errors import InvalidInputError
from ..transports import choose_transport, explain_transport, native_wires
from ..transports.ops import Routed, compressed_route
from . import native, prediction
from .graphs import SteadyCompressed, call_graph_key
from .paths import PathChooser, StepChooser, size_class, warmup_calls
from .wire import wire_dtype

# Steady plans kept per kind before the oldest are dropped (a job has a few
# bucket sizes; a leak of signatures must not grow without bound).
MAX_STEADY = 64


def resolve_path(transport: str, request) -> Routed:
    """The answer to a program's ``Route`` (``request``) once ``transport``
    carries its data: the native path asked for where ``transport`` has an
    all-reduce of its own for the call's arrays, summing in the wire dtype
    of the codec and input dtype (``native_wires``, ``wire.wire_dtype``);
    else the compressed program, saying why where native was asked for.
    From agreed facts only, so every rank resolves alike."""
    wires = native_wires(transport, request.backend) if request.path == "native" else ()
    if not wires:
        return compressed_route(request, transport)
    return Routed(transport, "native", wire_dtype(request.codec, request.dtype, wires))


@dataclass
class Plan:
    hierarchy: str = "flat"
    route: str = "engine"           # "levels" | "steady" | "graph" | "engine"
    path: str = "compressed"        # the engine's path
    why: str = ""                   # why that path
    timed: bool = False             # the path choice times this call
    key: tuple | None = None        # the path choice's class of calls
    hierarchy_why: str = ""
    hierarchy_key: tuple | None = None
    hierarchy_timed: bool = False   # the hierarchy choice times this call
    steady: object = None           # SteadyNative (route "steady"), SteadyCompressed ("graph")
    steady_key: tuple | None = None  # remember a native engine call under this key
    graph_key: tuple | None = None   # remember a compressed engine call as a graph
    collective: str = "allreduce"   # or "reduce_scatter"


class CallPlanner:
    """Resolves calls to plans; keeps the path and hierarchy choices and the
    plans of steady signatures (per call runner).  ``graphs``: whether steady
    compressed calls become graphs; ``links`` seed the hierarchy's
    prediction; ``auto_layout()``: the (nodes, node size) hierarchy="auto"
    may use, or None (hierarchy.NodeCalls); ``comm``: the communicator."""

    def __init__(self, plane, size: int, graphs: bool = False, links=None, auto_layout=None,
                 comm=None, gather="ring"):
        self.plane, self.size, self.use_graphs, self.links = plane, size, graphs, links
        self.gather = gather        # the calls' all-gather, for the hierarchy's prediction
        self.comm = comm
        self.gpu_sharing = {}       # device -> which ranks share a GPU ('' : none), asked once
        self.auto_layout = auto_layout
        # a device class over NCCL may replay its compressed calls (key: _choose_path)
        self.paths = PathChooser(plane, warmup_of=lambda key: warmup_calls(
            graphs and key[0] == "gpu" and key[5] in ("auto", "nccl")))
        self.hierarchies = PathChooser(plane, options=("nodes", "flat"))
        self.measured = None        # PathChooser of the classes a caller times (class_choice)
        self.steps = None           # StepChooser of whole training steps (step_choice)
        self.steady = {}            # native.SteadyNative by native.steady_key
        self.graphs = {}            # graphs.SteadyCompressed by graphs.graph_key

    # -- resolving
    def plan_allreduce(self, x, out, call, hierarchy, want_report, profile) -> Plan:
        """The plan of an all-reduce (``call``: the normalised arguments).
        May set ``call["path"]`` to "compressed" while a hierarchy is timed."""
        plan = None     # (made where needed: a steady call's is its SteadyNative's)
        if hierarchy == "auto":
            plan = Plan()
            (hierarchy, plan.hierarchy_key, plan.hierarchy_why,
             plan.hierarchy_timed) = self._choose_hierarchy(x, call)
            plan.hierarchy = hierarchy
        if hierarchy == "nodes" and self.size > 1:
            plan = plan or Plan(hierarchy="nodes")
            plan.route = "levels"
            return plan
        return self._plan_flat(x, out, call, want_report or (plan is not None and
                               plan.hierarchy_timed), profile, plan)

    def plan_reduce_scatter(self, x, out, call, hierarchy, want_report, profile) -> Plan:
        """The plan of a reduce-scatter: always compressed, on the levels
        ("nodes"; "auto" is flat: it measures all-reduces only), a staged
        graph (a steady quiet call on device arrays) or the engine."""
        if hierarchy == "nodes" and self.size > 1:
            return Plan(hierarchy="nodes", route="levels")
        plan = Plan(collective="reduce_scatter")
        if not (want_report or profile):
            self._find_graph(plan, x, out, call)
        return plan

    def _find_graph(self, plan, x, out, call) -> bool:
        """For a quiet call on device arrays with ``out``: its graph key in
        ``plan`` (remembered after an engine run) and, when a usable graph
        plan exists, the graph route.  True when routed to it."""
        if not (self.use_graphs and out is not None
                and type(x).__module__.startswith("cupy")):   # graphs replay device work only
            return False
        plan.graph_key = call_graph_key(x, out, call, plan.collective)
        entry = self.graphs.get(plan.graph_key) if plan.graph_key is not None else None
        if entry is None or (entry.failed and not entry.trusted):
            return False                # (a trusted one stays: its peers replay theirs)
        plan.route, plan.steady = "graph", entry
        return True

    def _plan_flat(self, x, out, call, want_report, profile, plan):
        requested = call["path"]
        quiet = not (want_report or profile)
        steady_key = None
        if requested != "compressed" and quiet:
            # a call like one agreed before on the native path: no engine
            try:
                steady = self.steady.get(steady_key := native.steady_key(x, out, call))
            except Exception:   # not an array, unhashable arguments: the engine
                steady_key = steady = None      # reports them to every rank
            if steady is not None:
                return steady.plan
        plan, chosen = plan or Plan(), None    # (its hierarchy: flat, unless "auto" chose)
        if requested != "native" and quiet and self._find_graph(plan, x, out, call):
            if plan.steady.measuring is None:
                return plan
            # a graph made while its class measures: the class's compressed
            # calls are timed as replays, as they run once decided
            _, path, _, timed = chosen = self._choose_path(x, call)
            if path == "compressed":
                plan.key, plan.path, plan.why, plan.timed = chosen
                if not timed:
                    plan.steady.measuring = None
                return plan
        plan.route, plan.steady = "engine", None
        plan.key, plan.path, plan.why, plan.timed = chosen or self._choose_path(x, call)
        if plan.path == "native" and not plan.timed and call["nonfinite"] != "raise":
            plan.steady_key = steady_key      # (a steady native call checks no NaN)
        return plan

    def _choose_path(self, x, call):
        """(class key, path, why, timed) of a flat call, from local facts
        only (every rank has the same ones when the call is valid; an invalid
        one fails agreement on every rank whatever the path)."""
        requested, transport, codec = call["path"], call["transport"], call["codec"]
        if requested != "auto" or self.size == 1:
            return None, requested if self.size > 1 else "compressed", "requested", False
        module = type(x).__module__
        on_device = module.startswith("cupy")
        if on_device:
            from ..transports.nccl import nccl_status
            can_native = transport in ("auto", "nccl") and nccl_status()[0]
        else:
            can_native = transport in ("auto", "mpi") and module.startswith("numpy")
        key = ("gpu" if on_device else "cpu", str(getattr(x, "dtype", None)),
               size_class(getattr(x, "size", 0)), signature_of(codec), call["topology"],
               transport, call["op"])
        if not getattr(codec, "auto_path", False):
            return key, "compressed", (f"codec {getattr(codec, 'name', '')} runs compressed "
                                       "unless path='native'"), False
        if not can_native:
            return key, "compressed", "no native all-reduce for these arrays and transport", False
        if on_device and getattr(codec.for_length(int(x.size)), "name", None) == "bf16" \
                and codec.native_wire == "bfloat16":   # (its own BF16 all-reduce: the same bytes)
            return (key, "native", "auto: the codec sends BF16; NCCL's BF16 all-reduce "
                    "sends the same bytes faster", False)
        return (key, *self.paths.choose(key))

    def _choose_hierarchy(self, x, call):
        """(hierarchy, class key, why, timed) of a call with hierarchy="auto":
        flat or nodes per class of calls, measured as the path choice
        measures, agreed by all ranks; both run compressed while measured.
        The cost model's prediction (prediction.py) orders the measurement,
        or decides the class without it where decisive on given links."""
        layout = self.auto_layout() if self.auto_layout is not None else None
        if layout is None:
            return "flat", None, "auto: one node, nodes of one rank, or unequal nodes", False
        on_device = type(x).__module__.startswith("cupy")
        key = ("gpu" if on_device else "cpu", str(getattr(x, "dtype", None)),
               size_class(getattr(x, "size", 0)), signature_of(call["codec"]),
               call["topology"], call["transport"], call["op"], call["path"])

        def predict():      # the class's first call: from agreed inputs and the class only
            if call["path"] == "native":
                return None     # the model predicts the compressed calls
            try:
                return prediction.predict_hierarchies(
                    layout[0], layout[1], 1 << key[2], np.dtype(x.dtype).itemsize,
                    call["codec"], call["topology"], self.links, on_device, self.gather)
            except Exception:   # not an array, a codec or topology the model does not know:
                return None     # measured (an invalid call fails agreement on every rank)

        choice, why, timed = self.hierarchies.choose(key, predict)
        if timed and call["path"] == "auto":
            call["path"] = "compressed"
        return choice, key, why, timed

    def transport(self, requested, metas, x, explain=False) -> tuple:
        """(transport, why) that carries a call's data, from every rank's
        agreement record (``transports.choose_transport``; raises on every
        rank when the one asked for cannot run); device arrays are staged
        through host memory where ranks share a GPU, which NCCL refuses
        (asked for by name: every rank raises).  ``why`` only when asked."""
        name = choose_transport(requested, metas)
        if name == "nccl":
            device = x.device.id
            shared = self.gpu_sharing.get(device)
            if shared is None:      # collective: every rank's first NCCL call of a device
                from ..transports.nccl import ranks_sharing_a_gpu
                shared = self.gpu_sharing[device] = ranks_sharing_a_gpu(self.plane, device)
            if shared:              # the same answer on every rank: all raise or all stage
                if requested == "nccl":
                    raise InvalidInputError(f"transport='nccl' is not usable: NCCL needs one GPU "
                                            f"per rank ({shared}); use transport='mpi' or 'auto'")
                return "mpi", (f"auto: NCCL needs one GPU per rank ({shared}): device buffers "
                               "staged through host memory")
        return name, explain_transport(requested, metas)[1] if explain else ""

    def route(self, request, metas, x, explain=False) -> tuple:
        """(Routed, why): the answer to a program's ``Route`` (``request``)
        from every rank's agreement record: the transport (:meth:`transport`)
        and the path the program runs on it (:func:`resolve_path`)."""
        name, why = self.transport(request.transport, metas, x, explain)
        return resolve_path(name, request), why

    # -- choices a caller times itself, each agreed over a private duplicate
    # of the comm, never the calls' plane (the DDP hook's worker calls meanwhile)
    def class_choice(self) -> PathChooser:
        if self.measured is None:
            self.measured = PathChooser(as_plane(self.comm).dup(),
                                        warmup=warmup_calls(self.use_graphs))
        return self.measured

    def step_choice(self, options, elapsed, **schedule) -> StepChooser:
        if self.steps is None:      # (one a planner: later calls get it as it is)
            plane = as_plane(self.comm).dup()
            plane.barrier()         # made now, on every rank, not inside a decision
            self.steps = StepChooser(plane, options, elapsed, **schedule)
        return self.steps

    def free_choices(self):
        """Free the choosers' duplicated planes (collective, as Collective.free)."""
        for chooser in filter(None, (self.measured, self.steps)):
            chooser.plane.free()
        self.measured = self.steps = None

    def path_decisions(self) -> dict:
        out = self.paths.decisions()
        for chooser in filter(None, (self.measured, self.steps)):
            out.update(chooser.decisions())
        return out

    # -- learning from a call that ran
    def record_path(self, plan, seconds, report):
        """A timed engine call's seconds, counted whether or not it met NaN
        (a replay knows no report: every rank counts alike)."""
        if plan.timed:
            self._record_path(plan, seconds, report.path, report.path_reason)

    def record_replay(self, plan, seconds):
        """A timed graph replay's seconds (compressed)."""
        self._record_path(plan, seconds, plan.path, "")

    def _record_path(self, plan, seconds, ran, why):
        self.paths.record(plan.key, plan.path, seconds, ran, why)
        if self.paths.choice_of(plan.key) == "native":   # its graphs are not needed
            self.free_graphs(lambda entry: entry.measuring == plan.key)

    def record_hierarchy(self, plan, seconds, report):
        if plan.hierarchy_timed and not report.nonfinite:
            self.hierarchies.record(plan.hierarchy_key, plan.hierarchy, seconds, plan.hierarchy)

    def remember(self, plan, report, meta, codec, backend):
        """Keep the plan of an engine call whose signature may repeat: a
        native call as a steady plan, a sync-free compressed call over NCCL
        as a graph plan (captured on its next occurrence).  ``meta``: this
        rank's agreement record of the call."""
        if meta is None:
            return
        if plan.steady_key is not None and report.path == "native":
            if len(self.steady) > MAX_STEADY:
                self.steady.clear()
            steady = self.steady[plan.steady_key] = native.SteadyNative(
                meta, codec, report.transport, report.codec_info["wire"], backend, self.plane)
            steady.bits = report.bits_per_coord
            steady.plan = Plan(route="steady", path="native", steady=steady)
        if (plan.graph_key is not None and report.path == "compressed"
                and report.sync_free and report.transport == "nccl"
                and plan.graph_key not in self.graphs):
            if len(self.graphs) >= MAX_STEADY:
                self.free_graphs()
            entry = self.graphs[plan.graph_key] = SteadyCompressed(meta, "nccl", plan.collective)
            entry.measuring = plan.key if plan.timed else None
            entry.bits = report.bits_per_coord

    def forget_paths(self):
        for chooser in filter(None, (self.paths, self.measured)):   # the step choice stands
            chooser.forget()
        self.steady.clear()         # their path came from the choices just forgotten
        self.free_graphs()

    def free_graphs(self, which=lambda entry: True):
        for key in [k for k, e in self.graphs.items() if which(e)]:
            entry = self.graphs.pop(key)
            if entry.graph is not None:
                entry.graph.free()

