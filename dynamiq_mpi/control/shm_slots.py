"""Shared-memory slots for a torch plane on one host (docs/design.md,
"Control planes"): all-gathers of a few bytes as a store and a poll.  Per
rank two slots (the call's parity) of a sequence number and ``SLOT`` bytes;
store-then-flag relies on x86's total store order.  Rank 0 removes the
segment's name once every member attached: nothing is left in /dev/shm.
"""
from __future__ import annotations

import contextlib
import platform
import time

import numpy as np

SLOT = 64                  # bytes a rank may contribute to one all-gather
SPIN_S = 200e-6            # poll this long, then yield the processor between polls


def supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


class SharedSlots:
    def __init__(self, store, rank: int, size: int, timeout_s: float):
        from multiprocessing import shared_memory
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.ok, self.why, self._shm, self._owner = False, "", None, rank == 0
        self.count = 0
        nbytes = size * 2 * (8 + SLOT)
        try:
            if self._owner:
                self._shm = shared_memory.SharedMemory(create=True, size=nbytes)
                store.set("shm", self._shm.name)
            else:
                name = store.get("shm").decode()
                self._shm = shared_memory.SharedMemory(name=name)
                _untrack(self._shm)
            buf = self._shm.buf
            self.seq = np.ndarray((size, 2), np.uint64, buf, 0)
            self.data = np.ndarray((size, 2, SLOT), np.uint8, buf, size * 2 * 8)
            if self._owner:
                self.seq[...] = 0
            self.ok = True
        except Exception as exc:      # no slots on this rank: the caller agrees on it
            self.why = f"{type(exc).__name__}: {exc}"
            self.close()

    def allgather(self, mine: bytes) -> list:
        k = len(mine)
        self.count += 1
        p = self.count & 1
        self.data[self.rank, p, :k] = np.frombuffer(mine, np.uint8)
        self.seq[self.rank, p] = self.count          # after the bytes (x86: in order)
        column = self.seq[:, p]
        start = time.perf_counter()
        while (column < self.count).any():
            waited = time.perf_counter() - start
            if waited > SPIN_S:
                if waited > self.timeout_s:
                    late = [r for r in range(self.size) if column[r] < self.count]
                    raise TimeoutError(f"dynamiq_mpi: ranks {late} of the plane did not "
                                       f"arrive within {self.timeout_s:.0f} s")
                time.sleep(0)
        return [self.data[r, p, :k].tobytes() for r in range(self.size)]

    def release_name(self):
        """Once every member attached: remove the segment's name (the mappings stay)."""
        if self._owner and self._shm is not None:
            with contextlib.suppress(Exception):
                self._shm.unlink()
            self._owner = False

    def close(self):
        shm, self._shm = self._shm, None
        self.ok = False
        if shm is None:
            return
        self.seq = self.data = None
        with contextlib.suppress(Exception):
            shm.close()
            if self._owner:
                shm.unlink()


def _untrack(shm):
    """Leave the segment's removal to its creator (Python < 3.13's resource
    tracker would remove it when an attaching process exits)."""
    with contextlib.suppress(Exception):
        from multiprocessing import resource_tracker
        resource_tracker.unregister(shm._name, "shared_memory")
