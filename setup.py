"""Build of dynamiq-mpi: the CPU codec extension always; the CUDA kernels when
nvcc is found (see src_cuda/).  The CUDA runtime is linked statically so that
importing never needs a GPU or a driver.

Environment:
  CUDA_HOME           CUDA toolkit to use (default: /usr/local/cuda, then the
                      toolkit of an `nvcc` on PATH)
  DYNAMIQ_NO_CUDA=1   build the CPU extension only
  DYNAMIQ_CUDA_ARCH   compute capabilities to build SASS for, e.g. "80;90"
                      (default: the data-centre GPUs this nvcc can target
                      among 8.0, 9.0, 10.0 and 12.0); PTX of the highest is
                      embedded too, for newer GPUs

When nvcc is missing or fails, the CPU extension is still installed (NumPy
arrays, and torch CPU tensors over gloo) and the build says why.
"""
import os
import shutil
import subprocess
import sys

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
try:
    from setuptools.errors import CompileError, LinkError
except ImportError:        # setuptools < 59
    from distutils.errors import CompileError, LinkError

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = "src_cuda"
# No FMA contraction, no fast math: the CPU and GPU codecs must agree bit for bit.
HOST_FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-fast-math", "-fno-finite-math-only"]
# The device side of the same rules (spec section 4): no FMA contraction, IEEE
# division and square root, denormals kept.
NVCC_FLAGS = ["-O3", "-std=c++17", "-fmad=false", "-ftz=false", "-prec-div=true",
              "-prec-sqrt=true", "-Xcompiler", "-fPIC", "-Xcompiler", "-ffp-contract=off",
              "-Xcompiler", "-fno-fast-math"]


def _find_cuda_home():
    """(CUDA_HOME, nvcc path) or (None, None)."""
    env = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [env] if env else []
    candidates.append("/usr/local/cuda")
    which = shutil.which("nvcc")
    if which:
        # PATH entries may be wrapper scripts or links: resolve to the toolkit
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(which))))
    for home in candidates:
        nvcc = os.path.join(home, "bin", "nvcc")
        if os.path.isfile(nvcc) and os.access(nvcc, os.X_OK):
            return home, nvcc
    return None, None


# A100, H100/H200, B200/GB200 and RTX PRO 6000 Blackwell: the default
# targets, kept to those the installed nvcc can compile for.
DEFAULT_ARCHS = ("80", "90", "100", "120")


def _nvcc_archs(nvcc) -> set:
    """The sm_XY targets ``nvcc --list-gpu-code`` names (empty if it cannot say)."""
    try:
        out = subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    return {code[3:] for code in out.split() if code.startswith("sm_")}


def _cuda_archs(nvcc) -> list:
    """``$DYNAMIQ_CUDA_ARCH`` as given, else :data:`DEFAULT_ARCHS` that nvcc supports."""
    given = os.environ.get("DYNAMIQ_CUDA_ARCH", "").strip()
    if not given:
        known = _nvcc_archs(nvcc)
        # an nvcc that cannot list its targets: A100 and H100 (CUDA 11.8 and later)
        return [a for a in DEFAULT_ARCHS if a in known] if known else ["80", "90"]
    archs = [a.strip().replace(".", "") for a in given.replace(",", ";").split(";") if a.strip()]
    if not archs or not all(a.isdigit() for a in archs):
        raise SystemExit(f"DYNAMIQ_CUDA_ARCH must list compute capabilities like '80;90', "
                         f"got {given!r}")
    return archs


def _gencode_flags(archs):
    flags = []
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    top = max(archs, key=int)
    flags += ["-gencode", f"arch=compute_{top},code=compute_{top}"]   # PTX for newer GPUs
    return flags


