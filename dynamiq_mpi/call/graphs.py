"""Steady compressed calls replayed as one CUDA graph (docs/design.md,
"Sync-free calls: the fixed layout and CUDA graphs").

A compressed call on device arrays in the fixed layout makes no host read
(``Report.sync_free``).  Such a call, repeated with the same arguments, is
captured once into a CUDA graph and replayed:

* :class:`CallGraph`: a memory pool and workspace of its own (nothing else
  reuses what the graph touches), the device copy of the generator keys the
  encoders read (written before each replay: each replay draws its own
  counter's randomness), and two instances that alternate (relaunching one
  still running would block the host).
* :class:`SteadyCompressed`: one steady call of a Collective: its agreed
  record (each replay costs one 8-byte digest exchange; a rank whose call
  differs makes every rank raise; a Collective made with
  ``agree_replays=False`` replays a reduce-scatter on its capture's
  agreement alone, and where that graph failed on one rank, runs it there
  eagerly without a digest, as its peers replay) and its graph once
  captured.

An all-reduce's graph reads and writes the caller's buffers (the DDP hook's
persist); a reduce-scatter's is *staged*: it copies the input in and the
output out around each replay (FSDP2 hands fresh buffers every step).  A
rank whose capture or launch fails after the digest exchange runs that call
on the engine, which sends the same messages in the same order, and never
tries its graph again.  Graphs are on by default (``graphs=False`` or
``DYNAMIQ_GRAPHS=0`` turns them off).
"""
from __future__ import annotations

import gc
import time
import weakref

from ..codecs.base import signature_of
from ..errors import InvalidInputError
from ..rng import call_keys
from ..settings import env_switch
from ..control.agreement import Digests, digest_with_counter, record_digest
from ..transports.ops import Agree, Route, Routed
from .workspace import Workspace

_RELAXED = 2        # cudaStreamCaptureModeRelaxed: the pool may grow during a capture


class CallGraph:
    """A call's device work, captured once on a stream and replayed."""

    def __init__(self, blocks: int = 1):
        """``blocks``: the generator streams the call keys (a reduce-scatter:
        one a block, each key pair 8 bytes after the last)."""
        import cupy
        from .. import _gpu
        self._cupy, self._gpu = cupy, _gpu
        self.pool = cupy.cuda.MemoryPool()
        self.workspace = Workspace()
        with cupy.cuda.using_allocator(self.pool.malloc):
            self.keys = cupy.zeros(2 * blocks, dtype=cupy.uint32)
        self._handles = _GraphHandles(cupy.cuda.runtime.getDevice())
        # A graph left to the garbage collector (its Collective never freed)
        # or alive at exit is destroyed before any communicator can be:
        # ncclCommDestroy waits until every graph holding the communicator is
        # gone, so a leaked handle hangs whoever drops the communicator.
        # (weakref callbacks run before the collector clears a cycle, and
        # at exit before the modules are torn down.)
        weakref.finalize(self, self._handles.destroy, cupy.cuda.runtime)
        # What the captured messages go through (its NCCL communicators): held
        # as long as the graph, so that no communicator it captured can be
        # dropped before it (the finalizer runs before this reference goes).
        self.holds = None
        self.staged = None          # (input, output) of a staged graph
        self._turn = 0
        self.replays = 0

    @property
    def keys_at(self) -> int:
        """The device address of the keys (CallSpec.keys_at)."""
        return int(self.keys.data.ptr)

    def capture(self, body, stream):
        """Capture ``body()`` (which enqueues the call on ``stream``, the
        current stream) without running it; returns body's result.  Raises
        what the capture raised (the stream is then out of capture).
        :meth:`launch` runs it."""
        rt = self._cupy.cuda.runtime
        # No garbage collection inside the capture (on any thread): a
        # collected Collective would free device memory and destroy graphs
        # and communicators there.  (No collection before it either: a DDP
        # step captures one call per bucket.)
        collecting = gc.isenabled()
        gc.disable()
        try:
            rt.streamBeginCapture(stream.ptr, _RELAXED)
            try:
                with self._cupy.cuda.using_allocator(self.pool.malloc):
                    result = body()
            except BaseException:
                try:
                    rt.graphDestroy(rt.streamEndCapture(stream.ptr))
                except Exception:   # an invalidated capture: ended with an error
                    pass
                raise
            self._handles.graph = rt.streamEndCapture(stream.ptr)   # raises if a host wait invalidated it
        finally:
            if collecting:
                gc.enable()
        for _ in range(2):
            self._handles.execs.append(rt.graphInstantiate(self._handles.graph))
        return result

    def stage(self, x, out):
        """Buffers of the graph's own, shaped as ``x`` and ``out``, that a
        staged graph reads and writes."""
        with self._cupy.cuda.using_allocator(self.pool.malloc):
            self.staged = (self._cupy.empty_like(x), self._cupy.empty_like(out))
        return self.staged

    def launch(self, keys, stream, x=None, out=None):
        """Replay with the generator keys of this call (rng.CallKeys, or a
        list of them: one a block); a staged graph takes ``x`` in and gives
        ``out`` back, on ``stream``."""
        cupy = self._cupy
        if self.staged is not None:
            with stream:
                cupy.copyto(self.staged[0], x)
        for b, k in enumerate(keys if isinstance(keys, list) else [keys]):
            self._gpu.set_keys(self.keys[2 * b:2 * b + 2], k.value, k.perm, stream)
        cupy.cuda.runtime.graphLaunch(self._handles.execs[self._turn], stream.ptr)
        if self.staged is not None:
            with stream:
                cupy.copyto(out, self.staged[1])
        self._turn ^= 1
        self.replays += 1

    def free(self):
        self._handles.destroy(self._cupy.cuda.runtime)
        self.workspace.clear()
        self.staged = None


