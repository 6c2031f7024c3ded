"""PyTorch adapter: a DDP communication hook and a gradient all-reduce for
hand-written training loops, both running :class:`dynamiq_mpi.Collective`.

    import dynamiq_mpi as dq
    import dynamiq_mpi.torch as dqt

    torch.distributed.init_process_group("nccl")   # torchrun, Lightning, mp.spawn ...
    # (under mpiexec: dqt.init_process_group_from_mpi())
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[...])
    state = dqt.HookState(codec=dq.DynamiQ(bits=5))
    dqt.register_comm_hook(ddp, state)      # over ddp.process_group

    # or, without DDP, after loss.backward():
    dqt.allreduce_gradients(model.parameters(), state)

CPU tensors reach the collective as NumPy views and CUDA tensors as CuPy views,
both zero-copy; the result is written back into the same memory.
CUDA work runs on torch's current stream, so no device synchronisation is
added.  torch is imported only by this module: ``import dynamiq_mpi`` never
imports it.
"""
import threading
import time

import torch

from .. import (COLLECTIVE_OPTIONS, Collective, DynamiQ, Exact, InputMismatchError,
               check_collective_options, default_comm, is_torch_group, plane_of)
from ..settings import env_choice
from .arrays import stream_view, tensor_as_array, torch_stream
from .ddp_buckets import DEFAULT_FUSE_MB, HOOK_PATHS, STEP_ROUNDS, BucketRouter, auto_steps
from .groups import _adopt_group, _native_group, init_process_group_from_mpi  # noqa: F401 (re-exported)
from .hook_gate import leaves_ddp_alone

__all__ = ["HookState", "ddp_comm_hook", "register_comm_hook", "allreduce_gradients",
           "init_process_group_from_mpi", "tensor_as_array", "ReduceScatter"]

DEFAULT_BUCKET_CAP_MB = 25.0   # DDP's default bucket size


