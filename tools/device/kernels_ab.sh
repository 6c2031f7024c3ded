#!/bin/bash
# Same-run A/B of the kernel benchmark on one GPU: an old version of the sources
# against the working tree, alternating in one job so that clock and thermal
# drift hit both alike (a time measured on another day or machine compares nothing).
#   git archive <rev> dynamiq_mpi pyx src_cuda setup.py setup.cfg pyproject.toml | tar -x -C .ab_old
#   OLD_DIR=.ab_old bash tools/device.sh build kernels-ab      ([AB_ROUNDS=2] [SIZES=26,28])
# Builds OLD_DIR in place, then per round runs the working tree's `python -m research kernels`
# on the old package, then the new (PYTHONSAFEPATH=1 and the package's directory first on
# PYTHONPATH, so `python -m` cannot put the new package first; each side prints the package
# it imported).  Output under $OUT/kernels_ab.txt and JSON.
set -o pipefail
OLD=${1:?old source directory}; ROUNDS=${2:-2}
OUT=${OUT:-device_out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
SIZES=${SIZES:-26,28}
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
OLD=$(cd "$OLD" && pwd)
( cd "$OLD" && $PY setup.py build_ext --inplace > /tmp/build_old.log 2>&1 ) \
  || { tail -30 /tmp/build_old.log; exit 1; }
echo "old build rc 0" | tee "$OUT/kernels_ab.txt"
for r in $(seq "$ROUNDS"); do
  for v in old new; do
    P=$PWD; [ "$v" = old ] && P=$OLD
    echo "== $v (round $r): $(PYTHONPATH=$P $PY -c 'import dynamiq_mpi; print(dynamiq_mpi.__file__)')" \
      | tee -a "$OUT/kernels_ab.txt"
    PYTHONPATH=$P:$PWD timeout 200 $PY -m research kernels --sizes "$SIZES" --no-variant \
      --json "$OUT/kernels_ab_${v}_$r.json" 2>&1 | grep -E "^ +2\^" | tee -a "$OUT/kernels_ab.txt"
  done
done