class _GraphHandles:
    """The CUDA handles of one captured call (apart from the CallGraph, so
    that its finalizer holds no reference to it)."""

    __slots__ = ("device", "graph", "execs")

    def __init__(self, device: int):
        self.device, self.graph, self.execs = device, 0, []

    def destroy(self, runtime):
        """Destroy the executables, then the graph (an executable still
        running is freed when it completes); idempotent."""
        execs, graph, self.execs, self.graph = self.execs, self.graph, [], 0
        if not execs and not graph:
            return
        previous = runtime.getDevice()
        if previous != self.device:      # (a thread of no device gets none made current)
            runtime.setDevice(self.device)
        try:
            for e in execs:
                runtime.graphExecDestroy(e)
            if graph:
                runtime.graphDestroy(graph)
        finally:
            if previous != self.device:
                runtime.setDevice(previous)


def graph_key(x, out, codec_signature, topology, op, seed, transport, tile_bytes, nonfinite,
              path, stream_ptr, collective="allreduce"):
    """What must equal for a call to replay another's graph: everything the
    engine's agreement covers but the counter, from local facts, plus the
    stream it runs on and (unless staged: the reduce-scatter's) the
    addresses the graph reads and writes."""
    staged = collective == "reduce_scatter"
    return (collective, x.shape, x.dtype, x.flags.c_contiguous, x.device.id,
            None if staged else int(x.data.ptr), out.shape, out.dtype,
            None if staged else int(out.data.ptr), codec_signature, topology, op, int(seed),
            transport, tile_bytes, nonfinite, path, stream_ptr)


class SteadyCompressed:
    """One steady compressed call of a Collective (see the module's doc):
    seen once (``graph`` None), then captured, then replayed."""

    __slots__ = ("record", "static", "transport", "collective", "graph", "failed", "measuring",
                 "bits", "trusted", "_digests")

    def __init__(self, record: dict, transport: str, collective: str = "allreduce"):
        self.record = {k: v for k, v in record.items() if k != "counter"}
        self.static = record_digest(self.record)
        self.transport = transport
        self.collective = collective    # "allreduce", or "reduce_scatter" (staged)
        self.graph = None           # CallGraph once captured
        self.failed = ""            # why this call cannot be a graph ('' : it can)
        self.measuring = None       # the path choice's class key while it measures
        self.bits = None            # Report.bits_per_coord of the call (every replay's)
        self.trusted = False        # replays (and, once failed, eager runs) exchange no digest
        self._digests = None

    def agree(self, comm, counter) -> bool:
        """One 8-byte digest exchange: True when every rank makes this call."""
        if self._digests is None:
            self._digests = Digests(comm)
        return self._digests.match(digest_with_counter(self.static, counter))

    def metas(self, counter, size):
        """The agreement's answer for this call (every rank's record alike)."""
        return [dict(self.record, counter=counter)] * size


def default_graphs(value=None) -> bool:
    """``value``, else on unless ``$DYNAMIQ_GRAPHS`` says no ("0", "false",
    "off", "no"): steady compressed calls over NCCL replayed as CUDA graphs."""
    return bool(value) if value is not None else env_switch("DYNAMIQ_GRAPHS")


def drive_agreed(program, metas, data, capturing=True):
    """Run a rank program whose agreement is known (``metas``) on ``data``:
    the body of a graph capture (no MPI, no host wait), or (``capturing``
    False) the same call run eagerly after a failed capture, whose digests
    the ranks have already exchanged.  Returns its report."""
    request = program.send(None)
    while True:
        if isinstance(request, Agree):
            answer = metas
        elif isinstance(request, Route):
            answer = Routed(data.name)      # a graph's call is planned compressed
        else:
            answer = data.answer(request)
        try:
            request = program.send(answer)
        except StopIteration as done:
            data.join(fresh=capturing)      # every forked lane joins (the capture)
            report = done.value[1]
            if capturing and not report.sync_free:
                raise RuntimeError("the call read device data on the host")
            return report


