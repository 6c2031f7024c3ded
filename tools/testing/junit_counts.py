"""Counts of one world size's JUnit reports (tools/testing/run_tests.sh).

    python tools/testing/junit_counts.py FILE...

prints "passed failed skipped reports agree": the first report's passed and
skipped, the largest failure count of any (failures + errors), how many
reports could be read, and agree=1 if all of them have the same counts.  An
aborted rank writes no report, so `reports` < the world size says one died.
"""
import sys
import xml.etree.ElementTree as ET


def counts_of(path):
    """(passed, failed, skipped) of one report, or None when unreadable."""
    try:
        root = ET.parse(path).getroot()
    except Exception:
        return None
    suites = [root] if root.tag == "testsuite" else root.iter("testsuite")
    t = f = s = 0
    for su in suites:
        t += int(su.get("tests", 0))
        f += int(su.get("failures", 0)) + int(su.get("errors", 0))
        s += int(su.get("skipped", 0))
    return t - f - s, f, s


def main(paths):
    counts = [c for c in map(counts_of, paths) if c is not None]
    if not counts:
        return "0 0 0 0 0"
    p, _, s = counts[0]
    f = max(c[1] for c in counts)      # the worst rank's failures
    return f"{p} {f} {s} {len(counts)} {int(all(c == counts[0] for c in counts))}"


if __name__ == "__main__":
    print(main(sys.argv[1:]))
