#!/bin/bash
# The GPU training comparison, one device call on the 2x H200 machine:
#   mpi_examples/train_lm.py, one rank per GPU, NCCL forced onto its socket
#   transport (so communication matters), BF16 DDP over 3 seeds against
#   DynamiQ at 5 and 4 bits, the same steps, data and initial models.
#
#   bash tools/device.sh train                   (from the repository root)
#
# Knobs (environment): STEPS=500  SEEDS_BF16="0 1 2"  SEEDS_DQ="0"
#   CODECS_DQ="dynamiq:5 dynamiq:4"  NP=2  TRAIN_ARGS="" (more train_lm.py options)
#   RUN_TIMEOUT=120 (seconds per run)  PYTHON=python3  SKIP_BUILD=1  OUT=device_out
#   DYNAMIQ_CUDA_ARCH=90
# Writes to $OUT: env.txt, table.txt, runs.json (every run's JSON as {"runs": [...]}),
# curves.png (if matplotlib is there), logs.tar.gz (build and per-run logs).
set -uo pipefail
OUT=${OUT:-device_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
STEPS=${STEPS:-500}
SEEDS_BF16=${SEEDS_BF16:-0 1 2}
SEEDS_DQ=${SEEDS_DQ:-0}
CODECS_DQ=${CODECS_DQ:-dynamiq:5 dynamiq:4}
NP=${NP:-2}
RUN_TIMEOUT=${RUN_TIMEOUT:-120}
read -r -a EXTRA <<<"${TRAIN_ARGS:-}"
WORK=$(mktemp -d)
T_ALL=$(date +%s.%N)
elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# Open MPI 4.1 as root, oversubscribed, and unbound: its default binding pins
# each rank (and NCCL's socket threads with it) to one core.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
       OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_hwloc_base_binding_policy=none
# NCCL on sockets, tuned (spec section 7); the same for every run, BF16 included.
export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NSOCKS_PERTHREAD=4 NCCL_SOCKET_NTHREADS=4 \
       NCCL_MIN_NCHANNELS=8 NCCL_P2P_NET_CHUNKSIZE=2097152 NCCL_NCHANNELS_PER_NET_PEER=4
export DYNAMIQ_CUDA_ARCH=${DYNAMIQ_CUDA_ARCH:-90}

{
    echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    nvidia-smi -L 2>&1
    echo "git HEAD of this copy (may lag its files): $(git rev-parse --short HEAD 2>/dev/null)"
    $PY -c 'import sys, torch, cupy; from cupy.cuda import nccl
print("python", sys.version.split()[0], "| torch", torch.__version__,
      "| cupy", cupy.__version__, "| nccl", nccl.get_version())' 2>&1
    $PY -c 'import transformers; print("transformers", transformers.__version__)' 2>&1
    mpiexec --version 2>&1 | head -n 1
    env | grep -E '^(NCCL_|OMPI_MCA_)' | sort
    echo "steps $STEPS, bf16 seeds: $SEEDS_BF16, $CODECS_DQ seeds: $SEEDS_DQ, extra: ${TRAIN_ARGS:-none}"
} | tee "$OUT/env.txt"

if [ "${SKIP_BUILD:-0}" != 1 ]; then
    t0=$(date +%s.%N)
    if ! $PY setup.py build_ext --inplace >"$WORK/build.log" 2>&1; then
        tail -n 40 "$WORK/build.log"
        tar czf "$OUT/logs.tar.gz" -C "$WORK" .
        echo "device_train: build failed" >&2
        exit 1
    fi
    echo "build: $(elapsed "$t0") s"
fi

# Interleaved so that a run cut short still leaves a comparison.
RUNS=()
set -- $SEEDS_BF16
RUNS+=("bf16 $1")
shift
for c in $CODECS_DQ; do for s in $SEEDS_DQ; do RUNS+=("$c $s"); done; done
for s in "$@"; do RUNS+=("bf16 $s"); done

FAILED=0
for r in "${RUNS[@]}"; do
    read -r codec seed <<<"$r"
    tag=${codec//:/}_s$seed
    t0=$(date +%s.%N)
    timeout -k 10 "$RUN_TIMEOUT" mpiexec -n "$NP" "$PY" mpi_examples/train_lm.py \
        --codec "$codec" --seed "$seed" --steps "$STEPS" --no-progress \
        --json "$WORK/run_$tag.json" "${EXTRA[@]}" >"$WORK/log_$tag.txt" 2>&1
    rc=$?
    echo "run $codec seed $seed: exit $rc, $(elapsed "$t0") s (total $(elapsed "$T_ALL") s)"
    grep -a "final val loss" "$WORK/log_$tag.txt" || { tail -n 25 "$WORK/log_$tag.txt"; FAILED=1; }
done

# One JSON of all runs, the table, the curves.
$PY - "$WORK" "$OUT" <<'PYEOF' | tee "$OUT/table.txt"
import glob, json, os, statistics, sys
work, out = sys.argv[1:]
runs = []
for path in sorted(glob.glob(os.path.join(work, "run_*.json"))):
    with open(path) as f:
        runs.append(json.load(f))
env = open(os.path.join(out, "env.txt")).read()
with open(os.path.join(out, "runs.json"), "w") as f:
    json.dump({"env": env, "runs": runs}, f)
if not runs:
    sys.exit("no run finished")
fmt = lambda x, f: "-" if x is None else format(x, f)
print(f"{'codec':10s} {'seed':>4s} {'final val':>9s} {'train':>7s} {'ms/step':>8s} "
      f"{'compute':>8s} {'comm':>7s} {'hook':>7s} {'bits':>6s} {'vNMSE':>9s} {'wall s':>7s}")
for r in sorted(runs, key=lambda r: (r["summary"]["codec"], r["summary"]["seed"])):
    s = r["summary"]
    print(f"{s['codec']:10s} {s['seed']:4d} {s['final_val_loss']:9.4f} "
          f"{s['final_train_loss']:7.4f} {s['step_ms']:8.1f} {s['compute_ms']:8.1f} "
          f"{s['comm_ms']:7.1f} {fmt(s['hook_ms'], '7.1f')} {fmt(s['bits_per_coord'], '6.2f')} "
          f"{fmt(s['vnmse_mean'], '9.2e')} {s['wall_s']:7.1f}")
c = runs[0]["config"]
print(f"\n{c['n_params'] / 1e6:.1f}M parameters, {c['world_size']} ranks, {c['device']}, "
      f"{c['steps']} steps of {c['world_size']}x{c['batch']}x{c['seq_len']} bytes")
bf = [r["summary"]["final_val_loss"] for r in runs if r["summary"]["codec"] == "bf16"]
if bf:
    mean = statistics.mean(bf)
    lo, hi = min(bf), max(bf)
    sd = statistics.stdev(bf) if len(bf) > 1 else float("nan")
    print(f"bf16 over {len(bf)} seeds: mean {mean:.4f}, min {lo:.4f}, max {hi:.4f}, sd {sd:.4f}")
    for r in runs:
        s = r["summary"]
        if s["codec"] != "bf16":
            v = s["final_val_loss"]
            print(f"{s['codec']} seed {s['seed']}: {100 * (v - mean) / mean:+.2f} % vs the bf16 "
                  f"mean; inside the bf16 seed range [{lo:.4f}, {hi:.4f}]: {lo <= v <= hi}")
PYEOF
if $PY -c 'import matplotlib' 2>/dev/null; then
    $PY mpi_examples/train_lm.py plot "$OUT/curves.png" "$OUT/runs.json" && echo "wrote $OUT/curves.png"
else
    echo "matplotlib missing: no curves.png (plot later: train_lm.py plot OUT.png runs.json)"
fi
tar czf "$OUT/logs.tar.gz" -C "$WORK" $(cd "$WORK" && ls *.log *.txt 2>/dev/null)
echo "total $(elapsed "$T_ALL") s"
exit $FAILED
