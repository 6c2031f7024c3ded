#!/bin/bash
# The four-GPU stages of tools/device.sh (device kind nvidia-h100-x4), one call:
#   bash tools/device/nodes.sh [STAGES]   STAGES: any of build tests4 hier flat4 sockets4
#                                            torch4 ddp4
# build: the extension in place; tests4: the MPI GPU suites at 4 ranks, a GPU
# each (hierarchy on emulated nodes 2x2 and 1x4 with NCCL inside a node,
# NCCL transport, paths, reduce-scatter); hier: the hierarchical call on
# emulated nodes of 2 (NCCL over NVLink inside a node) with the rails over
# host-staged Open MPI forced onto TCP (the emulated slow link between nodes),
# DynamiQ 5 bits against BF16 on the same rails; sockets4: NCCL's own
# all-reduce and our flat and hierarchical calls with the whole job on NCCL's
# sockets; flat4: the defaults (path auto) at 4 ranks on NVLink against NCCL;
# torch4: the graph, torch-adapter, FSDP and control-plane MPI suites at 4
# ranks and the torchrun GPU launcher test; ddp4: mpi_examples/ddp_bench.py
# at 4 ranks on NVLink and on sockets, and FSDP2 on NVLink; medium4: the
# inputs of the cost model at 4 ranks (tools/profiling/p2p.py probe: a ring
# step against NCCL's all-reduce, small to large messages, 1 and 4 lanes, on
# shared memory and sockets) and the compressed call at 2^22-2^24 on shared
# memory with 1 and with 4 lanes; gather4: the all-gather's ring against
# recursive doubling (DYNAMIQ_GATHER), ring and butterfly topologies, the
# compressed call at 2^20-2^24 on shared memory and sockets, alternating
# (GATHER_ROUNDS, default 2), after the GPU all-reduce and reduce-scatter
# suites at 4 ranks with the doubling.
# Needs .whl/pytest_mpi*.whl (make wheels) carried along.  Output under $OUT.
set -o pipefail
OUT=${OUT:-device_out}; mkdir -p "$OUT"
STAGES=${*:-build tests4 hier sockets4 flat4}
has() { [[ " $STAGES " == *" $1 "* ]]; }
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
BENCH="$PY -m dynamiq_mpi bench --dtype bf16 -w 2 -n ${BENCH_ITERS:-4} --rounds 2"
# Open MPI between the emulated nodes: TCP only (no shared memory, no CUDA IPC)
TCP="OMPI_MCA_btl=self,tcp OMPI_MCA_pml=ob1"

if has build; then
  echo "== build"; t0=$(date +%s)
  $PY setup.py build_ext --inplace > /tmp/build.log 2>&1 || { tail -40 /tmp/build.log; exit 1; }
  echo "build took $(( $(date +%s) - t0 )) s"
fi

if has tests4; then
  echo "== tests4"; t0=$(date +%s)
  SKIP_SERIAL=1 MPI_TESTS="tests/mpi/test_hierarchy_mpi.py tests/mpi/test_allreduce_gpu_mpi.py tests/mpi/test_reduce_scatter_gpu_mpi.py tests/mpi/test_paths_gpu_mpi.py tests/mpi/test_transports_mpi.py" \
    MPI_TIMEOUT=240 timeout 270 tools/testing/run_tests.sh $PY 4 2>&1 | tail -14 | tee "$OUT/tests4.txt"
  echo "tests4 took $(( $(date +%s) - t0 )) s"
fi

if has hier; then
  echo "== hier: 2 nodes x 2, NCCL inside, rails over Open MPI TCP"
  env $TCP timeout 200 mpiexec -n 4 $BENCH --codec dynamiq:5,bf16 --topology ring --paths compressed \
    --transport mpi --hierarchy nodes --node-size 2 --sizes ${HIER_SIZES:-32M,128M,512M} \
    --json "$OUT/hier_tcp.json" 2>&1 | grep -v '^\[' | tee "$OUT/hier.txt"
fi

if has sockets4; then
  echo "== sockets4: the whole job on NCCL's sockets"
  env $SOCKETS $TUNED timeout 200 mpiexec -n 4 $BENCH --codec dynamiq:5 --topology ring \
    --paths compressed --hierarchy flat,nodes --node-size 2 --sizes ${HIER_SIZES:-32M,128M,512M} \
    --json "$OUT/sockets4.json" 2>&1 | grep -v '^\[' | tee "$OUT/sockets4.txt"
fi