def call_graph_key(x, out, call, collective="allreduce"):
    """The graph key of a call (``call``: its normalised arguments) on device
    arrays, or None (anything else, or arguments the engine will refuse: it
    reports them to every rank)."""
    if not type(x).__module__.startswith("cupy") or type(out) is not type(x):
        return None
    try:
        import cupy
        return graph_key(x, out, signature_of(call["codec"]), call["topology"], call["op"],
                         call["seed"], call["transport"], call["tile_bytes"], call["nonfinite"],
                         call.get("path", "compressed"), cupy.cuda.get_current_stream().ptr,
                         collective)
    except Exception:
        return None


class GraphCalls:
    """The graph route of a call runner: a steady compressed call replayed
    (or captured) on its runtime (runtime.py)."""

    def __init__(self, runtime, settings, agree_replays=True):
        self.runtime, self.settings = runtime, settings     # CallSpec's layout, decode_into
        self.agree_replays = agree_replays  # False: a replay trusts its capture's agreement

    def run(self, entry, x, out, call):
        """Replay (or capture, on its second occurrence) a steady compressed
        call (a failed capture runs it on the engine: the same messages in
        the same order, so peers replaying their graphs still match).
        Returns the seconds the capture took (0.0 for a replay): a timed call
        counts its replay alone."""
        rt = self.runtime
        captured = 0.0
        counter = call["counter"]
        # agree_replays=False: a staged reduce-scatter (its key names no
        # buffer, so every rank making the same calls replays alike) is agreed
        # when captured only; where its graph failed on this rank it runs
        # eagerly without a digest, message for message its peers' replays.
        entry.trusted = not self.agree_replays and entry.collective == "reduce_scatter"
        agree = not entry.trusted or (entry.graph is None and not entry.failed)
        if agree and not entry.agree(rt.plane, counter):
            from .phases import check_agreement      # every rank raises, as on the engine's path
            check_agreement(rt.plane.allgather(dict(entry.record, counter=counter)))
            raise InvalidInputError("ranks disagree on the call")
        stream = rt.fence_stream()
        keys = call_keys(int(call["seed"]), counter)
        if entry.collective == "reduce_scatter":
            from .engine_rs import block_keys
            keys = [block_keys(keys, b) for b in range(rt.size)]

        from .engine import rank_program      # (the engine imports what this imports)
        from .engine_rs import rank_program_rs
        from .phases import CallSpec
        make = rank_program_rs if entry.collective == "reduce_scatter" else rank_program

        def program(keys_at, workspace, src=x, dst=out):   # (a replay needs none)
            spec = CallSpec(call["codec"], call["topology"], call["op"], call["seed"], counter,
                            call["transport"], call["tile_bytes"], path="compressed",
                            nonfinite=call["nonfinite"], keys_at=keys_at, **self.settings)
            return (make(rt.rank, rt.size, src, spec, dst, workspace, detailed_report=False),
                    entry.metas(counter, rt.size), rt.route(entry.transport, x))
        try:
            if entry.failed:        # (trusted) this rank's graph failed; its peers replay
                drive_agreed(*program(0, rt.workspace), capturing=False)
                return captured
            try:
                if entry.graph is None:
                    t0 = time.perf_counter()        # (a capture runs nothing on the device)
                    graph = CallGraph(len(keys) if isinstance(keys, list) else 1)
                    try:
                        staged = (graph.stage(x, out) if entry.collective == "reduce_scatter"
                                  else (x, out))
                        run = program(graph.keys_at, graph.workspace, *staged)
                        graph.holds = run[2]
                        on = rt.capture_stream(stream)
                        with on:                # the body enqueues on the current stream
                            graph.capture(lambda: drive_agreed(*run), on)
                    except BaseException:
                        graph.free()
                        raise
                    entry.graph = graph
                    captured = time.perf_counter() - t0
                entry.graph.launch(keys, stream, x, out)
            except Exception as exc:
                # Whatever failed after the agreement failed on this rank alone
                # (a capture that met a host read, an allocation, a launch):
                # run the agreed call on the engine with no second agreement,
                # so that peers replaying their graphs meet the same messages
                # in the same order, and never try a graph for it again.
                entry.failed = f"graph failed: {type(exc).__name__}: {exc}"
                if entry.graph is not None:
                    entry.graph.free()
                    entry.graph = None
                drive_agreed(*program(0, rt.workspace), capturing=False)
        finally:
            rt.record_stream(stream)
        return captured


def graph_stats(entries) -> dict:
    """{"captured": graphs made, "replays": their launches, "failed": [why, ...]}
    of the steady compressed calls ``entries``."""
    graphs = [e for e in entries if e.graph is not None]
    return {"captured": len(graphs), "replays": sum(e.graph.replays for e in graphs),
            "failed": [e.failed for e in entries if e.failed]}
