"""The requests a rank program (one generator per rank) yields and a transport
answers (docs/design.md, "The parts"): :class:`Agree` (every rank's small
value, all of them back), :class:`Exchange` (post a send and a receive: a
:class:`Received` handle back; forwarded as such, it waits for its receive
only), :class:`ExchangeAll` (several at once), :class:`Claim` (the received
buffer, valid in stream order), :class:`Route` (answered by the planner with
a :class:`Routed`), :class:`Mark` (a phase boundary) and
:class:`NativeAllreduce`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Agree:
    value: Any


@dataclass
class Exchange:
    """Send ``send`` (uint8 array or :class:`Received`) to ``dest`` while
    receiving ``recv.nbytes`` from ``source`` into ``recv`` (either may be None)."""
    send: Any
    dest: int
    recv: Any
    source: int


@dataclass
class ExchangeAll:
    """Several :class:`Exchange` posted at once (one NCCL group: their
    messages travel together); a list of handles back, one per exchange."""
    exchanges: list


@dataclass
class Claim:
    handle: "Received"


@dataclass
class Route:
    """The transport and path ("compressed" or "native") asked for, with what
    the native wire dtype follows: the codec, the arrays' backend and dtype."""
    transport: str
    path: str = "compressed"
    codec: Any = None
    backend: str = ""
    dtype: str = ""


@dataclass(frozen=True)
class Routed:
    """The answer to :class:`Route`: the transport, the path (native: with
    the ``wire`` dtype it sums in); ``reason``: why a native path asked for
    runs compressed ("" otherwise)."""
    transport: str
    path: str = "compressed"
    wire: str = ""
    reason: str = ""


def compressed_route(request: Route, transport: str) -> Routed:
    """The :class:`Routed` running ``request`` compressed on ``transport`` (and why)."""
    reason = ""
    if request.path == "native":
        reason = f"no native all-reduce on {transport} for {request.backend} arrays"
    return Routed(transport, reason=reason)


@dataclass
class Mark:
    name: str


@dataclass
class NativeAllreduce:
    """Sum ``send`` over the ranks into ``recv`` (may be ``send``) by the
    transport's own all-reduce, the same bits on every rank; answer: ``recv``."""
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
