"""The runtime's stream fence (call/runtime.py), driven on the CPU with a
stand-in for CuPy's streams and events: a call on a new stream waits for the
last call's work, including steady calls that recorded no event of their own."""
import sys
from types import SimpleNamespace

from mpi4py import MPI

from dynamiq_mpi.call.runtime import Runtime


def test_a_stream_switch_waits_for_calls_that_recorded_no_event(monkeypatch):
    log = []

    class Stream:
        def __init__(self, ptr):
            self.ptr = ptr

        def wait_event(self, event):
            log.append(("wait", self.ptr))

    class Event:
        def __init__(self, **kwargs):
            pass

        def record(self, stream):
            log.append(("record", stream.ptr))

    current = [Stream(1)]
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(cuda=SimpleNamespace(
        get_current_stream=lambda: current[0], Event=Event)))
    rt = Runtime(MPI.COMM_SELF, 1, None)
    rt.record_stream(rt.fence_stream())         # a call that records (stream 1)
    assert log == [("record", 1)] and rt.unrecorded is None
    rt.record_stream(rt.fence_stream(), took_workspace=False)   # a steady call: no event
    current[0] = Stream(2)
    rt.record_stream(rt.fence_stream())         # a switch: stream 1's work recorded, then waited
    assert log == [("record", 1), ("record", 1), ("wait", 2), ("record", 2)]
    assert rt.unrecorded is None and rt.last_stream[0] == 2
    current[0] = Stream(3)
    rt.fence_stream()                           # the last call recorded: no extra record
    assert log[-1] == ("wait", 3) and log[-2] == ("record", 2)
