"""The hierarchical (nodes, then rails) all-reduce of many simulated ranks,
in memory independent of the number of ranks (``levels_allreduce``).

The definition (the multi-process implementation follows it to
the letter).  ``n = N * K`` ranks, node ``j`` holding ranks ``jK .. jK+K-1``:

1. in-node sum: ``s_j = x_{jK} + x_{jK+1} + ... + x_{jK+K-1}``, added left to
   right in local-rank order, in the input's dtype (float32 adds; bfloat16:
   rounded after each add);
2. shards, interleaved: the length-``L`` vector is cut into blocks of
   ``B = 256`` elements (one DynamiQ super-group), block ``j`` =
   ``[j B, min(L, (j+1) B))`` for ``j = 0 .. ceil(L/B) - 1`` (the last may be
   partial); rail ``l`` (``l = 0 .. K-1``) holds the blocks with
   ``j mod K == l``, concatenated in increasing ``j`` (:func:`rail_blocks`,
   :func:`rail_gather`, :func:`rail_scatter`, with the library's
   ``rail_length``; ``dynamiq_mpi/call/hierarchy.py``, the multi-process
   call, cuts the same shards: tests/test_scale_levels.py checks).  The
   rails' lengths differ by at most ``B``; a rail with no block (``K`` > the
   block count) is empty;
3. rail ``l``: the flat compressed all-reduce (op "sum", the call's codec and
   topology, the call's seed and counter on every rail) over the ``N`` node
   sums' shard ``l`` (rail rank ``j`` = node ``j``); an empty shard is
   skipped.  A butterfly over a node count that is not a power of two runs
   the ring on that level (``rail_topology`` says which ran);
4. the result: each rail's result scattered back to its blocks (op "mean":
   divided by ``n`` at the end, one float32 division).

Why interleaved: every rail's statistics and bit budget then cover a sample
of the whole vector (each layer, the embedding table included, is spread
over all rails), so the rails' budgets stay fair; and every rail carries the
same number of coordinates, so every rail's NIC finishes at the same time.
(Contiguous shards of real gradients are very unlike: one rail got the
embedding table's zero rows and could spend only part of its bits.)

Bits per coordinate: the rails' wire bytes (statistics included) over the
input's ``L`` coordinates, with the flat accounting ``2 (N - 1) L``: the
rails' own bits per coordinate weighted by shard length.  The in-node phases
are not compressed and are not counted.

``levels_allreduce`` runs the rails one after another through
:func:`~research.scale_sim.scale_allreduce`, each on a
:class:`NodeRailSource` that produces node sums of one rail's shard on
demand from the flat study's :class:`RankSource` (``K`` rank rows summed per
node row, only the rail's rows generated, never all ``n`` inputs at once;
ArraySource and LogNormalMixture read just those rows, any other source
through its ``span`` from the rail's first row to its last).
``levels_simulate`` is the same definition over explicit inputs with
:func:`~dynamiq_mpi.simulate_allreduce` on each shard: it runs any codec
(THC, OmniReduce) and any input dtype, in memory ``n`` times the vector.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import numpy as np

from dynamiq_mpi.backend import array_module
from dynamiq_mpi.codecs.base import DEFAULT_TILE_BYTES
# the rails' lengths and topology are the library's own, so the simulation
# and the multi-process call (hierarchy.py) cut the same rails
from dynamiq_mpi.call.study import (BLOCK, RAIL_BUDGETS, applies, rail_length,  # noqa: F401
                                    rail_shares, rail_topology)
from dynamiq_mpi.codecs import DEFAULT_CODEC
from dynamiq_mpi.codecs.dynamiq import DynamiQ
from .scale_sim import (ArraySource, LogNormalMixture, RankSource, _vnmse, reduced_statistics,
                        scale_allreduce)


def rail_blocks(length: int, node_size: int, block: int = BLOCK):
    """For each rail ``l`` the increasing numbers ``j`` of its blocks
    (``j % node_size == l``; int64 arrays), block ``j`` being the elements
    ``[j * block, min(length, (j + 1) * block))``."""
    nb = -(-length // block) if length else 0
    return [np.arange(l, nb, node_size, dtype=np.int64) for l in range(node_size)]


def rail_index(length: int, node_size: int, rail: int, block: int = BLOCK):
    """The element positions of rail ``rail``'s shard, in shard order (int64):
    ``x[rail_index(...)]`` is :func:`rail_gather`'s shard."""
    j = rail_blocks(length, node_size, block)[rail]
    idx = (j[:, None] * block + np.arange(block, dtype=np.int64)).reshape(-1)
    return idx[idx < length]