class BuildExtNvcc(build_ext):
    """build_ext that cythonizes each extension just before building it (an
    sdist needs no Cython output; a GPU extension whose nvcc fails costs no
    Cython time), compiles the .cu sources of an extension with nvcc and
    links the objects in.  A GPU extension that fails to build is left out
    with a message: the CPU extension is what every install needs."""

    def build_extension(self, ext):
        (cythonized,) = cythonize([ext], language_level=3, include_path=["pyx"],
                                  force=self.force)
        ext.sources = cythonized.sources
        super().build_extension(ext)

    def build_extensions(self):
        self.check_extensions_list(self.extensions)
        for ext in list(self.extensions):
            if ext.name != GPU_EXTENSION:
                self.build_extension(ext)
                continue
            try:
                self._build_gpu_extension(ext)
            except (subprocess.CalledProcessError, OSError, CompileError, LinkError) as exc:
                # dropped from the list: nothing to copy or install for it
                self.extensions.remove(ext)
                print(f"dynamiq-mpi: WARNING: the CUDA kernels failed to build ({exc}); "
                      f"installing the CPU codec only, without {GPU_EXTENSION}. Set CUDA_HOME "
                      "to a working toolkit, DYNAMIQ_CUDA_ARCH to your GPUs' compute "
                      "capabilities, or DYNAMIQ_NO_CUDA=1 to build without CUDA.", flush=True)

    def _build_gpu_extension(self, ext):
        cu = [s for s in ext.sources if s.endswith(".cu")]
        if cu:
            ext.sources = [s for s in ext.sources if not s.endswith(".cu")]
            nvcc = NVCC
            archs = _cuda_archs(nvcc)
            print(f"dynamiq-mpi: building the CUDA kernels for sm_{', sm_'.join(archs)} "
                  "(DYNAMIQ_CUDA_ARCH overrides)", flush=True)
            objs = []
            os.makedirs(self.build_temp, exist_ok=True)
            for src in cu:
                obj = os.path.join(self.build_temp, os.path.basename(src) + ".o")
                deps = [src] + [os.path.join(SRC, f) for f in os.listdir(SRC) if f.endswith((".h", ".cuh"))]
                cmd = [nvcc, "-c", src, "-o", obj, *NVCC_FLAGS, *_gencode_flags(archs),
                       *[f"-I{d}" for d in ext.include_dirs]]
                # the command is part of the object's key: other archs or flags rebuild it
                stamp = obj + ".cmd"
                same_cmd = os.path.exists(stamp) and open(stamp).read() == " ".join(cmd)
                if self.force or not os.path.exists(obj) or not same_cmd or \
                        max(os.path.getmtime(d) for d in deps) > os.path.getmtime(obj):
                    print(" ".join(cmd), flush=True)
                    subprocess.check_call(cmd)
                    with open(stamp, "w") as f:
                        f.write(" ".join(cmd))
                objs.append(obj)
            ext.extra_objects = objs + list(ext.extra_objects or [])
            # relink when a kernel object changed (setuptools only compares sources)
            ext.depends = list(ext.depends or []) + objs
        self.build_extension(ext)


GPU_EXTENSION = "dynamiq_mpi._gpu"
extensions = [
    Extension(
        "dynamiq_mpi._cpu",
        sources=["pyx/_cpu.pyx", f"{SRC}/dq_cpu.cpp", f"{SRC}/dq_plan_cpu.cpp"],
        include_dirs=[SRC, np.get_include()],
        language="c++",
        extra_compile_args=HOST_FLAGS,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
]

NVCC = None
if os.environ.get("DYNAMIQ_NO_CUDA", "") not in ("", "0"):
    print("dynamiq-mpi: DYNAMIQ_NO_CUDA is set: building the CPU codec only", flush=True)
else:
    cuda_home, NVCC = _find_cuda_home()
    if NVCC is None:
        print("dynamiq-mpi: nvcc not found (set CUDA_HOME): building the CPU codec only, "
              "without dynamiq_mpi._gpu", flush=True)
    else:
        lib_dirs = [d for d in (os.path.join(cuda_home, "lib64"), os.path.join(cuda_home, "lib"))
                    if os.path.isdir(d)]
        gpu = Extension(
            GPU_EXTENSION,
            sources=["pyx/_gpu.pyx", f"{SRC}/dq_kernels.cu", f"{SRC}/dq_plan.cu", f"{SRC}/mx_kernels.cu"],
            include_dirs=[SRC, os.path.join(cuda_home, "include"), np.get_include()],
            library_dirs=lib_dirs,
            # static CUDA runtime: importing needs no driver, ldd shows no CUDA library
            libraries=["cudart_static", "rt", "dl", "pthread"],
            language="c++",
            extra_compile_args=HOST_FLAGS,
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        )
        extensions.append(gpu)

setup(
    ext_modules=extensions,
    cmdclass={"build_ext": BuildExtNvcc},
)
