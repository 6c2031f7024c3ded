# Sourced by the multi-GPU stage scripts (links.sh, nodes.sh): one host's
# Open MPI and NCCL settings, the link environments, and the header of a run.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# Open MPI as root on one host; no binding: bound ranks pin NCCL's socket threads to one core.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
       OMPI_MCA_hwloc_base_binding_policy=none
export NCCL_NVLS_ENABLE=0                       # the machine's rule: no NVLink multicast
PY=python3
SOCKETS="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1"
# Shared memory: point-to-point chunks of 512 KiB (the largest the default 4 MiB
# buffers allow; NCCL's 128 KiB default for ranks of one node without NVLink);
# NCCL's all-reduce does not read it (measured equal, 2026-11-23 chunks stage).
SHM="NCCL_P2P_DISABLE=1 NCCL_P2P_PCI_CHUNKSIZE=524288"
# Socket settings found best for both sides (docs/benchmarks.md 2.0f: NCCL's
# all-reduce was fastest with 1-2 threads per connection and 8 channels; our
# point-to-point needs the 2 MiB chunks and 4 channels per peer).
TUNED="NCCL_NSOCKS_PERTHREAD=2 NCCL_SOCKET_NTHREADS=2 NCCL_MIN_NCHANNELS=8 NCCL_P2P_NET_CHUNKSIZE=2097152 NCCL_NCHANNELS_PER_NET_PEER=4"
{ date -u; nvidia-smi -L; nvidia-smi topo -m 2>/dev/null | head -6
  $PY -c "import cupy, mpi4py, numpy; from cupy.cuda import nccl; print('cupy', cupy.__version__, 'nccl', nccl.get_version(), 'mpi4py', mpi4py.__version__, 'numpy', numpy.__version__)"
  git log --oneline -1 2>/dev/null; } 2>&1 | tee "$OUT/env.txt"
