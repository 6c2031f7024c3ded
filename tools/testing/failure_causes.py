"""Why one world size of the MPI suite failed, read from its logs (tools/testing/run_tests.sh).

    python tools/testing/failure_causes.py LOG...
    python tools/testing/failure_causes.py --test-failed LOG...   (exit 0 if a test failed)

prints at most MAX_LINES lines, meant for the summary at the end of a test run
(the part of a CI log that is always shown).  When a test failed, the lines are
each rank's abort headline from tests/conftest.py, "[rank r/n] FAILED (call)
tests/mpi/...::test_x", followed by the first "E   ..." line of its traceback.
When no test failure is on record (MPI or the launcher died, a rank crashed),
they are the error lines of MPI, the launcher or Python.  Prints nothing when
the logs hold neither.
"""
import re
import sys

MAX_LINES = 8
WIDTH = 200

HEADLINE = re.compile(r"^\[rank \d+/\d+\] (FAILED|COLLECTION ERROR) ")
EXCEPTION = re.compile(r"^E\s+\S")
# What MPICH, Open MPI, hydra, the kernel and Python print when a job dies
# outside a test: checked only when no test failure was found.
CRASH = re.compile(r"Fatal error|error stack|BAD TERMINATION|Segmentation fault|"
                   r"killed by signal|Killed|core dumped|MPI_ABORT|PMPI_|HYD_|"
                   r"^\w*(Error|Exception): ")


def _lines(path):
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n").replace("\0", "") for line in f]
    except OSError:
        return []


def _clip(text):
    text = text.strip()
    return text if len(text) <= WIDTH else text[:WIDTH - 3] + "..."


def test_failures(lines):
    """(headline, first exception line or None) for each abort block in ``lines``."""
    found = []
    for i, line in enumerate(lines):
        if HEADLINE.match(line):
            exc = next((x for x in lines[i + 1:i + 400] if EXCEPTION.match(x)), None)
            found.append((line, exc))
    return found


def causes(paths):
    """The summary lines for the logs in ``paths``."""
    out = []
    seen = set()
    for path in paths:
        for headline, exc in test_failures(_lines(path)):
            if headline in seen:
                continue
            seen.add(headline)
            out.append(_clip(headline))
            if exc is not None:
                out.append("  " + _clip(exc))
    if not out:
        for path in paths:
            for line in _lines(path):
                if CRASH.search(line) and line.strip() not in seen:
                    seen.add(line.strip())
                    out.append(_clip(line))
    return out[:MAX_LINES]


def any_test_failed(paths):
    """True when some log in ``paths`` holds an abort headline of tests/conftest.py."""
    return any(test_failures(_lines(path)) for path in paths)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--test-failed"]:
        sys.exit(0 if any_test_failed(sys.argv[2:]) else 1)
    for line in causes(sys.argv[1:]):
        print(line)
