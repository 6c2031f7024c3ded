"""What the engine needs from a codec (docs/design.md, "The parts"): an
immutable :class:`Codec` may ask for statistics reduced exactly
(``local_stats``), then builds a per-call :class:`Plan` cutting the stream
into ``n`` chunks of whole records and tiles, one buffer (``wire``) holding
every tile's slot: the all-gather receives into it, decoded in place.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass, field

# Bytes per message: a tile's kernel overlaps the previous tile's transfer but
# costs ~100 us of host time; on 2x H200 at 2^27 BF16 elements 32 MiB beat 8 MiB
# by 1.2x on sockets and matched 128 MiB on NVLink.
DEFAULT_TILE_BYTES = 32 << 20


def signature_of(codec):
    """A codec's signature (computed once per codec object); the repr of
    anything else, which the engine then refuses on every rank alike."""
    return codec.cached_signature() if isinstance(codec, Codec) else repr(codec)


class Codec:
    name = "codec"
    fused_gpu = True                # False: CuPy array code on device arrays
    native_wire = "bfloat16"        # the native path's sum dtype (None: the input's)
    auto_path = False               # path="auto" may go native (BF16 is as accurate)

    def signature(self) -> tuple:
        """Hashable description every rank must agree on before any byte moves."""
        raise NotImplementedError

    def cached_signature(self) -> tuple:
        """:meth:`signature`, computed once per (immutable) codec object."""
        sig = self.__dict__.get("_cached_signature")
        if sig is None:
            sig = self.__dict__["_cached_signature"] = self.signature()
        return sig

    def for_length(self, length: int) -> "Codec":
        """The codec that runs for ``length`` elements (tiny inputs may go uncompressed)."""
        return self

    def local_stats(self, x, backend, workspace, keys=None):
        """(local statistics to all-reduce exactly before planning, or None;
        local state handed to ``plan``); ``keys``: the call's rng.CallKeys."""
        return None, None

    def plan(self, x, reduced_stats, n, keys, backend, local_state, workspace,
             tile_bytes=DEFAULT_TILE_BYTES) -> "Plan":
        raise NotImplementedError


