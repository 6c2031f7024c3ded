"""tools/testing/failure_causes.py, which names in tools/testing/run_tests.sh's summary why a
world size of the MPI suite failed."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location(
    "failure_causes", os.path.join(ROOT, "tools", "testing", "failure_causes.py"))
failure_causes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(failure_causes)

ABORT = """..s.
{bang}
[rank {r}/4] FAILED (call) tests/mpi/test_x.py::test_y[{r}]
def test_y():
>       assert vnmse(out, ref) < 0.05, f"seed {{seed}}"
E       AssertionError: seed 12345
E       assert 0.07 < 0.05
[rank {r}] aborting the MPI job (MPI.COMM_WORLD.Abort(1))
{bang}
"""


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_each_ranks_failing_test_and_its_exception(tmp_path):
    logs = [write(tmp_path, f"rank{r}.log", ABORT.format(bang="!" * 70, r=r)) for r in (0, 2)]
    lines = failure_causes.causes(logs + [str(tmp_path / "absent.log")])
    assert failure_causes.any_test_failed(logs)
    assert lines == ["[rank 0/4] FAILED (call) tests/mpi/test_x.py::test_y[0]",
                     "  E       AssertionError: seed 12345",
                     "[rank 2/4] FAILED (call) tests/mpi/test_x.py::test_y[2]",
                     "  E       AssertionError: seed 12345"]


def test_mpi_errors_when_no_test_failed(tmp_path):
    log = write(tmp_path, "launcher.log",
                "python : x\nAbort(1091215) on node 3: Fatal error in internal_Init: Other MPI error\n"
                "\0ordinary line\nModuleNotFoundError: No module named 'numpy'\n")
    lines = failure_causes.causes([log])
    assert not failure_causes.any_test_failed([log])
    assert lines == ["Abort(1091215) on node 3: Fatal error in internal_Init: Other MPI error",
                     "ModuleNotFoundError: No module named 'numpy'"]


def test_clipped_and_bounded(tmp_path):
    text = "".join(f"Fatal error number {i} " + "x" * 300 + "\n" for i in range(20))
    lines = failure_causes.causes([write(tmp_path, "rank1.log", text)])
    assert len(lines) == failure_causes.MAX_LINES
    assert all(len(line) == failure_causes.WIDTH and line.endswith("...") for line in lines)
    assert failure_causes.causes([write(tmp_path, "rank3.log", "....ss..\n")]) == []
