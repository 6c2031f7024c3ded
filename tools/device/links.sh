#!/bin/bash
# The two-GPU stages of tools/device.sh (device kind nvidia-h200-x2), one call:
#   bash tools/device/links.sh [STAGES]   STAGES: any of build tests profile ncu timeline
#                                            nvlink shm sockets probe tune hostid lanes mx agprobe pairab sockset shm1
#                                            paths ddp fsdp defaults
# build: the extension in place; tests: GPU kernel/planner tests, then the MPI
# suites with CuPy arrays over NCCL and host-staged MPI (one rank per GPU);
# nvlink/shm/sockets: `python -m dynamiq_mpi bench` against NCCL's own BF16
# all-reduce on the same data, the same NCCL environment for both sides;
# profile: kernel times of statistics and planner, cProfile of the host side;
# ncu: the statistics kernels and the planner under Nsight Compute (one GPU);
# timeline: every message of one profiled 2^27 call on sockets and shm (GB/s per tile);
# probe: lanes and tile sizes on sockets and NVLink; hostid: sockets between two
# emulated hosts; lanes: shared memory with 1/2/4 communicators; mx: the baselines.
# Needs .whl/pytest_mpi*.whl (make wheels) carried along.  Output under $OUT.
set -o pipefail
OUT=${OUT:-device_out}; mkdir -p "$OUT"
STAGES=${*:-build tests profile nvlink shm sockets probe}
has() { [[ " $STAGES " == *" $1 "* ]]; }
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
BENCH="$PY -m dynamiq_mpi bench --dtype bf16 --codec dynamiq:5,bf16 --topology ring -w 3 -n ${BENCH_ITERS:-5} --rounds 2"

