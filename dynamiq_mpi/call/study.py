"""The study interface: what ``research/``'s simulators run of the call
machinery (the engine's per-rank program and the simulated transport; the
rails' lengths, topology and shared budget), so a simulated rank runs the
library's own code.  These names stay put; the rest of ``call/`` may change.
"""
from ..transports.simulate import SimulatedTransport
from .engine import rank_program
from .phases import CallSpec
from .hierarchy import BLOCK, rail_length, rail_topology
from .rail_budget import RAIL_BUDGETS, applies, rail_shares
from .workspace import FRESH

__all__ = ["SimulatedTransport", "CallSpec", "rank_program", "FRESH", "BLOCK", "rail_length",
           "rail_topology", "RAIL_BUDGETS", "applies", "rail_shares"]
