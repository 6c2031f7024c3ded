#!/bin/bash
# One GPU: cells of the simulated-ranks training table (docs/training.md,
# `python -m research train-sim`), resumable across device calls.
#   RUNS="N/codec/topology/node_size/seed ..."  ("dynamiq": dynamiq:5:small_input=0)
#   HOST_RUNS="..."    the same, with --reduce-on host (the codec in NumPy, the
#                      same bits: the host's cores take a share; --node-size runs
#                      reduce there anyway)
#   WORKLOAD=lm|cls PRESET=compact STEPS TRAIN_ARGS (for all; e.g. --batched)
#   PYTHON=python3 DEVICE=cuda (tests/test_train_sim.py runs this script on the
#                      CPU, with a stand-in for nvidia-cuda-mps-control)
#   DEADLINE=s         every run stops by then (seconds from now) and saves its state
#   STATE=dir          the runs of an earlier call (JSON + checkpoints) to go on from
#   MPS=0              do not start CUDA MPS.  By default, where nvidia-cuda-mps-control
#                      exists, the runs share one GPU context through MPS (started
#                      here, checked by a 3-step tiny run, stopped at the end): the many
#                      small processes then overlap on the GPU instead of taking turns
#                      (a DynamiQ N = 128 run made 2.8 steps/s beside 19 others with
#                      it, 1.3 beside 12 without, in another session's call: not an
#                      A/B; docs/training.md)
# All runs at once (JOBS, default all).  Output under $OUT: table.txt,
# train_sim_curves.png and train_sim_runs.tgz.part-* (every run's JSON and
# checkpoint: `cat` the parts, unpack into STATE to go on in the next call).
set -o pipefail
OUT=${OUT:-device_out}; mkdir -p "$OUT/runs"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
HERE=$(dirname "${BASH_SOURCE[0]}")
PY=${PYTHON:-python3}
export PRESET=${PRESET:-compact} DEVICE=${DEVICE:-cuda}
t0=$(date +%s)
if [ -n "${STATE:-}" ]; then
  [ -d "$STATE" ] || { echo "STATE=$STATE is no directory" >&2; exit 2; }
  cp -r "$STATE"/. "$OUT/runs/"
fi
mps_stop() { echo quit | nvidia-cuda-mps-control > /dev/null; }
if [ "${MPS:-1}" != 0 ] && command -v nvidia-cuda-mps-control > /dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/dynamiq_mps_pipe}
  export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/dynamiq_mps_log}
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d && timeout 120 $PY -m research train-sim --preset tiny \
      --device "$DEVICE" --ranks 8 --codec dynamiq:5:small_input=0 --batched --steps 3 --eval-every 0 \
      --quiet --json "$OUT/mps_check.json"; then
    echo "CUDA MPS on"; trap mps_stop EXIT
  else
    mps_stop; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; echo "CUDA MPS off (did not start)"
  fi
  rm -f "$OUT/mps_check.json"
fi
export TRAIN_ARGS=${TRAIN_ARGS:-} WORKLOAD=${WORKLOAD:-lm} PYTHON=$PY
# every run stops in time to end by then (train_sim_cells.sh: END_AT)
export END_AT=$(( t0 + ${DEADLINE:-450} ))
n_dev=$(wc -w <<< "${RUNS:-}"); n_host=$(wc -w <<< "${HOST_RUNS:-}")
(( n_dev + n_host )) || { echo "RUNS and HOST_RUNS are empty" >&2; exit 2; }
# the two queues run side by side; the one table comes after both
export NO_TABLE=1
[ "$n_dev" -gt 0 ] && RUNS="$RUNS" OUT=$OUT/runs JOBS=${JOBS:-$n_dev} \
  bash "$HERE/../../research/scripts/train_sim_cells.sh" > "$OUT/device_runs.log" 2>&1 &
[ "$n_host" -gt 0 ] && RUNS="$HOST_RUNS" OUT=$OUT/runs JOBS=${JOBS:-$n_host} \
  TRAIN_ARGS="$TRAIN_ARGS --reduce-on host" \
  bash "$HERE/../../research/scripts/train_sim_cells.sh" > "$OUT/host_runs.log" 2>&1 &
wait
grep -sahE "stopped|failed|have|: [0-9]+ s$|Error" "$OUT"/device_runs.log "$OUT"/host_runs.log
echo "all runs: $(( $(date +%s) - t0 )) s"
$PY -m research train-sim table "$OUT"/runs/*.json --png "$OUT/train_sim_curves.png" \
  | tee "$OUT/table.txt"
# files come back at most 16 MiB each: the archive in parts (cat them to unpack)
tar czf - -C "$OUT/runs" . | split -b 15M - "$OUT/train_sim_runs.tgz.part-" && rm -r "$OUT/runs"
