"""The DDP hook's overlap (docs/design.md, "The parts"): compressed bucket
calls run in order on a worker thread and stream, which waits for the
hook's event, so the hook returns its future at once (a call's host wait
would stall autograd).  A call's error is set on its future and kept; the
iteration's last bucket's hook raises it from ``backward()`` with its type.
"""
from __future__ import annotations

import queue
import threading

import torch


def new_future(device: torch.device) -> torch.futures.Future:
    """A pending future for a bucket on ``device``: CUDA ones name the device,
    so that DDP's consumer waits for the result on the device, not the host."""
    if device.type == "cuda":
        return torch.futures.Future(devices=[device])
    return torch.futures.Future()


def complete(futures, bufs) -> None:
    """Each future gets its own bucket's tensor (on CUDA: recorded on the current stream)."""
    for fut, buf in zip(futures, bufs, strict=True):
        fut.set_result(buf)


class BucketWorker:
    """One thread running bucket calls in order, on CUDA on its own stream; a
    call may reduce several buckets (a fused group), one future each."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._jobs = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0
        self._error = None          # the first exception of a call, until taken
        self._thread = threading.Thread(target=self._loop, name="dynamiq-bucket-worker",
                                        daemon=True)
        self._thread.start()

    def submit(self, bufs, run, futures=None) -> list:
        """Futures of ``bufs`` (tensors) once ``run(bufs)`` reduced them in
        place; ``futures``: pending ones to complete instead of new ones."""
        ready = None
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            for buf in bufs:   # the caching allocator must not reuse them early
                buf.record_stream(self.stream)
        if futures is None:
            futures = [new_future(self.device) for _ in bufs]
        with self._idle:
            self._pending += 1
        self._jobs.put((ready, bufs, run, futures))
        return futures

    def _loop(self):
        if self.stream is not None:
            torch.cuda.set_device(self.device)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            ready, bufs, run, futures = job
            try:
                if self.stream is None:
                    run(bufs)
                    complete(futures, bufs)
                else:
                    with torch.cuda.stream(self.stream):
                        self.stream.wait_event(ready)
                        run(bufs)
                        # records the completion on this (current) stream
                        complete(futures, bufs)
            except BaseException as exc:  # handed to whoever waits on the futures
                with self._idle:
                    if self._error is None:
                        self._error = exc
                for fut in futures:
                    if not fut.done():
                        fut.set_exception(exc)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def drain(self) -> None:
        """Wait until every submitted call has run (not for its device work)."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def take_error(self):
        """After :meth:`drain`: the first exception since the last take, or None."""
        with self._idle:
            exc, self._error = self._error, None
        return exc

    def close(self) -> None:
        self.drain()
        self._jobs.put(None)
        self._thread.join()
