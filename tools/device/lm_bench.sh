#!/bin/bash
# The real-model benchmark on one host of 2 or 4 GPUs (one rank a GPU, torchrun):
# mpi_examples/lm_bench.py on the 0.8B LLaMA preset, every configuration
# alternating in rounds inside each job.
#
#   bash tools/device.sh lm-tests lm-ddp-sockets lm-ddp-nvlink      (one device call)
#   bash tools/device.sh lm-fsdp-sockets lm-fsdp-nvlink lm-fuse lm-profile
#
# lm-tests         the torch adapter's GPU suite at 2 ranks (one GPU each, NCCL)
# lm-ddp-sockets   DDP over NCCL's socket transport (the README's settings), bucket
#                  caps default/100/400: plain, torch's bf16_compress_hook, ours
# lm-ddp-nvlink    the same over NVLink (lm-ddp-nvlink25: DDP's default buckets only)
# lm-fsdp-sockets  FSDP2, BF16 parameters: reduce fp32, reduce bf16, ours
# lm-fsdp-nvlink   the same over NVLink
# lm-fuse          ours at fused groups of 64, 256 (default) and 1024 MB, DDP's default
#                  buckets, sockets, against the BF16 hook
# lm-profile       one steady step of each DDP configuration under torch.profiler (sockets,
#                  DDP's default buckets)
# Knobs: NP (default: every GPU), LM_ARGS (more lm_bench.py options), LM_TIMEOUT=280.
# The extension is built unless it imports (carry dynamiq_mpi/*.cpython-312*.so).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
STAGES=" $* "
has() { [[ "$STAGES" == *" $1 "* ]]; }
NP=${NP:-$(nvidia-smi -L | wc -l)}
TIMEOUT=${LM_TIMEOUT:-280}
read -r -a EXTRA <<<"${LM_ARGS:-}"

if ! $PY -c "import dynamiq_mpi._gpu" 2>/dev/null; then
  echo "== build"; t0=$(date +%s)
  $PY setup.py build_ext --inplace > /tmp/build.log 2>&1 || { tail -40 /tmp/build.log; exit 1; }
  echo "build took $(( $(date +%s) - t0 )) s"
fi

bench() {   # name, environment, lm_bench options
  local name=$1 envs=$2; shift 2
  echo "== $name ($NP GPUs; $envs)"
  env $envs timeout $TIMEOUT torchrun --standalone --nproc_per_node "$NP" \
    mpi_examples/lm_bench.py --preset 0.8b --no-progress --json "$OUT/lm_$name.json" \
    "$@" "${EXTRA[@]}" 2>&1 | grep -v "^\[W\|Warning\|warn(" | tail -40
}

if has lm-tests; then
  echo "== tests"; t0=$(date +%s)
  SKIP_SERIAL=1 MPI_TESTS="tests/mpi/test_torch_gpu_mpi.py" MPI_TIMEOUT=200 \
    timeout 230 tools/testing/run_tests.sh $PY 2 2>&1 | tail -12
  echo "tests took $(( $(date +%s) - t0 )) s"
fi
has lm-ddp-sockets && bench ddp_sockets "$SOCKETS $TUNED"
has lm-ddp-nvlink && bench ddp_nvlink ""
has lm-ddp-nvlink25 && bench ddp_nvlink25 "" --bucket-caps default
has lm-fsdp-sockets && bench fsdp_sockets "$SOCKETS $TUNED" --fsdp
has lm-fsdp-nvlink && bench fsdp_nvlink "" --fsdp
has lm-fuse && bench fuse_sockets "$SOCKETS $TUNED" --bucket-caps default \
  --configs bf16,ours:64,ours,ours:1024 --rounds 2
has lm-profile && bench profile_sockets "$SOCKETS $TUNED" --rounds 1 --steps 2 --profile \
  --bucket-caps default
exit 0