def rail_gather(x, node_size: int, rail: int, block: int = BLOCK):
    """Rail ``rail``'s shard of the vector ``x`` (NumPy or CuPy, 1-D): its
    blocks concatenated in order; a new array, except for ``node_size == 1``."""
    full, elems = x.shape[0] // block, rail_length(x.shape[0], node_size, rail, block)
    if node_size == 1:
        return x
    body = x[:full * block].reshape(full, block)[rail::node_size].reshape(-1)
    tail = x[full * block:full * block + elems - body.shape[0]]   # the partial last block
    return array_module(x).concatenate([body, tail])


def rail_scatter(out, shard, node_size: int, rail: int, block: int = BLOCK):
    """The inverse of :func:`rail_gather`: write ``shard`` (rail ``rail``'s
    elements in shard order) into its blocks of ``out``, in place."""
    full, elems = out.shape[0] // block, rail_length(out.shape[0], node_size, rail, block)
    if shard.shape[0] != elems:
        raise ValueError(f"rail {rail} of {node_size} holds {elems} elements, "
                         f"{shard.shape[0]} given")
    nbody = -(-(full - rail) // node_size) if full > rail else 0     # its whole blocks
    out[:full * block].reshape(full, block)[rail::node_size] = \
        shard[:nbody * block].reshape(nbody, block)
    if elems > nbody * block:
        out[full * block:] = shard[nbody * block:]
    return out


def _check(n, node_size):
    if node_size < 1 or n < 1 or n % node_size:
        raise ValueError(f"{n} ranks do not make nodes of {node_size}: the hierarchical "
                         "all-reduce needs equal nodes (ranks a multiple of the node size)")
    return n // node_size


# ----------------------------------------------------------------------------- rail sources
def _rows_at(source, xp, ranks, row, at, size, cache):
    """Rows ``at[k]`` (rows of ``row`` elements of the whole vector) of ranks
    ``ranks[k]``, concatenated, the first ``size`` elements (the last row may
    be partial).  Only those rows are generated where the source allows it."""
    if hasattr(source, "rows_at"):                     # a source's own hook, if any
        return source.rows_at(xp, ranks, row, at)[:size]
    if isinstance(source, ArraySource):
        blocks = source._data.reshape(source.ranks, -1, row)
        out = blocks[np.asarray(ranks, dtype=np.int64), at].reshape(-1)[:size]
        return out if xp is np else xp.asarray(out)
    if isinstance(source, LogNormalMixture):
        # Every element is a function of (position, rank) through the
        # source's per-row position hashes and scales: a view of the source
        # whose rows are the gathered ones gives the same bits.
        key = (xp.__name__, row)
        view = cache.get(key)
        if view is None:
            idx, std = source._index(xp, row)
            view = copy.copy(source)
            view._cache = {key: (idx[xp.asarray(at)], std[xp.asarray(at)])}
            view.length = size
            cache[key] = view
        return view.span(xp, ranks, row, 0)
    # any other source: the span from the first to the last row, then the rows
    first, k = int(at[0]), int(at[-1]) - int(at[0]) + 1
    fill = np.full(k, int(ranks[0]), dtype=np.int64)
    fill[at - first] = ranks
    y = source.span(xp, fill, row, first)
    pad = k * row - y.shape[0]
    if pad:
        y = xp.concatenate([y, xp.zeros(pad, dtype=y.dtype)])
    return y.reshape(k, row)[xp.asarray(at - first)].reshape(-1)[:size]


class NodeRailSource(RankSource):
    """Rail inputs: rank ``j`` of this source is node ``j``'s in-node sum
    (float32, added in local-rank order) over rail ``rail``'s interleaved
    shard (:func:`rail_blocks`) of ``source``.  A rail row (32 or 256
    elements: a divisor of the block) lies inside one block, so it is one
    row of the whole vector.  ``rows_with_exact`` also gives the float64 sum
    of the node's inputs, so the rail's exact sum is that of the original
    ranks."""

    name = "node sums"

    def __init__(self, source: RankSource, node_size: int, rail: int, block: int = BLOCK):
        self.source, self.k, self.rail, self.block = source, int(node_size), int(rail), int(block)
        self.length = rail_length(source.length, self.k, self.rail, self.block)
        self.ranks = None if source.ranks is None else source.ranks // self.k
        self._at, self._views = {}, {}

    def rows(self, xp, rank_of_row, row):
        return self._sums(xp, rank_of_row, row, False)[0]

    def rows_with_exact(self, xp, rank_of_row, row):
        return self._sums(xp, rank_of_row, row, True)

    def _rows_of(self, row):
        """The whole vector's row number of each rail row."""
        if row not in self._at:
            if self.block % row:
                raise ValueError(f"rows of {row} elements: rail rows must divide the "
                                 f"block of {self.block}")
            q = self.block // row
            r = np.arange(-(-self.length // row), dtype=np.int64)
            self._at[row] = (self.rail + self.k * (r // q)) * q + r % q
        return self._at[row]

    def _sums(self, xp, rank_of_row, row, exact):
        nodes = np.asarray(rank_of_row, dtype=np.int64)
        if self.length == 0:
            empty = xp.zeros(0, dtype=np.float32)
            return empty, (xp.zeros(0, dtype=np.float64) if exact else None)
        at, k = self._rows_of(row), self.k
        acc = acc64 = None
        for t in range(k):                        # local-rank order: the sum's order
            y = _rows_at(self.source, xp, nodes * k + t, row, at, self.length, self._views)
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
    rails: list = field(default_factory=list)      # per rail: blocks, coords, bytes, bits, s
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


def _rail_codecs(codec, rail_budget, nodes, node_size, rails):
    """Each rail's codec: ``codec`` itself, or with ``rail_budget="joint"``
    its share of one allocation over the rails that have statistics
    (``rails``: (rail length, reduced statistics or None) per non-empty rail,
    in rail order; the collective's rule, dynamiq_mpi/call/rail_budget.py)."""
    check_rail_budget(rail_budget)
    if not applies(rail_budget, nodes, node_size, codec):
        return [codec] * len(rails)
    return rail_shares(codec, [None if reduced is None
                               else codec.share_summary(np.asarray(reduced), length)
                               for length, reduced in rails])


def check_rail_budget(rail_budget):
    if rail_budget not in RAIL_BUDGETS:
        raise ValueError(f"rail_budget must be one of {RAIL_BUDGETS}, got {rail_budget!r}")


def levels_allreduce(source: RankSource, n: int, node_size: int, *, codec=None,
                     topology="ring", op="sum", seed=0, counter=0,
                     tile_bytes=DEFAULT_TILE_BYTES, xp=None, exact=True, progress=False,
                     detailed=False, rail_budget="joint") -> LevelsResult:
    """The hierarchical all-reduce (module docstring) of ``n`` ranks in nodes
    of ``node_size`` whose inputs ``source`` produces (float32), rail by rail
    with :func:`scale_allreduce`: memory independent of ``n``.  ``exact``:
    also the float64 sum of the inputs and the vNMSE against it.
    ``rail_budget``: "joint" (one allocation over the rails, as the
    multi-process call's default) or "even"."""
    xp = np if xp is None else xp
    codec = DynamiQ() if codec is None else codec
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
    live = [(l, blocks, NodeRailSource(source, node_size, l))
            for l, blocks in enumerate(rail_blocks(length, node_size))]
    live = [r for r in live if r[2].length]        # an empty shard has no rail call
    rail_stats = [reduced_statistics(rail, nodes, codec=codec, topology=rail_topo, seed=seed,
                                counter=counter, tile_bytes=tile_bytes, xp=xp)
             for _, _, rail in live]
    codecs = _rail_codecs(codec, rail_budget, nodes, node_size,
                          [(rail.length, None if st is None else st[0])
                           for (_, _, rail), st in zip(live, rail_stats)])
    for (l, blocks, rail), st, rail_codec in zip(live, rail_stats, codecs):
        r = scale_allreduce(rail, nodes, codec=rail_codec, topology=rail_topo, op="sum",
                            seed=seed, counter=counter, tile_bytes=tile_bytes, xp=xp,
                            exact=exact, progress=progress, detailed=detailed, statistics=st)
        rail_scatter(out, r.out, node_size, l)
        if total is not None:
            rail_scatter(total, r.exact, node_size, l)
        wire += r.wire_bytes_total
        stats += r.stats_bytes_total
        name = name or r.codec
        infos.append(r.codec_info)
        rails.append(dict(rail=l, blocks=int(blocks.shape[0]), coords=rail.length,
                          bits_per_coord=r.bits_per_coord,
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


class _Collected(Exception):
    """Stops a rail's simulated call once its statistics are reduced."""


def _rail_statistics(shards, codec, topology, seed, counter, tile_bytes):
    """The reduced statistics a simulated rail call plans from (None where
    it has none), through the engine's own statistics phase."""
    from dynamiq_mpi.call.study import FRESH, CallSpec, SimulatedTransport, rank_program
    n = len(shards)
    if n < 2 or shards[0].shape[0] == 0:
        return None
    got = []

    def hook(run, reduced, backend):
        got.append(np.array(backend.to_host(reduced), copy=True))
        raise _Collected

    spec = CallSpec(codec, topology, "sum", seed, counter, "auto", tile_bytes, plan_hook=hook)
    try:
        SimulatedTransport(n).run([rank_program(r, n, shards[r], spec, None, FRESH, False)
                                   for r in range(n)])
    except _Collected:
        return got[0]
    return None                                     # the call had no statistics


def levels_simulate(xs, node_size, *, codec=None, topology="ring", op="sum", seed=0,
                    counter=0, tile_bytes=DEFAULT_TILE_BYTES,
                    rail_budget="joint") -> LevelsResult:
    """The same definition over explicit inputs (every rank's array, any
    dtype simulate_allreduce takes), each rail by
    :func:`~dynamiq_mpi.simulate_allreduce`: any codec, memory ``n`` vectors.
    ``rail_budget`` as in :func:`levels_allreduce`."""
    from dynamiq_mpi import simulate_allreduce
    codec = DEFAULT_CODEC if codec is None else codec
    t0 = time.perf_counter()
    n = len(xs)
    sums = node_sums(xs, node_size)
    nodes = len(sums)
    rail_topo = rail_topology(topology, nodes)
    length = sums[0].shape[0]
    out = np.zeros(length, dtype=sums[0].dtype)
    wire = stats = 0
    rails, infos, name = [], [], ""
    live = [(l, blocks, [rail_gather(s, node_size, l) for s in sums])
            for l, blocks in enumerate(rail_blocks(length, node_size))
            if rail_length(length, node_size, l)]
    joint = applies(rail_budget, nodes, node_size, codec)
    codecs = _rail_codecs(codec, rail_budget, nodes, node_size, [
        (shards[0].shape[0],
         _rail_statistics(shards, codec, rail_topo, seed, counter, tile_bytes) if joint else None)
        for _, _, shards in live])
    for (l, blocks, shards), rail_codec in zip(live, codecs):
        coords = shards[0].shape[0]
        t1 = time.perf_counter()
        outs, reps = simulate_allreduce(shards, codec=rail_codec, topology=rail_topo, op="sum",
                                        seed=seed, counter=counter, tile_bytes=tile_bytes,
                                        return_reports=True)
        rail_scatter(out, outs[0], node_size, l)
        rep = reps[0]
        wire += rep.wire_bytes_total
        stats += rep.stats_bytes_total
        name = name or rep.codec
        infos.append(rep.codec_info)
        rails.append(dict(rail=l, blocks=int(blocks.shape[0]), coords=coords,
                          bits_per_coord=rep.bits_per_coord,
                          wire_bytes_total=rep.wire_bytes_total, codec=rep.codec,
                          seconds=time.perf_counter() - t1))
    total = np.sum(np.stack([np.asarray(x, dtype=np.float64).reshape(-1) for x in xs]), axis=0)
    res = LevelsResult(out, nodes=nodes, node_size=node_size, topology=topology,
                       rail_topology=rail_topo, codec=name, codec_info=_merge_info(infos),
                       rails=rails)
    _finish(res, out, total, n, op, np, wire, stats, length, nodes)
    res.seconds = time.perf_counter() - t0
    return res
