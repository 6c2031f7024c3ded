"""Host time of the torch adapter's hand-over of a CUDA tensor to CuPy, on
one GPU: DLPack's view (``tensor_as_array``), the pointer-made view the
adapter uses (``stream_view``), and entering torch's stream
(``torch_stream``), each the median of rounds of back-to-back calls.

    python tools/profiling/views_host.py [--calls 2000] [--rounds 5]
"""
import argparse
import statistics
import time

import torch

from dynamiq_mpi.torch.arrays import stream_view, tensor_as_array, torch_stream


def per_call_us(fn, calls, rounds):
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    t = torch.empty(1 << 25, device="cuda")
    dev = t.device

    def stream_only():
        with torch_stream(dev):
            pass

    def dlpack():
        with torch_stream(dev):
            tensor_as_array(t)

    def pointer():
        with torch_stream(dev):
            stream_view(t)

    rows = [("enter torch's stream", stream_only), ("+ DLPack view", dlpack),
            ("+ pointer view", pointer)]
    for name, fn in rows:
        fn()                                  # warm: imports, the dtype learnt
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: host us a call "
          f"(median of {args.rounds} rounds of {args.calls})")
    for name, fn in rows:
        print(f"  {name:22s} {per_call_us(fn, args.calls, args.rounds):8.2f}")


if __name__ == "__main__":
    main()
