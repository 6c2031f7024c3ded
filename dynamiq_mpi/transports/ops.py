"""The two communication requests a rank program can make."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class AllgatherObject:
    """Every rank contributes a small picklable value and gets the list of all."""
    value: Any


@dataclass
class Exchange:
    """Send ``payload`` (uint8 array) to ``dest`` while receiving exactly
    ``recv_nbytes`` bytes from ``source``.  The answer is the received uint8 array."""
    payload: Any
    dest: int
    recv_nbytes: int
    source: int


def drive(program, execute):
    """Run a rank program, answering each request with ``execute(request)``."""
    try:
        request = program.send(None)
        while True:
            request = program.send(execute(request))
    except StopIteration as done:
        return done.value
