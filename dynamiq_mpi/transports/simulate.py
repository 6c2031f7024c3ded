"""All ranks of a collective in one process, in lockstep.

Used for statistical studies over many seeds and for error studies at large
world sizes without mpiexec.  Every rank program must issue the same kind of
request at the same time (the schedules guarantee it); messages are matched by
(source, destination) in order, and a size mismatch is an error, as it would be
on a real transport.
"""
from __future__ import annotations

from collections import defaultdict, deque


from .ops import AllgatherObject, Exchange


class SimulatedTransport:
    name = "simulate"

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"world size must be >= 1, got {size}")
        self.size = size

    def run(self, programs):
        """Drive one program per rank to completion; returns their results."""
        if len(programs) != self.size:
            raise ValueError(f"expected {self.size} rank programs, got {len(programs)}")
        answers = [None] * self.size
        results = [None] * self.size
        live = list(range(self.size))
        while live:
            requests = {}
            for r in live:
                try:
                    requests[r] = programs[r].send(answers[r])
                except StopIteration as done:
                    results[r] = done.value
            finished = [r for r in live if r not in requests]
            if finished and len(finished) != len(live):
                raise RuntimeError(f"ranks {finished} finished while others still communicate")
            live = [r for r in live if r in requests]
            if not live:
                break
            kinds = {type(q) for q in requests.values()}
            if len(kinds) != 1:
                raise RuntimeError(f"ranks issued different requests at the same step: {kinds}")
            kind = kinds.pop()
            if kind is AllgatherObject:
                values = [requests[r].value for r in range(self.size)]
                for r in live:
                    answers[r] = list(values)
            elif kind is Exchange:
                mailbox = defaultdict(deque)
                for r in live:
                    q = requests[r]
                    mailbox[(r, q.dest)].append(q.payload.copy())
                for r in live:
                    q = requests[r]
                    msg = mailbox[(q.source, r)].popleft()
                    if msg.nbytes != q.recv_nbytes:
                        raise RuntimeError(f"rank {r} expected {q.recv_nbytes} bytes from "
                                           f"{q.source}, got {msg.nbytes}")
                    answers[r] = msg
            else:
                raise RuntimeError(f"unknown request {kind}")
        return results
