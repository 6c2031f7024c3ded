"""One process, one GPU: the statistics kernel and the device
planner at 2^27 BF16 elements, for ncu (tools/device.sh ncu):

    ncu -k regex:"k_stats|k_plan" --section SpeedOfLight ... python tools/profiling/stats_workload.py
"""
import cupy as cp

import dynamiq_mpi as dq
from dynamiq_mpi import _gpu
from dynamiq_mpi.codecs.allocation import record_bits
from dynamiq_mpi.bench.gradients import gradient_like_xp

LOG2 = 27


def main():
    n = 1 << LOG2
    nsg = n // 256
    x = gradient_like_xp(cp, n, 0, dtype=dq.backend.BFLOAT16)
    mean, norm2 = cp.empty(nsg, cp.float32), cp.empty(nsg, cp.float32)
    tail, scratch = cp.empty(2, cp.float32), cp.empty(1, cp.int64)
    _gpu.stats_into(x, nsg, True, mean, norm2, tail, scratch)
    widths, order = cp.empty(nsg, cp.int8), cp.empty(nsg, cp.int64)
    pos, header = cp.empty(nsg, cp.int64), cp.empty(_gpu.PLAN_HEADER, cp.float64)
    pscratch = cp.empty(_gpu.plan_scratch_bytes(nsg), cp.uint8)
    rec = [record_bits(w, True) for w in (2, 4, 8, 16)]
    _gpu.plan(nsg, True, True, True, 0, 64 * nsg + 64, rec, 5.0 * n, 5.0 * n, norm2, mean, tail,
              widths, order, pos, header, pscratch)
    cp.cuda.get_current_stream().synchronize()


if __name__ == "__main__":
    main()
