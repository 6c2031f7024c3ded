"""Shared test helpers: fresh random inputs, the float64 oracle, bit checks."""
from __future__ import annotations

import hashlib
import os

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)


def fresh_seed() -> int:
    """A new random seed per test run (printed in failures to reproduce)."""
    return int.from_bytes(os.urandom(4), "little")


def rank_inputs(seed: int, n: int, length: int, kind: str = "heavy", dtype=np.float32):
    """Every rank's input, derivable on every rank from the shared seed."""
    rng = np.random.default_rng(seed)
    nsg = -(-length // 256) if length else 0
    xs = []
    for _ in range(n):
        if kind == "heavy":
            scale = np.repeat(10.0 ** rng.uniform(-4, 3, size=nsg), 256)[:length]
            x = rng.standard_t(3, size=length) * scale
        elif kind == "normal":
            x = rng.standard_normal(length)
        else:
            raise ValueError(kind)
        xs.append(x.astype(dtype))
    return xs


def exact_sum(xs) -> np.ndarray:
    """The oracle: an independent float64 NumPy sum."""
    return np.sum(np.stack([np.asarray(x, dtype=np.float64).reshape(-1) for x in xs]), axis=0)


def vnmse(out, exact) -> float:
    out = np.asarray(out, dtype=np.float64).reshape(-1)
    return float(np.sum((out - exact) ** 2) / np.sum(exact ** 2))


def digest(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).tobytes()).hexdigest()


def load_example(name: str):
    """A script of mpi_examples/ imported as a module (they are not a package)."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "mpi_examples", name + ".py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