# --------------------------------------------------------------------- state
class HookState:
    """What the hook and :func:`allreduce_gradients` need between calls
    (docs/reference.md lists every option and attribute).

    Holds the codec, seed, topology, transport, the communicator and its
    :class:`~dynamiq_mpi.Collective` (made on first use), whose call counter
    keys the generator: every rank makes the same calls, so the counters
    agree; nothing is keyed on DDP's bucket index, so DDP's bucket rebuild
    changes nothing.  The communicator: ``process_group=`` (a
    torch.distributed group) or ``comm=`` (that, or an mpi4py communicator);
    given neither, the launcher's default, decided on first use (a job of
    several processes with none raises on every rank).
    :func:`register_comm_hook` takes a subgroup from ``ddp.process_group``.

    Pickling keeps the configuration and the counters, never the
    communicator: the new collective continues from the saved counter.
    With ``reports``, ``last_report`` is the last call's Report (on the GPU
    a report costs a device-to-host copy per call, and such calls run
    eagerly); :meth:`pop_stats` returns and resets the totals;
    ``measure_error = True`` also reduces each bucket exactly (float64, untimed)
    for ``pop_stats()["vnmse"]``.

    ``path`` (DDP hook): "auto" (default) chooses by whole training steps
    among "plain" (the group's all-reduce, as DDP without a hook), "native"
    (BF16 on the wire, as ``bf16_compress_hook``) and "compressed"
    (ddp_buckets.py); ``path_decisions()`` gives the choice and the times.
    ``fuse_mb`` (256): compressed buckets reduced in one call once they hold
    this many MiB (0: each alone); ``auto_rounds``: the A/B rounds of "auto".
    ``hierarchy``, ``node_size``, ``links``, ``rail_budget``, ``graphs``,
    ``lanes``: the collective's options (None: its default), checked here and
    pickled.  ``overlap`` (default: for CUDA buckets): compressed calls run on
    a worker thread and the hook returns at once (overlap.py); the order and
    bits are the same either way.
    """

    agree_replays = True        # the DDP hook's calls: every graph replay agreed too
    _PICKLED = ("codec", "seed", "transport", "topology", "iteration", "measure_error",
                "reports", "timing", "path", "nonfinite", "overlap", "fuse_mb", "auto_rounds",
                *COLLECTIVE_OPTIONS)

    def __init__(self, codec=None, comm=None, seed: int = 0, transport: str = "auto", *,
                 topology: str = "ring", reports: bool = True, timing: bool = False,
                 path: str | None = None, nonfinite: str = "propagate",
                 overlap: bool | None = None, process_group=None,
                 fuse_mb: float = DEFAULT_FUSE_MB, auto_rounds: int = STEP_ROUNDS,
                 hierarchy: str | None = None, node_size: int | None = None, links=None,
                 rail_budget: str | None = None, graphs: bool | None = None,
                 lanes: int | str | None = None):
        given = dict(hierarchy=hierarchy, node_size=node_size, links=links,
                     rail_budget=rail_budget, graphs=graphs, lanes=lanes)
        check_collective_options(**given)   # None: the collective's default or DYNAMIQ_*
        for name, value in given.items():
            setattr(self, name, value)
        self.codec = DynamiQ(bits=5) if codec is None else codec
        self.seed = int(seed)
        self.transport = transport
        self.topology = topology
        self.path = env_choice(path, "DYNAMIQ_PATH", HOOK_PATHS, "path")
        if not 0 <= fuse_mb < float("inf"):
            raise ValueError(f"fuse_mb must be a finite number >= 0 (MiB), got {fuse_mb!r}")
        self.fuse_mb = float(fuse_mb)
        if int(auto_rounds) < 1:
            raise ValueError(f"auto_rounds must be >= 1, got {auto_rounds!r}")
        self.auto_rounds = int(auto_rounds)
        # "propagate": NaN/Inf on any rank gives NaN gradients on every rank
        # (GradScaler then skips the step); "raise": NonFiniteInputError.
        if nonfinite not in ("propagate", "raise"):
            raise ValueError(f"nonfinite must be 'propagate' or 'raise', got {nonfinite!r}")
        self.nonfinite = nonfinite
        self.overlap = overlap      # None: for CUDA buckets; True: CPU ones too
        self.iteration = 0          # DDP iterations seen (advanced on the last bucket)
        self.measure_error = False
        self.reports = reports      # keep each call's Report (last_report, bits in pop_stats)
        self.timing = timing        # time each call (CUDA events on GPU: no host sync)
        self._counter = 0
        if process_group is not None:
            if comm is not None and comm is not process_group:
                raise ValueError("HookState: give comm= or process_group=, not both")
            if not is_torch_group(process_group):
                raise TypeError("HookState: process_group must be a torch.distributed "
                                f"ProcessGroup, got {type(process_group).__name__}")
            comm = process_group
        self._init_runtime(comm)

    def _init_runtime(self, comm):
        self._comm = comm
        self._plane = None
        self._collective = None
        self._lock = threading.Lock()
        self.last_report = None
        self._buckets = BucketRouter(self)  # the DDP hook's paths, fused groups, workers
        self._stats_lock = threading.Lock()
        self._reset_stats()

    def _reset_stats(self):
        self._calls = 0
        self._buckets_seen = 0
        self._path_counts = {}
        self._coords = 0
        self._reported = 0          # coordinates of the calls that returned a report
        self._bits = 0.0
        self._seconds = 0.0
        self._events = []
        self._host_s = 0.0          # the caller's thread inside the hook / reduce-scatter
        self._err_sq = 0.0
        self._ref_sq = 0.0

    # -- pickling: configuration and counters, never the communicator
    def __getstate__(self):
        self.settle()
        state = {k: getattr(self, k) for k in self._PICKLED}
        state["counter"] = self.counter
        # path="auto"'s choice: a resumed run goes on with it, as one never stopped
        state["auto_choice"] = self.path_decisions().get("step")
        return state

    def __setstate__(self, state):
        state.setdefault("path", "auto")           # checkpoints of earlier versions
        state.setdefault("nonfinite", "propagate")
        state.setdefault("overlap", None)
        state.setdefault("fuse_mb", DEFAULT_FUSE_MB)
        state.setdefault("auto_rounds", STEP_ROUNDS)
        for name in COLLECTIVE_OPTIONS:
            state.setdefault(name, None)
        for k in self._PICKLED:
            setattr(self, k, state[k])
        self._counter = int(state["counter"])
        self._init_runtime(None)
        if state.get("auto_choice"):
            self._buckets.decided = tuple(state["auto_choice"])

    # -- communicator and collective
    @property
    def comm(self):
        """The communicator: an mpi4py communicator or a torch.distributed
        group (what was given, else the launcher's default, decided once)."""
        if self._comm is None:
            self._comm = default_comm()
        return self._comm

    @property
    def process_group(self):
        """The torch.distributed group the state reduces over (None when it
        runs over an mpi4py communicator)."""
        comm = self.comm
        return comm if is_torch_group(comm) else None

    @property
    def plane(self):
        """The communicator's control plane (rank, size, small exchanges)."""
        if self._plane is None:
            self._plane = plane_of(self.comm)
        return self._plane

    @comm.setter
    def comm(self, comm):
        # Re-attach (e.g. after unpickling): a new collective is made on next
        # use and continues from the current call counter.
        self.settle()
        with self._lock:
            self._drop_collective()
            self._comm = comm
            self._plane = None
            self._buckets.close()      # (path="auto"'s choice, restored or made, stays)
            self._buckets = BucketRouter(self, decided=self._buckets.decided)

    @property
    def collective(self) -> Collective:
        with self._lock:
            if self._collective is None:
                coll = Collective(comm=self.comm, transport=self.transport,
                                  agree_replays=self.agree_replays,
                                  **self.collective_options())
                coll.counter = self._counter
                self._collective = coll
            return self._collective

    def collective_options(self) -> dict:
        """The :class:`~dynamiq_mpi.Collective` options given to the state
        (those left to the collective's defaults omitted)."""
        return {name: getattr(self, name) for name in COLLECTIVE_OPTIONS
                if getattr(self, name) is not None}

    @property
    def counter(self) -> int:
        """The call counter that keys the generator (the same on every rank)."""
        coll = self._collective
        return coll.counter if coll is not None else self._counter

    @counter.setter
    def counter(self, value: int):
        self.settle()
        with self._lock:
            self._counter = int(value)
            if self._collective is not None:
                self._collective.counter = int(value)

    # -- the all-reduce of one tensor
    def allreduce_(self, t: torch.Tensor, path: str | None = None) -> torch.Tensor:
        """Replace contiguous ``t`` by its mean over the ranks (compressed by
        ``codec``, or as the collective's path choice says) on the current
        stream; returns ``t``.  Measures the error first when asked."""
        self.settle()       # the hook's worker shares the collective's workspace
        return self._allreduce_now(t, path)

    def _allreduce_now(self, t, path=None, buckets=1):
        exact = self.exact_mean(t) if self.measure_error else None
        with torch_stream(t.device):
            coll = self.collective
            arr = stream_view(t)
            start = self._start_timer(t.device)
            report = self._reduce_array(coll, arr, path)
            self._stop_timer(t.device, start)
        self._count_call(t.numel(), report, bits=coll.last_bits_per_coord, buckets=buckets,
                         path=report.path if report is not None else path or self.path)
        if exact is not None:
            self.record_error(t, exact)
        return t

    def _count_call(self, numel: int, report=None, *, bits=None, path=None, buckets=1):
        """Add one call of ``numel`` coordinates to the totals: its report (or
        its wire's ``bits`` a coordinate), and the ``buckets`` it carried
        under ``path``."""
        with self._stats_lock:
            self._calls += 1
            self._coords += numel
            if report is not None:
                self.last_report = report
                bits = report.bits_per_coord
            if bits is not None:
                self._reported += numel
                self._bits += bits * numel
            if path is not None:
                self._buckets_seen += buckets
                self._path_counts[path] = self._path_counts.get(path, 0) + buckets

    def _reduce_array(self, coll, arr, path=None):
        """Mean over the ranks written into ``arr`` itself; the Report or None.
        "plain" through the collective is its uncompressed float32 ring."""
        path = self.path if path is None else path
        codec = self.codec
        if path == "plain":
            codec, path = Exact(), "compressed"
        res = coll.allreduce(arr, codec=codec, topology=self.topology, op="mean",
                             seed=self.seed, out=arr, return_report=self.reports,
                             path=path, nonfinite=self.nonfinite)
        res, report = res if self.reports else (res, None)
        if res is not arr:          # the contract returns ``out``; be safe if not
            arr[...] = res
        return report

    # -- the DDP hook's buckets (ddp_buckets.py)
    def bucket_future(self, buf: torch.Tensor, last: bool | None = None) -> torch.futures.Future:
        """The mean of ``buf`` over the ranks, as DDP wants it from a hook.

        ``last``: from a DDP hook, ``bucket.is_last()`` (called inside the
        backward pass): the future may then still be pending when returned,
        compressed buckets being fused with the next ones.  None: a bucket
        alone, outside DDP's steps: it starts at once (on the worker thread
        for CUDA) and ends no step.
        """
        return self._buckets.bucket(buf, last)

    def settle(self) -> None:
        """Wait until the hook's worker has run every queued call and its
        device work is done (before a call on another stream or thread)."""
        self._buckets.settle()

    def raise_pending_error(self) -> None:
        """Wait for the hook's worker; raise the first error of its calls."""
        self._buckets.raise_pending_error()

    def close(self) -> None:
        """Stop the hook's worker threads (made again on next use)."""
        self._buckets.close()

    def free(self) -> None:
        """Free what the state holds, collectively (every rank at the same
        point, e.g. after training): its worker threads and its collective's
        graphs, NCCL communicators and duplicated communicator.  A later
        call makes them again and continues the call counter (``path="auto"``
        then measures again)."""
        self.settle()
        self.close()
        with self._lock:
            self._drop_collective()

    def _drop_collective(self):
        """Free the collective (collective; under the lock), keeping its counter."""
        old, self._collective = self._collective, None
        if old is not None:
            self._counter = old.counter
            old.free()              # its graphs, NCCL communicators and MPI duplicate

    @property
    def _workers(self) -> dict:
        return self._buckets._workers

    @staticmethod
    def _synced_time(buf):
        if buf.is_cuda:
            torch.cuda.synchronize(buf.device)
        return time.perf_counter()

    @property
    def auto_steps(self) -> int:
        """DDP steps before ``path="auto"`` has chosen (0 for other paths,
        for codecs that always run compressed, and once chosen or restored)."""
        if (self.path != "auto" or not getattr(self.codec, "auto_path", False)
                or self._buckets.decided is not None):
            return 0
        return auto_steps(self.auto_rounds)

    def step_periods(self) -> dict:
        """``path="auto"``'s measured step periods (seconds) of each path, on
        this rank (the choice uses the slowest rank's typical ones)."""
        chooser = self._buckets.chooser
        return {} if chooser is None else dict(chooser.periods)

    def path_decisions(self) -> dict:
        """The decided paths, {key: (path, why)}: ``Collective.path_decisions``
        (the hook's whole-step choice under "step", the reduce-scatter's per
        size class, the collective's own), or "step" as restored."""
        coll, decided = self._collective, self._buckets.decided
        out = coll.path_decisions() if coll is not None else {}
        return out if decided is None else {**out, "step": tuple(decided)}

    def _start_timer(self, device):
        if not self.timing:
            return None
        if device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _stop_timer(self, device, start):
        if start is None:
            return
        if device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((start, end))
        else:
            self._seconds += time.perf_counter() - start

    # -- error measurement against an exact all-reduce
    def exact_mean(self, t: torch.Tensor) -> torch.Tensor:
        """The float64 mean over the ranks of ``t``, reduced uncompressed:
        through torch.distributed when it spans the same ranks, else over
        the control plane on a host copy."""
        ref = t.detach().to(torch.float64, copy=True)
        ok, group = _native_group(self.comm)
        if ok:
            torch.distributed.all_reduce(ref, group=group)
        else:
            host = ref.cpu().numpy()
            self.plane.allreduce_sum(host, host)
            ref = torch.from_numpy(host).to(t.device)
        return ref.div_(self.plane.size)

    def record_error(self, result: torch.Tensor, exact: torch.Tensor):
        """Accumulate ||result - exact||^2 and ||exact||^2 (float64)."""
        diff = result.detach().to(torch.float64) - exact
        self._err_sq += float(diff.square().sum())
        self._ref_sq += float(exact.square().sum())

    def pop_stats(self) -> dict:
        """Totals since the last call, then reset: ``calls`` (collective calls
        and the group's all-reduces), ``buckets`` (DDP buckets) and ``paths``
        (buckets per path: "compressed", "native", "plain"), ``coords``,
        ``bits_per_coord`` (coordinate-weighted over the calls whose bits are
        known: every call but a hierarchical one without a report; None if
        none), ``comm_s`` (time inside the all-reduce when
        ``timing`` is on; waits for its CUDA events), ``host_s`` (time the
        caller's thread spent inside the hook or the reduce-scatter: DDP's or
        FSDP2's autograd thread, including at a step's last bucket the wait
        until the worker has launched its calls, and the synchronised calls
        that ``path="auto"`` times) and ``vnmse`` (None unless measured).
        With ``timing`` on, call it every step or so."""
        self.settle()
        seconds = self._seconds
        for start, end in self._events:
            end.synchronize()
            seconds += start.elapsed_time(end) / 1e3
        out = {
            "calls": self._calls,
            "buckets": self._buckets_seen,
            "paths": dict(self._path_counts),
            "coords": self._coords,
            "bits_per_coord": self._bits / self._reported if self._reported else None,
            "comm_s": seconds,
            "host_s": self._host_s,
            "vnmse": self._err_sq / self._ref_sq if self._ref_sq > 0 else None,
        }
        self._reset_stats()
        return out

    def __repr__(self):
        return (f"HookState(codec={self.codec!r}, seed={self.seed}, topology={self.topology!r}, "
                f"transport={self.transport!r}, counter={self.counter}, "
                f"iteration={self.iteration})")


