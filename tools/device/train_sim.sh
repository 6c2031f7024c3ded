#!/bin/bash
# One GPU: cells of the simulated-ranks training table (docs/training.md,
# `python -m dynamiq_mpi train-sim`).  RUNS: "N/codec/topology/node_size/seed"
# entries (WORKLOAD=lm|cls, PRESET=small|compact, STEPS, TRAIN_ARGS such as
# --batched, for all), run in the order given while DEADLINE seconds have not
# passed; then
# the table and the curves.  Output under $OUT: table.txt, train_sim_curves.png,
# train_sim_runs.tgz (every run's JSON).
OUT=${OUT:-device_out}; mkdir -p "$OUT/runs"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
DQ=dynamiq:5:small_input=0
RUNS=${RUNS:-"8/bf16/ring/1/0 8/dynamiq/ring/1/0"}     # "dynamiq": $DQ
DEADLINE=${DEADLINE:-450}
t0=$(date +%s)
for run in $RUNS; do
  IFS=/ read -r n codec topo k seed <<< "$run"
  [[ $codec == dynamiq ]] && codec=$DQ
  if (( $(date +%s) - t0 > DEADLINE )); then echo "skipped (deadline): $run"; continue; fi
  name="${WORKLOAD:-lm}_${PRESET:-small}_n${n}_${codec//[:=]/-}_${topo}_k${k}_s${seed}"
  s=$(date +%s)
  timeout 300 python3 -m dynamiq_mpi train-sim --ranks "$n" --codec "$codec" --topology "$topo" \
    --node-size "$k" --seed "$seed" --preset "${PRESET:-small}" ${STEPS:+--steps $STEPS} \
    --workload "${WORKLOAD:-lm}" $TRAIN_ARGS --quiet --json "$OUT/runs/$name.json" \
    || echo "failed: $run"
  echo "$name: $(( $(date +%s) - s )) s"
done
python3 -m dynamiq_mpi train-sim table "$OUT"/runs/*.json --png "$OUT/train_sim_curves.png" \
  | tee "$OUT/table.txt"
tar czf "$OUT/train_sim_runs.tgz" -C "$OUT" runs && rm -r "$OUT/runs"
