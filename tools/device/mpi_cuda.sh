#!/usr/bin/env bash
# The CUDA-aware MPI run on the GPU machine (device kind nvidia-h200-x2; one GPU
# works too, both ranks then share it):
#
#   bash tools/device/mpi_cuda.sh [STAGES]    STAGES: any of build ext probe tests bench
#                                             (default: all, in that order)
#
# build: Open MPI --with-cuda and mpi4py against it (tools/device/build_cuda_openmpi.sh,
#        from the sources in .whl/cuda-mpi; a few minutes with 16 cores, once per
#        machine: a later call on the same machine skips it);
# ext:   the project's extension in place, if it does not import with CUDA yet;
# probe: what the new MPI says (ompi_info, the library's detection on every
#        rank) and one CuPy Sendrecv through it;
# tests: the MPI suites with CuPy arrays under this MPI: mpi-cuda, then NCCL and
#        host-staged MPI (tools/testing/run_tests.sh, world size $NP);
# bench: `python -m dynamiq_mpi bench` with --transport mpi-cuda, mpi and nccl
#        on the same data under the same launcher (NCCL all-reduce reference row).
#
# Carry: .whl (sources from `tools/device/build_cuda_openmpi.sh fetch` and the pytest-mpi
# wheel from `make wheels`).  Results and logs under $OUT.  Each stage prints
# its time; a failed build stops the script, a failed later stage is recorded
# and the next one still runs (exit status 1 at the end).
set -euo pipefail
OUT=${OUT:-device_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
STAGES=${*:-build ext probe tests bench}
has() { [[ " $STAGES " == *" $1 "* ]]; }
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ROOT=$PWD
PY=${PYTHON:-python3}
export PREFIX=${PREFIX:-/tmp/ompi-cuda} MPI4PY_TARGET=${MPI4PY_TARGET:-/tmp/mpi4py-cuda}
export BUILD_ROOT=${BUILD_ROOT:-/tmp/cuda-mpi-build} PYTHON=$PY
NP=${NP:-2}
T0=$(date +%s)
FAILED=()
say() { echo "[device_mpi_cuda +$(( $(date +%s) - T0 ))s] $*"; }
timed() {   # name cmd...: run it and print its time; returns its status
    local name=$1 t rc=0
    t=$(date +%s)
    shift
    say "== $name"
    "$@" || rc=$?
    say "== $name: rc=$rc in $(( $(date +%s) - t ))s"
    return $rc
}

{ date -u; nvidia-smi -L 2>&1 || true
  if command -v nvcc >/dev/null; then nvcc --version | tail -n 2; fi
  $PY -c "import sys, cupy, numpy; print('python', sys.version.split()[0], 'cupy', cupy.__version__, 'numpy', numpy.__version__)" || true
  git log --oneline -1 2>/dev/null || true
  ls -l .whl .whl/cuda-mpi 2>&1 || true; } 2>&1 | tee "$OUT/env.txt"

if has build; then
    rc=0
    timed "build Open MPI + mpi4py" bash tools/device/build_cuda_openmpi.sh build 2>&1 | tee "$OUT/build.txt" || rc=$?
    mkdir -p "$OUT/build_logs"
    cp "$BUILD_ROOT/logs/configure.flags" "$OUT/build_logs/" 2>/dev/null || true
    for f in "$BUILD_ROOT"/logs/*.log; do
        if [ -f "$f" ]; then tail -n 60 "$f" > "$OUT/build_logs/$(basename "$f")"; fi
    done
    [ "$rc" = 0 ] || { say "build failed (rc=$rc): logs in $OUT/build_logs"; exit 1; }
fi

# Select the new MPI and mpi4py for everything below.
[ -x "$PREFIX/bin/mpiexec" ] || { echo "no $PREFIX/bin/mpiexec: run the build stage" >&2; exit 1; }
export PATH=$PREFIX/bin:$PATH
export LD_LIBRARY_PATH=$PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONPATH=$MPI4PY_TARGET:$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_hwloc_base_binding_policy=none
# ob1 over the CUDA-aware shared-memory transport (CUDA IPC between the ranks'
# GPUs); the environment may override either.
export OMPI_MCA_pml=${OMPI_MCA_pml:-ob1} OMPI_MCA_btl=${OMPI_MCA_btl:-self,smcuda}
export NCCL_NVLS_ENABLE=0                      # the machine's rule: no NVLink multicast
MPIEXEC=$PREFIX/bin/mpiexec

if has ext; then
    if $PY -c "import dynamiq_mpi as d, sys; sys.exit(not d.has_cuda())" 2>/dev/null; then
        say "extension already built with CUDA"
    elif ! timed "build the extension in place" bash -c "$PY setup.py build_ext --inplace > '$OUT/ext_build.txt' 2>&1"; then
        tail -n 40 "$OUT/ext_build.txt"
        exit 1
    fi
fi

if has probe; then
    cat > "$OUT/probe.py" <<'EOF'
import cupy as cp
from mpi4py import MPI

from dynamiq_mpi.transports.cuda_aware import cuda_aware_mpi, loaded_mpi_library_paths

comm = MPI.COMM_WORLD
cp.cuda.Device(comm.rank % cp.cuda.runtime.getDeviceCount()).use()
info = comm.Get_info()
print(f"rank {comm.rank}: {MPI.Get_library_version().splitlines()[0].strip(chr(0))}; "
      f"mpi_memory_alloc_kinds={info.Get('mpi_memory_alloc_kinds')!r}; "
      f"library={loaded_mpi_library_paths()[:1]}; {cuda_aware_mpi()}", flush=True)
n = 1 << 24
send = cp.full(n, comm.rank + 1, dtype=cp.uint8)
recv = cp.zeros(n, dtype=cp.uint8)
cp.cuda.get_current_stream().synchronize()
comm.Sendrecv([send, MPI.BYTE], (comm.rank + 1) % comm.size, 0,
              [recv, MPI.BYTE], (comm.rank - 1) % comm.size, 0)
want = (comm.rank - 1) % comm.size + 1
assert int(recv.min()) == int(recv.max()) == want, (int(recv.min()), int(recv.max()), want)
print(f"rank {comm.rank}: CuPy Sendrecv of {n} bytes through MPI: ok", flush=True)
EOF
    {
        ompi_info --parsable --all | grep -E "mpi_built_with_cuda_support:value|opal_cuda_support:value" || true
        ompi_info | grep -iE "Open MPI:|MPI extensions|btl: smcuda" || true
        timed "probe" timeout 120 "$MPIEXEC" -n "$NP" "$PY" "$OUT/probe.py" || FAILED+=(probe)
    } > "$OUT/probe.txt" 2>&1
    cat "$OUT/probe.txt"
fi

if has tests; then
    # tools/testing/run_tests.sh: the pytest-mpi wheel from .whl, rank logs, JUnit checks.
    timed "MPI suites under $MPIEXEC, world size $NP" env MPIEXEC="$MPIEXEC" SKIP_SERIAL=1 \
        MPI_TESTS="tests/mpi/test_mpi_cuda_mpi.py tests/mpi/test_allreduce_gpu_mpi.py tests/mpi/test_transports_mpi.py" \
        MPI_TIMEOUT="${MPI_TIMEOUT:-420}" MPI_LOG_ROOT="$OUT/mpi-logs" PYTEST_ARGS="-rs" \
        tools/testing/run_tests.sh "$PY" "$NP" > "$OUT/tests_full.txt" 2>&1 || FAILED+=(tests)
    tail -n 40 "$OUT/tests_full.txt" | tee "$OUT/tests.txt"
fi

if has bench; then
    SIZES=${SIZES:-2M,16M,128M,512M}
    for transport in mpi-cuda mpi nccl; do
        ref=()
        [ "$transport" = mpi-cuda ] || ref=(--no-reference)   # one reference row is enough
        timed "bench --transport $transport" timeout 300 "$MPIEXEC" -n "$NP" "$PY" -m dynamiq_mpi bench \
            --array cupy --dtype bf16 --codec dynamiq:5,bf16 --topology ring --transport "$transport" \
            --sizes "$SIZES" -w 3 -n 10 --breakdown ${ref[@]+"${ref[@]}"} --json "$OUT/bench_$transport.json" \
            > "$OUT/bench_$transport.txt" 2>&1 || FAILED+=("bench-$transport")
        grep -v '^\[' "$OUT/bench_$transport.txt" | tee -a "$OUT/bench.txt" || true
    done
fi

if [ ${#FAILED[@]} -gt 0 ]; then say "FAILED: ${FAILED[*]}; results in $OUT"; exit 1; fi
say "done; results in $OUT"
