"""The codec's error with correlated and with independent rounding, for two
builds of the package side by side (CPU codec; e.g. before and after a
generator change): fixed 4-bit codes on a ring of n ranks, T calls with fresh
keys each (tests/test_statistics.errors_over_calls), MSE of the sum with and
without correlated rounding, their ratio and ||mean error||^2 / MSE.

    python research/scripts/generator_error_ab.py ROOT [ROOT ...]   [--calls 300] [--ranks 3,5,8]

ROOT is a directory holding a built `dynamiq_mpi` package (the working tree
is `.`; an old one: `git archive <rev> dynamiq_mpi pyx src_cuda setup.py
setup.cfg pyproject.toml | tar -x -C .ab_old`, then `DYNAMIQ_NO_CUDA=1 python
setup.py build_ext --inplace` there).  Each root runs in its own process."""
import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

_CHILD = r"""
import sys, numpy as np
root, calls, ranks = sys.argv[1], int(sys.argv[2]), [int(r) for r in sys.argv[3].split(",")]
sys.path.insert(0, root)
import dynamiq_mpi as dq
sys.path.insert(1, REPO + "/tests"); sys.path.insert(2, REPO)
from helpers import rank_inputs
from tests.test_statistics import errors_over_calls
print(f"package: {dq.__file__}")
for n in ranks:
    xs = rank_inputs(12345 + n, n, 256 * 8, kind="normal")
    cfg = dict(small_input=0, bits=9, fixed_width=4)
    on = errors_over_calls(xs, dq.DynamiQ(**cfg), "ring", calls)
    off = errors_over_calls(xs, dq.DynamiQ(correlated=False, **cfg), "ring", calls)
    mse_on = np.mean(np.sum(on ** 2, axis=1)); mse_off = np.mean(np.sum(off ** 2, axis=1))
    bias2 = np.sum(on.mean(axis=0) ** 2)
    print(f"  n={n}: MSE correlated {mse_on:.4g}, independent {mse_off:.4g}, "
          f"ratio {mse_on / mse_off:.3f}, ||mean error||^2 / MSE {bias2 / mse_on:.4f}")
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("roots", nargs="+")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--ranks", default="3,5,8")
    a = ap.parse_args()
    for root in a.roots:
        code = _CHILD.replace("REPO", repr(REPO))
        subprocess.run([sys.executable, "-c", code, os.path.abspath(root), str(a.calls), a.ranks],
                       check=True, cwd="/tmp")


if __name__ == "__main__":
    main()
