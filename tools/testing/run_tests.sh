#!/usr/bin/env bash
# Run the serial test suite, then the MPI suite under mpiexec at several world sizes.
#
#   tools/testing/run_tests.sh PYTHON [N ...]        (default sizes: 2 3 4 8)
#
# PYTHON is the interpreter that has numpy, mpi4py, pytest (and pytest-mpi) and
# the built extension; the MPI launcher used is the `mpiexec` next to it if there
# is one (a venv with the PyPI `mpich`), otherwise the one on PATH.
#
# Environment knobs (all optional):
#   MPI_TIMEOUT=600       seconds one world size may take before it is killed
#                         (MPIEXEC_TIMEOUT for the launcher, plus an outer `timeout`)
#   MPI_TESTS=tests/mpi   what the MPI suite runs (`--with-mpi --only-mpi`)
#   SERIAL_TESTS=tests    what the serial suite runs (MPI-marked tests are skipped)
#   PYTEST_ARGS=""        extra pytest arguments for both suites, e.g. "-k ring -x"
#   SKIP_SERIAL=1 / SKIP_MPI=1
#   MPIEXEC=/path/mpiexec launcher override
#   MPI_LOG_ROOT=.mpi-logs  where rank logs and JUnit reports go
#   PYTEST_MPI_SITE=/tmp/site  where a carried pytest-mpi wheel (.whl/) is unpacked
#                         when PYTHON cannot import pytest_mpi
#
# Only rank 0 prints to the terminal (and to MPI_LOG_ROOT/npN/launcher.log);
# rank R writes MPI_LOG_ROOT/npN/rankR.log, which is printed when that world
# size fails.  The summary at the end names, under a failed size, the failing
# test and its exception on each rank (tools/testing/failure_causes.py), or MPI's error
# lines when no test failed.  A size whose job died before any rank started a
# test (MPI or the launcher failed) is launched once more, and its summary line
# says so; a size in which a test failed never is.  Exit status: 0 only if
# every suite at every size passed on every rank.
set -uo pipefail

