"""The hierarchical all-reduce (docs/design.md, "Nodes and levels"): an
uncompressed in-node reduce-scatter hands local rank ``l`` the node's sum of
its rail's shard (blocks ``l, l + K, ...`` of 256 elements), local rank
``l`` of every node all-reduces it compressed (one rail per local rank), an
in-node all-gather assembles the result.  ``research/scale_levels.py``
simulates the same definition.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..backend import array_module, dtype_name
from ..errors import InvalidInputError, NonFiniteInputError
from ..settings import env_text
from .rail_budget import JointRailBudget, applies

BLOCK = 256          # the interleave's block: one DynamiQ super-group
HIERARCHIES = ("flat", "nodes", "auto")


# ----------------------------------------------------------------- shards
def rail_length(length: int, node_size: int, rail: int, block: int = BLOCK) -> int:
    """The elements of rail ``rail``'s shard, blocks ``rail, rail + K, ...``
    (0: the rail is skipped); the rails' lengths differ by at most ``block``."""
    if node_size < 1 or not 0 <= rail < node_size:
        raise ValueError(f"rail {rail} of {node_size}")
    if block < 1 or length < 0:
        raise ValueError(f"blocks of {block} over {length} elements")
    nb = -(-length // block)                           # blocks, the last maybe partial
    count = max(0, -(-(nb - rail) // node_size))       # j = rail, rail + K, ... < nb
    elems = count * block
    if count and (nb - 1) % node_size == rail:         # this rail holds the last block
        elems -= nb * block - length
    return elems


# ----------------------------------------------------------------- nodes
@dataclass(frozen=True)
class NodeLayout:
    node: int           # this rank's node (0..nodes-1, in order of their lowest rank)
    local: int          # this rank's place in its node (by rank)
    nodes: int
    node_size: int
    how: str            # how the nodes were found
    table: tuple = ()   # table[j][l]: the rank of local rank l of node j

    def rank_of(self, node: int, local: int) -> int:
        return self.table[node][local]

    def describe(self) -> str:
        return f"{self.nodes} node(s) x {self.node_size} ({self.how})"


def default_node_size(value=None):
    """``value``, else ``$DYNAMIQ_NODE_SIZE``, else None (find the nodes)."""
    if value is None:
        value = env_text("DYNAMIQ_NODE_SIZE", "").strip() or None
    if value is None:
        return None
    try:
        k = int(value)
    except (TypeError, ValueError):
        k = 0
    if k < 1:
        raise ValueError(f"node_size must be a positive integer (argument or "
                         f"$DYNAMIQ_NODE_SIZE), got {value!r}")
    return k


def find_nodes(plane, node_size=None) -> NodeLayout:
    """Which ranks share a node, alike on every rank (collective): ``node_size``
    consecutive ranks, else shared memory (MPI) or host names (torch)."""
    n = plane.size
    if node_size is not None:
        if n % node_size:
            raise InvalidInputError(
                f"node_size={node_size} does not divide the {n} ranks: nodes of unequal size "
                "are refused (every rail needs one rank of each node)")
        table = tuple(tuple(range(j * node_size, (j + 1) * node_size))
                      for j in range(n // node_size))
        return NodeLayout(plane.rank // node_size, plane.rank % node_size, n // node_size,
                          node_size, f"node_size={node_size}: consecutive ranks", table)
    if getattr(plane, "mpi_comm", None) is not None:
        key, how = plane.shared_memory_leader(), "MPI_Comm_split_type(SHARED)"
    else:
        key, how = plane.node_name(), "host names"
    keys = plane.allgather(key)
    firsts = {}
    for r, k in enumerate(keys):
        firsts.setdefault(k, r)
    order = sorted(firsts, key=firsts.get)
    sizes = {k: keys.count(k) for k in order}
    if len(set(sizes.values())) != 1:
        raise InvalidInputError(
            f"nodes of unequal size ({', '.join(f'{k}: {v}' for k, v in sizes.items())}) are "
            "refused by hierarchy='nodes': every rail needs one rank of each node (use "
            "hierarchy='flat')")
    table = tuple(tuple(r for r, k in enumerate(keys) if k == key) for key in order)
    node = order.index(keys[plane.rank])
    return NodeLayout(node, table[node].index(plane.rank), len(order), n // len(order), how, table)


def rail_topology(topology: str, nodes: int) -> str:
    """The rails' topology: the ring where the butterfly lacks a power-of-two node count."""
    from .. import schedules
    schedules.check_topology(topology, 1)          # the name only
    return "ring" if topology == "butterfly" and nodes & (nodes - 1) else topology


# ----------------------------------------------------------------- the call
def rails_rows(x, node_size: int, block: int = BLOCK):
    """``x`` (1-D) as ``(node_size, segment)`` rows, row ``l`` rail ``l``'s shard, padded."""
    xp, length = array_module(x), x.shape[0]
    per_rail = -(-(-(-length // block)) // node_size)
    total = per_rail * node_size * block
    padded = x
    if total != length:
        padded = xp.zeros(total, dtype=x.dtype)
        padded[:length] = x
    rows = padded.reshape(per_rail, node_size, block).transpose(1, 0, 2)
    return xp.ascontiguousarray(rows).reshape(node_size, per_rail * block)


def vector_of_rows(rows, length: int, block: int = BLOCK):
    """The inverse of :func:`rails_rows`: the vector of ``length`` elements."""
    xp = array_module(rows)
    k, seg = rows.shape
    vec = xp.ascontiguousarray(rows.reshape(k, seg // block, block).transpose(1, 0, 2))
    return vec.reshape(-1)[:length]


def _mean(a, n: int):
    """One division of the float32 value by n, then the dtype's rounding."""
    from ..backend import BFLOAT16, as_float32, float32_to_bf16
    if isinstance(a, np.ndarray):
        return (a.astype(np.float32) / np.float32(n)).astype(a.dtype)
    value = as_float32(a) / np.float32(n)                   # CuPy: integer-op BF16 rounding
    return float32_to_bf16(value) if a.dtype == BFLOAT16 else value.astype(a.dtype)


def _seconds_since(t0, xp, measured):
    """Seconds of an in-node phase (``measured``: device work waited for)."""
    if measured and xp is not np:
        xp.cuda.get_current_stream().synchronize()
    return time.perf_counter() - t0


def _deliver(result, flat_out, out, backend, on_device):
    """The result into the caller's ``out`` (returned), or a new flat array of x's kind."""
    staged = on_device and isinstance(result, np.ndarray)
    if flat_out is not None:
        if staged:
            flat_out.set(result)
        else:
            flat_out[...] = result
        return out
    return backend.xp.asarray(result) if staged else result


def agree_call(coll, x, out, collective, *, codec, topology, op, seed, counter, transport,
               tile_bytes, path, nonfinite):
    """The first exchange of a hierarchical call, which a rank making a flat
    call meets too (then every rank raises); (flat input, flat out, backend)."""
    from .. import schedules
    from .phases import CallSpec, agreement_record, check_agreement, check_local, check_scatter
    from ..control.agreement import agree
    n = coll.size
    spec = CallSpec(codec, topology, op, seed, counter, transport, tile_bytes,
                    path="compressed" if path == "auto" else path, nonfinite=nonfinite,
                    layout=coll.layout, gather=coll.gather)
    error, flat, flat_out, backend = None, None, None, None
    try:
        schedules.check_topology(topology, 1)   # the name (rails fall back to the ring)
        local = CallSpec(codec, "ring", op, seed, counter, transport, tile_bytes,
                         path=spec.path, nonfinite=nonfinite, layout=coll.layout)
        if collective == "allreduce":
            flat, flat_out, backend = check_local(x, out, local, n)
        else:
            flat, _, backend = check_local(x, None, local, n)
            flat_out = check_scatter(x, out, flat, backend, n)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    record = agreement_record(error, flat, backend, spec, hierarchy="nodes",
                              node_size=coll.node_size, collective=collective,
                              rail_budget=coll.rail_budget)
    record["can"] = {}      # the rails choose their transport in their own agreement
    check_agreement(agree(coll.plane, record))
    return flat, flat_out, backend


class Levels:
    """The node and rail planes, the rail's call runner and the in-node levels."""

    def __init__(self, plane, layout: NodeLayout, make_rail):
        from ..transports.node_level import StagedNodeLevel
        self.layout = layout
        self._plane = plane
        self.node = plane.split(layout.node, layout.local)        # my node's ranks
        self._rail_plane = plane.split(layout.local, layout.node)  # local rank l of every node
        self.rail = make_rail(self._rail_plane)      # a flat runner.CallRunner
        self._staged = StagedNodeLevel(self.node, layout.local, layout.node_size)
        self._device_levels = {}     # device id -> (in-node level, why), decided once
        self._orders = {}            # array module -> the reduce-scatter's chunk order

    def free(self):
        for level, _ in self._device_levels.values():
            level.free()
        self._device_levels.clear()
        self.rail.free()
        self._rail_plane.free()
        self.node.free()

    def _chunk_order(self, xp):
        """The reduce-scatter's chunk order: row l the chunks of local index l's ranks, by node."""
        if xp not in self._orders:
            lay = self.layout
            self._orders[xp] = xp.asarray([lay.rank_of(j, l) for l in range(lay.node_size)
                                           for j in range(lay.nodes)], dtype=np.int64)
        return self._orders[xp]

    def _node_level(self, on_device, flat):
        """(in-node level, why) of this call (collective on a device's first call)."""
        if not on_device:
            return self._staged, "in-node level over the control plane (host arrays)"
        device = flat.device.id
        if device not in self._device_levels:
            from ..transports.node_level import node_level_for
            self._device_levels[device] = node_level_for(self._plane, self.node, device,
                                                         self._staged)
        return self._device_levels[device]

    def _start(self, coll, agreed, nonfinite, topology):
        """After the agreement: NaN/Inf with nonfinite="raise" raises on every
        rank; else the call's facts, the in-node level and its input."""
        from .phases import holds_nonfinite
        from ..control.agreement import agree
        flat, flat_out, backend = agreed
        if nonfinite == "raise":
            flags = agree(coll.plane, holds_nonfinite(backend.xp, flat))
            bad = [r for r, f in enumerate(flags) if f]
            if bad:
                raise NonFiniteInputError(f"NaN or Inf in the input of ranks {bad}")
        on_device = backend.name == "gpu"
        level, why = self._node_level(on_device, flat)
        src = flat.get() if on_device and not level.device_arrays else flat
        lay = self.layout
        return (flat, flat_out, backend, on_device, level, why, src, array_module(src),
                int(flat.shape[0]), np.dtype(flat.dtype), lay.nodes * lay.node_size,
                lay.node_size, rail_topology(topology, lay.nodes))

    def _rail_call(self, method, shard, stage, call, hook=None):
        """(result, report, seconds) of the rail's flat ``method`` on the node
        sums' shard; ``stage``: the shard goes back to the device for it;
        ``hook``: the joint budget, finished after the call."""
        t1 = time.perf_counter()
        rail_in = shard
        if stage:
            import cupy
            rail_in = cupy.asarray(shard)
        call = dict(call, op="sum")
        try:
            res, rep = (self.rail.allreduce(rail_in, None, call, "flat", True, False, hook)
                        if method == "allreduce" else
                        self.rail.reduce_scatter(rail_in, None, call, "flat", True, False))
        finally:
            if hook is not None:
                hook.finish()
        if stage:
            res = res.get()
        return res, rep, time.perf_counter() - t1

    def allreduce(self, coll, x, out, agreed, *, codec, topology, op, seed, counter, transport,
                  tile_bytes, path, nonfinite, return_report):
        """One hierarchical call after :func:`agree_call`, on every rank."""
        from .phases import holds_nonfinite
        from ..report import Report
        t0 = time.perf_counter()
        lay = self.layout
        (flat, flat_out, backend, on_device, level, level_why, src, xp, length, dtype, n, k,
         rail_topo) = self._start(coll, agreed, nonfinite, topology)

        t1 = time.perf_counter()                # 1. in-node reduce-scatter
        node_sums = level.reduce_scatter(rails_rows(src, k))
        mine = rail_length(length, k, lay.local)
        shard = node_sums[:mine]
        t_rs = _seconds_since(t1, xp, return_report)

        hook = None                             # 2. the rails, compressed
        if applies(coll.rail_budget, lay.nodes, k, codec):
            hook = JointRailBudget(self.node, mine)
        reduced, rail_rep, t_rail = self._rail_call(
            "allreduce", shard, on_device and not level.device_arrays, dict(
                codec=codec, topology=rail_topo, seed=seed, counter=counter,
                transport=transport, tile_bytes=tile_bytes, path=path, nonfinite=nonfinite),
            hook=hook)

        t1 = time.perf_counter()                # 3. in-node all-gather
        part = xp.zeros(node_sums.shape[0], dtype=dtype)
        part[:mine] = reduced
        result = vector_of_rows(level.all_gather(part), length)
        if op == "mean":
            result = _mean(result, n)
        t_ag = _seconds_since(t1, xp, return_report)
        shaped = _deliver(result, flat_out, out, backend, on_device)
        if flat_out is None:
            shaped = shaped.reshape(x.shape)
        if not return_report:
            return shaped, None

        rails = self.node.allgather((lay.local, mine, rail_rep.wire_bytes_total,
                                     rail_rep.bits_per_coord, rail_rep.path,
                                     rail_rep.transport))
        wire = sum(r[2] for r in rails)
        node_bytes = 2 * (k - 1) * length * dtype.itemsize // k        # per rank, both phases
        report = Report(codec=rail_rep.codec, topology=topology, world_size=n, length=length,
                        dtype=dtype_name(dtype), op=op, seed=int(seed), call_counter=counter,
                        transport=rail_rep.transport, path=rail_rep.path,
                        path_reason=rail_rep.path_reason, gather=rail_rep.gather,
                        nonfinite=bool(holds_nonfinite(xp, result)) if length else False,
                        wire_bytes_total=wire,
                        stats_bytes_total=rail_rep.stats_bytes_total,
                        bytes_sent=rail_rep.bytes_sent + node_bytes,
                        seconds=time.perf_counter() - t0,
                        codec_info=dict(rail_rep.codec_info, nodes=lay.describe()),
                        hierarchy="nodes", control_plane=coll.control_plane,
                        transport_reason=rail_rep.transport_reason,
                        bits_override=(wire * 8.0 / (2.0 * (lay.nodes - 1) * length)
                                       if lay.nodes > 1 and length else 0.0))
        node = {"path": "uncompressed", "codec": dtype_name(dtype), "ranks": k,
                "transport": level.name, "transport_reason": level_why,
                "bytes_sent": node_bytes // 2}
        report.levels = [
            dict(node, level="node reduce-scatter", seconds=t_rs),
            {"level": "rails", "path": rail_rep.path, "codec": rail_rep.codec,
             "topology": rail_topo, "ranks": lay.nodes, "rails": k,
             "bits_per_coord": report.bits_override,
             "per_rail": [{"rail": r[0], "coords": r[1], "wire_bytes_total": r[2],
                           "bits_per_coord": r[3], "path": r[4], "transport": r[5]}
                          for r in sorted(rails)],
             "bytes_sent": rail_rep.bytes_sent, "seconds": t_rail,
             "rail_budget": ("joint" if hook is not None and hook.shared > 1 else "even")},
            dict(node, level="node all-gather", seconds=t_ag),
        ]
        if rail_topo != topology:
            report.levels[1]["note"] = (f"butterfly needs a power-of-two node count "
                                        f"({lay.nodes}): the rails ran the ring")
        return shaped, report

    def reduce_scatter(self, coll, x, out, agreed, *, codec, topology, op, seed, counter,
                       transport, tile_bytes, nonfinite, return_report):
        """Hierarchical reduce-scatter: local rank l's shard is the chunks of
        the ranks of local index l, summed in the node; the rail's
        reduce-scatter hands node j its rank's chunk."""
        from ..report import Report
        t0 = time.perf_counter()
        lay = self.layout
        (flat, flat_out, backend, on_device, level, level_why, src, xp, length, dtype, n, k,
         rail_topo) = self._start(coll, agreed, nonfinite, topology)
        m = length // n

        order = self._chunk_order(xp)
        t1 = time.perf_counter()
        shard = level.reduce_scatter(src.reshape(n, m)[order].reshape(k, lay.nodes * m))
        t_rs = _seconds_since(t1, xp, return_report)
        mine, rail_rep, t_rail = self._rail_call(
            "reduce_scatter", shard, on_device and not level.device_arrays, dict(
                codec=codec, topology=rail_topo, seed=seed, counter=counter,
                transport=transport, tile_bytes=tile_bytes, nonfinite=nonfinite))
        if op == "mean":
            mine = _mean(mine, n)
        result = _deliver(mine, flat_out, out, backend, on_device)
        if not return_report:
            return result, None
        rails = self.node.allgather((lay.local, rail_rep.wire_bytes_total))
        wire = sum(r[1] for r in rails)
        report = Report(codec=rail_rep.codec, topology=topology, world_size=n, length=length,
                        dtype=dtype_name(dtype), op=op, seed=int(seed), call_counter=counter,
                        transport=rail_rep.transport, path="compressed",
                        wire_bytes_total=wire, stats_bytes_total=rail_rep.stats_bytes_total,
                        bytes_sent=rail_rep.bytes_sent, seconds=time.perf_counter() - t0,
                        codec_info=dict(rail_rep.codec_info, nodes=lay.describe()),
                        collective="reduce_scatter", hierarchy="nodes",
                        control_plane=coll.control_plane,
                        bits_override=(wire * 8.0 / ((lay.nodes - 1) * length)
                                       if lay.nodes > 1 and length else 0.0))
        report.levels = [
            {"level": "node reduce-scatter", "path": "uncompressed", "codec": dtype_name(dtype),
             "ranks": k, "transport": level.name, "transport_reason": level_why,
             "seconds": t_rs},
            {"level": "rails", "path": "compressed", "codec": rail_rep.codec,
             "topology": rail_topo, "ranks": lay.nodes, "rails": k,
             "bits_per_coord": report.bits_override, "seconds": t_rail}]
        return result, report


class NodeCalls:
    """A call runner's hierarchy route; ``make_rail(plane)`` makes a rail's flat runner."""

    def __init__(self, runtime, layout, node_size, rail_budget, links, make_rail,
                 gather="ring"):
        self.plane, self.size, self.control_plane = runtime.plane, runtime.size, runtime.plane.name
        self.layout = layout            # the codecs' layout (phases.default_layout)
        self.gather = gather            # the rails' all-gather (agreed over the whole plane)
        self.node_size, self.rail_budget, self.links = node_size, rail_budget, links
        self._make_rail = make_rail
        self._levels = self._found = None   # Levels; the nodes found for hierarchy="auto"
        self._auto = None               # whether "auto" may use nodes (decided once)

    def auto_layout(self):
        """(nodes, node size) that hierarchy="auto" may use, or None where levels
        cannot help; found once, the ranks agreeing on asking, ``node_size``
        and the links."""
        if self._auto is not None:
            return self._auto or None
        k, n = self.node_size, self.size
        if k is not None and not (n % k == 0 and 1 < k < n):
            self._auto = False
            return None
        from ..errors import InputMismatchError
        from ..control.agreement import agree
        from .phases import check_agreed
        asks = agree(self.plane, {"hierarchy": "auto", "node_size": k, "links": self.links})
        if any(not isinstance(a, dict) or a.get("hierarchy") != "auto" for a in asks):
            raise InputMismatchError("ranks disagree on hierarchy: some ask 'auto', others not")
        for field in ("node_size", "links"):
            check_agreed([a.get(field) for a in asks], f"the {field} of hierarchy='auto'")
        if k is None:
            try:
                layout = find_nodes(self.plane, None)
            except InvalidInputError:       # unequal nodes: flat (the same on every rank)
                layout = None
            if layout is not None and 1 < layout.node_size < n:
                self._found, k = layout, layout.node_size
        self._auto = (n // k, k) if k else False
        return self._auto or None

    def run(self, collective, x, out, **call):
        """A hierarchical call, agreed over the whole plane, run on the node and rail planes."""
        from .phases import check_nonfinite
        check_nonfinite(call["nonfinite"])
        return_report = call.pop("return_report")
        agreed = agree_call(self, x, out, collective, **call)
        levels = self.levels()
        if collective == "reduce_scatter":
            call.pop("path")
            return levels.reduce_scatter(self, x, out, agreed, return_report=return_report, **call)
        return levels.allreduce(self, x, out, agreed, return_report=return_report, **call)

    def levels(self) -> Levels:
        """The node and rail planes (made by the first call, collectively)."""
        if self._levels is None:
            layout = self._found or find_nodes(self.plane, self.node_size)
            self._levels = Levels(self.plane, layout, self._make_rail)
        return self._levels

    def free(self):
        if self._levels is not None:
            self._levels.free()
            self._levels = None
