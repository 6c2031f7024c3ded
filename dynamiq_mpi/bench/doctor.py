"""``python -m dynamiq_mpi doctor``: what the library found on this machine
(the kernels and their GPU architectures, NumPy, CuPy, NCCL, torch, mpi4py
and its MPI, the launcher) and what a default call would choose.  It starts
no collective; under ``mpiexec -n N`` rank 0 lists every rank's host and GPUs.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import struct
import sys

from ..settings import environment

# Environment variables by launcher, the first that is set names it.
LAUNCHERS = (("torchrun", ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE")),
             ("mpiexec", ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")),
             ("srun", ("SLURM_STEP_ID",)),
             ("torch.distributed (RANK/WORLD_SIZE)", ("WORLD_SIZE",)))
SIZES = (1 << 16, 1 << 20, 1 << 22, 1 << 26)    # elements, for "what a call would choose"
_FATBIN_MAGIC = 0xBA55ED50


def _version(module_name: str):
    try:
        module = __import__(module_name)
    except Exception:        # absent, or broken: either way not usable
        return None
    return getattr(module, "__version__", "unknown version")


# ---------------------------------------------------------------- kernels
def cuda_binaries(path: str) -> dict:
    """{"sass": [...], "ptx": [...]}: the compute capabilities of the CUDA code
    in the shared library at ``path`` (its ``.nv_fatbin`` section's entries)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError(f"{path} is not a 64-bit ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    entsize, count, names_index = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", data, shoff + i * entsize) for i in range(count)]
    names_at = sections[names_index][4]

    def name(offset):
        start = names_at + offset
        return data[start:data.index(b"\0", start)].decode()

    found = {1: set(), 2: set()}
    for sec_name, _, _, _, offset, size in sections:
        if name(sec_name) != ".nv_fatbin":
            continue
        pos, end = offset, offset + size
        while pos + 16 <= end:
            magic, _, header, fat_size = struct.unpack_from("<IHHQ", data, pos)
            if magic != _FATBIN_MAGIC:      # padding between the fat binaries
                pos += 8
                continue
            entry, stop = pos + header, pos + header + fat_size
            while entry < stop:
                kind, _, entry_header, entry_size = struct.unpack_from("<HHIQ", data, entry)
                arch, = struct.unpack_from("<I", data, entry + 28)
                if kind in found:
                    found[kind].add(arch)
                entry += entry_header + entry_size
            pos = stop
    return {"sass": sorted(found[2]), "ptx": sorted(found[1])}


def _arch_list(archs) -> str:
    return ", ".join(f"{a // 10}.{a % 10}" for a in archs) or "none"


def kernels() -> dict:
    out = {}
    try:
        from .. import _cpu
        out["cpu"] = f"built ({os.path.basename(_cpu.__file__)})"
    except Exception as exc:
        out["cpu"] = f"NOT BUILT: {exc} (reinstall: pip install -v .)"
    try:
        from .. import _gpu
    except Exception as exc:
        out["gpu"] = (f"not built ({exc.__class__.__name__}): nvcc was missing or failed at "
                      "install time, or DYNAMIQ_NO_CUDA=1; CuPy arrays cannot be reduced")
        return out
    try:
        found = cuda_binaries(_gpu.__file__)
        archs = (f"SASS for compute capability {_arch_list(found['sass'])}, "
                 f"PTX for {_arch_list(found['ptx'])}")
    except Exception as exc:    # a format this reader does not know
        archs = f"architectures unknown ({exc})"
    out["gpu"] = f"built: {archs}"
    try:
        out["gpu_usable"] = bool(_gpu.is_usable())
    except Exception:
        out["gpu_usable"] = False
    return out


# ---------------------------------------------------------------- packages
def packages() -> dict:
    out = {"python": platform.python_version(), "numpy": _version("numpy"),
           "ml_dtypes": _version("ml_dtypes"), "cupy": _version("cupy")}
    if out["cupy"] is not None:
        try:
            import cupy
            runtime = cupy.cuda.runtime
            out["cuda_runtime"] = runtime.runtimeGetVersion()
            out["cuda_driver"] = runtime.driverGetVersion()
            out["gpus"] = runtime.getDeviceCount()
        except Exception as exc:
            out["gpus"] = f"none usable ({exc.__class__.__name__}: {exc})"
        from ..transports.nccl import nccl_status
        ok, why = nccl_status()
        if ok:
            from cupy.cuda import nccl
            version = nccl.get_version()
            out["nccl"] = f"{version // 10000}.{version // 100 % 100}.{version % 100}"
        else:
            out["nccl"] = f"unavailable: {why}"
    out["torch"] = _version("torch")
    if out["torch"] is not None:
        import torch
        out["torch_cuda"] = bool(torch.cuda.is_available())
        dist = torch.distributed
        out["torch_backends"] = [b for b in ("gloo", "nccl", "mpi")
                                 if dist.is_available()
                                 and getattr(dist, f"is_{b}_available", lambda: False)()]
    return out


# ---------------------------------------------------------------- MPI
def launcher(environ=None) -> str:
    env = environment() if environ is None else environ
    for name, variables in LAUNCHERS:
        for var in variables:
            if env.get(var, "").strip():
                return f"{name} ({var}={env[var]})"
    return "none (one process)"


def _launched_by_mpi(environ=None) -> bool:
    from ..control import _MPI_SIZE_VARS, _env_size
    return _env_size(_MPI_SIZE_VARS, environment() if environ is None else environ)[0] > 1


def mpi(ask: bool) -> dict:
    """mpi4py, the MPI library and its CUDA-awareness; ``ask``: initialise MPI
    to ask it, else only what mpi4py tells without (under torchrun)."""
    out = {"mpi4py": _version("mpi4py")}
    if out["mpi4py"] is None:
        out["note"] = ("not installed: the MPI control plane (mpiexec) needs it "
                       "(pip install 'dynamiq-mpi[mpi]'); torch.distributed jobs do not")
        return out
    import mpi4py
    if not ask and "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.initialize = False
    try:
        from mpi4py import MPI
        out["library"] = MPI.Get_library_version().strip().splitlines()[0]
        out["standard"] = "%d.%d" % MPI.Get_version()
    except Exception as exc:
        out["library"] = f"unusable: {exc}"
        return out
    if not MPI.Is_initialized():
        out["cuda_aware"] = "not asked (MPI is not initialised in a torch.distributed job)"
        return out
    from ..transports.cuda_aware import cuda_aware_mpi
    aware = cuda_aware_mpi()
    verdict = "yes" if aware.aware else ("unknown" if aware.source == "none" else "no")
    out["cuda_aware"] = f"{verdict} ({aware.why})"
    return out


# ---------------------------------------------------------------- defaults
def default_choices(found: dict) -> dict:
    """What a call with the defaults would choose, from what was found."""
    from ..api import default_hierarchy
    from ..call.graphs import default_graphs
    from ..call.paths import default_path
    from ..codecs import DEFAULT_CODEC
    out = {}
    gpu_ready = (found["kernels"].get("gpu_usable") and found["packages"].get("cupy")
                 and not str(found["packages"].get("nccl", "")).startswith("unavailable"))
    out["transport, NumPy arrays"] = ("mpi (host memory, over the control plane's "
                                      "point-to-point: MPI's, or gloo's under torch)")
    if gpu_ready:
        out["transport, CuPy arrays"] = "nccl (when every rank can use it)"
    elif found["mpi"].get("cuda_aware", "").startswith("yes"):
        out["transport, CuPy arrays"] = "mpi-cuda (no usable NCCL here; the MPI is CUDA-aware)"
    else:
        out["transport, CuPy arrays"] = ("mpi through host memory" if found["kernels"].get(
            "gpu_usable") else "none here (no usable GPU kernels)")
    try:
        path = default_path()
    except ValueError as exc:
        path = f"invalid: {exc}"
    out["path"] = (f"{path}: per size class, the codec's compressed call or the transport's "
                   "own all-reduce (NCCL's in BF16, MPI's), whichever measures faster on the "
                   "first calls" if path == "auto" else f"{path} ($DYNAMIQ_PATH)")
    codec = DEFAULT_CODEC
    threshold = getattr(codec, "small_input", 0)
    for n in SIZES:
        what = codec.for_length(n) if hasattr(codec, "for_length") else codec
        why = (f" (below DynamiQ's small_input of 2^{threshold.bit_length() - 1})"
               if n < threshold else "")
        label = f"DynamiQ at {what.bits:g} bits" if what.name == "dynamiq" else what.name.upper()
        out[f"codec for 2^{n.bit_length() - 1} elements"] = f"{label}{why}"
    for key, read in (("hierarchy", default_hierarchy), ("graphs", default_graphs)):
        try:
            out[key] = read()
        except ValueError as exc:
            out[key] = f"invalid: {exc}"
    return out


# ---------------------------------------------------------------- ranks
def _this_rank() -> dict:
    me = {"host": socket.gethostname(), "gpus": []}
    with contextlib.suppress(Exception):        # no CuPy or no GPU: the host alone
        import cupy
        runtime = cupy.cuda.runtime
        for d in range(runtime.getDeviceCount()):
            props = runtime.getDeviceProperties(d)
            name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            me["gpus"].append(f"{name} (bus {runtime.deviceGetPCIBusId(d)})")
    return me


def collect(environ=None) -> dict:
    import dynamiq_mpi
    launched = _launched_by_mpi(environ)
    where = launcher(environ)
    torch_job = where.startswith(("torch", "srun"))
    found = {"version": dynamiq_mpi.__version__,
             "location": os.path.dirname(dynamiq_mpi.__file__),
             "kernels": kernels(), "packages": packages(),
             "mpi": mpi(ask=launched or not torch_job), "launcher": where}
    found["defaults"] = default_choices(found)
    found["ranks"] = [_this_rank()]
    if launched and found["mpi"].get("mpi4py"):
        from ..control import default_comm
        comm = default_comm()
        found["control_plane"] = f"mpi ({comm.Get_size()} ranks)"
        found["ranks"] = comm.gather(found["ranks"][0], root=0)
        found["rank"] = comm.Get_rank()
    elif torch_job:
        found["control_plane"] = ("torch, once the job calls "
                                  "torch.distributed.init_process_group()")
        rank = (environment() if environ is None else environ).get("RANK", "0")
        found["rank"] = int(rank) if rank.isdigit() else 0    # rank 0 alone prints
    else:
        found["control_plane"] = ("mpi, a world of one" if found["mpi"].get("mpi4py")
                                  else "none: one process without mpi4py")
    return found


def render(found: dict) -> str:
    k, p, m = found["kernels"], found["packages"], found["mpi"]
    lines = [f"dynamiq-mpi {found['version']} ({found['location']})",
             f"  CPU codec (dynamiq_mpi._cpu): {k['cpu']}",
             f"  CUDA kernels (dynamiq_mpi._gpu): {k['gpu']}"]
    if "gpu_usable" in k:
        lines.append(f"  a GPU usable by the kernels: {'yes' if k['gpu_usable'] else 'no'}")
    lines.append(f"Python {p['python']}, NumPy {p['numpy']}, ml_dtypes {p['ml_dtypes']}")
    if p["cupy"] is None:
        lines.append("CuPy: not installed (pip install 'dynamiq-mpi[cuda12]' or [cuda13])")
    else:
        lines.append(f"CuPy {p['cupy']}: CUDA runtime {p.get('cuda_runtime')}, driver "
                     f"{p.get('cuda_driver')}, GPUs: {p.get('gpus')}")
        lines.append(f"NCCL: {p['nccl']}")
    if p["torch"] is None:
        lines.append("torch: not installed (pip install 'dynamiq-mpi[torch]')")
    else:
        lines.append(f"torch {p['torch']}: CUDA available: {'yes' if p['torch_cuda'] else 'no'}, "
                     f"distributed backends: {', '.join(p['torch_backends']) or 'none'}")
    if m["mpi4py"] is None:
        lines.append(f"mpi4py: {m['note']}")
    else:
        lines.append(f"mpi4py {m['mpi4py']}: {m.get('library')}")
        if "cuda_aware" in m:
            lines.append(f"  MPI {m['standard']}, CUDA-aware: {m['cuda_aware']}")
    lines.append(f"launcher: {found['launcher']}")
    lines.append(f"control plane: {found['control_plane']}")
    lines.append("a call with the library's defaults:")
    lines += [f"  {key}: {value}" for key, value in found["defaults"].items()]
    ranks = found["ranks"]
    lines.append(f"ranks: {len(ranks)}" if found["control_plane"].startswith("mpi")
                 else "ranks: this process only (every rank is listed under mpiexec)")
    for r, info in enumerate(ranks):
        gpus = "; ".join(info["gpus"]) or "no GPU"
        lines.append(f"  rank {r}: {info['host']}, {gpus}")
    hosts = {info["host"] for info in ranks}
    if len(ranks) > 1:
        link = ("one host: shared memory (NVLink or PCIe between its GPUs)" if len(hosts) == 1
                else f"{len(hosts)} hosts: the network between them")
        lines.append(f"  links: {link}")
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("--json", default=None, help="also write what was found as JSON")


def run(args) -> None:
    found = collect()
    if found.get("rank", 0) == 0:
        print(render(found), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(found, f, indent=1)
