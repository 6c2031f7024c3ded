#!/bin/bash
# The one-GPU stages of tools/device.sh (run through it): GPU kernel tests, the
# MPI GPU suites at 2 ranks (sharing one GPU they run over MPI), the kernel
# benchmark, ncu counts, compute-sanitizer.  Results under $OUT, 8 files at most.
#   bash tools/device/kernels.sh [STAGES]   STAGES: any of gpu-tests gpu-mpi kernels ncu-kernels sanitize
#   GPU_TAG=h200 SIZES=26,28 BENCH_ARGS=--no-variant    names, sizes, bench options
#   GPU_TESTS="tests/gpu/test_scale_sim_gpu.py"        the gpu-tests stage's tests (default tests/gpu)
OUT=${OUT:-device_out}; mkdir -p "$OUT"
STAGES=${*:-gpu-tests gpu-mpi kernels ncu-kernels sanitize}
has() { [[ " $STAGES " == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
SIZES=${SIZES:-20,22,24,26,28}
GPU_TAG=${GPU_TAG:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'h100|h200|a100|l4|l40s' | tr A-Z a-z)}
GPU_TAG=${GPU_TAG:-gpu}
{
  date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.sm,power.limit --format=csv
  nvcc --version | tail -2
  $PY -c "import cupy, numpy, Cython, ml_dtypes; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'cython', Cython.__version__, 'ml_dtypes', ml_dtypes.__version__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if has gpu-tests; then
  echo "== tests"; t0=$(date +%s)
  timeout 300 $PY -m pytest -q -rs --maxfail=10 ${GPU_TESTS:-tests/gpu} 2>&1 | tee "$OUT/pytest.txt" | tail -30
  echo "tests took $(( $(date +%s) - t0 )) s"
fi
if has gpu-mpi; then
  echo "== MPI GPU suites, 2 ranks"; t0=$(date +%s)
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
  SKIP_SERIAL=1 MPI_TESTS="${MPI_TESTS:-tests/mpi/test_allreduce_gpu_mpi.py tests/mpi/test_reduce_scatter_gpu_mpi.py tests/mpi/test_paths_gpu_mpi.py tests/mpi/test_torch_gpu_mpi.py}" \
    MPI_TIMEOUT=300 timeout 330 tools/testing/run_tests.sh $PY 2 2>&1 | tail -25 | tee "$OUT/mpi_tests.txt"
  echo "mpi took $(( $(date +%s) - t0 )) s"
fi
if has kernels; then
  echo "== bench"; t0=$(date +%s)
  timeout 240 $PY -m research kernels --sizes $SIZES $BENCH_ARGS --json "$OUT/kernel_bench_$GPU_TAG.json" 2>&1 \
    | tee "$OUT/kernel_bench_$GPU_TAG.txt" | tail -75
  echo "bench took $(( $(date +%s) - t0 )) s"
fi
if has ncu-kernels; then
  echo "== ncu"; t0=$(date +%s)
  timeout 180 ncu --clock-control none --kernel-name regex:'k_encode|k_decompress|k_stats' --launch-count 40 \
    --metrics smsp__inst_executed.sum,smsp__thread_inst_executed.sum,gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fmaheavy.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__average_warp_latency_issue_stalled_short_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_mio_throttle.ratio,smsp__average_warp_latency_issue_stalled_math_pipe_throttle.ratio,smsp__average_warp_latency_issue_stalled_wait.ratio,smsp__average_warp_latency_issue_stalled_not_selected.ratio,smsp__average_warp_latency_issue_stalled_selected.ratio,smsp__average_warp_latency_issue_stalled_no_instruction.ratio,smsp__average_warp_latency_issue_stalled_lg_throttle.ratio,smsp__average_warp_latency_issue_stalled_branch_resolving.ratio,smsp__average_warp_latency_issue_stalled_dispatch_stall.ratio,smsp__warps_active.avg.per_cycle_active,sm__cycles_elapsed.avg.per_second,launch__registers_per_thread \
    --csv $PY tools/profiling/ncu_workload.py > "$OUT/ncu.csv" 2> /tmp/ncu.err
  { tail -5 /tmp/ncu.err; $PY tools/profiling/ncu_summary.py "$OUT/ncu.csv"; } 2>&1 | tee "$OUT/ncu_summary.txt"
  echo "ncu took $(( $(date +%s) - t0 )) s"
fi
if has sanitize; then
  echo "== compute-sanitizer"; t0=$(date +%s)
  { for tool in memcheck racecheck; do
      echo "---- compute-sanitizer --tool $tool $PY tools/profiling/gpu_sanitize.py"
      timeout 150 compute-sanitizer --tool $tool --print-limit 20 $PY tools/profiling/gpu_sanitize.py 2>&1 | tail -15
    done; } > "$OUT/sanitizer.txt" 2>&1
  cat "$OUT/sanitizer.txt"
  echo "sanitizer took $(( $(date +%s) - t0 )) s"
fi
