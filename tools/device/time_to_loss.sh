#!/bin/bash
# Time to BF16's loss on one host of 2 or 4 GPUs: mpi_examples/time_to_loss.py run,
# one torchrun job a run, NCCL on its socket transport (the README's settings).
#
#   SEEDS=0,1 REF= bash tools/device.sh ttl          (then SEEDS=2 REF=fp32:0 in a second call)
#
# Knobs: NP (default: every GPU), STEPS=300, PRESET=0.8b, CODECS=bf16,dynamiq:5, SEEDS=0,1,2,
#   REF=fp32:0 (reference runs, '' for none), RUN_TIMEOUT=260, TTL_ARGS (train_lm.py options).
# Writes $OUT/ttl/run_*.json, $OUT/ttl.json, $OUT/ttl.png and the log.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
NP=${NP:-$(nvidia-smi -L | wc -l)}
if ! $PY -c "import dynamiq_mpi._gpu" 2>/dev/null; then
  echo "== build"; t0=$(date +%s)
  $PY setup.py build_ext --inplace > /tmp/build.log 2>&1 || { tail -40 /tmp/build.log; exit 1; }
  echo "build took $(( $(date +%s) - t0 )) s"
fi
read -r -a EXTRA <<<"${TTL_ARGS:-}"
echo "== time to loss ($NP GPUs; $SOCKETS $TUNED)"
env $SOCKETS $TUNED $PY mpi_examples/time_to_loss.py run --nproc "$NP" \
  --preset "${PRESET:-0.8b}" --steps "${STEPS:-300}" --codecs "${CODECS:-bf16,dynamiq:5}" \
  --seeds "${SEEDS:-0,1,2}" --reference "${REF-fp32:0}" --run-timeout "${RUN_TIMEOUT:-260}" \
  --out "$OUT/ttl" --json "$OUT/ttl.json" --png "$OUT/ttl.png" ${EXTRA[@]:+-- "${EXTRA[@]}"} 2>&1 \
  | grep -v "^\[W\|Warning\|warn(\|OMP_NUM_THREADS\|^\*\*\*"
exit 0