if [ $# -lt 1 ]; then
    echo "usage: $0 PYTHON [N ...]" >&2
    exit 2
fi
PY=$1
shift
if [ $# -gt 0 ]; then NPS=("$@"); else NPS=(2 3 4 8); fi

cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
ROOT=$PWD

MPI_TIMEOUT=${MPI_TIMEOUT:-600}
MPI_TESTS=${MPI_TESTS:-tests/mpi}
SERIAL_TESTS=${SERIAL_TESTS:-tests}
LOG_ROOT=${MPI_LOG_ROOT:-.mpi-logs}
read -r -a EXTRA <<<"${PYTEST_ARGS:-}"

now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
hr() { printf '%s\n' "======================================================================"; }

# ---------------------------------------------------------------- interpreter
if ! PY_ABS=$("$PY" -c 'import sys; print(sys.executable)'); then
    echo "run_tests: cannot run the interpreter '$PY'" >&2
    exit 2
fi
PY_BIN=$(dirname "$PY_ABS")

# pytest-mpi: the GPU machine has no package index, so its wheel may be carried in .whl/.
if ! "$PY_ABS" -c 'import pytest_mpi' 2>/dev/null; then
    whl=$(ls "$ROOT"/.whl/pytest_mpi*.whl 2>/dev/null | head -n 1)
    if [ -z "$whl" ]; then
        echo "run_tests: '$PY_ABS' cannot import pytest_mpi and there is no .whl/pytest_mpi*.whl" >&2
        echo "run_tests: run 'make wheels' on a machine with a package index and carry .whl/" >&2
        exit 2
    fi
    site=${PYTEST_MPI_SITE:-/tmp/site}
    echo "run_tests: installing $(basename "$whl") into $site (added to PYTHONPATH)"
    if ! "$PY_ABS" -m pip install --quiet --no-index --no-deps --target "$site" "$whl"; then
        # No usable pip: a pure-Python wheel is just a zip archive.
        mkdir -p "$site" && "$PY_ABS" -m zipfile -e "$whl" "$site" || exit 2
    fi
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    "$PY_ABS" -c 'import pytest_mpi' || exit 2
fi

# ---------------------------------------------------------------- launcher
if [ -n "${MPIEXEC:-}" ]; then
    :
elif [ -x "$PY_BIN/mpiexec" ]; then
    MPIEXEC=$PY_BIN/mpiexec
    export PATH="$PY_BIN:$PATH"   # hydra's helpers and libmpi live beside it
else
    MPIEXEC=$(command -v mpiexec || true)
fi

# Settings for every mpiexec call.  The command line stays vendor-neutral
# (`mpiexec -n N`); Open MPI's root/oversubscribe switches go in the environment,
# where MPICH ignores them.  MPIEXEC_TIMEOUT is honoured by MPICH's hydra (and
# by Open MPI 4's mpirun); the outer `timeout` is the backstop for any launcher.
MPI_ENV=(
    OMPI_ALLOW_RUN_AS_ROOT=1
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    OMPI_MCA_rmaps_base_oversubscribe=1
    PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
    OMP_NUM_THREADS=1
    PYTHONUNBUFFERED=1            # rank 0's progress reaches the terminal through tee
    MPIEXEC_TIMEOUT="$MPI_TIMEOUT"
    MPI_TEST_PYTHON="$PY_ABS"
)
# mpirun_bounded N: run "${LAUNCH[@]}" on N ranks.  stdin is closed: under `timeout`
# the launcher is not in the terminal's foreground group and must never read the tty.
mpirun_bounded() {
    timeout -k 15 $((MPI_TIMEOUT + 30)) env "${MPI_ENV[@]}" "$MPIEXEC" -n "$1" "${LAUNCH[@]}" </dev/null
}

# junit_counts FILE... -> "passed failed skipped reports agree" (tools/testing/junit_counts.py)
junit_counts() { "$PY_ABS" "$ROOT/tools/testing/junit_counts.py" "$@"; }

TOTAL_P=0 TOTAL_F=0 TOTAL_S=0 FAILED=0
SUMMARY=()
add_summary() { SUMMARY+=("$1"); echo; echo ">>> $1"; }

mkdir -p "$LOG_ROOT"
START_ALL=$(now)
hr
echo "python : $PY_ABS ($("$PY_ABS" -c 'import platform; print(platform.python_version())'))"
echo "mpiexec: ${MPIEXEC:-<none>}"
echo "sizes  : ${NPS[*]}    timeout per size: ${MPI_TIMEOUT}s"
hr

# ---------------------------------------------------------------- serial suite
if [ "${SKIP_SERIAL:-0}" != 1 ]; then
    echo "### serial suite: $PY_ABS -m pytest -q $SERIAL_TESTS"
    rm -f "$LOG_ROOT/serial.xml"
    t0=$(now)
    "$PY_ABS" -m pytest -q -p no:cacheprovider --color=no \
        --junitxml="$LOG_ROOT/serial.xml" "${EXTRA[@]}" $SERIAL_TESTS
    rc=$?
    dt=$(secs "$t0" "$(now)")
    read -r p f s _ _ <<<"$(junit_counts "$LOG_ROOT/serial.xml")"
    if [ "$rc" = 0 ]; then
        status=PASS
    else
        status="FAIL (pytest exit $rc$([ "$rc" = 5 ] && echo ', no tests collected'))"
        FAILED=1
        [ "$f" = 0 ] && f=1
    fi
    TOTAL_P=$((TOTAL_P + p)) TOTAL_F=$((TOTAL_F + f)) TOTAL_S=$((TOTAL_S + s))
    add_summary "$(printf 'serial       : %-6s %d passed, %d failed, %d skipped in %ss' "$status" "$p" "$f" "$s" "$dt")"
fi

# ---------------------------------------------------------------- MPI suite
if [ "${SKIP_MPI:-0}" != 1 ]; then
    if [ -z "$MPIEXEC" ]; then
        echo "run_tests: no mpiexec found (next to $PY_ABS or on PATH)" >&2
        exit 2
    fi
    # Preflight: mpi4py must see the world that this mpiexec starts.  With a
    # mismatched MPI each rank would be a singleton, and every min_size test
    # would be skipped instead of run.
    LAUNCH=("$PY_ABS" -c 'from mpi4py import MPI; c = MPI.COMM_WORLD; assert c.Get_size() == 2, f"mpi4py sees a world of {c.Get_size()}, not 2: mpiexec and mpi4py use different MPIs"; c.Get_rank() or print("MPI    :", MPI.Get_library_version().splitlines()[0].replace(chr(0), "").strip())')
    if ! mpirun_bounded 2; then
        add_summary "mpi preflight: FAIL ($MPIEXEC -n 2 cannot start mpi4py ranks)"
        FAILED=1
        NPS=()
    fi

    for n in "${NPS[@]}"; do
        dir="$LOG_ROOT/np$n"
        retry_note=""
        for attempt in 1 2; do
            rm -rf "$dir"
            mkdir -p "$dir"
            hr
            echo "### MPI suite, world size $n: mpiexec -n $n tools/testing/mpi_rank_pytest.sh -q --only-mpi $MPI_TESTS"
            echo "### (rank 0 below, also in $dir/launcher.log; ranks 1..$((n - 1)) log to $dir/rankR.log)"
            LAUNCH=("$ROOT/tools/testing/mpi_rank_pytest.sh" -q --only-mpi "${EXTRA[@]}" $MPI_TESTS)
            t0=$(now)
            MPI_LOG_DIR=$dir mpirun_bounded "$n" 2>&1 | tee "$dir/launcher.log"
            rc=${PIPESTATUS[0]}
            dt=$(secs "$t0" "$(now)")
            read -r p f s reports agree <<<"$(junit_counts "$dir"/rank*.xml)"
            started=$(find "$dir" -name 'rank*.started' | wc -l)
            ok=0
            [ "$rc" = 0 ] && [ "$reports" = "$n" ] && [ "$agree" = 1 ] && [ "$f" = 0 ] && ok=1
            # A job that died before any rank started a test or reported a
            # collection error (MPI or the launcher failed to start it) is
            # launched once more; a test failure never is.
            if [ "$ok" = 1 ] || [ "$started" != 0 ] || [ "$attempt" = 2 ] \
               || "$PY_ABS" "$ROOT/tools/testing/failure_causes.py" --test-failed "$dir"/*.log; then
                break
            fi
            cause=$("$PY_ABS" "$ROOT/tools/testing/failure_causes.py" "$dir"/launcher.log "$dir"/rank*.log | head -n 1)
            retry_note=" (launched twice: the first job died before any test started, exit $rc${cause:+: $cause})"
            echo
            echo ">>> world size $n died before any test started (exit $rc); launching it once more"
        done
        note=""
        causes=""
        if [ "$ok" = 1 ]; then
            status=PASS
        else
            FAILED=1
            if awk -v d="$dt" -v t="$MPI_TIMEOUT" 'BEGIN { exit !(d + 1 >= t) }'; then
                status=TIMEOUT
                note=" (exit $rc: killed by the ${MPI_TIMEOUT}s backstop; a rank hung, e.g. in a collective another rank skipped)"
            else
                status=FAIL
                if [ "$rc" != 0 ]; then
                    note=" (exit $rc$([ "$rc" = 5 ] && echo ', no tests collected'))"
                elif [ "$reports" != "$n" ]; then
                    note=" (only $reports of $n ranks wrote a report)"
                elif [ "$agree" != 1 ]; then
                    note=" (ranks disagree on the results; see $dir/rank*.xml)"
                fi
            fi
            [ "$f" = 0 ] && f=1
            for log in "$dir"/rank*.log; do
                [ -e "$log" ] || continue
                echo
                echo "----- $log (last 300 lines) -----"
                tail -n 300 "$log" | tr -d '\000'
            done
            echo
            echo "----- end of rank logs for world size $n -----"
            causes=$("$PY_ABS" "$ROOT/tools/testing/failure_causes.py" "$dir"/launcher.log "$dir"/rank*.log)
            [ -n "$causes" ] || causes="no test failure and no error line in $dir/*.log"
        fi
        TOTAL_P=$((TOTAL_P + p)) TOTAL_F=$((TOTAL_F + f)) TOTAL_S=$((TOTAL_S + s))
        if [ "$status" = PASS ]; then where="on each of $n ranks"; else where="($reports of $n ranks reported)"; fi
        add_summary "$(printf 'mpi np=%-5s : %-6s %d passed, %d failed, %d skipped %s in %ss%s%s' \
            "$n" "$status" "$p" "$f" "$s" "$where" "$dt" "$note" "$retry_note")"
        # Why it failed, under its summary line: the end of a CI log is what is shown.
        while IFS= read -r line; do
            [ -n "$line" ] && SUMMARY+=("    $line")
        done <<<"$causes"
    done
fi

# ---------------------------------------------------------------- summary
if [ "$FAILED" = 0 ] && [ "$TOTAL_P" = 0 ]; then
    SUMMARY+=("no test passed anywhere: the suites collected nothing to run")
    FAILED=1
    TOTAL_F=1
fi
echo
hr
echo "Test summary (total $(secs "$START_ALL" "$(now)")s)"
for line in "${SUMMARY[@]}"; do echo "  $line"; done
if [ "$FAILED" = 0 ]; then echo "RESULT: PASS"; else echo "RESULT: FAIL"; fi
hr
echo "TOTAL: $TOTAL_P passed, $TOTAL_F failed, $TOTAL_S skipped"
exit "$FAILED"
