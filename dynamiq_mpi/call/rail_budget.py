"""One bit allocation over a node's rails (the hierarchical call's
``rail_budget="joint"``).

Each rail of a hierarchical call plans its own shard: planned apart, the
rails split the call's budget evenly, so a rail that drew several of the
vector's largest super-groups spends its bits on them and leaves mid-sized
ones at 2 bits, while another rail has bits to spare.  ``"joint"`` gives
the node's rails one allocation instead, the paper's rule with one
threshold over every super-group of the vector, under the whole budget:

1. every rail reduces its statistics over the nodes, as a flat call does;
2. each rank summarises its rail's reduced norms on the host (a count
   of the super-groups per step of a threshold grid and width step:
   ``DynamiQ.share_summary``, a few thousand integers whatever the length),
   and the ranks of a node exchange their summaries (one all-gather inside
   the node, host memory);
3. every rank computes the same shares (``DynamiQ.shares_on_grid``): the
   smallest grid threshold (steps of 2^(1/16)) whose total cost fits the
   budget, no rail above ``RAIL_SHARE_CAP`` (1.05) times its even share,
   what the grid leaves unspent shared by length; each rail then plans its
   share exactly with its own planner.

The rails' norms are the same on every node (each rail's reduction is
exact and alike on its ranks), so every node computes the same shares and
every rail's ranks plan alike.  A rail whose call has no statistics (the
native path, a length below the codec's ``small_input``, a codec without
variable widths) joins the exchange with nothing after its call and keeps
its own budget; the others share theirs.  So no rank waits for a rank that
waits for it: a rail's statistics need only its own ranks, and every rank
of a node reaches the exchange once per call.

What it costs: the summary (on the host, about 2 ms a rail at 2^28
elements in 8 rails; one pass over the norms), one small in-node exchange
and the shares (under a millisecond); for device arrays the call waits for
its statistics on the host there (the summary's copy), where a call with
the rails apart need not; and rails whose bytes differ by up to the cap, so
the slowest rail's NIC may finish up to 5 % later.  On real gradients the
interleaved rails already hold alike samples of the vector and the joint
allocation changes little (docs/error-study.md).  ``"even"`` plans every
rail apart (no exchange).
"""
from __future__ import annotations

from ..settings import env_choice

RAIL_BUDGETS = ("joint", "even")
# No rail takes more than this times its even share: the node's NICs stay
# within 5 % of one another.  On the Table 7 data at 64 x 8 the cap kept
# most of the gain (seed 0: 3.58e-2 capped, 3.37e-2 not, 5.53e-2 "even").
RAIL_SHARE_CAP = 1.05


def default_rail_budget(value=None) -> str:
    """``value``, else ``$DYNAMIQ_RAIL_BUDGET``, else "joint"."""
    return env_choice(value, "DYNAMIQ_RAIL_BUDGET", RAIL_BUDGETS, "rail_budget", "joint")


def joins(codec) -> bool:
    """Whether a call with ``codec`` may share its rails' budget."""
    return bool(getattr(codec, "joins_budgets", False))


def applies(rail_budget: str, nodes: int, node_size: int, codec) -> bool:
    """Whether a hierarchical call shares one allocation over its rails:
    asked for, with rails of more than one node and more than one rail."""
    return rail_budget == "joint" and nodes > 1 and node_size > 1 and joins(codec)


def rail_shares(codec, summaries) -> list:
    """Each rail's codec from its summary (``DynamiQ.share_summary``; None:
    a rail without statistics, which keeps ``codec``): the rails that have
    one share one allocation (``DynamiQ.shares_on_grid``), if two or more."""
    codecs = [codec] * len(summaries)
    joined = [i for i, s in enumerate(summaries) if s is not None]
    if len(joined) >= 2:
        shares = codec.shares_on_grid([summaries[i] for i in joined], RAIL_SHARE_CAP)
        for i, c in zip(joined, shares):
            codecs[i] = c
    return codecs


class JointRailBudget:
    """The plan hook of one rail call (phases.CallSpec.plan_hook) and its
    in-node exchange.  ``node``: the node's plane (ranks in local order);
    ``length``: this rail's shard length."""

    def __init__(self, node, length: int):
        self.node, self.length = node, int(length)
        self.done = False
        self.parts = None           # after the exchange: (length, summary) or None per rail

    def _exchange(self, mine):
        self.done = True            # never twice, whatever happens inside
        self.parts = self.node.allgather(mine)
        return self.parts

    @property
    def shared(self) -> int:
        """How many of the node's rails shared one allocation (0: none)."""
        return sum(p is not None for p in self.parts or ())

    def __call__(self, codec, reduced, backend):
        if self.done:
            return codec
        if not joins(codec):
            self._exchange(None)
            return codec
        parts = self._exchange(codec.share_summary(reduced, self.length))
        return rail_shares(codec, parts)[self.node.rank]

    def finish(self):
        """After the rail call: join the exchange with nothing if the call
        had no statistics to share."""
        if not self.done:
            self._exchange(None)
