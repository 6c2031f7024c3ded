#!/bin/bash
# Stage "suites" of tools/device.sh: the GPU kernel tests, then the MPI suites (CPU and CuPy
# all-reduce) at the given world sizes with the machine's Open MPI, then the
# demo on CuPy arrays.  Usage: bash tools/device/suites.sh [NP...]
set -o pipefail
OUT=${OUT:-device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
       OMPI_MCA_rmaps_base_oversubscribe=1
NPS=${*:-2 4}
{ date -u; nvidia-smi -L; } | tee "$OUT/env.txt"
# The rank logs come back even when the caller's own timeout ends this stage.
trap 'tar czf "$OUT/mpi-logs.tgz" .mpi-logs 2>/dev/null' EXIT
trap 'exit 124' TERM INT
# A hung test dumps every thread's stack after 120 s, a world size is killed
# after MPI_TIMEOUT (240 s), and every rank's log comes back in one archive.
PYTEST_ARGS="${PYTEST_ARGS:--o faulthandler_timeout=120}" MPI_TIMEOUT=${MPI_TIMEOUT:-240} \
  SERIAL_TESTS="tests/gpu tests/test_api.py tests/test_schedules.py" make test-installed NP_LIST="$NPS" 2>&1 | tee "$OUT/test.txt" | tail -40
for n in $NPS; do
  mpiexec -n $n python3 -m dynamiq_mpi demo --gpu --length $((1 << 22)) 2>&1 | tee -a "$OUT/demo_gpu.txt"
done
