"""The study interface: what the simulators in ``research/`` run of the call
machinery, so a simulated rank runs the library's own code; these names
stay put, the rest of ``call/`` may change (``tests/test_layers.py``).  The
engine's per-rank program (``rank_program`` over a ``CallSpec``, buffers
``FRESH``) and the transport driving all ranks in one process; the rails of
the hierarchical call: their lengths (blocks of ``BLOCK``), topology and
how they share the bit budget.
"""
from ..transports.simulate import SimulatedTransport
from .engine import rank_program
from .phases import CallSpec
from .hierarchy import BLOCK, rail_length, rail_topology
from .rail_budget import RAIL_BUDGETS, applies, rail_shares
from .workspace import FRESH

__all__ = ["SimulatedTransport", "CallSpec", "rank_program", "FRESH", "BLOCK", "rail_length",
           "rail_topology", "RAIL_BUDGETS", "applies", "rail_shares"]
