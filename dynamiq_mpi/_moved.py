"""Deprecated module paths of modules that moved into subpackages
(2026-11-24, 2026-11-26): ``import dynamiq_mpi.errorstudy``,
``dynamiq_mpi.engine`` and the like still work, with
a DeprecationWarning, and hand out the module at its new path."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "dynamiq_mpi.errorstudy": "dynamiq_mpi.studies.errorstudy",
    "dynamiq_mpi.scale_sim": "dynamiq_mpi.studies.scale_sim",
    "dynamiq_mpi.gradients": "dynamiq_mpi.studies.gradients",
    "dynamiq_mpi.bench_kernels": "dynamiq_mpi.bench.kernels",
    "dynamiq_mpi.torch_fsdp": "dynamiq_mpi.torch.fsdp",
    # 2026-11-26: the machinery of a call under dynamiq_mpi.call
    "dynamiq_mpi.engine": "dynamiq_mpi.call.engine",
    "dynamiq_mpi.engine_rs": "dynamiq_mpi.call.engine_rs",
    "dynamiq_mpi.native": "dynamiq_mpi.call.native",
    "dynamiq_mpi.graphs": "dynamiq_mpi.call.graphs",
    "dynamiq_mpi.paths": "dynamiq_mpi.call.paths",
    "dynamiq_mpi.workspace": "dynamiq_mpi.call.workspace",
    "dynamiq_mpi.hierarchy": "dynamiq_mpi.call.hierarchy",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name in MOVED:
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        return None         # a plain module, filled in by exec_module

    def exec_module(self, module):
        new = MOVED[module.__name__]
        warnings.warn(f"{module.__name__} moved to {new}; import it from there",
                      DeprecationWarning, stacklevel=2)
        target = importlib.import_module(new)
        # the old name is the new module itself from now on
        sys.modules[module.__name__] = target


def install() -> None:
    if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
        sys.meta_path.append(_MovedModules())
