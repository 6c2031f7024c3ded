"""Public entry points: :func:`allreduce`, :class:`Collective` and
:func:`simulate_allreduce`.  The public face only: how a call runs is
decided by the call planner (call/planner.py) and carried out by the runner
(call/runner.py) on the communicator's runtime (call/runtime.py).  An
adapter also takes :func:`plane_of` (a communicator's control plane),
:func:`default_comm` and :func:`is_torch_group` from here."""
from __future__ import annotations

import threading

from .call.engine import rank_program
from .call.engine_rs import rank_program_rs
from .call.graphs import default_graphs
from .call.hierarchy import default_node_size
from .call.paths import default_path
from .call.phases import CallSpec, check_nonfinite, default_gather, default_layout
from .call.prediction import default_links
from .call.rail_budget import default_rail_budget
from .call.runner import CallRunner
from .call.runtime import Runtime
from .call.workspace import FRESH
from .codecs import DEFAULT_CODEC
from .codecs.base import DEFAULT_TILE_BYTES
from .control import as_plane as plane_of, default_comm, is_torch_group  # noqa: F401
from .settings import check_flag, env_choice, env_text
from .transports import TRANSPORTS
from .transports.simulate import SimulatedTransport


def _check_transport(transport):
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")


class Collective:
    """A communicator's compressed all-reduce.

    ``comm``: an mpi4py communicator, a ``torch.distributed`` process group
    (the torch control plane: torchrun, Lightning, ``mp.spawn``), or None for
    the launcher's default (``control.default_comm``: ``MPI.COMM_WORLD`` in a
    job started by mpiexec, else torch.distributed's default group when it is
    initialised; a job whose launcher says it has several processes but that
    has neither is an error on every rank, never a world of one).
    ``control_plane`` says which ("mpi" or "torch").

    Owns the per-communicator call counter that keys the generator
    (successive calls with the same seed draw fresh randomness) and a call
    runner (call/runner.py) on a runtime (call/runtime.py): a private
    duplicate of ``comm``, reusable workspace, and - created on the first
    call that uses it - one NCCL communicator per lane for device arrays.
    Calls are serialised by a lock, so DDP hooks on other threads may share
    it.  Every rank must make the same sequence of calls.

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
    all-gather (measured slower on two H200s).

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
    ``rail_budget`` (or ``$DYNAMIQ_RAIL_BUDGET``): "joint" (default: one
    DynamiQ bit allocation over all rails of a node, from their statistics
    exchanged inside the node; rails then send unequal bytes) or "even"
    (every rail planned apart); call/rail_budget.py.  "auto" chooses flat
    or nodes per class of calls, measured as ``path`` is, seeded by the cost
    model's prediction (call/prediction.py): the predicted winner is
    measured first, and where ``links`` were given and the loser is
    predicted at least 2x slower, the winner is kept unmeasured.
    ``links`` (or ``$DYNAMIQ_LINKS``): ``"intra=400GB/s,inter=25GB/s,nics=8"``
    or a dict of those keys: one rank's in-node bandwidth, one NIC's, NICs
    per node (default: one per rank); every rank must give the same.

    ``graphs``: replay steady compressed calls over NCCL as CUDA graphs
    (call/graphs.py): a call with ``out=`` whose every argument, buffer and stream
    repeats one made before is captured on its second occurrence and
    replayed from then on, for one digest exchange and a graph launch of host
    time.  On by default; ``graphs=False`` or ``DYNAMIQ_GRAPHS=0`` turns it off.
    :meth:`graph_stats` says what was captured.  ``agree_replays=False``
    skips that digest exchange on a reduce-scatter's replays (the call was
    agreed when it was captured): the exchange is a rendezvous of the ranks'
    host threads, so skipping it lets a rank's host run ahead, as NCCL's own
    calls do.  Only for callers whose every rank makes the same
    reduce-scatters in the same order by construction (FSDP2's): a rank that
    replays a different call, or skips one, then hangs in NCCL or reduces
    with other ranks' random draws instead of raising.
    """

    def __init__(self, comm=None, transport: str = "auto", tile_bytes: int = DEFAULT_TILE_BYTES,
                 lanes: int | str | None = None, path: str | None = None,
                 nonfinite: str = "propagate", graphs: bool | None = None,
                 hierarchy: str | None = None, node_size: int | None = None,
                 rail_budget: str | None = None, links=None, agree_replays: bool = True):
        if comm is None:
            comm = default_comm()
        _check_transport(transport)
        check_nonfinite(nonfinite)
        self.path = default_path(path)
        self.hierarchy = default_hierarchy(hierarchy)
        self.node_size = default_node_size(node_size)
        self.rail_budget = default_rail_budget(rail_budget)
        self.links = default_links(links)
        self.nonfinite = nonfinite
        self.layout = default_layout()
        self.gather = default_gather()
        self.graphs = default_graphs(graphs)
        self.agree_replays = check_flag(agree_replays, "agree_replays")
        self.parent = comm
        self.transport = transport
        self.tile_bytes = int(tile_bytes)
        self.lanes = default_lanes(lanes)
        lane_bytes = env_text("DYNAMIQ_NCCL_LANE_BYTES")
        if lane_bytes is not None and not (lane_bytes.strip().isdigit() and int(lane_bytes) > 0):
            raise ValueError("DYNAMIQ_NCCL_LANE_BYTES must be a positive number of bytes, "
                             f"got {lane_bytes!r}")
        self.lane_bytes = int(lane_bytes) if lane_bytes is not None else None
        self._runtime = Runtime(comm, self.lanes, self.lane_bytes)
        self.control_plane = self._runtime.plane.name
        self.rank, self.size = self._runtime.rank, self._runtime.size
        self._runner = CallRunner(self._runtime, self.layout, self.graphs, self.node_size,
                                  self.rail_budget, self.links, gather=self.gather,
                                  agree_replays=agree_replays)
        self._counter = 0
        self._lock = threading.Lock()

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
        call = {"codec": DEFAULT_CODEC if codec is None else codec, "topology": topology,
                "op": op, "seed": seed, "path": self.path if path is None else default_path(path),
                "transport": self.transport if transport is None else transport,
                "tile_bytes": self.tile_bytes if tile_bytes is None else tile_bytes,
                "nonfinite": self.nonfinite if nonfinite is None else nonfinite}
        hierarchy = self.hierarchy if hierarchy is None else default_hierarchy(hierarchy)
        with self._lock:
            call["counter"] = self._counter
            self._counter += 1
            out, report = self._runner.allreduce(x, out, call, hierarchy, return_report, profile)
        return (out, report) if return_report else out

    def reduce_scatter(self, x, *, codec=None, topology="ring", op="sum", seed=0, out=None,
                       transport=None, tile_bytes=None, return_report=False, profile=False,
                       nonfinite=None, hierarchy=None):
        """Reduce-scatter ``x`` (see :func:`reduce_scatter`); always compressed
        (``path`` does not apply).  Shares the call counter with
        :meth:`allreduce`.  ``hierarchy="nodes"``: hierarchy.py."""
        call = {"codec": DEFAULT_CODEC if codec is None else codec, "topology": topology,
                "op": op, "seed": seed, "transport": self.transport if transport is None
                else transport, "nonfinite": self.nonfinite if nonfinite is None else nonfinite,
                "tile_bytes": self.tile_bytes if tile_bytes is None else tile_bytes}
        hierarchy = self.hierarchy if hierarchy is None else default_hierarchy(hierarchy)
        with self._lock:
            call["counter"] = self._counter
            self._counter += 1
            out, report = self._runner.reduce_scatter(x, out, call, hierarchy, return_report,
                                                      profile)
        return (out, report) if return_report else out

    def path_decisions(self) -> dict:
        """{key: (path, why)} of every path decided: ``path="auto"``'s classes
        (backend, dtype, log2 size, codec, topology, transport, op),
        :meth:`class_choice`'s, and :meth:`step_choice`'s under "step"."""
        return self._runner.planner.path_decisions()

    def class_choice(self):
        """Compressed or native per class of the caller's own timed calls,
        as ``path="auto"`` decides (paths.PathChooser; FSDP's reduce-scatter).
        This and :meth:`step_choice` are made on first use (collective)."""
        return self._runner.planner.class_choice()

    def step_choice(self, options, elapsed, **schedule):
        """One of ``options`` (most exact first) by whole steps the caller
        runs and marks (paths.StepChooser, ``schedule`` its keywords)."""
        return self._runner.planner.step_choice(options, elapsed, **schedule)

    def hierarchy_decisions(self) -> dict:
        """{(backend, dtype, log2 size, codec, topology, transport, op, path):
        (hierarchy, why)} for the classes ``hierarchy="auto"`` has decided."""
        return self._runner.planner.hierarchies.decisions()

    def forget_paths(self):
        """Measure every class of calls again, :meth:`class_choice`'s too
        (all ranks must call it alike); the step choice stands."""
        with self._lock:
            self._runner.forget_paths()

    @property
    def last_bits_per_coord(self):
        """``Report.bits_per_coord`` of this collective's last call, also when
        it returned no report (a replay: its graph's call's); None if unknown."""
        return self._runner.last_bits

    def graph_stats(self) -> dict:
        """{"captured": graphs made, "replays": their launches, "failed": [why, ...]}."""
        with self._lock:
            return self._runner.graph_stats()

    def nodes(self):
        """The node layout the hierarchical call uses (collective on first use)."""
        with self._lock:
            return self._runner.nodes.levels().layout

    def free(self):
        """Release the NCCL communicators and the control plane's duplicate."""
        with self._lock:
            self._runner.free()


