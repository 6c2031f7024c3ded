"""The hierarchical (nodes, then rails) all-reduce of many simulated ranks,
in memory independent of the number of ranks (``levels_allreduce``).

The definition (issue 31; the multi-process implementation follows it to
the letter).  ``n = N * K`` ranks, node ``j`` holding ranks ``jK .. jK+K-1``:

1. in-node sum: ``s_j = x_{jK} + x_{jK+1} + ... + x_{jK+K-1}``, added left to
   right in local-rank order, in the input's dtype (float32 adds; bfloat16:
   rounded after each add);
2. shards: the length-``L`` vector is cut into ``K`` contiguous shards of
   ``m = ceil(L / K)`` elements, shard ``l`` = ``[l m, min(L, (l+1) m))`` (the
   last ones may be shorter or empty);
3. rail ``l``: the flat compressed all-reduce (op "sum", the call's codec and
   topology, the call's seed and counter on every rail) over the ``N`` node
   sums' shard ``l`` (rail rank ``j`` = node ``j``); an empty shard is
   skipped.  A butterfly over a node count that is not a power of two runs
   the ring on that level (``rail_topology`` says which ran);
4. the result is the rails' results concatenated (op "mean": divided by
   ``n`` at the end, one float32 division).

Bits per coordinate: the rails' wire bytes (statistics included) over the
input's ``L`` coordinates, with the flat accounting ``2 (N - 1) L``: the
rails' own bits per coordinate weighted by shard length.  The in-node phases
are not compressed and are not counted.

``levels_allreduce`` runs the rails one after another through
:func:`~dynamiq_mpi.studies.scale_sim.scale_allreduce`, each on a
:class:`NodeShardSource` that produces node sums of one shard on demand from
the flat study's :class:`RankSource` (``K`` rank rows summed per node row,
never all ``n`` inputs at once).  ``levels_simulate`` is the same definition
over explicit inputs with :func:`~dynamiq_mpi.simulate_allreduce` on each
shard: it runs any codec (THC, OmniReduce) and any input dtype, in memory
``n`` times the vector.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .. import schedules
from ..codecs.base import DEFAULT_TILE_BYTES
from .scale_sim import RankSource, _vnmse, scale_allreduce

# The source rows a shard is read in: the smallest row every source serves
# (LogNormalMixture pairs elements within blocks of 32).
SOURCE_ROW = 32


def rail_topology(topology: str, nodes: int) -> str:
    """The topology the rail level runs: the butterfly needs a power-of-two
    node count; on any other count the rails run the ring (never an error)."""
    schedules.check_topology(topology, 1)          # the name only
    if topology == "butterfly" and nodes & (nodes - 1):
        return "ring"
    return topology


def shards(length: int, node_size: int):
    """The ``node_size`` shards ``(start, stop)`` of step 2 (empty ones included)."""
    m = -(-length // node_size) if length else 0
    return [(min(length, l * m), min(length, (l + 1) * m)) for l in range(node_size)]


def _check(n, node_size):
    if node_size < 1 or n < 1 or n % node_size:
        raise ValueError(f"{n} ranks do not make nodes of {node_size}: the hierarchical "
                         "all-reduce needs equal nodes (ranks a multiple of the node size)")
    return n // node_size


class NodeShardSource(RankSource):
    """Rail inputs: rank ``j`` of this source is node ``j``'s in-node sum
    (float32, added in local-rank order) over the shard ``[start, stop)`` of
    ``source``.  ``rows_with_exact`` also gives the float64 sum of the node's
    inputs, so the rail's exact sum is that of the original ranks."""

    name = "node sums"

    def __init__(self, source: RankSource, node_size: int, start: int, stop: int):
        self.source, self.k = source, int(node_size)
        self.start, self.stop = int(start), int(stop)
        self.length = self.stop - self.start
        self.ranks = None if source.ranks is None else source.ranks // self.k

    def rows(self, xp, rank_of_row, row):
        return self._sums(xp, rank_of_row, row, False)[0]

    def rows_with_exact(self, xp, rank_of_row, row):
        return self._sums(xp, rank_of_row, row, True)

    def _sums(self, xp, rank_of_row, row, exact):
        if row % SOURCE_ROW:
            raise ValueError(f"rows of {row} elements: a shard is read in rows of {SOURCE_ROW}")
        nodes = np.asarray(rank_of_row, dtype=np.int64)
        a, b, k, rs = self.start, self.stop, self.k, SOURCE_ROW
        g0, g1 = a // rs, -(-b // rs)             # the source rows that cover the shard
        lo = a - g0 * rs
        if g1 <= g0:
            empty = xp.zeros(0, dtype=np.float32)
            return empty, (xp.zeros(0, dtype=np.float64) if exact else None)
        # A shard that starts inside a source row puts a rail row boundary
        # inside source rows: such a row holds two nodes' elements, read as
        # the node of its first element (A) and of its last (B).
        g = np.arange(g0, g1, dtype=np.int64)
        first = np.maximum(g * rs, a) - a
        last = np.minimum((g + 1) * rs, b) - 1 - a
        node_a, node_b = nodes[first // row], nodes[last // row]
        mixed = bool((node_a != node_b).any())
        if mixed:
            elem_node = nodes[np.arange(self.length) // row]
            take_b = xp.asarray(elem_node != np.repeat(node_a, rs)[lo:lo + self.length])
        acc = acc64 = None
        for t in range(k):                        # local-rank order: the sum's order
            y = self.source.span(xp, node_a * k + t, rs, g0)[lo:lo + self.length]
            if mixed:
                yb = self.source.span(xp, node_b * k + t, rs, g0)[lo:lo + self.length]
                y = xp.where(take_b, yb, y)
            if acc is None:
                acc = xp.array(y, dtype=np.float32, copy=True)    # never a view of the source
            else:
                acc += y                                          # float32 adds
            if exact:
                acc64 = y.astype(np.float64) if acc64 is None else acc64 + y
        return acc, acc64


@dataclass
class LevelsResult:
    """What :func:`levels_allreduce` / :func:`levels_simulate` return."""
    out: object                       # the result (every rank's, bit for bit)
    exact: object = None              # float64 sum of the n inputs (when asked for)
    vnmse: float | None = None
    bits_per_coord: float = 0.0
    wire_bytes_total: int = 0         # the rail level's, statistics included
    stats_bytes_total: int = 0
    nodes: int = 0
    node_size: int = 1
    topology: str = "ring"            # asked for
    rail_topology: str = "ring"       # run on the rail level
    codec: str = ""
    codec_info: dict = field(default_factory=dict)
    rails: list = field(default_factory=list)      # per rail: shard, bytes, bits, seconds
    seconds: float = 0.0


def _merge_info(infos):
    """The rails' codec reports as one: width counts summed (super-groups of
    the whole vector), ``budget_binds`` if it binds on any rail."""
    if not infos:
        return {}
    merged = dict(infos[0])
    if all("widths" in i for i in infos):
        widths = {}
        for i in infos:
            for w, c in i["widths"].items():
                widths[w] = widths.get(w, 0) + c
        merged["widths"] = widths
    if all("budget_binds" in i for i in infos):
        merged["budget_binds"] = any(i["budget_binds"] for i in infos)
    return merged


def _finish(res, out, total, n, op, xp, wire, stats, length, nodes):
    if op == "mean":              # one division of the float32 value, then the dtype's rounding
        out = (out.astype(np.float32) / np.float32(n)).astype(out.dtype)
    res.out = out
    res.wire_bytes_total, res.stats_bytes_total = wire, stats
    res.bits_per_coord = wire * 8.0 / (2.0 * (nodes - 1) * length) if nodes > 1 and length else 0.0
    if total is not None:
        res.exact = total
        # no coordinate, no error (as the flat study reports an empty call)
        res.vnmse = _vnmse(xp, out, total / n if op == "mean" else total) if length else 0.0
    return res


def levels_allreduce(source: RankSource, n: int, node_size: int, *, codec=None,
                     topology="ring", op="sum", seed=0, counter=0,
                     tile_bytes=DEFAULT_TILE_BYTES, xp=None, exact=True, progress=False,
                     detailed=False) -> LevelsResult:
    """The hierarchical all-reduce (module docstring) of ``n`` ranks in nodes
    of ``node_size`` whose inputs ``source`` produces (float32), rail by rail
    with :func:`scale_allreduce`: memory independent of ``n``.  ``exact``:
    also the float64 sum of the inputs and the vNMSE against it."""
    xp = np if xp is None else xp
    nodes = _check(n, node_size)
    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
    if source.ranks is not None and source.ranks < n:
        raise ValueError(f"the source has {source.ranks} ranks, {n} asked for")
    rail_topo = rail_topology(topology, nodes)
    length = source.length
    t0 = time.perf_counter()
    out = xp.zeros(length, dtype=np.float32)
    total = xp.zeros(length, dtype=np.float64) if exact else None
    wire = stats = 0
    rails, infos, name = [], [], ""
    for l, (a, b) in enumerate(shards(length, node_size)):
        if a == b:
            continue                               # an empty shard has no rail call
        r = scale_allreduce(NodeShardSource(source, node_size, a, b), nodes, codec=codec,
                            topology=rail_topo, op="sum", seed=seed, counter=counter,
                            tile_bytes=tile_bytes, xp=xp, exact=exact, progress=progress,
                            detailed=detailed)
        out[a:b] = r.out
        if total is not None:
            total[a:b] = r.exact
        wire += r.wire_bytes_total
        stats += r.stats_bytes_total
        name = name or r.codec
        infos.append(r.codec_info)
        rails.append(dict(rail=l, start=a, stop=b, bits_per_coord=r.bits_per_coord,
                          wire_bytes_total=r.wire_bytes_total, codec=r.codec,
                          seconds=r.seconds.get("total", 0.0)))
    res = LevelsResult(out, nodes=nodes, node_size=node_size, topology=topology,
                       rail_topology=rail_topo, codec=name, codec_info=_merge_info(infos),
                       rails=rails)
    _finish(res, out, total, n, op, xp, wire, stats, length, nodes)
    res.seconds = time.perf_counter() - t0
    return res


def node_sums(xs, node_size):
    """Step 1 over explicit inputs: each node's sum in the inputs' dtype,
    added left to right (a NumPy add of two bfloat16 arrays rounds once)."""
    xs = [np.asarray(x).reshape(-1) for x in xs]
    nodes = _check(len(xs), node_size)
    sums = []
    for j in range(nodes):
        acc = xs[j * node_size].copy()
        for x in xs[j * node_size + 1:(j + 1) * node_size]:
            acc = acc + x
        sums.append(acc.astype(xs[0].dtype, copy=False))
    return sums


def levels_simulate(xs, node_size, *, codec=None, topology="ring", op="sum", seed=0,
                    counter=0, tile_bytes=DEFAULT_TILE_BYTES) -> LevelsResult:
    """The same definition over explicit inputs (every rank's array, any
    dtype simulate_allreduce takes), each rail by
    :func:`~dynamiq_mpi.simulate_allreduce`: any codec, memory ``n`` vectors."""
    from .. import simulate_allreduce
    t0 = time.perf_counter()
    n = len(xs)
    sums = node_sums(xs, node_size)
    nodes = len(sums)
    rail_topo = rail_topology(topology, nodes)
    length = sums[0].shape[0]
    out = np.zeros(length, dtype=sums[0].dtype)
    wire = stats = 0
    rails, infos, name = [], [], ""
    for l, (a, b) in enumerate(shards(length, node_size)):
        if a == b:
            continue
        t1 = time.perf_counter()
        outs, reps = simulate_allreduce([s[a:b] for s in sums], codec=codec, topology=rail_topo,
                                        op="sum", seed=seed, counter=counter,
                                        tile_bytes=tile_bytes, return_reports=True)
        out[a:b] = outs[0]
        rep = reps[0]
        wire += rep.wire_bytes_total
        stats += rep.stats_bytes_total
        name = name or rep.codec
        infos.append(rep.codec_info)
        rails.append(dict(rail=l, start=a, stop=b, bits_per_coord=rep.bits_per_coord,
                          wire_bytes_total=rep.wire_bytes_total, codec=rep.codec,
                          seconds=time.perf_counter() - t1))
    total = np.sum(np.stack([np.asarray(x, dtype=np.float64).reshape(-1) for x in xs]), axis=0)
    res = LevelsResult(out, nodes=nodes, node_size=node_size, topology=topology,
                       rail_topology=rail_topo, codec=name, codec_info=_merge_info(infos),
                       rails=rails)
    _finish(res, out, total, n, op, np, wire, stats, length, nodes)
    res.seconds = time.perf_counter() - t0
    return res
