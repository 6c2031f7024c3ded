"""FSDP2's gradient reduce-scatter through :func:`dynamiq_mpi.reduce_scatter`.

    import dynamiq_mpi as dq
    import dynamiq_mpi.torch as dqt
    from torch.distributed.fsdp import fully_shard

    torch.distributed.init_process_group(...)   # torchrun; under mpiexec: dqt.init_process_group_from_mpi()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    rs = dqt.ReduceScatter(codec=dq.DynamiQ(bits=5))
    for module in model.modules():          # every FSDP module has its own param group
        if hasattr(module, "set_custom_reduce_scatter"):
            module.set_custom_reduce_scatter(rs)

FSDP2 (torch >= 2.11) calls the object on its reduce-scatter stream with
one parameter group's padded flat gradient (``len = n x shard``, in FSDP's
``reduce_dtype``: float32 or BF16) and the shard to fill, with FSDP's op
(AVG, SUM, or PREMUL_SUM(f) from ``set_gradient_divide_factor``); tensors
become CuPy (CUDA, torch's current stream) or NumPy views, zero-copy.
Parameters are all-gathered by FSDP itself, uncompressed.

State, pickling, reports, ``pop_stats`` and the non-finite semantics are
:class:`~dynamiq_mpi.torch.HookState`'s (NaN/Inf on any rank: NaN shards on
every rank, so ``GradScaler`` skips the step alike; or, with
``nonfinite="raise"``, every rank raises).  ``path="auto"`` (default) times,
per size class, the compressed reduce-scatter against the group's own with
BF16 on the wire (what ``reduce_dtype=bfloat16`` sends), agreed by all ranks
(``path_decisions()``); "compressed" / "native" force, "plain" is the
group's reduce-scatter in FSDP's ``reduce_dtype``.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..settings import check_flag
from .arrays import stream_view, torch_stream
from .ddp import HookState
from .groups import _adopt_group, _native_group

try:     # the abstract class is not re-exported by torch; FSDP only calls it
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _FSDPReduceScatter
except Exception:   # torch without FSDP2's custom reduce-scatter (< 2.11)
    class _FSDPReduceScatter:
        pass

__all__ = ["ReduceScatter"]


def _op_of(op) -> tuple:
    """("sum" or "mean", factor or None) of FSDP's reduce op: SUM, AVG, or
    PREMUL_SUM(f) (FSDP's ``set_gradient_divide_factor``: f x the sum)."""
    R = dist.ReduceOp
    kind = getattr(op, "op", op)            # a PREMUL_SUM op carries its factor
    for name, value in (("sum", R.SUM), ("mean", R.AVG)):
        if kind == value:
            return name, None
    if kind == R.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if factor is None:                  # torch 2.11 shows it only to pickling
            state = getattr(op, "__getstate__", lambda: None)()
            if isinstance(state, tuple) and len(state) == 2:
                factor = state[1]
        if isinstance(factor, torch.Tensor):
            factor = factor.item()
        if factor is None:
            raise NotImplementedError("dynamiq_mpi.torch.ReduceScatter: a PREMUL_SUM op "
                                      "without its factor")
        return "sum", float(factor)
    raise NotImplementedError(
        f"dynamiq_mpi.torch.ReduceScatter supports ReduceOp.SUM, AVG and PREMUL_SUM, "
        f"got {op!r}")


def _group_reduce_scatter(output, input, op, group):
    """torch.distributed's reduce-scatter of one flat tensor (the name changed
    in torch 2.13: reduce_scatter_single; reduce_scatter_tensor before)."""
    single = getattr(dist, "reduce_scatter_single", None)
    if single is not None:
        return single(output=output, input=input, group=group, op=op)
    return dist.reduce_scatter_tensor(output, input, op=op, group=group)


class ReduceScatter(_FSDPReduceScatter, HookState):
    """FSDP2's ``ReduceScatter`` interface (``allocate`` and ``__call__``) for
    ``FSDPModule.set_custom_reduce_scatter``, on :func:`dynamiq_mpi.reduce_scatter`.

    ``codec`` defaults to ``DynamiQ(bits=5)``; ``seed`` keys the generator
    with the collective's call counter (checkpoint the object: pickling keeps
    the configuration and the counter, see :class:`HookState`).  Made
    without ``comm`` / ``process_group``, it reduces over the group FSDP
    calls it with (HSDP's shard group included; one object serves one
    group); made with one, FSDP's group must hold the same ranks, else every
    rank raises ``InvalidInputError``.  ``hierarchy``, ``node_size``,
    ``links``, ``rail_budget``, ``graphs`` and ``lanes``: the collective's
    options, as :class:`HookState` takes them (``hierarchy="nodes"``: the
    reduce-scatter goes uncompressed inside a node, compressed across).

    ``agree_replays`` (default True): whether a reduce-scatter replayed as
    a CUDA graph exchanges its digest again.  With False every call is
    agreed on until its graph is captured; after that FSDP2's sequence of
    reduce-scatters, the same on every rank by construction (its own
    all-gathers rely on it), stands for the agreement, and a replay no
    longer waits for the other ranks' host threads
    (``Collective(agree_replays=...)``).
    """

    _PICKLED = HookState._PICKLED + ("agree_replays",)

    def __init__(self, codec=None, seed: int = 0, comm=None, transport: str = "auto", *,
                 topology: str = "ring", reports: bool = False, timing: bool = False,
                 path: str | None = None, nonfinite: str = "propagate", process_group=None,
                 hierarchy: str | None = None, node_size: int | None = None, links=None,
                 rail_budget: str | None = None, graphs: bool | None = None,
                 lanes: int | str | None = None, agree_replays: bool = True):
        self.agree_replays = check_flag(agree_replays, "agree_replays")
        HookState.__init__(self, codec, comm, seed, transport, topology=topology,
                           reports=reports, timing=timing, path=path, nonfinite=nonfinite,
                           process_group=process_group, hierarchy=hierarchy,
                           node_size=node_size, links=links, rail_budget=rail_budget,
                           graphs=graphs, lanes=lanes)

    def __setstate__(self, state):
        state.setdefault("agree_replays", True)      # checkpoints of earlier versions
        HookState.__setstate__(self, state)

    @property
    def auto_steps(self) -> int:
        """0: the reduce-scatter's ``path="auto"`` decides per size class,
        within its first calls, not by whole steps."""
        return 0

    # -- FSDP's interface
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group,
                 op, async_op: bool = False):
        t_host = time.perf_counter()
        opname, factor = _op_of(op)
        self._check_group(group)
        path, key, timed = self._rs_path(input_tensor)
        if timed:
            t0 = self._synced_time(input_tensor)
        if path in ("native", "plain"):
            self._group_rs(output_tensor, input_tensor, group, opname, factor, path)
        else:
            self.reduce_scatter_(output_tensor, input_tensor, opname,
                                 path="compressed" if key is not None else None)
            if factor is not None:
                output_tensor.mul_(factor)
        if timed:
            self.collective.class_choice().record(key, path,
                                                  self._synced_time(input_tensor) - t0, path)
        work = None
        if async_op:
            fut = torch.futures.Future()
            fut.set_result([output_tensor])
            work = torch._C._distributed_c10d._create_work_from_future(fut)
        self._host_s += time.perf_counter() - t_host
        return work

    def _group_rs(self, output, input, group, opname, factor, path):
        """The group's own reduce-scatter: "plain" in the input's dtype,
        "native" with the codec's native wire (BF16 for float32 input and
        DynamiQ, what ``MixedPrecisionPolicy(reduce_dtype=bfloat16)`` sends).
        Where the backend lacks AVG or PREMUL_SUM (gloo), a SUM and a scale."""
        wire_in, wire_out = input, output
        if (path == "native" and getattr(self.codec, "native_wire", None) == "bfloat16"
                and input.dtype == torch.float32):
            wire_in = input.to(torch.bfloat16)
            wire_out = torch.empty(output.shape, dtype=torch.bfloat16, device=output.device)
        if dist.get_backend(group) == "nccl":
            op = (dist.ReduceOp.AVG if opname == "mean" and factor is None
                  else dist._make_nccl_premul_sum(factor) if factor is not None
                  else dist.ReduceOp.SUM)
            scale = None
        else:
            op = dist.ReduceOp.SUM
            scale = factor if factor is not None else (
                1.0 / dist.get_world_size(group) if opname == "mean" else None)
        _group_reduce_scatter(wire_out, wire_in, op, group)
        if scale is not None:
            wire_out.mul_(scale)
        if wire_out is not output:
            output.copy_(wire_out)
        self._count_call(input.numel(), bits=8 * wire_in.element_size(), path=path)

    # -- the compressed reduce-scatter of one flat tensor
    def reduce_scatter_(self, output: torch.Tensor, input: torch.Tensor, op: str = "mean",
                        path=None) -> torch.Tensor:
        """Write rank r's chunk of the sum (``op="sum"``) or mean of ``input``
        over the ranks into ``output`` (``input.numel() / n`` elements)."""
        exact = self._exact_chunk(input, op) if self.measure_error else None
        with torch_stream(input.device):
            coll = self.collective
            arr, out = stream_view(input), stream_view(output)
            start = self._start_timer(input.device)
            res = coll.reduce_scatter(arr, codec=self.codec, topology=self.topology, op=op,
                                      seed=self.seed, out=out, return_report=self.reports,
                                      nonfinite=self.nonfinite)
            self._stop_timer(input.device, start)
        self._count_call(input.numel(), res[1] if self.reports else None,
                         bits=coll.last_bits_per_coord, path="compressed")
        if exact is not None:
            self.record_error(output, exact)
        return output

    def _exact_chunk(self, t, op):
        ref = self.exact_mean(t)
        n, r = self.plane.size, self.plane.rank
        if op == "sum":
            ref.mul_(n)
        m = t.numel() // n
        return ref.reshape(-1)[r * m:(r + 1) * m]

    def _check_group(self, group):
        """Reduce over FSDP's group: taken when the object has no
        communicator yet; one of other ranks is an error."""
        if group is None or group is self._comm:
            return
        _adopt_group(self, group, "ReduceScatter", "FSDP's group")

    def _rs_path(self, t):
        """(path, class key or None, timed) of one reduce-scatter."""
        native_ok = t.device.type in ("cpu", "cuda") and _native_group(self.comm)[0]
        if self.path != "auto" or not native_ok:
            return ("compressed" if self.path == "auto" else self.path), None, False
        if not getattr(self.codec, "auto_path", False):
            return "compressed", None, False
        paths = self.collective.class_choice()
        key = (t.device.type, str(t.dtype), paths.size_class(t.numel()),
               self.codec.cached_signature(), self.topology, "fsdp", "reduce_scatter")
        path, _, timed = paths.choose(key)
        return path, key, timed

    def __repr__(self):
        return (f"ReduceScatter(codec={self.codec!r}, seed={self.seed}, "
                f"topology={self.topology!r}, transport={self.transport!r}, "
                f"counter={self.counter})")

