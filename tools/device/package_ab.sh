#!/bin/bash
# A/B of two versions of the Python package on a two-GPU machine (nvidia-h200-x2),
# alternating in one job so that link and host drift hit both alike:
#   OLD_DIR=... bash tools/device.sh package-ab  (or bash tools/device/package_ab.sh OLD_DIR [ROUNDS])
# OLD_DIR contains the old `dynamiq_mpi` package (e.g. from `git archive <rev> dynamiq_mpi`),
# with the compiled extensions copied in; the working tree is the new one.
# Each round runs `python -m dynamiq_mpi bench` (DynamiQ 5 bits and NCCL's BF16
# all-reduce on the same data) on NVLink, shared memory and tuned sockets, old
# then new; then NVLink with smaller tiles (new).  Output under $OUT/ab.txt.
# AB_KIND=host: instead, the host-bound sizes (2^20, 2^22, 2^24 BF16 elements) of a
# steady compressed call over NVLink, where a call's time is its host time.
set -o pipefail
OLD=${1:?old package directory}; ROUNDS=${2:-2}
OUT=${OUT:-device_out}; mkdir -p "$OUT"
# PYTHONSAFEPATH=1: without it `python -m` puts the working directory (the new
# package) before PYTHONPATH, and "old" silently runs the new code (it did in
# the A/B of docs/benchmarks.md 2.0e; corrected there).
export PYTHONSAFEPATH=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
       OMPI_MCA_hwloc_base_binding_policy=none NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
SHM="NCCL_P2P_DISABLE=1 NCCL_P2P_PCI_CHUNKSIZE=524288"
SOCKETS="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NSOCKS_PERTHREAD=2 NCCL_SOCKET_NTHREADS=2 NCCL_MIN_NCHANNELS=8 NCCL_P2P_NET_CHUNKSIZE=2097152 NCCL_NCHANNELS_PER_NET_PEER=4"
bench() {   # label, pythonpath, env, sizes, extra args
  echo "== $1" | tee -a "$OUT/ab.txt"
  env $3 PYTHONPATH=$2 timeout 150 mpiexec -n 2 python3 -m dynamiq_mpi bench --dtype bf16 \
    --codec dynamiq:5 --topology ring -w 3 -n 20 --sizes "$4" $5 2>&1 | grep -v '^\[' \
    | grep -E "^ +[0-9]" | tee -a "$OUT/ab.txt"
}
for P in "$(cd "$OLD" && pwd)" "$PWD"; do   # which package each side imports
  echo "PYTHONPATH=$P imports $(PYTHONPATH=$P python3 -c 'import dynamiq_mpi; print(dynamiq_mpi.__file__)')" | tee -a "$OUT/ab.txt"
done
if [ "${AB_KIND:-}" = host ]; then
  for r in $(seq "$ROUNDS"); do
    for v in old new; do
      P=$PWD; [ "$v" = old ] && P=$(cd "$OLD" && pwd)
      bench "nvlink compressed $v (round $r)" "$P" "" 2M,8M,32M "--paths compressed -n 100 -w 10"
    done
  done
  exit 0
fi
for r in $(seq "$ROUNDS"); do
  for v in old new; do
    P=$PWD; [ "$v" = old ] && P=$(cd "$OLD" && pwd)
    bench "nvlink $v (round $r)" "$P" "" 16M,128M,256M,512M
    bench "shm $v (round $r)" "$P" "$SHM" 128M,256M
    bench "sockets tuned $v (round $r)" "$P" "$SOCKETS" 16M,256M
  done
done
for tile in 8388608 16777216; do
  bench "nvlink new, tile $tile" "$PWD" "" 256M,512M "--tile-bytes $tile"
done