class StreamLayout:
    """Byte offsets of a stream of runs of equal-size units (records),
    ``runs = [(count, unit_bytes), ...]``; cuts cost O(runs), never per unit."""

    def __init__(self, runs):
        self.runs = [(int(c), int(b)) for c, b in runs]
        self.starts = [0]           # unit index where each run starts
        self.byte_starts = [0]
        for c, b in self.runs:
            self.starts.append(self.starts[-1] + c)
            self.byte_starts.append(self.byte_starts[-1] + c * b)
        self.count = self.starts[-1]
        self.nbytes = self.byte_starts[-1]

    def offset(self, s: int) -> int:
        """Byte offset of unit ``s`` (``s == count``: the total)."""
        for k, (c, b) in enumerate(self.runs):
            if s <= self.starts[k + 1]:
                return self.byte_starts[k] + (s - self.starts[k]) * b
        return self.nbytes

    def cut(self, t: int) -> int:
        """The smallest unit index s with offset(s) >= t."""
        if t <= 0:
            return 0
        for k, (c, b) in enumerate(self.runs):
            end = self.byte_starts[k + 1]
            if c and end >= t:
                return self.starts[k] + -(-(t - self.byte_starts[k]) // b)
        return self.count

    def split(self, lo: int, hi: int, parts: int) -> list:
        """Cut units [lo, hi) into ``parts`` contiguous ranges of (nearly) equal bytes."""
        b0, b1 = self.offset(lo), self.offset(hi)
        bounds = [lo]
        for k in range(1, parts):
            target = b0 + (k * (b1 - b0)) // parts
            bounds.append(min(max(self.cut(target), bounds[-1]), hi))
        bounds.append(hi)
        return [(bounds[k], bounds[k + 1]) for k in range(parts)]


@dataclass
class Tiling:
    """Chunks and tiles of one call's compressed stream (units: records)."""
    layout: StreamLayout
    chunks: list        # chunk -> (first unit, end unit)
    chunk_tiles: list   # chunk -> tile ids, the same number for every chunk
    units: list         # tile -> (first unit, end unit)
    offsets: list       # tile -> byte offset of its slot in the wire buffer (aligned)
    nbytes: list        # tile -> bytes
    wire_bytes: int     # size of the wire buffer (slots plus alignment padding)
    # what codecs derive from this tiling alone (shared by calls of the same runs)
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    @functools.cached_property      # (a Tiling is never modified)
    def chunk_nbytes(self):
        return [sum(self.nbytes[t] for t in tiles) for tiles in self.chunk_tiles]


_TILINGS: dict = {}


def _cached_tiling(key, make) -> Tiling:
    tiling = _TILINGS.get(key)
    if tiling is None:
        if len(_TILINGS) > 256:
            _TILINGS.clear()
        tiling = _TILINGS[key] = make()
    return tiling


# Chunks per plan where the engine asks another count (engine_rs.py: one per block).
_CHUNKS: contextvars.ContextVar = contextvars.ContextVar("dynamiq_chunks", default=None)


@contextlib.contextmanager
def plan_chunks(chunks: int):
    """Plans built inside cut their stream into ``chunks`` chunks instead of n."""
    token = _CHUNKS.set(int(chunks))
    try:
        yield
    finally:
        _CHUNKS.reset(token)


# The stream's layout, set by the engine around planning (docs/design.md,
# "Sync-free calls"): "exact" is cut on the host from the plan (one read back),
# "fixed" on the device into slots sized from the budget alone (no read back).
LAYOUTS = ("exact", "fixed")
_LAYOUT: contextvars.ContextVar = contextvars.ContextVar("dynamiq_layout", default="exact")


@contextlib.contextmanager
def plan_layout(layout: str):
    """Plans built inside use ``layout`` ("exact" or "fixed")."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    token = _LAYOUT.set(layout)
    try:
        yield
    finally:
        _LAYOUT.reset(token)


def current_layout() -> str:
    return _LAYOUT.get()


def tile_stream(layout: StreamLayout, n: int, tile_bytes: int) -> Tiling:
    """Cut the stream into ``n`` chunks of (nearly) equal bytes (a ring step
    lasts as long as its largest message), every chunk into as many tiles of
    about ``tile_bytes`` at most, so a step's tiles pair up send for receive.
    Cached: a Tiling is never modified."""
    n = planned_chunks(n)
    return _cached_tiling((tuple(layout.runs), int(n), int(tile_bytes)),
                          lambda: _tile_stream(layout, n, tile_bytes))


def _tile_stream(layout: StreamLayout, n: int, tile_bytes: int) -> Tiling:
    chunks = layout.split(0, layout.count, n)
    largest = max(layout.offset(b) - layout.offset(a) for a, b in chunks)
    per_chunk = max(1, -(-largest // max(1, int(tile_bytes))))
    units, chunk_tiles = [], []
    for a, b in chunks:
        ids = []
        for lo, hi in layout.split(a, b, per_chunk):
            ids.append(len(units))
            units.append((lo, hi))
        chunk_tiles.append(ids)
    nbytes = [layout.offset(b) - layout.offset(a) for a, b in units]
    offsets, at = [], 0
    for nb in nbytes:               # every slot starts aligned (NCCL's fast copy path)
        offsets.append(at)
        at += align_up(nb)
    return Tiling(layout, chunks, chunk_tiles, units, offsets, nbytes, at)


def planned_chunks(n: int) -> int:
    """The chunks a plan cuts its stream into: n, or :func:`plan_chunks`'s."""
    chunks = _CHUNKS.get()
    return int(n) if chunks is None else chunks


def fixed_tiling(n: int, tiles_per_chunk: int, slot_bytes: int) -> Tiling:
    """The fixed layout's tiling: ``n`` chunks of ``tiles_per_chunk`` slots of
    ``slot_bytes``; a tile's records are known on the device only."""
    count = n * tiles_per_chunk
    return _cached_tiling(("fixed", int(n), int(tiles_per_chunk), int(slot_bytes)), lambda: Tiling(
        None, [], [list(range(c * tiles_per_chunk, (c + 1) * tiles_per_chunk)) for c in range(n)],
        [], [t * slot_bytes for t in range(count)], [slot_bytes] * count, count * slot_bytes))


# Slots start at multiples of this: NCCL moves unaligned buffers several times slower.
SLOT_ALIGN = 256


def align_up(nbytes: int) -> int:
    return -(-int(nbytes) // SLOT_ALIGN) * SLOT_ALIGN


class Plan:
    """Per-call state of a codec on one rank (see the module docstring)."""

    tiling: Tiling
    wire: object        # uint8 array holding the whole compressed stream

    @property
    def chunk_tiles(self):
        return self.tiling.chunk_tiles

    @property
    def chunk_nbytes(self):
        return self.tiling.chunk_nbytes

    def tile_nbytes(self, tile: int) -> int:
        return self.tiling.nbytes[tile]

    def sub(self, array, a: int, b: int):
        """``array[a:b]`` of a workspace buffer (``Workspace.sub``'s cached view)."""
        ws = getattr(self, "ws", None)
        return array[a:b] if ws is None else ws.sub(array, a, b)

    def wire_slot(self, tile: int):
        off = self.tiling.offsets[tile]
        return self.sub(self.wire, off, off + self.tiling.nbytes[tile])

    def scratch(self, nbytes: int):
        """A uint8 buffer of ``nbytes`` for the receives of the reduce phase."""
        raise NotImplementedError

    def compress(self, tile: int, event: int):
        """Compress this rank's local values of ``tile`` into its wire slot."""
        raise NotImplementedError

    def accumulate(self, tile: int, payload, acc):
        """acc (None: the local values) + decode(payload), in float32."""
        raise NotImplementedError

    def dar(self, tile: int, payload, acc, event: int):
        """compress(decode(payload) + (acc or the local values)), fused."""
        raise NotImplementedError

    def decode(self, tile: int, payload) -> None:
        """Decode the final compressed sum of ``tile`` into the result."""
        raise NotImplementedError

    def finish(self, divisor: float, out):
        """The result / ``divisor`` into ``out`` (flat, caller's dtype), returned."""
        raise NotImplementedError

    def bind_output(self, out, divisor: float) -> bool:
        """Offer the final buffer before the data phases: a plan that accepts
        (True) decodes straight into ``out`` (may be the input: every read of
        the local values precedes every decode) and ``finish`` completes it."""
        return False

    def report(self, detailed: bool = True) -> dict:
        """What the codec decided (``detailed``: also per super-group data)."""
        return {}
