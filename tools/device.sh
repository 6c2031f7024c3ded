#!/bin/bash
# The one device runner: named stages, run in the order given, in one device
# call (the `device` tool runs it in the repository root; results under $OUT).
#
#   bash tools/device.sh STAGE...        e.g. build gpu-tests kernels ncu-kernels
#
# build         the extension in place (the .so files are then carried or kept)
# one GPU (tools/device/kernels.sh):
#   gpu-tests     tests/gpu (kernels, planner, pieces against the CPU)
#   gpu-mpi       the MPI GPU suites at 2 ranks (sharing one GPU: host-staged MPI)
#   kernels       python -m research kernels (SIZES=26,28 BENCH_ARGS=--no-variant GPU_TAG=...)
#   ncu-kernels   ncu counts of the codec kernels and the statistics pass
#   sanitize      compute-sanitizer memcheck and racecheck
#   suites        tests/gpu and the MPI suites through `make test-installed`, then the
#                 GPU demo (NP_LIST="2 4"; tools/device/suites.sh)
# recipes        every mpi_examples recipe on the machine's GPUs with the library's
#                defaults, then the fault tests over NCCL (tools/device/recipes.sh)
# two GPUs, one host (tools/device/links.sh; each stage says what it runs):
#   tests profile ncu timeline nvlink shm sockets probe tune hostid lanes mx agprobe
#   pairab sockset shm1 chunks p2p ab paths ddp fsdp defaults
# four GPUs, one host (tools/device/nodes.sh):
#   tests4 hier sockets4 flat4 torch4 ddp4 medium4 gather4
# the real-model benchmark, 2 or 4 GPUs (tools/device/lm_bench.sh):
#   lm-tests lm-ddp-sockets lm-ddp-nvlink lm-ddp-nvlink25 lm-fsdp-sockets lm-fsdp-nvlink lm-fuse lm-profile
# training (tools/device/train.sh):
#   train         mpi_examples/train_lm.py, BF16 against DynamiQ (STEPS, SEEDS_*, CODECS_DQ, TRAIN_ARGS)
#   ttl           time to BF16's loss, 2 or 4 GPUs, sockets (tools/device/time_to_loss.sh:
#                 SEEDS, REF, STEPS, CODECS, PRESET)
#   train-sim     simulated ranks on one GPU (tools/device/train_sim.sh: RUNS, HOST_RUNS, STATE, DEADLINE)
# CUDA-aware MPI (tools/device/mpi_cuda.sh; carry .whl with the sources):
#   mpi-cuda-build mpi-cuda-ext mpi-cuda-probe mpi-cuda-tests mpi-cuda-bench
# A/B of two package versions, alternating (tools/device/package_ab.sh):
#   package-ab    OLD_DIR=<old dynamiq_mpi package> [AB_ROUNDS=2]
# A/B of the kernels of two source versions on one GPU (tools/device/kernels_ab.sh):
#   kernels-ab    OLD_DIR=<old sources, git archive> [AB_ROUNDS=2] [SIZES=26,28]
#
# Consecutive stages of one family run in one invocation of its script.
set -o pipefail
[ $# -gt 0 ] || { sed -n '2,30p' "$0"; exit 2; }
OUT=${OUT:-device_out}; mkdir -p "$OUT"; export OUT
PY=${PYTHON:-python3}
HERE=$(dirname "${BASH_SOURCE[0]}")

family_of() {
  case $1 in
    build) echo build ;;
    gpu-tests|gpu-mpi|kernels|ncu-kernels|sanitize) echo kernels ;;
    suites) echo suites ;;
    recipes) echo recipes ;;
    tests|profile|ncu|timeline|nvlink|shm|sockets|probe|tune|hostid|lanes|mx|agprobe|pairab|sockset|shm1|chunks|p2p|ab|paths|ddp|fsdp|defaults) echo links ;;
    tests4|hier|sockets4|flat4|torch4|ddp4|medium4|gather4) echo nodes ;;
    lm-tests|lm-ddp-sockets|lm-ddp-nvlink|lm-ddp-nvlink25|lm-fsdp-sockets|lm-fsdp-nvlink|lm-fuse|lm-profile) echo lm_bench ;;
    train) echo train ;;
    ttl) echo time_to_loss ;;
    train-sim) echo train_sim ;;
    mpi-cuda-build|mpi-cuda-ext|mpi-cuda-probe|mpi-cuda-tests|mpi-cuda-bench) echo mpi_cuda ;;
    package-ab) echo package_ab ;;
    kernels-ab) echo kernels_ab ;;
    *) echo unknown ;;
  esac
}

run_family() {   # family, its stages
  local fam=$1; shift
  case $fam in
    build)
      echo "== build"; local t0=$(date +%s)
      $PY setup.py build_ext --inplace > /tmp/build.log 2>&1 || { tail -40 /tmp/build.log; return 1; }
      echo "build took $(( $(date +%s) - t0 )) s" ;;
    kernels|links|nodes) bash "$HERE/device/$fam.sh" "$@" ;;
    suites) bash "$HERE/device/suites.sh" ${NP_LIST:-2 4} ;;
    recipes) bash "$HERE/device/recipes.sh" ;;
    lm_bench) bash "$HERE/device/lm_bench.sh" "$@" ;;
    train) SKIP_BUILD=1 bash "$HERE/device/train.sh" ;;
    train_sim) bash "$HERE/device/train_sim.sh" ;;
    time_to_loss) bash "$HERE/device/time_to_loss.sh" ;;
    mpi_cuda) bash "$HERE/device/mpi_cuda.sh" "${@#mpi-cuda-}" ;;
    package_ab) bash "$HERE/device/package_ab.sh" "${OLD_DIR:?OLD_DIR: the old package directory}" ${AB_ROUNDS:-2} ;;
    kernels_ab) bash "$HERE/device/kernels_ab.sh" "${OLD_DIR:?OLD_DIR: the old source directory}" ${AB_ROUNDS:-2} ;;
  esac
}

for s in "$@"; do
  [ "$(family_of "$s")" = unknown ] && { echo "tools/device.sh: unknown stage '$s'" >&2; exit 2; }
done
rc=0; fam=; group=()
for s in "$@" ""; do
  f=$([ -n "$s" ] && family_of "$s")
  if [ -n "$fam" ] && [ "$f" != "$fam" ]; then
    run_family "$fam" "${group[@]}" || rc=1
    group=()
  fi
  fam=$f; [ -n "$s" ] && group+=("$s")
done
exit $rc
