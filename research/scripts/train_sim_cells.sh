#!/bin/bash
# Cells of the simulated-ranks training table on the CPU (or any one device),
# JOBS at a time (docs/training.md, `python -m research train-sim`).
#   RUNS="N/codec/topology/node_size/seed[/workload[/steps[/batch]]] ..."
#        ("dynamiq": dynamiq:5:small_input=0; workload lm or cls, WORKLOAD's by default;
#        steps STEPS's, else the preset's; batch: sequences a rank, the preset's by default;
#        a run of other steps or batch is named ..._tSTEPS_bBATCH)
#   PRESET=compact DEVICE=cpu JOBS=2 OUT=dir [STEPS=...] [WORKLOAD=lm|cls]
#   [TRAIN_ARGS="--batched --reduce-on host"] [MAX_SECONDS=s] [END_AT=epoch seconds]
#   bash research/scripts/train_sim_cells.sh
# Each run writes OUT/NAME.json as it goes ("partial": true until it ends)
# and its state to OUT/NAME.ckpt at every evaluation: a run already complete
# is skipped, a partial one goes on from its checkpoint (the same bits), so
# re-running resumes a queue.  To fit a time-limited machine, each run stops
# after the first step past MAX_SECONDS of training, or early enough to end
# by END_AT (a run that would start too late is skipped).
# Then the table of every run in OUT (unless NO_TABLE is set).
set -uo pipefail
OUT=${OUT:-train_sim_out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
# `python -m research` from any working directory: the checkout on the path
export PYTHONPATH=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)${PYTHONPATH:+:$PYTHONPATH}
export PRESET=${PRESET:-compact} DEVICE=${DEVICE:-cpu} WORKLOAD=${WORKLOAD:-lm} OUT PY
export STEPS=${STEPS:-} TRAIN_ARGS=${TRAIN_ARGS:-} MAX_SECONDS=${MAX_SECONDS:-} END_AT=${END_AT:-}
complete() {    # a run's JSON that parses and was written at its end (dated, not partial)
  $PY -c "import json,sys; d=json.load(open(sys.argv[1])); sys.exit(d.get('partial') or 'date' not in d)" "$1" 2>/dev/null
}
export -f complete
one() {
  IFS=/ read -r n codec topo k seed work steps batch <<< "$1"
  [[ $codec == dynamiq ]] && codec=dynamiq:5:small_input=0
  work=${work:-$WORKLOAD}; steps=${steps:-$STEPS}
  local name="${work}_${PRESET}_n${n}_${codec//[:=]/-}_${topo}_k${k}_s${seed}"
  name+="${steps:+_t$steps}${batch:+_b$batch}"
  local json="$OUT/$name.json"
  if [[ -s $json ]] && complete "$json"; then echo "have $name"; return 0; fi
  local s=$(date +%s) limit=$MAX_SECONDS
  if [[ -n $END_AT ]]; then     # start-up, the last step and the checkpoint: 90 s
    local left=$(( END_AT - s - 90 ))
    (( left < 30 )) && { echo "skipped (deadline): $1"; return 0; }
    [[ -z $limit ]] || (( left < limit )) && limit=$left
  fi
  if OMP_NUM_THREADS=1 $PY -m research train-sim --preset "$PRESET" --device "$DEVICE" \
      --workload "$work" --ranks "$n" --codec "$codec" --topology "$topo" --node-size "$k" \
      --seed "$seed" ${steps:+--steps $steps} ${batch:+--batch $batch} $TRAIN_ARGS \
      --quiet --json "$json" \
      --checkpoint "$OUT/$name.ckpt" ${limit:+--max-seconds $limit}; then
    if ! complete "$json"; then
      echo "$name: stopped at step $($PY -c "import json,sys; print(len(json.load(open(sys.argv[1]))['steps']))" "$json") after $(( $(date +%s) - s )) s"
    else
      rm -f "$OUT/$name.ckpt"; echo "$name: $(( $(date +%s) - s )) s"
    fi
  else
    echo "failed: $1"
  fi
}
export -f one
printf '%s\n' ${RUNS:?RUNS is empty} | xargs -P "${JOBS:-2}" -I{} bash -c 'one {}'
[[ -n ${NO_TABLE:-} ]] || ! compgen -G "$OUT/*.json" > /dev/null ||
  $PY -m research train-sim table "$OUT"/*.json
