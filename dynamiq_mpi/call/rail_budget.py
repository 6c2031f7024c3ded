"""One bit allocation over a node's rails (``rail_budget="joint"``;
docs/design.md, "Nodes and levels"): the node's ranks all-gather their
rails' grid summaries and compute the same shares.  A rail without
statistics joins the exchange with nothing after its call and keeps its
budget, so every rank of a node reaches the exchange once per call.
"""
from __future__ import annotations

from ..settings import env_choice

RAIL_BUDGETS = ("joint", "even")
# The node's NICs stay within 5 % of one another; on the Table 7 data at 64 x 8
# (seed 0) the cap kept most of the gain: 3.58e-2 capped, 3.37e-2 not, 5.53e-2 even.
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
    """Each rail's codec from its summary (None: ``codec``): one allocation over the rest."""
    codecs = [codec] * len(summaries)
    joined = [i for i, s in enumerate(summaries) if s is not None]
    if len(joined) >= 2:
        shares = codec.shares_on_grid([summaries[i] for i in joined], RAIL_SHARE_CAP)
        for i, c in zip(joined, shares):
            codecs[i] = c
    return codecs


class JointRailBudget:
    """The plan hook of one rail call (``CallSpec.plan_hook``) and its
    in-node exchange over ``node`` (the node's plane); ``length``: the shard's."""

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
        """After the rail call: join the exchange with nothing if not yet done."""
        if not self.done:
            self._exchange(None)
