#!/bin/bash
# Stage "recipes" of tools/device.sh: every user recipe in mpi_examples/ as the
# user types it (torchrun or Lightning's own launcher, the library's defaults,
# NCCL over NVLink), one GPU a rank, then the fault tests over NCCL (a peer that
# stalls or dies in a run of device-array calls).  Knob: NP (default: every GPU).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
NP=${NP:-$(nvidia-smi -L | wc -l)}
$PY -c "import accelerate" 2>/dev/null || pip install -q --no-deps .whl/accelerate-*.whl \
  .whl/psutil-*.whl 2>&1 | tail -1           # HF Trainer's requirement (carry .whl)
unset $(env | grep -o '^DYNAMIQ_[A-Z_]*')       # the library's defaults, as a user has them
recipe() {   # name, command...
  local name=$1; shift
  echo "== $name: $*"; local t0=$(date +%s)
  timeout 180 "$@" > "/tmp/recipe_$name.txt" 2>&1; local rc=$?
  grep -v "^\[W\|Warning\|warn(\|^W1\|^  warnings\|^\*\*\*\|OMP_NUM_THREADS" "/tmp/recipe_$name.txt" | tail -14
  echo "-- $name: exit $rc in $(( $(date +%s) - t0 )) s"
}
TR="torchrun --standalone --nproc_per_node $NP"
recipe torchrun_ddp $TR mpi_examples/torchrun_ddp.py
recipe torchrun_fsdp $TR mpi_examples/torchrun_fsdp.py
recipe fsdp2_bf16 $TR mpi_examples/fsdp2_bf16.py
[ "$NP" -ge 4 ] && recipe hsdp $TR mpi_examples/hsdp.py --shard $((NP / 2))
recipe hf_trainer $TR mpi_examples/hf_trainer.py --steps 6 --out /tmp/hf_out
recipe accelerate_ddp $TR mpi_examples/accelerate_ddp.py --steps 6
recipe lightning_ddp $PY mpi_examples/lightning_ddp.py --devices "$NP"
echo "== faults over NCCL (2 GPUs)"; t0=$(date +%s)
timeout 200 $PY -m pytest -q -p no:cacheprovider tests/test_launchers.py -k "stalled or dead" 2>&1 | tail -6
echo "faults took $(( $(date +%s) - t0 )) s"
