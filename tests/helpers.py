"""Shared test helpers: fresh random inputs, the float64 oracle, bit checks."""
from __future__ import annotations

import contextlib
import hashlib
import os

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)


def fresh_seed() -> int:
    """A new random seed per test run (printed in failures to reproduce)."""
    return int.from_bytes(os.urandom(4), "little")


def rank_inputs(seed: int, n: int, length: int, kind: str = "heavy", dtype=np.float32):
    """Every rank's input, derivable on every rank from the shared seed."""
    rng = np.random.default_rng(seed)
    nsg = -(-length // 256) if length else 0
    xs = []
    for _ in range(n):
        if kind == "heavy":
            scale = np.repeat(10.0 ** rng.uniform(-4, 3, size=nsg), 256)[:length]
            x = rng.standard_t(3, size=length) * scale
        elif kind == "normal":
            x = rng.standard_normal(length)
        else:
            raise ValueError(kind)
        xs.append(x.astype(dtype))
    return xs


def exact_sum(xs) -> np.ndarray:
    """The oracle: an independent float64 NumPy sum."""
    return np.sum(np.stack([np.asarray(x, dtype=np.float64).reshape(-1) for x in xs]), axis=0)


def vnmse(out, exact) -> float:
    out = np.asarray(out, dtype=np.float64).reshape(-1)
    return float(np.sum((out - exact) ** 2) / np.sum(exact ** 2))


def magnitude_nmse(out, xs) -> float:
    """Squared error relative to the squared sum of the ranks' magnitudes,
    sum((out - sum_r x_r)^2) / sum((sum_r |x_r|)^2).

    A quantized hop errs in proportion to the partial sums it carries, which
    sum_r |x_r| bounds, not in proportion to the final sum: where the ranks'
    values cancel (a 1-element input, say) vnmse is unbounded while this stays
    at the codec's resolution.  Use it for short inputs, vnmse for long ones.
    """
    out = np.asarray(out, dtype=np.float64).reshape(-1)
    magnitude = exact_sum([np.abs(x) for x in xs])
    return float(np.sum((out - exact_sum(xs)) ** 2) / np.sum(magnitude ** 2))


def bf16_magnitude_bound(n_ranks: int) -> float:
    """The largest magnitude_nmse a BF16 all-reduce over ``n_ranks`` can
    give: every value on the wire is rounded to nearest-even (8 significant
    bits: relative error <= 2^-8), an element's path holds at most
    ``n_ranks`` roundings (the ring's n-1 partial sums and the gathered sum;
    fewer for butterfly and levels), and every partial sum is bounded by
    sum_r |x_r|.  A heavy-tailed short input whose one element dominates
    comes near it (2.5e-5 seen at 4 ranks: that element erred by 1.6 x 2^-8)."""
    return (n_ranks * 2.0 ** -8) ** 2


@contextlib.contextmanager
def gloo_process_group():
    """torch.distributed over gloo on MPI's ranks (one CPU thread a rank),
    destroyed on leaving: a torch MPI test module's process group."""
    import torch
    import torch.distributed as dist
    import dynamiq_mpi.torch as dqt
    torch.set_num_threads(1)
    dqt.init_process_group_from_mpi("gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()


def digest(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).tobytes()).hexdigest()


def shared_seed(comm) -> int:
    """A fresh seed, the same on every rank of ``comm`` (rank 0 draws it)."""
    return comm.bcast(fresh_seed() if comm.rank == 0 else None)


def same_everywhere(comm, value) -> bool:
    """True if every rank of ``comm`` holds an equal ``value``."""
    values = comm.allgather(value)
    return all(v == values[0] for v in values)


def assert_identical_everywhere(comm, out):
    """Every rank's ``out`` has the same bytes."""
    digests = comm.allgather(digest(out))
    assert len(set(digests)) == 1, f"ranks disagree: {digests}"


def load_example(name: str):
    """A script of mpi_examples/ imported as a module (they are not a package)."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "mpi_examples", name + ".py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def scale_boundary_input(rng, nsg: int):
    """float32 super-groups whose group maxima sit on the edges of the
    hierarchical scale code (spec 2.7): each super-group's maximum is 255 * u
    for a random BF16 unit u (so its unit is exactly u), and every other group's
    maximum is k * u, its float32 successor (code k + 1) or its predecessor
    (code k), k random in 1..254.  A quarter of the units are subnormal BF16
    (m * 2^-133), where decoded scales fall below FLT_MIN.  Returns (x,
    expected codes (nsg, 16))."""
    exps = rng.integers(-60, 60, nsg)
    mant = rng.integers(0x80, 0x100, nsg)                  # 8 significant bits: a BF16
    u = np.ldexp(mant.astype(np.float64) / 0x80, exps)
    tiny = rng.random(nsg) < 0.25
    u[tiny] = np.ldexp(rng.integers(1, 0x80, int(tiny.sum())).astype(np.float64), -133)
    k = rng.integers(1, 255, (nsg, 16)).astype(np.float64)
    side = rng.integers(-1, 2, (nsg, 16))                  # -1: predecessor, 0: exact, 1: successor
    s = (k * u[:, None]).astype(np.float32)                # exact: 8 bits times 8 bits
    s = np.where(side > 0, np.nextafter(s, np.float32(np.inf)),
                 np.where(side < 0, np.nextafter(s, np.float32(0)), s)).astype(np.float32)
    expect = np.where(side > 0, k + 1, k)
    g0 = rng.integers(0, 16, nsg)
    s[np.arange(nsg), g0] = (255 * u).astype(np.float32)   # fixes the unit at u
    expect[np.arange(nsg), g0] = 255
    x = rng.uniform(-1, 1, (nsg, 16, 16)) * s[:, :, None]
    at = rng.integers(0, 16, (nsg, 16))
    sign = np.where(rng.random((nsg, 16)) < 0.5, -1.0, 1.0)
    np.put_along_axis(x, at[:, :, None], (sign * s)[:, :, None], axis=2)
    return x.astype(np.float32).reshape(-1), expect.astype(np.uint8)


def _widths_at(F, theta, bf16_class):
    """The paper's rule at threshold theta (codecs/allocation.py's form):
    8 bits iff 17 F >= theta, 4 iff 512 F >= theta, 16 iff S16 F >= theta."""
    w = np.where(17.0 * F >= theta, 8, np.where(512.0 * F >= theta, 4, 2))
    if bf16_class:
        w = np.where(4369.0 / 131072.0 * F >= theta, 16, w)
    return np.where(F > 0, w, 0)


def capped_joint_costs(norms, stats_bits, budget, padded, caps, hierarchical=True,
                       bf16_class=True, grid=False):
    """One threshold over all parts' super-groups, no part above its cap,
    by brute force over every threshold allowed (tests only): the smallest
    whose total fits; a part that would pass its cap takes the smallest
    threshold of its own that keeps it under.  The thresholds: the
    candidates ``s F`` (the paper's rule), or with ``grid`` the float64
    values whose low 48 bits are zero (codecs/allocation.py's grid)."""
    from dynamiq_mpi.codecs.allocation import record_bits
    rec = {w: record_bits(w, hierarchical) for w in (2, 4, 8, 16)}
    F = [np.asarray(f, dtype=np.float32).astype(np.float64) for f in norms]

    def cost(i, theta):
        w = _widths_at(F[i], theta, bf16_class)
        return stats_bits[i] + sum(int(np.sum(w == k)) * rec[k] for k in rec)

    scales = (512.0, 17.0) + ((4369.0 / 131072.0,) if bf16_class else ())
    values = [s * v for f in F for v in f[f > 0] for s in scales]
    if grid:       # every grid value from below the smallest s F to above the largest
        bits = np.array(values, dtype=np.float64).view(np.int64) >> 48
        js = np.arange(bits.min() - 1, bits.max() + 2, dtype=np.int64) if values else []
        cands = sorted(float((np.array([j], np.int64) << 48).view(np.float64)[0])
                       for j in js if j >= 0) + [np.inf]
    else:
        cands = sorted(set(values) | {np.inf})
    cands = [0.0] + cands
    own = []
    for i in range(len(F)):
        fits = [t for t in cands if caps is None or cost(i, t) <= caps[i]]
        own.append(fits[0] if fits else np.inf)
    if sum(cost(i, np.inf) for i in range(len(F))) > budget:
        budget = padded
    for t in cands:
        costs = [cost(i, max(t, own[i])) for i in range(len(F))]
        if sum(costs) <= budget:
            return costs
    return [cost(i, max(np.inf, own[i])) for i in range(len(F))]


def joint_rail_codecs(codec, rails, topology, tile_bytes=None, cap=1.05):
    """The joint rail budget (dynamiq_mpi/call/rail_budget.py), written here
    from its definition: ``rails`` holds each non-empty rail's node inputs
    (one array per node).  Every rail's statistics (the codec's local
    statistics of each node's shard, reduced by the exact float32 all-reduce
    in the rail's schedule order: the statistics phase's rule), then one
    allocation over all rails' super-groups under the sum of their budgets,
    its threshold on the grid of float64 values with 4 mantissa bits, no
    rail above ``cap`` times its own budget; what the grid leaves unspent
    shared by length, a rail at its cap passing its part on to the others;
    each rail planned with exactly that share.  Rails below
    ``small_input`` (no statistics) keep the codec; so do all when fewer
    than two rails have statistics."""
    import dynamiq_mpi as dq
    from dynamiq_mpi.backend import backend_for
    from dynamiq_mpi.call.workspace import FRESH
    kw = {} if tile_bytes is None else {"tile_bytes": tile_bytes}
    if getattr(codec, "name", "") != "dynamiq" or not codec.variable_width \
            or codec.fixed_width is not None:
        return [codec] * len(rails)
    assert codec.centring and codec.zero_class       # the statistics' layout read below
    live = [i for i, shards in enumerate(rails)
            if len(shards) > 1 and shards[0].size and codec.for_length(shards[0].size) is codec]
    if len(live) < 2:
        return [codec] * len(rails)
    norms, stats_bits, lengths = [], [], []
    for i in live:
        shards = [np.asarray(s) for s in rails[i]]
        m = shards[0].size
        values = [s if s.dtype in (np.float32, BF16) else s.astype(np.float32) for s in shards]
        local = [np.array(codec.local_stats(v, backend_for(v), FRESH)[0], copy=True)
                 for v in values]
        reduced = dq.simulate_allreduce(local, codec=dq.Exact(), topology=topology, **kw)[0]
        nsg = -(-m // 256)
        norms.append(reduced[nsg:2 * nsg])          # [means | norms | flag, max]
        stats_bits.append(32 * (2 * nsg + 2))
        lengths.append(m)
    budget = codec.bits * sum(lengths)
    padded = codec.bits * 256 * sum(n.size for n in norms) + sum(stats_bits)
    caps = [cap * codec.bits * m for m in lengths]
    costs = capped_joint_costs(norms, stats_bits, budget, padded, caps, codec.hierarchical,
                               codec.bf16_class, grid=True)
    # what the grid left unspent, shared by length under the caps
    from dynamiq_mpi.codecs.allocation import record_bits
    floor2 = sum(sb + int(np.sum(n > 0)) * record_bits(2, codec.hierarchical)
                 for n, sb in zip(norms, stats_bits))
    left = int(np.floor(padded if floor2 > budget else budget)) - sum(costs)
    room = {i: max(0, int(np.floor(cp)) - c) for i, (c, cp) in enumerate(zip(costs, caps))}
    while left > 0:                  # by length, a rail at its cap passing its part on
        open_ = [i for i in room if room[i] > 0]
        give = {i: min(room[i], left * lengths[i] // sum(lengths[j] for j in open_))
                for i in open_}
        if not open_ or not any(give.values()):
            break
        for i, g in give.items():
            costs[i] += g
            room[i] -= g
            left -= g
    out = [codec] * len(rails)
    for i, c, m in zip(live, costs, lengths):
        out[i] = codec.with_exact_bits(c, m)
    return out
