#!/bin/bash
# One device call (nvidia-h200-x2): the fast-path benchmarks, then the training
# comparison.  At most 8 files come back: the benchmark JSON and the test log
# travel in one tarball, the training output under train/.
set -o pipefail
OUT=${OUT:-device_out}; mkdir -p "$OUT/train"
OUT=$OUT bash tools/device_fastpath.sh build tests nvlink shm sockets
(cd "$OUT" && tar czf bench_json.tar.gz bench_*.json tests.txt && rm -f bench_*.json tests.txt)
OUT=$OUT/train SKIP_BUILD=1 bash tools/device_train.sh 2>&1 | tail -25