def register_comm_hook(ddp, state: "HookState", hook=None) -> "HookState":
    """``ddp.register_comm_hook(state, hook or ddp_comm_hook)`` with the
    state's communicator taken from ``ddp.process_group`` when it has none;
    raises ``InvalidInputError`` when the state was made for other ranks
    (a state over the whole job on a DDP over a subgroup would mix the
    groups' gradients).  Returns ``state``.

    With ``path="auto"`` on a CUDA model, a link so fast that the group's
    own all-reduce of a bucket costs less than any Python comm hook's
    own host time (NVLink at DDP's default buckets) gets no hook: DDP keeps
    its C++ reducer, ``path_decisions()["step"]`` is ``("ddp", why)`` and
    rank 0 warns once (hook_gate.py).  Any other path, a ``hook``, and
    registrations that bypass this function (``ddp.register_comm_hook``,
    Lightning's ``DDPStrategy(ddp_comm_hook=...)``) register the hook."""
    group = getattr(ddp, "process_group", None)
    if group is not None:
        _adopt_group(state, group, "register_comm_hook", "the DDP model's process group")
    if hook is None and leaves_ddp_alone(ddp, state, group):
        return state
    ddp.register_comm_hook(state, ddp_comm_hook if hook is None else hook)
    return state


# --------------------------------------------------------------------- DDP hook
def ddp_comm_hook(state: "HookState", bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: ``ddp.register_comm_hook(state, ddp_comm_hook)``.

    All-reduces the bucket's flat buffer in place to the mean over the ranks
    (DDP hands it over undivided), compressed over fused groups of buckets or
    by torch.distributed's own all-reduce (float32 or BF16) as ``state.path``
    decides (ddp_buckets.py).
    NaN/Inf on any rank gives NaN gradients on every rank (``GradScaler``
    skips the step); with ``HookState(nonfinite="raise")`` every rank raises
    from ``loss.backward()`` instead.
    """
    t0 = time.perf_counter()
    last = bucket.is_last()
    fut = state.bucket_future(bucket.buffer(), last=last)
    if last:
        state.raise_pending_error()     # an overlapped call's error, with its own type
    state._host_s += time.perf_counter() - t0
    return fut


# --------------------------------------------------------------------- plain loops
def gradient_buckets(grads, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> list:
    """The buckets of :func:`allreduce_gradients` (and of the training
    simulator, research/train_sim.py, which must cut alike): lists of indices
    into ``grads``, grouped by device and dtype in order of first appearance,
    coalesced up to ``bucket_cap_mb`` MiB (a larger tensor is a bucket of
    its own)."""
    groups = {}
    for i, g in enumerate(grads):
        groups.setdefault((g.device, g.dtype), []).append(i)
    cap = max(1, int(bucket_cap_mb * 2 ** 20))
    buckets = []
    for members in groups.values():
        current, size = [], 0
        for i in members:
            nbytes = grads[i].numel() * grads[i].element_size()
            if current and size + nbytes > cap:
                buckets.append(current)
                current, size = [], 0
            current.append(i)
            size += nbytes
        if current:
            buckets.append(current)
    return buckets


def allreduce_gradients(parameters, state: "HookState", *,
                        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, group=None) -> int:
    """Average the ``.grad`` of ``parameters`` over the ranks, in place.

    ``group``: the torch.distributed group (or mpi4py communicator) to
    average over; a state without a communicator takes it, one made for
    other ranks raises ``InvalidInputError``.  Default: the state's.

    Gradients are grouped by device and dtype (in order of first appearance)
    and coalesced into buckets of at most ``bucket_cap_mb`` MiB (a tensor
    larger than the cap is a bucket of its own): one all-reduce per bucket.
    Parameters without a gradient are skipped; all ranks must have gradients
    of the same shapes and dtypes, else every rank raises
    :class:`~dynamiq_mpi.InputMismatchError`.  Returns the number of buckets.
    """
    if group is not None:
        _adopt_group(state, group, "allreduce_gradients")
    grads = []
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        if g.is_sparse or g.layout != torch.strided:
            raise TypeError("allreduce_gradients: sparse gradients are not supported")
        grads.append(g)
    buckets = [[grads[i] for i in b] for b in gradient_buckets(grads, bucket_cap_mb)]

    # One small exchange first: a rank with a different gradient list would
    # otherwise make a different number of calls and leave the others waiting.
    layout = [(str(b[0].dtype), b[0].device.type, sum(g.numel() for g in b)) for b in buckets]
    layouts = state.plane.allgather(layout)
    if any(other != layouts[0] for other in layouts):
        differ = [r for r, other in enumerate(layouts) if other != layouts[0]]
        raise InputMismatchError(
            "allreduce_gradients: ranks disagree on the gradients to reduce "
            f"(buckets of (dtype, device, numel)): rank 0 has {layouts[0]}, "
            f"rank {differ[0]} has {layouts[differ[0]]}")

    for b in buckets:
        if len(b) == 1 and b[0].is_contiguous():
            state.allreduce_(b[0])
            continue
        flat = torch.cat([g.reshape(-1) for g in b])
        state.allreduce_(flat)
        offset = 0
        for g in b:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n
    return len(buckets)
