"""All-reduce schedules as plain data: per rank and step, which chunk goes to
whom and comes from whom, and the round of the step (a round's steps share
their peers and need nothing received in that round: they are posted
together).  The rank of *role* ``v = (rank - c) mod n`` for chunk ``c``
quantizes it once, as event ``v``; the sink is role ``n - 1``.  The
all-gather forwards the sinks' bytes unchanged, over a ring (n - 1 rounds)
or by recursive doubling (ceil(log2 n) rounds, the same bytes per rank).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

REDUCE = "reduce"   # reduce-scatter step: send a (re)compressed partial sum
GATHER = "gather"   # all-gather step: forward compressed bytes unchanged

TOPOLOGIES = ("ring", "butterfly")
GATHERS = ("ring", "doubling")

# A call's statistics (a few bytes per 256 elements) over 3 to
# STATS_DIRECT_RANKS ranks, up to STATS_DIRECT_BYTES, are reduce-scattered and
# all-gathered directly, every peer at once: two rounds of n - 1 messages
# instead of the topology's 2 (n - 1) steps, the same bytes per rank (a
# latency-bound call pays per step).  Larger vectors take the steps: sent
# directly, more of their bytes would cross a node's NICs.  Two ranks: one
# exchange.
STATS_DIRECT_RANKS = 8
STATS_DIRECT_BYTES = 1 << 20


# The all-gather's schedule, $DYNAMIQ_GATHER: "ring" (the default) or
# "doubling", ceil(log2 n) rounds instead of n - 1 with the same bytes per
# rank, for latency-bound links with the call's ranks on one host or one a
# host.  (On a flat call over nodes of several GPUs the doubling's far rounds
# send every rank's bytes across a node's NICs at once.)
DEFAULT_GATHER = "ring"


def stats_direct(n: int, nbytes: int, ranks=STATS_DIRECT_RANKS, max_bytes=STATS_DIRECT_BYTES):
    """Whether ``nbytes`` of statistics over ``n`` ranks travel directly."""
    return 2 < n <= ranks and nbytes <= max_bytes


@dataclass(frozen=True)
class Step:
    phase: str       # REDUCE or GATHER
    send_chunk: int
    dest: int
    recv_chunk: int
    source: int
    round: int       # within the phase; a round's steps are posted together


def rounds(steps):
    """Consecutive steps of one phase and round, as lists, in order."""
    out = []
    for st in steps:
        if out and (out[-1][0].phase, out[-1][0].round) == (st.phase, st.round):
            out[-1].append(st)
        else:
            out.append([st])
    return out


@dataclass(frozen=True)
class Schedule:
    topology: str
    size: int
    steps: tuple            # steps[rank] -> tuple[Step, ...], same length for every rank
    gather: str = "ring"
    rounds: tuple = ()      # rounds[rank] -> the rank's steps grouped by rounds()

    def owned_chunk(self, rank: int) -> int:
        """The chunk this rank is the sink of (role n - 1)."""
        return (rank + 1) % self.size

    def event(self, rank: int, chunk: int) -> int:
        """Role of ``rank`` in the reduction tree of ``chunk``."""
        return (rank - chunk) % self.size


class TopologyError(ValueError):
    """A topology that cannot run at this world size."""


def check_topology(topology: str, size: int) -> None:
    if topology not in TOPOLOGIES:
        raise TopologyError(f"unknown topology {topology!r}; expected one of {TOPOLOGIES}")
    if size < 1:
        raise TopologyError(f"world size must be >= 1, got {size}")
    if topology == "butterfly" and size & (size - 1):
        raise TopologyError(
            f"butterfly needs a power-of-two number of ranks, got {size}; use topology='ring'")


def _all_gather_steps(rank: int, n: int) -> list:
    # Step s: forward chunk (rank + 1 - s) to the right, receive chunk (rank - s) from the left.
    return [Step(GATHER, (rank + 1 - s) % n, (rank + 1) % n, (rank - s) % n, (rank - 1) % n, s)
            for s in range(n - 1)]


def _doubling_gather_steps(rank: int, n: int) -> list:
    # Rank q sinks chunk q + 1.  Before round k (distance d = 2^k) a rank holds
    # the chunks of the d ranks q = rank, rank - 1, ..., rank - d + 1; it sends
    # the first min(d, n - d) of them to rank + d and receives as many from
    # rank - d, the chunks of ranks rank - d, rank - d - 1, ...  Round 0 is the
    # ring's first step: the rank's own chunk to its right.
    steps, k = [], 0
    while (1 << k) < n:
        d = 1 << k
        steps += [Step(GATHER, (rank - j + 1) % n, (rank + d) % n,
                       (rank - d - j + 1) % n, (rank - d) % n, k)
                  for j in range(min(d, n - d))]
        k += 1
    return steps


def _ring_reduce_steps(rank: int, n: int) -> list:
    # Step s: chunk (rank - s) goes right (role s), chunk (rank - s - 1) comes from the left.
    return [Step(REDUCE, (rank - s) % n, (rank + 1) % n, (rank - s - 1) % n, (rank - 1) % n, s)
            for s in range(n - 1)]


def trailing_ones(v: int) -> int:
    """How many low bits of ``v`` are set: role ``v``'s level in the butterfly's tree."""
    t = 0
    while v & 1:
        v >>= 1
        t += 1
    return t


def _butterfly_reduce_steps(rank: int, n: int) -> list:
    # Chunk c is reduced along a binomial tree over roles v = (rank - c) mod n:
    # role v sends to role v + 2^t, t = trailing ones of v (0->1, 2->3, 1->3, ...),
    # the sink is role n - 1; levels run in order, so every parent has heard its
    # children.  One chunk per rank and step: n - 1 steps, bandwidth-optimal.
    steps = []
    level = 0
    while (1 << level) < n:
        dist = 1 << level
        roles = [v for v in range(n - 1) if trailing_ones(v) == level]
        # a level's roles send to one peer, and none of them hears from it
        # in this level (the parent's level is higher): one round
        for v in roles:
            steps.append(Step(REDUCE, (rank - v) % n, (rank + dist) % n,
                              (rank - dist - v) % n, (rank - dist) % n, level))
        level += 1
    return steps


def reduce_steps(topology: str, rank: int, n: int) -> list:
    return (_ring_reduce_steps if topology == "ring" else _butterfly_reduce_steps)(rank, n)


def gather_steps(gather: str, rank: int, n: int) -> list:
    return (_all_gather_steps if gather == "ring" else _doubling_gather_steps)(rank, n)


@lru_cache(maxsize=64)
def build(topology: str, size: int, gather: str = "ring") -> Schedule:
    check_topology(topology, size)
    if gather not in GATHERS:
        raise ValueError(f"unknown all-gather {gather!r}; expected one of {GATHERS}")
    n = size
    steps = tuple(tuple(reduce_steps(topology, r, n) + gather_steps(gather, r, n))
                  for r in range(n))
    return Schedule(topology, n, steps, gather,
                    tuple(tuple(tuple(g) for g in rounds(s)) for s in steps))
