#!/bin/sh
# Per-rank pytest launcher, started by tools/testing/run_tests.sh as
#     mpiexec -n N tools/testing/mpi_rank_pytest.sh [pytest args...]
# Rank 0 writes to the terminal; rank R > 0 writes to $MPI_LOG_DIR/rankR.log.
# Every rank also writes a JUnit XML report, $MPI_LOG_DIR/rankR.xml, which the
# runner reads to check that every rank ran (and passed) the same tests, and
# $MPI_LOG_DIR/rankR.started when its first test starts (tests/conftest.py).
#
# Environment: MPI_TEST_PYTHON (the interpreter, default python3),
#              MPI_LOG_DIR     (default .mpi-logs).
# The rank comes from the launcher: PMI_RANK (MPICH/hydra),
# OMPI_COMM_WORLD_RANK (Open MPI), PMIX_RANK (other PMIx launchers).
rank=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-${PMIX_RANK:-0}}}
logdir=${MPI_LOG_DIR:-.mpi-logs}
py=${MPI_TEST_PYTHON:-python3}
mkdir -p "$logdir"
export MPI_TEST_STARTED="$logdir/rank$rank.started"

# --capture=sys: what MPI or a crashing extension writes to file descriptor 2
# reaches the log even when the process dies before pytest could show it.
set -- -m pytest --with-mpi -p no:cacheprovider --color=no --capture=sys \
    --junitxml="$logdir/rank$rank.xml" "$@"
if [ "$rank" = 0 ]; then
    exec "$py" "$@"
else
    exec "$py" "$@" >"$logdir/rank$rank.log" 2>&1
fi
