"""The agreement: every rank's small record of a call, compared before any
payload byte moves, as a 64-bit digest in one fixed-size all-gather; only
differing digests make the ranks exchange the records, to say who differs.
Steady paths keep a :class:`Digests` and the record's static digest.
"""
from __future__ import annotations

import hashlib
import pickle

import numpy as np

from . import as_plane

_COUNTER_STEP = 0x9E3779B97F4A7C15

_STATIC_DIGESTS: dict = {}     # frozen record (no counter) -> its hash: steady calls repeat one
_AS_IS, _TAGGED = {str, type(None)}, {bool, int, float}     # keyed as is, or with their type


def _frozen(value, skip=None):
    """A hashable key of ``value`` (1, True and 1.0 differ), less a dict's key ``skip``."""
    if isinstance(value, dict):         # (in line: every field of every call's record)
        return tuple([(k, v if type(v) in _AS_IS
                       else (type(v).__name__, v) if type(v) in _TAGGED
                       else _frozen(v))
                      for k, v in sorted(value.items()) if k != skip])
    if isinstance(value, list):
        return ("list",) + tuple([_frozen(v) for v in value])
    return (type(value).__name__, value) if isinstance(value, (bool, int, float)) else value


def record_digest(value) -> int:
    """64-bit digest of an agreement value: a (cached) hash of it without its
    ``counter``, plus the counter times an odd constant."""
    counter, skip = 0, None
    if isinstance(value, dict) and "counter" in value:
        counter, skip = int(value["counter"]), "counter"
    try:
        key = _frozen(value, skip)
        static = _STATIC_DIGESTS.get(key)
    except TypeError:           # an unhashable part: hash it every time
        key = static = None
    if static is None:
        value = {k: v for k, v in value.items() if k != skip} if skip else value
        raw = hashlib.blake2b(pickle.dumps(value, protocol=4), digest_size=8).digest()
        static = int.from_bytes(raw, "little")
        if key is not None:
            if len(_STATIC_DIGESTS) >= 1024:
                _STATIC_DIGESTS.clear()
            _STATIC_DIGESTS[key] = static
    return digest_with_counter(static, counter)


def digest_with_counter(static: int, counter: int) -> int:
    return (static + counter * _COUNTER_STEP) & 0xFFFFFFFFFFFFFFFF


class Digests:
    """One fixed-size all-gather of every rank's digest (:meth:`match`: all
    equal?), its buffers kept; ``plane``: a control plane or an mpi4py communicator."""

    def __init__(self, plane):
        self.plane = as_plane(plane)
        self.mine = np.empty(1, dtype=np.uint64)
        self.everyone = np.empty(self.plane.size, dtype=np.uint64)

    def match(self, digest: int) -> bool:
        self.mine[0] = digest
        self.plane.allgather_array(self.mine, self.everyone)
        return self.everyone.tolist().count(digest) == self.everyone.shape[0]


def agree(plane, value, digests=None):
    """Every rank's small picklable ``value``; where all digests match, none is
    sent (``digests``: the caller's :class:`Digests` of ``plane``, kept across calls)."""
    digests = digests or Digests(plane)
    if digests.match(record_digest(value)):
        return [value] * digests.plane.size
    return digests.plane.allgather(value)
