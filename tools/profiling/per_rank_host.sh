#!/bin/bash
# Run a command with NCCL_HOSTID set per MPI rank, so NCCL treats the ranks of
# one machine as separate hosts: their traffic goes through the network
# transport and point-to-point uses NCCL_NCHANNELS_PER_NET_PEER channels per
# peer (NCCL gives two ranks of one host without NVLink exactly 2, whatever
# the environment: src/graph/paths.cc, ncclTopoGetNchannels).  The emulation
# of a two-node socket link that the fast-path benchmark uses.
#   mpiexec -n 2 tools/profiling/per_rank_host.sh python -m dynamiq_mpi bench ...
export NCCL_HOSTID="dq-host-${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-${PMIX_RANK:-0}}}"
exec "$@"
