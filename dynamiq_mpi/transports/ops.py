"""The requests a rank program makes of its transport.

The engine is one generator per rank; it yields these and a transport answers:

* :class:`Agree` - every rank contributes a small picklable value and gets the
  list of all (the agreement before any data byte moves);
* :class:`Exchange` - post a send and a receive of packed bytes; the answer is
  a :class:`Received` handle, not the data: a transport may still be moving it;
* :class:`Claim` - the engine is about to read a received buffer; the answer is
  the buffer, valid in the order of the caller's computation (for the NCCL
  transport: the compute stream now waits for the receive);
* :class:`Route` - after agreement, the transport and path asked for;
  whoever drives the program chooses the transport that carries the data
  from the agreed records and the path the program runs on it (the same on
  every rank: call/planner.py) and answers a :class:`Routed`;
* :class:`Mark` - a phase boundary, for the per-phase breakdown (a no-op unless
  the transport profiles);
* :class:`NativeAllreduce` - the transport's own uncompressed all-reduce (NCCL's,
  MPI's) of one buffer, in place: the "native" path of a call, which the
  engine runs where the answer to ``Route`` names it.

A payload that is a :class:`Received` handle is forwarded unchanged: it needs
no wait for the computation, only for its own receive.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Agree:
    value: Any


@dataclass
class Exchange:
    """Send ``send`` (a uint8 array or a :class:`Received`) to ``dest`` while
    receiving exactly ``recv.nbytes`` bytes from ``source`` into ``recv``.
    ``send`` or ``recv`` may be None (nothing that way)."""
    send: Any
    dest: int
    recv: Any
    source: int


@dataclass
class Claim:
    handle: "Received"


@dataclass
class Route:
    """The transport asked for, and the path: "compressed" (the codec's
    program) or "native" (the transport's own all-reduce, where it has one),
    with the facts the native path's wire dtype follows: the codec, the
    arrays' backend ("cpu", "gpu") and dtype."""
    transport: str
    path: str = "compressed"
    codec: Any = None
    backend: str = ""
    dtype: str = ""


@dataclass(frozen=True)
class Routed:
    """The answer to :class:`Route`: the transport that carries the call's
    data and the path the program runs on it, "compressed" or "native" (with
    the ``wire`` dtype the transport's all-reduce sums in); ``reason``: why
    a native path asked for runs compressed ("" otherwise)."""
    transport: str
    path: str = "compressed"
    wire: str = ""
    reason: str = ""


def compressed_route(request: Route, transport: str) -> Routed:
    """The answer that runs ``request``'s call compressed on ``transport``,
    saying why where the native path was asked for: ``transport`` has no
    all-reduce of its own for the call's arrays."""
    reason = ""
    if request.path == "native":
        reason = f"no native all-reduce on {transport} for {request.backend} arrays"
    return Routed(transport, reason=reason)


@dataclass
class Mark:
    name: str


@dataclass
class NativeAllreduce:
    """Sum ``send`` (a flat float array) over the ranks into ``recv`` (the
    same array for in place), with the transport's own all-reduce; the
    answer is ``recv``, valid in the caller's stream order.  Every rank gets
    the same bits (NCCL's ring and tree reduce each element on one rank and
    forward the result; MPI's reductions add the same operands,
    commutatively, on every rank)."""
    send: Any
    recv: Any


class Received:
    """A receive posted by :class:`Exchange`; ``buffer`` is where the bytes land."""
    __slots__ = ("buffer", "token")

    def __init__(self, buffer, token=None):
        self.buffer = buffer
        self.token = token


def payload_array(payload):
    """The array behind a payload (an array or a :class:`Received`)."""
    return payload.buffer if isinstance(payload, Received) else payload


def drive(program, answer):
    """Run a rank program, answering each request with ``answer(request)``."""
    try:
        request = program.send(None)
        while True:
            request = program.send(answer(request))
    except StopIteration as done:
        return done.value