if has build; then
  echo "== build"; t0=$(date +%s)
  $PY setup.py build_ext --inplace > /tmp/build.log 2>&1 || { tail -40 /tmp/build.log; exit 1; }
  echo "build took $(( $(date +%s) - t0 )) s"
  mkdir -p "$OUT/so" && cp dynamiq_mpi/*.cpython-3*.so "$OUT/so/"   # carry them to skip the next build
fi

if has tests; then
  echo "== tests"; t0=$(date +%s)
  { timeout 240 $PY -m pytest -q -rs -p no:cacheprovider tests/gpu 2>&1 | tail -15
    SKIP_SERIAL=1 MPI_TESTS="tests/mpi/test_allreduce_gpu_mpi.py tests/mpi/test_transports_mpi.py tests/mpi/test_paths_gpu_mpi.py tests/mpi/test_paths_mpi.py tests/mpi/test_reduce_scatter_gpu_mpi.py tests/mpi/test_torch_gpu_mpi.py" \
      MPI_TIMEOUT=360 timeout 390 tools/testing/run_tests.sh $PY 2 2>&1 | tail -25
  } 2>&1 | tee "$OUT/tests.txt"
  echo "tests took $(( $(date +%s) - t0 )) s"
fi

if has profile; then
  echo "== profile (NVLink)"
  timeout 120 mpiexec -n 2 $PY tools/profiling/host_time.py profile --sizes 23,27 2>&1 | tee "$OUT/profile.txt" | grep -E "^==|tottime|dynamiq_mpi|cupy|nccl" | head -60
fi

if has ncu; then
  echo "== ncu (statistics kernels, planner; 2^27 BF16)"
  timeout 240 ncu -k 'regex:k_stats|k_plan' --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats $PY tools/profiling/stats_workload.py > "$OUT/ncu.txt" 2>&1
  grep -E "k_stats|k_plan|Duration|Memory Throughput|Achieved Occupancy|Registers Per|Theoretical Occ|Block Limit Reg|Warp Cycles Per Issued|DRAM Throughput|Compute \(SM\)" \
    "$OUT/ncu.txt" | head -90
fi

if has timeline; then   # per-message rates of one profiled call per link
  for link in "sockets:$SOCKETS $TUNED" "shm:$SHM"; do
    echo "== timeline ${link%%:*}" | tee -a "$OUT/timeline.txt"
    env ${link#*:} timeout 120 mpiexec -n 2 $BENCH --codec dynamiq:5 --sizes 256M --breakdown \
      --json "$OUT/timeline_${link%%:*}.json" 2>&1 | grep -v '^\[' | tail -6 | tee -a "$OUT/timeline.txt"
    $PY - "$OUT/timeline_${link%%:*}.json" <<'PYEOF' | tee -a "$OUT/timeline.txt"
import json, sys
for row in json.load(open(sys.argv[1]))["rows"]:
    for a, b, sent, got in row.get("timeline_ms", []):
        mb = max(sent, got) / 1e6
        print(f"  {a:9.3f} -> {b:9.3f} ms  sent {sent / 1e6:7.2f} MB  received {got / 1e6:7.2f} MB"
              f"  {mb / max(b - a, 1e-9):6.2f} GB/s")
PYEOF
  done
fi

run_bench() {   # name, env, bench args
  local name=$1 envs=$2; shift 2
  echo "== bench $name: $envs"; local t0=$(date +%s)
  env $envs timeout 280 mpiexec -n 2 $BENCH --json "$OUT/bench_$name.json" "$@" 2>&1 \
    | grep -v '^\[' | tee -a "$OUT/bench.txt"
  echo "bench $name took $(( $(date +%s) - t0 )) s"
}
has nvlink && run_bench nvlink "" --sizes 2M,16M,128M,256M,512M --breakdown
has shm && run_bench shm "$SHM" --sizes 16M,128M,256M,512M --breakdown
has shm1 && run_bench shm_1lane "$SHM DYNAMIQ_NCCL_LANES=1" --sizes 16M,128M,256M,512M
has sockets && run_bench sockets_tuned "$SOCKETS $TUNED" --sizes 2M,16M,64M,128M,256M,512M --breakdown
has sockets && run_bench sockets_default "$SOCKETS" --sizes 16M,256M
# paths: DynamiQ compressed, NCCL's BF16 all-reduce (native) and the library's
# choice (auto) against NCCL's own all-reduce, 2^16..2^28 BF16 elements per link
PATH_SIZES=128K,1M,8M,16M,64M,128M,256M,512M
has paths && run_bench paths_nvlink "" --codec dynamiq:5 --sizes $PATH_SIZES
has paths && run_bench paths_shm "$SHM" --codec dynamiq:5 --sizes $PATH_SIZES
has paths && run_bench paths_sockets "$SOCKETS $TUNED" --codec dynamiq:5 --sizes $PATH_SIZES
if has fsdp; then   # FSDP2 step time: float32 and BF16 reduce-scatter, ours (auto, compressed)
  for link in "sockets:$SOCKETS $TUNED" "nvlink:"; do
    echo "== fsdp ${link%%:*}: ${link#*:}"; t0=$(date +%s)
    env ${link#*:} timeout 240 mpiexec -n 2 $PY mpi_examples/ddp_bench.py --fsdp --params ${DDP_PARAMS:-268M} \
      --json "$OUT/fsdp_${link%%:*}.json" 2>&1 | grep -v '^\[' | tee -a "$OUT/fsdp.txt"
    echo "fsdp ${link%%:*} took $(( $(date +%s) - t0 )) s"
  done
fi
# defaults: the 16-bit class and hybrid codes against the earlier defaults, same run
has defaults && run_bench defaults_nvlink "" --paths compressed --no-reference --rounds 3 \
  --codec dynamiq:5:scale_code=ceil:bf16_class=false,dynamiq:5:bf16_class=false,dynamiq:5 --sizes 16M,64M,256M,512M
has defaults && run_bench defaults_shm "$SHM" --paths compressed --no-reference --rounds 3 \
  --codec dynamiq:5:scale_code=ceil:bf16_class=false,dynamiq:5:bf16_class=false,dynamiq:5 --sizes 16M,64M,256M,512M
if has ddp; then   # DDP step time: plain, torch's BF16 hook, our hook (auto, compressed)
  for link in "nvlink:" "sockets:$SOCKETS $TUNED" "shm:$SHM"; do
    echo "== ddp ${link%%:*}: ${link#*:}"; t0=$(date +%s)
    env ${link#*:} timeout 240 mpiexec -n 2 $PY mpi_examples/ddp_bench.py --params ${DDP_PARAMS:-268M} \
      --json "$OUT/ddp_${link%%:*}.json" 2>&1 | grep -v '^\[' | tee -a "$OUT/ddp.txt"
    echo "ddp ${link%%:*} took $(( $(date +%s) - t0 )) s"
  done
fi
if has tune; then   # socket and shm settings for the point-to-point path, 2^27 elements, same-run ratios
  for probe in "sockets 32M:$SOCKETS $TUNED:32M" "sockets 8M:$SOCKETS $TUNED:8M" \
               "sockets 32M, 8 channels/peer, 1 MiB chunks:$SOCKETS ${TUNED/NCCL_P2P_NET_CHUNKSIZE=2097152 NCCL_NCHANNELS_PER_NET_PEER=4/NCCL_P2P_NET_CHUNKSIZE=1048576 NCCL_NCHANNELS_PER_NET_PEER=8}:32M" \
               "sockets 32M, 2 lanes:$SOCKETS $TUNED DYNAMIQ_NCCL_LANES=2:32M" \
               "shm 32M:NCCL_P2P_DISABLE=1:32M" "shm 8M:NCCL_P2P_DISABLE=1:8M"; do
    IFS=: read -r name envs tile <<<"$probe"
    echo "== tune $name ($envs)" | tee -a "$OUT/tune.txt"
    env $envs timeout 120 mpiexec -n 2 $BENCH --codec dynamiq:5 --sizes 256M --tile-bytes $tile 2>&1 \
      | grep -v '^\[' | grep -E "^ +[0-9]" | tee -a "$OUT/tune.txt"
  done
fi

# Socket link emulated as two hosts (tools/profiling/per_rank_host.sh): the point-to-point
# path gets NCCL_NCHANNELS_PER_NET_PEER channels; NCCL's all-reduce in the same
# environment is the reference of each row, and the same-host rows beside it.
if has hostid; then
  for peer in 4 8; do
    envs="$SOCKETS ${TUNED/NCCL_NCHANNELS_PER_NET_PEER=4/NCCL_NCHANNELS_PER_NET_PEER=$peer}"
    echo "== hostid sockets, $peer channels per peer: $envs" | tee -a "$OUT/hostid.txt"
    env $envs timeout 150 mpiexec -n 2 tools/profiling/per_rank_host.sh $BENCH --sizes 16M,128M,256M,512M \
      --json "$OUT/bench_hostid_$peer.json" 2>&1 | grep -v '^\[' | tee -a "$OUT/hostid.txt"
  done
  echo "== same host, sockets tuned (for comparison)" | tee -a "$OUT/hostid.txt"
  env $SOCKETS $TUNED timeout 150 mpiexec -n 2 $BENCH --sizes 16M,128M,256M,512M \
    --json "$OUT/bench_samehost.json" 2>&1 | grep -v '^\[' | tee -a "$OUT/hostid.txt"
fi
# Lanes (one communicator and stream each) multiply the 2 point-to-point
# channels NCCL gives a peer of the same host; slices are 256-byte aligned.
if has lanes; then
  for probe in "shm:$SHM:1 2 4" "sockets:$SOCKETS $TUNED:1 2 4" "nvlink::1 2"; do
    IFS=: read -r link envs counts <<<"$probe"
    for lanes in $counts; do
      echo "== $link, $lanes lanes" | tee -a "$OUT/lanes.txt"
      env $envs DYNAMIQ_NCCL_LANES=$lanes timeout 120 mpiexec -n 2 $BENCH \
        --sizes 16M,128M,256M,512M --json "$OUT/bench_${link}_lanes$lanes.json" 2>&1 | grep -v '^\[' \
        | grep -E "^ +[0-9]" | tee -a "$OUT/lanes.txt"
    done
  done
fi
# Point-to-point chunk size on one host: NCCL uses NCCL_P2P_PCI_CHUNKSIZE (128 KiB)
# for ranks of one node without NVLink, whatever NCCL_P2P_NET_CHUNKSIZE says
# (src/init.cc computeBuffSizes), capped at NCCL_BUFFSIZE / 8.
if has chunks; then
  for probe in "shm, 512K chunks:NCCL_P2P_DISABLE=1 NCCL_P2P_PCI_CHUNKSIZE=524288" \
               "shm, 16M buffers, 2M chunks:NCCL_P2P_DISABLE=1 NCCL_BUFFSIZE=16777216 NCCL_P2P_PCI_CHUNKSIZE=2097152" \
               "sockets tuned, 512K chunks:$SOCKETS $TUNED NCCL_P2P_PCI_CHUNKSIZE=524288" \
               "sockets tuned, 16M buffers, 2M chunks:$SOCKETS $TUNED NCCL_BUFFSIZE=16777216 NCCL_P2P_PCI_CHUNKSIZE=2097152"; do
    name=${probe%%:*}; envs=${probe#*:}
    echo "== chunks $name ($envs)" | tee -a "$OUT/chunks.txt"
    env $envs timeout 120 mpiexec -n 2 $BENCH --sizes 16M,128M,256M,512M \
      --json "$OUT/bench_chunks_$(echo "$name" | tr -c 'a-zA-Z0-9' _).json" 2>&1 | grep -v '^\[' \
      | grep -v "^#  *size" | tee -a "$OUT/chunks.txt"
  done
fi
# Raw NCCL point-to-point against the all-reduce on each link (tools/profiling/p2p.py probe)
if has p2p; then
  for probe in "nvlink:" "nvlink, 2M chunks:NCCL_P2P_NVL_CHUNKSIZE=2097152" \
               "nvlink, copy engines:NCCL_P2P_USE_CUDA_MEMCPY=1" \
               "shm:NCCL_P2P_DISABLE=1" "shm, 512K chunks:$SHM" \
               "sockets tuned:$SOCKETS $TUNED"; do
    name=${probe%%:*}; envs=${probe#*:}
    echo "== p2p $name ($envs)" | tee -a "$OUT/p2p.txt"
    env $envs timeout 90 mpiexec -n 2 $PY tools/profiling/p2p.py probe --sizes 4M,21M,42M --split 1,4 --comms ${P2P_COMMS:-1} 2>&1 \
      | grep -v '^\[' | tee -a "$OUT/p2p.txt"
  done
fi
# A/B of DynamiQ decoding straight into the caller's buffer (default) against
# the float32 stream plus the final scatter, alternating, same job
if has ab; then
  for link in "nvlink:" "shm:$SHM"; do
    for direct in 1 0 1 0; do
      echo "== ab ${link%%:*}, decode into output=$direct" | tee -a "$OUT/ab.txt"
      env ${link#*:} DYNAMIQ_DECODE_INTO_OUTPUT=$direct timeout 90 mpiexec -n 2 $PY -m dynamiq_mpi bench \
        --dtype bf16 --codec dynamiq:5 --topology ring -w 3 -n 10 --sizes 128M,256M --no-reference 2>&1 \
        | grep -v '^\[' | grep -E "^ +[0-9]" | tee -a "$OUT/ab.txt"
    done
  done
fi
# The baselines' GPU speed: MXFP8 (fused kernels) and THC / OmniReduce (array code)
if has mx; then
  for link in "nvlink:" "sockets:$SOCKETS $TUNED"; do
    echo "== codecs, ${link%%:*}" | tee -a "$OUT/codecs.txt"
    env ${link#*:} timeout 150 mpiexec -n 2 $PY -m dynamiq_mpi bench --dtype bf16 -w 2 -n 5 \
      --codec dynamiq:5,mxfp:e4m3,mxfp:e2m1,bf16,thc,omnireduce --topology ring --sizes 16M,256M \
      --json "$OUT/bench_codecs_${link%%:*}.json" 2>&1 | grep -v '^\[' | tee -a "$OUT/codecs.txt"
  done
fi

# Raw all-gather against point-to-point and the all-reduce (same bytes each way),
# then DynamiQ with its two-rank exchanges as all-gathers, alternating, same job
if has agprobe; then
  for probe in "sockets tuned:$SOCKETS $TUNED" "shm:$SHM" "nvlink:"; do
    name=${probe%%:*}; envs=${probe#*:}
    echo "== agprobe raw $name ($envs)" | tee -a "$OUT/agprobe.txt"
    env $envs timeout 90 mpiexec -n 2 $PY tools/profiling/p2p.py probe --sizes 2M,8M,42M --split 1 --allgather 2>&1 \
      | grep -v '^\[' | tee -a "$OUT/agprobe.txt"
  done
  for pair in 0 1 0 1; do
    echo "== agprobe sockets tuned, pair all-gather=$pair" | tee -a "$OUT/agprobe.txt"
    env $SOCKETS $TUNED DYNAMIQ_NCCL_PAIR_ALLGATHER=$pair timeout 120 mpiexec -n 2 $BENCH --rounds 1 \
      --codec dynamiq:5 --sizes 16M,256M --json "$OUT/bench_agprobe_$pair.json" 2>&1 | grep -v '^\[' \
      | grep -E "^ +[0-9]" | tee -a "$OUT/agprobe.txt"
  done
fi
if has pairab; then   # the same, alternating in one process (tools/profiling/p2p.py pair-ab)
  for probe in "sockets tuned:$SOCKETS $TUNED:23,26,27" "sockets default:$SOCKETS:23,27" "shm:$SHM:26,27"; do
    IFS=: read -r name envs sizes <<<"$probe"
    echo "== pairab $name ($envs)" | tee -a "$OUT/pairab.txt"
    env $envs timeout 150 mpiexec -n 2 $PY tools/profiling/p2p.py pair-ab --sizes $sizes --rounds ${PAIRAB_ROUNDS:-3} $PAIRAB_ARGS 2>&1 \
      | grep -v '^\[' | tee -a "$OUT/pairab.txt"
  done
fi
# Socket settings for both sides: NCCL's all-reduce and our two variants, same process
if has sockset; then
  for probe in "N4 T4 C8:NCCL_NSOCKS_PERTHREAD=4 NCCL_SOCKET_NTHREADS=4 NCCL_MIN_NCHANNELS=8" \
               "N4 T2 C8:NCCL_NSOCKS_PERTHREAD=4 NCCL_SOCKET_NTHREADS=2 NCCL_MIN_NCHANNELS=8" \
               "N8 T1 C8:NCCL_NSOCKS_PERTHREAD=8 NCCL_SOCKET_NTHREADS=1 NCCL_MIN_NCHANNELS=8" \
               "N2 T2 C8:NCCL_NSOCKS_PERTHREAD=2 NCCL_SOCKET_NTHREADS=2 NCCL_MIN_NCHANNELS=8" \
               "N4 T4 C4:NCCL_NSOCKS_PERTHREAD=4 NCCL_SOCKET_NTHREADS=4 NCCL_MIN_NCHANNELS=4" \
               "N4 T2 C4:NCCL_NSOCKS_PERTHREAD=4 NCCL_SOCKET_NTHREADS=2 NCCL_MIN_NCHANNELS=4"; do
    name=${probe%%:*}; envs=${probe#*:}
    echo "== sockset $name ($envs)" | tee -a "$OUT/sockset.txt"
    env $SOCKETS $envs NCCL_P2P_NET_CHUNKSIZE=2097152 NCCL_NCHANNELS_PER_NET_PEER=4 timeout 100 mpiexec -n 2 $PY tools/profiling/p2p.py pair-ab --sizes ${SOCKSET_SIZES:-26,27} --rounds 2 2>&1 \
      | grep -v '^\[' | grep -v "^#" | tee -a "$OUT/sockset.txt"
  done
fi
if has probe; then   # the pair all-gather against send/receive, 2^27 elements
  for link in "sockets:$SOCKETS $TUNED" "shm:NCCL_P2P_DISABLE=1" "nvlink:"; do
    for pair in 1 0; do
      echo "== probe ${link%%:*}, pair all-gather=$pair" | tee -a "$OUT/bench.txt"
      env ${link#*:} DYNAMIQ_NCCL_PAIR_ALLGATHER=$pair timeout 120 mpiexec -n 2 $BENCH \
        --codec dynamiq:5,bf16 --sizes 256M --no-reference 2>&1 | grep -v '^\[' \
        | grep -E "^ +[0-9]" | tee -a "$OUT/bench.txt"
    done
  done
fi
