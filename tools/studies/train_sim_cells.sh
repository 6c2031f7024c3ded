#!/bin/bash
# Cells of the simulated-ranks training table on the CPU (or any one device),
# JOBS at a time (docs/training.md, `python -m dynamiq_mpi train-sim`).
#   RUNS="N/codec/topology/node_size/seed ..."   ("dynamiq": dynamiq:5:small_input=0)
#   PRESET=compact DEVICE=cpu JOBS=2 OUT=dir [STEPS=...] [WORKLOAD=lm|cls]
#   [TRAIN_ARGS="--batched --reduce-on host"]
#   bash tools/studies/train_sim_cells.sh
# Each run writes OUT/NAME.json (a run already there is skipped: re-running
# resumes a queue); then the table of every run in OUT.
set -uo pipefail
OUT=${OUT:-train_sim_out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PRESET=${PRESET:-compact} DEVICE=${DEVICE:-cpu} WORKLOAD=${WORKLOAD:-lm} OUT PY
export STEPS=${STEPS:-} TRAIN_ARGS=${TRAIN_ARGS:-}
one() {
  IFS=/ read -r n codec topo k seed <<< "$1"
  [[ $codec == dynamiq ]] && codec=dynamiq:5:small_input=0
  local name="${WORKLOAD}_${PRESET}_n${n}_${codec//[:=]/-}_${topo}_k${k}_s${seed}"
  [[ -s "$OUT/$name.json" ]] && { echo "have $name"; return 0; }
  local s=$(date +%s)
  OMP_NUM_THREADS=1 $PY -m dynamiq_mpi train-sim --preset "$PRESET" --device "$DEVICE" \
    --workload "$WORKLOAD" --ranks "$n" --codec "$codec" --topology "$topo" --node-size "$k" \
    --seed "$seed" ${STEPS:+--steps $STEPS} $TRAIN_ARGS --quiet --json "$OUT/$name.json.part" \
    && mv "$OUT/$name.json.part" "$OUT/$name.json" && echo "$name: $(( $(date +%s) - s )) s" \
    || echo "failed: $1"
}
export -f one
printf '%s\n' ${RUNS:?RUNS is empty} | xargs -P "${JOBS:-2}" -I{} bash -c 'one {}'
$PY -m dynamiq_mpi train-sim table "$OUT"/*.json