if has flat4; then
  echo "== flat4: defaults at 4 ranks on NVLink"
  timeout 150 mpiexec -n 4 $BENCH --codec dynamiq:5 --topology ring,butterfly --paths auto,compressed \
    --sizes ${FLAT_SIZES:-2M,32M,512M} --json "$OUT/flat4_nvlink.json" 2>&1 | grep -v '^\[' \
    | tee "$OUT/flat4.txt"
fi

if has medium4; then
  for link in "shm:$SHM" "sockets:$SOCKETS $TUNED"; do
    echo "== medium4: ring steps at 4 ranks, ${link%%:*} (${link#*:})"
    (cd tools/profiling && env ${link#*:} timeout 120 mpiexec -n 4 $PY p2p.py probe \
      --sizes ${P2P_SIZES:-4K,64K,256K,1M,4M,21M} --split 1 --comms 1,4) 2>&1 | grep -v '^\[' \
      | tee "$OUT/p2p4_${link%%:*}.txt"
  done
  for lanes in 1 4; do
    echo "== medium4: the compressed call on shared memory, DYNAMIQ_NCCL_LANES=$lanes"
    env $SHM DYNAMIQ_NCCL_LANES=$lanes timeout 150 mpiexec -n 4 $BENCH --codec dynamiq:5 \
      --paths compressed --sizes 8M,16M,32M --json "$OUT/medium4_shm_lanes$lanes.json" 2>&1 \
      | grep -v '^\[' | tee "$OUT/medium4_shm_lanes$lanes.txt"
  done
fi

if has gather4; then
  echo "== gather4: GPU suites at 4 ranks, DYNAMIQ_GATHER=doubling"; t0=$(date +%s)
  DYNAMIQ_GATHER=doubling SKIP_SERIAL=1 MPI_TESTS="tests/mpi/test_allreduce_gpu_mpi.py tests/mpi/test_reduce_scatter_gpu_mpi.py" \
    MPI_TIMEOUT=150 timeout 170 tools/testing/run_tests.sh $PY 4 2>&1 | tail -6 | tee "$OUT/gather4_tests.txt"
  echo "tests took $(( $(date +%s) - t0 )) s"
  for r in $(seq 1 ${GATHER_ROUNDS:-2}); do
    for link in "shm:$SHM" "sockets:$SOCKETS $TUNED"; do
      for g in ring doubling; do
        echo "== gather4 round $r: ${link%%:*}, DYNAMIQ_GATHER=$g"
        env ${link#*:} DYNAMIQ_GATHER=$g timeout 120 mpiexec -n 4 $BENCH --codec dynamiq:5 \
          --topology ring,butterfly --paths compressed --sizes ${GATHER_SIZES:-2M,8M,16M,32M} \
          --json "$OUT/gather4_${link%%:*}_${g}_r$r.json" 2>&1 | grep -v '^\[' | tail -12
      done
    done
  done
fi

if has torch4; then
  echo "== torch4"; t0=$(date +%s)
  SKIP_SERIAL=1 MPI_TESTS="tests/mpi/test_graphs_gpu_mpi.py tests/mpi/test_torch_gpu_mpi.py tests/mpi/test_fsdp_mpi.py tests/mpi/test_control_planes_mpi.py" \
    MPI_TIMEOUT=200 timeout 230 tools/testing/run_tests.sh $PY 4 2>&1 | tail -8 | tee "$OUT/torch4.txt"
  timeout 120 $PY -m pytest -q -p no:cacheprovider tests/test_launchers.py -m gpu 2>&1 | tail -3 | tee -a "$OUT/torch4.txt"
  echo "torch4 took $(( $(date +%s) - t0 )) s"
fi

if has ddp4; then
  DDP="$PY mpi_examples/ddp_bench.py --params 268M --bucket-mb 25 --steps ${DDP_STEPS:-12} --warmup 8"
  echo "== ddp4 nvlink"
  timeout 150 mpiexec -n 4 $DDP --json "$OUT/ddp4_nvlink.json" 2>&1 | grep -v '^\[' | tail -12
  echo "== ddp4 sockets"
  env $SOCKETS $TUNED timeout 200 mpiexec -n 4 $DDP --modes plain,bf16,dynamiq,dynamiq-compressed \
    --json "$OUT/ddp4_sockets.json" 2>&1 | grep -v '^\[' | tail -12
  echo "== fsdp4 nvlink"
  timeout 120 mpiexec -n 4 $DDP --fsdp --modes plain,bf16,dynamiq --json "$OUT/fsdp4_nvlink.json" \
    2>&1 | grep -v '^\[' | tail -10
fi