def default_hierarchy(value=None) -> str:
    """``value``, else ``$DYNAMIQ_HIERARCHY``, else "flat"."""
    from .call.hierarchy import HIERARCHIES
    return env_choice(value, "DYNAMIQ_HIERARCHY", HIERARCHIES, "hierarchy", default="flat")


def default_lanes(value=None):
    """``value``, else ``$DYNAMIQ_NCCL_LANES``, else "auto": NCCL lanes a
    call may use, a positive integer or "auto"."""
    if value is None:
        value = env_text("DYNAMIQ_NCCL_LANES", "auto")
    if value == "auto":
        return value
    try:
        lanes = int(value) if not isinstance(value, (bool, float)) else 0
    except (TypeError, ValueError):
        lanes = 0
    if lanes < 1:
        raise ValueError(f"lanes must be a positive integer or 'auto', got {value!r}")
    return lanes


def _check_graphs(value) -> bool:
    return check_flag(value, "graphs")


# The options a Collective takes from its maker beyond the control plane and
# the transport, and the check of each (also its reading of DYNAMIQ_*).
_OPTION_CHECKS = {"hierarchy": default_hierarchy, "node_size": default_node_size,
                  "links": default_links, "rail_budget": default_rail_budget,
                  "graphs": _check_graphs, "lanes": default_lanes}
