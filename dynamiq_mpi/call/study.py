"""The study interface: what the simulators beside the package (``research/``)
run of the call machinery, so that a simulated rank runs the library's own
code rather than a copy of it.  These names stay put for them; the rest of
``call/`` and ``transports/`` may change without notice
(``tests/test_layers.py`` keeps the studies to this module, the public API
and the declared interfaces of docs/design.md).

* the engine's per-rank program of one call (``rank_program`` over a
  ``CallSpec``, fresh buffers: ``FRESH``) and the transport that drives all
  ranks of it in one process (``SimulatedTransport``);
* the rails of the hierarchical call: how a node's shard is cut into rails
  (``rail_blocks``, ``rail_index``, ``rail_length``, ``rail_scatter``,
  ``rail_gather``, blocks of ``BLOCK`` elements), their topology
  (``rail_topology``) and how the rails share the bit budget
  (``RAIL_BUDGETS``, ``applies``, ``rail_shares``).
"""
from ..transports.simulate import SimulatedTransport
from .engine import rank_program
from .phases import CallSpec
from .hierarchy import (BLOCK, rail_blocks, rail_gather, rail_index, rail_length, rail_scatter,
                        rail_topology)
from .rail_budget import RAIL_BUDGETS, applies, rail_shares
from .workspace import FRESH

__all__ = ["SimulatedTransport", "CallSpec", "rank_program", "FRESH", "BLOCK", "rail_blocks",
           "rail_gather", "rail_index", "rail_length", "rail_scatter", "rail_topology",
           "RAIL_BUDGETS", "applies", "rail_shares"]
