"""tools/testing/junit_counts.py, which tells tools/testing/run_tests.sh whether every rank of
a world size passed (a rank that aborted writes no report)."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location(
    "junit_counts", os.path.join(ROOT, "tools", "testing", "junit_counts.py"))
junit_counts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(junit_counts)


def report(tmp_path, name, tests, failures, errors, skipped):
    path = tmp_path / name
    path.write_text(f'<testsuites><testsuite tests="{tests}" failures="{failures}" '
                    f'errors="{errors}" skipped="{skipped}"/></testsuites>')
    return str(path)


def test_counts_agree_and_take_the_worst_rank(tmp_path):
    a = report(tmp_path, "r0.xml", 10, 0, 0, 2)
    b = report(tmp_path, "r1.xml", 10, 0, 0, 2)
    assert junit_counts.main([a, b]) == "8 0 2 2 1"
    c = report(tmp_path, "r2.xml", 10, 1, 1, 2)
    assert junit_counts.main([a, b, c]) == "8 2 2 3 0"


def test_unreadable_and_missing_reports_do_not_count(tmp_path):
    bad = tmp_path / "r1.xml"
    bad.write_text("<testsuites")
    a = report(tmp_path, "r0.xml", 4, 0, 0, 0)
    assert junit_counts.main([a, str(bad), str(tmp_path / "absent.xml")]) == "4 0 0 1 1"
    assert junit_counts.main([]) == "0 0 0 0 0"
