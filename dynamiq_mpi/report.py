"""What one all-reduce call sent, returned to the caller (never global state)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Report:
    codec: str
    topology: str
    world_size: int
    length: int
    dtype: str
    op: str
    seed: int
    call_counter: int
    transport: str = ""           # the transport that carried the data: "nccl", "mpi-cuda", "mpi", "simulate"
    transport_reason: str = ""    # why "auto" (or the request) led to it
    path: str = "compressed"      # "compressed" (the codec's ring) or "native" (the transport's own all-reduce)
    path_reason: str = ""         # why: requested, measured crossover, codec, ...
    nonfinite: bool | None = None  # some rank's input held NaN/Inf (None: not checked)
    wire_bytes_total: int = 0     # bytes sent by all ranks, statistics included
    stats_bytes_total: int = 0    # of which the statistics phase
    bytes_sent: int = 0           # bytes this rank sent
    tiles_per_chunk: int = 0      # messages per chunk and step (the pipeline depth)
    gather: str = ""              # the all-gather's schedule: "ring" or "doubling"
    # the device work read nothing back to the host, so a CUDA graph can replay it
    sync_free: bool = False
    seconds: float = 0.0          # host time of the call on this rank
    codec_info: dict = field(default_factory=dict)
    phases: dict = field(default_factory=dict)    # seconds per phase, when profiled
    collective: str = "allreduce"  # or "reduce_scatter"
    control_plane: str = ""       # what carried rank, size and agreement: "mpi" or "torch"
    hierarchy: str = "flat"       # "flat" (one ring/butterfly) or "nodes" (hierarchy.py)
    hierarchy_reason: str = ""    # why, for hierarchy="auto"
    levels: list = field(default_factory=list)   # per level: path, codec, bytes, seconds
    # "nodes": the rail level's compressed wire bytes over the input's coordinates
    bits_override: float | None = None

    @property
    def bits_per_coord(self) -> float:
        """All bytes sent by all ranks x 8 / (2 (n-1)/n x n x length): the
        encoded size per coordinate, metadata included (reduce-scatter: half)."""
        if self.bits_override is not None:
            return self.bits_override
        n = self.world_size
        if n < 2 or self.length == 0:
            return 0.0
        hops = 1.0 if self.collective == "reduce_scatter" else 2.0
        return self.wire_bytes_total * 8.0 / (hops * (n - 1) * self.length)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["bits_per_coord"] = self.bits_per_coord
        return d
