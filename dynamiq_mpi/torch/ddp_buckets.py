"""The DDP hook's buckets: which path a step takes, and compressed calls
over several buckets at once.

Paths (``HookState(path=...)``):

- ``"plain"``: the group's own all-reduce of the bucket as it is (what DDP
  does without a hook; float32 for float32 gradients);
- ``"native"``: the group's all-reduce with the codec's native wire, BF16
  for float32 buckets (what torch's ``bf16_compress_hook`` does);
- ``"compressed"``: the codec's compressed all-reduce, over fused groups of
  consecutive buckets;
- ``"auto"`` (default): the three measured by whole training steps, in the
  conditions DDP runs them (overlapped with the backward pass, after the
  bucket rebuild), agreed by every rank (the collective's ``step_choice``,
  reported by ``path_decisions()``); the most exact one within 3 % of the
  fastest is kept.

Fusion: DDP calls the hook once per bucket, strictly in bucket order, and
waits for the buckets' futures only at the end of the backward pass.  So the
hook returns a pending future for a bucket and reduces consecutive buckets
in one compressed call once they hold ``fuse_mb`` MiB (or at the step's last
bucket): one call over 2^25-2^26 elements costs far less than eight calls
over 2^23 (its fixed costs are paid once, and the codec's bit budget is
shared over the group, as over the paper's whole-model bucket).  Group
boundaries are a pure function of the buckets' sizes in order, dtypes and
devices (the same on every rank, whatever DDP's bucket rebuild makes of
them), never of timing.  A bucket of ``fuse_mb`` or more runs alone, in
place; a group of several is copied into one buffer per device and dtype
(reused, at most ``2 x fuse_mb``), reduced, and copied back; each future
completes with its own bucket's tensor.  A group starts as soon as it is
complete, on the hook's worker thread for CUDA buckets (overlap.py), so the
overlap with the backward pass stays.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .groups import _native_group
from .overlap import BucketWorker, complete, new_future

HOOK_PATHS = ("auto", "compressed", "native", "plain")
NO_HOOK = "ddp"         # path="auto"'s choice of no hook at all (hook_gate.py)
STEP_OPTIONS = ("plain", "native", "compressed")     # most exact first
DEFAULT_FUSE_MB = 256.0
STEP_ROUNDS = 3         # timed A/B rounds of path="auto"
STEP_WARMUP = 1         # untimed rounds before them


def auto_steps(rounds: int) -> int:
    """Steps ``path="auto"`` takes before its choice: step 0, then two steps
    of each path a round, warm-up rounds included."""
    return 1 + 2 * len(STEP_OPTIONS) * (STEP_WARMUP + int(rounds))


def fused_groups(sizes, cap: int) -> list:
    """The fused groups of buckets of ``sizes`` elements in DDP's order (one
    dtype and device), as the hook forms them: lists of bucket indices."""
    groups, current, numel = [], [], 0
    for i, n in enumerate(sizes):
        if current and n >= cap:            # a bucket as large as a group runs alone
            groups.append(current)
            current, numel = [], 0
        current.append(i)
        numel += n
        if numel >= cap:                    # the group is complete: it starts now
            groups.append(current)
            current, numel = [], 0
    return groups + ([current] if current else [])


def _mark(device: torch.device):
    """A mark at the end of a step: a CUDA event on the current stream (no
    host synchronisation), or the host clock for CPU buckets."""
    if device.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def _elapsed(a, b) -> float:
    if isinstance(a, float):
        return b - a
    b.synchronize()
    return a.elapsed_time(b) / 1e3


class BucketRouter:
    """The DDP side of one :class:`~dynamiq_mpi.torch.HookState`: the step's
    path, the open fused group, the fused buffers and the worker threads."""

    def __init__(self, state, decided=None):
        self.state = state
        self.chooser = None         # the collective's step_choice of path="auto" (first use)
        self.decided = decided      # (path, why) of path="auto" restored from a checkpoint
        self._in_step = False       # a step's buckets have begun (its end not yet seen)
        self._group_info = None     # (torch.distributed spans the same ranks, its group)
        self._pg = None             # its ProcessGroup
        self._open = []             # [(bucket, future)] of the group not yet started
        self._open_key = None       # (device, dtype, collective path) of that group
        self._open_numel = 0
        self._fused = {}            # (device, dtype) -> the reused fused buffer
        self._workers = {}          # device -> BucketWorker
        self._threads_ok = None     # the control plane takes calls from a worker (asked once)

    # -- one bucket
    def bucket(self, buf: torch.Tensor, last) -> torch.futures.Future:
        """The future of ``buf``'s mean over the ranks.  ``last``: whether it
        is DDP's last bucket of the step (the open group starts, the step
        ends); None: a bucket given alone, outside DDP's steps (it starts at
        once and ends no step)."""
        if last is None:
            route, path = self._route(buf, alone=True)
            if route == "group":
                return self._group_all_reduce(buf, path)
            fut = self._add(buf, path)
            self._flush()
            return fut
        if not self._in_step:
            self._in_step = True
            # DDP skips the hook for a bucket of unused parameters when asked to
            # (skip_all_reduce_unused_params): the step then ends with the
            # backward pass, before DDP's own end-of-backward callback waits.
            # (A hook called by hand, outside a backward pass, ends its step
            # at its last bucket only.)
            try:
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda: self._end_step(buf.device))
            except RuntimeError:
                pass
        route, path = self._route(buf)
        if route == "group":
            fut = self._group_all_reduce(buf, path)
        else:
            fut = self._add(buf, path)
        if last:
            self._end_step(buf.device)
        return fut

    def _end_step(self, device):
        """Start the open group and end the step (once: at the last bucket,
        or when the backward pass ends without it)."""
        if not self._in_step:
            return
        self._in_step = False
        self._flush()
        st = self.state
        if self.chooser is not None and self.chooser.choice is None:
            self.chooser.step_ended(st.iteration, _mark(device))
        st.iteration += 1

    def _route(self, buf, alone=False) -> tuple:
        """("group", "plain" or "native"): the torch group's own all-reduce;
        ("fused", the collective's path): a fused group of collective calls
        ("compressed"; without a torch group over the same ranks, the
        collective's own choice, "plain" there meaning float32 through it)."""
        st = self.state
        if self._group_info is None:    # asked once: the group does not change under DDP
            self._group_info = _native_group(st.comm)
        if not (buf.device.type in ("cpu", "cuda") and self._group_info[0]):
            return "fused", st.path
        path = self._path(alone)
        return ("group" if path in ("plain", "native") else "fused"), path

    def _path(self, alone=False) -> str:
        """The step's path over a torch group: "plain", "native" or "compressed"
        (a bucket given alone outside DDP's steps: "compressed" under "auto"
        until the steps have chosen)."""
        st = self.state
        if st.path != "auto":
            return st.path
        if not getattr(st.codec, "auto_path", False):
            return "compressed"         # codecs that always run compressed
        if self.decided is not None:    # no hook chosen, yet called: DDP's own all-reduce
            return "plain" if self.decided[0] == NO_HOOK else self.decided[0]
        if alone:
            return self.chooser.choice if self.chooser and self.chooser.choice else "compressed"
        if self.chooser is None:
            self.chooser = st.collective.step_choice(STEP_OPTIONS, _elapsed, rounds=st.auto_rounds,
                                                     warmup=STEP_WARMUP, first="native")
        path = self.chooser.option(st.iteration)[0]
        if self.chooser.choice is not None and self.chooser.choice != "compressed":
            self._fused.clear()         # the fused buffers are not needed again
        return path

    # -- plain and native: the group's own all-reduce, returned at once
    def _process_group(self):
        """The torch ProcessGroup itself (asked once): its C++ ``allreduce``
        costs a fraction of ``dist.all_reduce``'s Python checks, which count
        at ~80 buckets a step on a fast link."""
        if self._pg is None:
            self._pg = self._group_info[1] or dist.distributed_c10d._get_default_group()
        return self._pg

    def _group_all_reduce(self, buf, path):
        st = self.state
        exact = st.exact_mean(buf) if st.measure_error else None
        pg = self._process_group()
        opts = dist.AllreduceOptions()
        # Divide, then SUM, as DDP's reducer and torch's hooks do: NCCL runs
        # AVG as a pre-multiplied sum, which its NVLink SHARP (NVLS)
        # algorithms do not take, so on an NVSwitch host an AVG all-reduce
        # falls back to the ring where DDP's own SUM does not.
        opts.reduceOp = dist.ReduceOp.SUM
        if path == "native" and getattr(st.codec, "native_wire", None) == "bfloat16" \
                and buf.dtype in (torch.float32, torch.float64):
            wire = buf.to(torch.bfloat16).div_(st.plane.size)   # as bf16_compress_hook does
        else:
            wire = buf.div_(st.plane.size)
        work = pg.allreduce([wire], opts)
        st._count_call(buf.numel(), bits=8 * wire.element_size(), path=path)

        def result(fut):
            out = fut.value()[0]
            if out is not buf:
                buf.copy_(out)
            return buf
        if exact is None:
            return work.get_future().then(result)
        work.wait()                     # a logged step: the error needs the result now
        st.record_error(result(work.get_future()), exact)
        fut = new_future(buf.device)
        fut.set_result(buf)
        return fut

    # -- compressed: fused groups of consecutive buckets
    def _add(self, buf, path):
        key = (buf.device, buf.dtype, path)
        cap = self._cap(buf)
        if self._open and (key != self._open_key or buf.numel() >= cap):
            self._flush()
        fut = new_future(buf.device)
        self._open.append((buf, fut))
        self._open_key = key
        self._open_numel += buf.numel()
        if self._open_numel >= cap:
            self._flush()
        return fut

    def _cap(self, buf) -> int:
        """Elements of a group that starts at once (``fuse_mb`` of the dtype;
        at least 1: ``fuse_mb=0`` runs every bucket alone)."""
        return max(1, int(self.state.fuse_mb * 2 ** 20) // buf.element_size())

    def _flush(self):
        """Start the open group: on the worker, or here."""
        if not self._open:
            return
        bufs = [b for b, _ in self._open]
        futures = [f for _, f in self._open]
        path = self._open_key[2]
        self._open, self._open_key, self._open_numel = [], None, 0

        def run(group):
            self._reduce_group(group, path)
        if self._overlaps(bufs[0]):
            self._worker(bufs[0].device).submit(bufs, run, futures)
            return
        try:
            run(bufs)
        except BaseException as exc:
            for fut in futures:
                fut.set_exception(exc)
            raise
        complete(futures, bufs)

    def _reduce_group(self, bufs, path):
        """One compressed call over ``bufs`` (in place when alone)."""
        st = self.state
        if len(bufs) == 1:
            st._allreduce_now(bufs[0], path, buckets=1)
            return
        n = sum(b.numel() for b in bufs)
        key = (bufs[0].device, bufs[0].dtype)
        fused = self._fused.get(key)
        if fused is None or fused.numel() < n:
            self._fused[key] = fused = None     # the old one back to the allocator first
            self._fused[key] = fused = torch.empty(n, dtype=bufs[0].dtype,
                                                   device=bufs[0].device)
        if fused.is_cuda:       # it may have been made on another stream (an inline group)
            fused.record_stream(torch.cuda.current_stream(fused.device))
        flat = fused[:n]
        torch.cat([b.reshape(-1) for b in bufs], out=flat)
        st._allreduce_now(flat, path, buckets=len(bufs))
        offset = 0
        for b in bufs:
            b.view(-1).copy_(flat[offset:offset + b.numel()])
            offset += b.numel()

    def _overlaps(self, buf) -> bool:
        """Whether this group's compressed call goes to the worker thread."""
        st = self.state
        wanted = buf.is_cuda if st.overlap is None else bool(st.overlap)
        if not wanted or st.measure_error:
            return False    # the error's exact all-reduce must keep DDP's order
        if self._threads_ok is None:
            self._threads_ok = st.plane.thread_safe
        return self._threads_ok

    def _worker(self, device) -> BucketWorker:
        worker = self._workers.get(device)
        if worker is None:
            worker = self._workers[device] = BucketWorker(device)
        return worker

    # -- the state's waits
    def settle(self) -> None:
        for worker in list(self._workers.values()):
            worker.drain()
            if worker.stream is not None:
                worker.stream.synchronize()

    def raise_pending_error(self) -> None:
        for worker in list(self._workers.values()):
            worker.drain()
            exc = worker.take_error()
            if exc is not None:
                raise exc

    def close(self) -> None:
        workers, self._workers = self._workers, {}
        for worker in workers.values():
            worker.close()


__all__ = ["BucketRouter", "auto_steps", "fused_groups", "HOOK_PATHS", "NO_HOOK", "STEP_OPTIONS",
           "DEFAULT_FUSE_MB", "STEP_ROUNDS"]
