"""Test-session hooks shared by the serial and the MPI suites.

Two things live here.  The suite tests the codecs and the compressed path,
so ``DYNAMIQ_PATH`` defaults to "compressed" (the tests of the path choice,
tests/mpi/test_paths_mpi.py, pass ``path=`` explicitly).  And under ``mpiexec`` a failure on a single rank must
not leave the other ranks waiting forever in a collective that the failing
rank will never enter.  As soon as an MPI-marked test fails (in setup, call or
teardown) on any rank, that rank prints the failure with its rank number and
aborts the whole MPI job with ``MPI.COMM_WORLD.Abort(1)``.  The same happens
when a test module fails to import on some rank, because the ranks would then
run different test lists and their collectives would no longer line up.

Nothing happens in a plain serial ``pytest`` run: the hooks only act when
mpi4py is already imported, MPI is initialised and the world has more than
one process.  Under tools/testing/run_tests.sh each rank also touches the file named
by ``MPI_TEST_STARTED`` when its first test starts, so that the runner can
tell a job that died while starting (MPI, the launcher) from one in which a
test failed.
"""
import os
import sys

import pytest

os.environ.setdefault("DYNAMIQ_PATH", "compressed")


def _world():
    """COMM_WORLD when running as one of several MPI processes, else None.

    mpi4py is never imported from here: if the tests have not imported it,
    there is no MPI job to abort.
    """
    mpi_mod = sys.modules.get("mpi4py.MPI")
    if mpi_mod is None:
        return None
    try:
        if not mpi_mod.Is_initialized() or mpi_mod.Is_finalized():
            return None
        world = mpi_mod.COMM_WORLD
        return world if world.Get_size() > 1 else None
    except Exception:  # pragma: no cover - a broken MPI must not mask the test failure
        return None


def pytest_collection_modifyitems(config, items):
    """``max_size(n)``: skipped in a world of more than n ranks (the suite
    also runs at 6 and 8 ranks for the hierarchy and the schedules; a test
    whose logic is the same at every size above n spends CI time there)."""
    world = _world()
    size = world.Get_size() if world is not None else 1
    for item in items:
        mark = item.get_closest_marker("max_size")
        if mark is not None and size > mark.args[0]:
            item.add_marker(pytest.mark.skip(reason=f"run at up to {mark.args[0]} ranks"))


def _abort_job(world, headline, details):
    rank = world.Get_rank()
    text = (
        f"\n{'!' * 70}\n"
        f"[rank {rank}/{world.Get_size()}] {headline}\n"
        f"{details}\n"
        f"[rank {rank}] aborting the MPI job (MPI.COMM_WORLD.Abort(1))\n"
        f"{'!' * 70}\n"
    )
    # Write straight to file descriptor 2 so that pytest's output capturing
    # cannot swallow it, and flush whatever Python still buffers first.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    try:
        os.write(2, text.encode("utf-8", "replace"))
    except OSError:
        pass
    world.Abort(1)
    os._exit(1)  # not reached when Abort kills the process, as it should


_started = False


def pytest_runtest_logstart(nodeid, location):
    global _started
    marker = os.environ.get("MPI_TEST_STARTED")
    if marker and not _started:
        _started = True
        with open(marker, "w") as f:
            f.write(nodeid + "\n")


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    if not report.failed or "mpi" not in report.keywords:
        return
    world = _world()
    if world is None:
        return
    _abort_job(world, f"FAILED ({report.when}) {report.nodeid}", report.longreprtext)


@pytest.hookimpl(trylast=True)
def pytest_collectreport(report):
    if not report.failed:
        return
    world = _world()
    if world is None:
        return
    _abort_job(world, f"COLLECTION ERROR {report.nodeid}", report.longreprtext)
