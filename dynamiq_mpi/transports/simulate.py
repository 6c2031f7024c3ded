"""All ranks of a collective in one process: each program runs until it
waits for a message or an agreement; messages match per (source,
destination) in posting order, as MPI and NCCL match them; a size mismatch
is an error, and so is a deadlock.
"""
from __future__ import annotations

from collections import defaultdict, deque

from .ops import (Agree, Claim, Exchange, ExchangeAll, Mark, Received, Route, compressed_route,
                  payload_array)


class _Rank:
    __slots__ = ("program", "answer", "waiting", "done", "result")

    def __init__(self, program):
        self.program = program
        self.answer = None
        self.waiting = None      # the Agree or Claim this rank is blocked on
        self.done = False
        self.result = None


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
        ranks = [_Rank(p) for p in programs]
        sent = defaultdict(deque)        # (src, dst) -> payload copies not yet received
        posted = defaultdict(deque)      # (src, dst) -> Received handles not yet filled

        def deliver(src, dst):
            while sent[(src, dst)] and posted[(src, dst)]:
                msg, handle = sent[(src, dst)].popleft(), posted[(src, dst)].popleft()
                if msg.nbytes != handle.buffer.nbytes:
                    raise RuntimeError(f"rank {dst} expected {handle.buffer.nbytes} bytes from "
                                       f"{src}, got {msg.nbytes}")
                handle.buffer[...] = msg
                handle.token = True      # filled

        def post(r, req):
            """Rank r's exchange: its message queued, its receive posted (a handle)."""
            if req.send is not None:
                sent[(r, req.dest)].append(payload_array(req.send).copy())
                deliver(r, req.dest)
            handle = None
            if req.recv is not None:
                handle = Received(req.recv, False)
                posted[(req.source, r)].append(handle)
                deliver(req.source, r)
            return handle

        def step(r, state):
            """Advance rank r until it blocks or ends; True if it moved."""
            moved = False
            while not state.done:
                if state.waiting is not None:
                    req = state.waiting
                    if isinstance(req, Claim):
                        if not req.handle.token:
                            return moved
                        state.answer, state.waiting = req.handle.buffer, None
                    else:
                        return moved     # Agree: resolved by the caller of step()
                try:
                    req = state.program.send(state.answer)
                except StopIteration as fin:
                    state.done, state.result = True, fin.value
                    return True
                moved = True
                state.answer = None
                if isinstance(req, Exchange):
                    state.answer = post(r, req)
                elif isinstance(req, ExchangeAll):
                    state.answer = [post(r, x) for x in req.exchanges]
                elif isinstance(req, (Claim, Agree)):
                    state.waiting = req
                elif isinstance(req, Route):     # no all-reduce of its own: compressed
                    state.answer = compressed_route(req, self.name)
                elif isinstance(req, Mark):
                    pass
                else:
                    raise RuntimeError(f"unknown request {req!r}")
            return moved

        while not all(s.done for s in ranks):
            moved = False
            for r, s in enumerate(ranks):
                moved |= step(r, s)
            agreeing = [s for s in ranks if isinstance(s.waiting, Agree)]
            if agreeing and len(agreeing) == len(ranks):
                values = [s.waiting.value for s in ranks]
                for s in ranks:
                    s.answer, s.waiting = list(values), None
                moved = True
            if not moved:
                finished = [r for r, s in enumerate(ranks) if s.done]
                if agreeing and finished:
                    raise RuntimeError(f"ranks {finished} finished while others wait to agree")
                raise RuntimeError("simulated ranks deadlocked: every rank waits for a message "
                                   "that no rank will send")
        return [s.result for s in ranks]