COLLECTIVE_OPTIONS = tuple(_OPTION_CHECKS)


def check_collective_options(**options) -> None:
    """Check the given (not None) :data:`COLLECTIVE_OPTIONS` as
    :class:`Collective` checks them, before anything is set up: a state that
    makes its collective later (the torch adapter's) raises where it is made,
    not in the first backward pass."""
    unknown = sorted(set(options) - set(_OPTION_CHECKS))
    if unknown:
        raise TypeError(f"not an option of Collective: {', '.join(unknown)}")
    for name, value in options.items():
        if value is not None:
            _OPTION_CHECKS[name](value)


_collectives = {}
_collectives_lock = threading.Lock()


def collective_for(comm=None) -> Collective:
    """The library's cached :class:`Collective` of ``comm`` (an mpi4py
    communicator or a torch.distributed group; None: the launcher's default,
    see :class:`Collective`)."""
    if comm is None:
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
    ``hierarchy``: "flat" (default), "nodes" or "auto" (see :class:`Collective`).
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
                       nonfinite="propagate", layout=None, gather=None):
    """Run the all-reduce of ``len(xs)`` ranks in this process (rank r passes
    ``xs[r]``; always the compressed path).  Returns the list of every rank's
    output (and reports).  ``layout``: see :func:`default_layout`;
    ``gather``: :func:`default_gather`."""
    spec = CallSpec(DEFAULT_CODEC if codec is None else codec, topology, op, seed, counter,
                    "auto", tile_bytes, nonfinite=nonfinite, layout=default_layout(layout),
                    gather=default_gather(gather))
    return _simulate([rank_program(r, len(xs), xs[r], spec, None, FRESH, return_reports)
                      for r in range(len(xs))], return_reports)


def simulate_reduce_scatter(xs, *, codec=None, topology="ring", op="sum", seed=0, counter=0,
                            tile_bytes=None, return_reports=False, nonfinite="propagate",
                            budget="per-chunk", layout=None):
    """Run the reduce-scatter of ``len(xs)`` ranks in this process (rank r
    passes ``xs[r]``).  Returns every rank's chunk (and reports).
    ``layout``: see :func:`default_layout`."""
    spec = CallSpec(DEFAULT_CODEC if codec is None else codec, topology, op, seed, counter,
                    "auto", DEFAULT_TILE_BYTES if tile_bytes is None else tile_bytes,
                    nonfinite=nonfinite, layout=default_layout(layout))
    return _simulate([rank_program_rs(r, len(xs), xs[r], spec, None, FRESH, return_reports,
                                      budget) for r in range(len(xs))], return_reports)


def _simulate(programs, return_reports):
    """Every rank's program driven in this process: the outputs (and reports)."""
    results = SimulatedTransport(len(programs)).run(programs)
    outs = [r[0] for r in results]
    return (outs, [r[1] for r in results]) if return_reports else outs
