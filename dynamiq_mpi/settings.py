"""Settings a caller may leave to the environment, and the one module of the
package that reads the environment: an argument, else the variable, else the
default, checked alike (ground floor: imports nothing of the package).
docs/reference.md lists every ``DYNAMIQ_*`` variable."""
from __future__ import annotations

import os

_FALSE = ("0", "false", "off", "no")


def environment():
    """The process environment, for the variables of launchers, MPI and NCCL
    that a module interprets itself (``RANK``, ``MASTER_ADDR``, ``NCCL_*``)."""
    return os.environ


def env_text(variable: str, default=None):
    """``$variable`` as set (not stripped), else ``default``."""
    return os.environ.get(variable, default)


def env_choice(value, variable: str, choices: tuple, what: str, default: str = "auto") -> str:
    """``value``, else ``$variable``, else ``default``: a clear error outside ``choices``."""
    if value is None:
        value = os.environ.get(variable, default).strip() or default
    if value not in choices:
        raise ValueError(f"{what} must be one of {choices} (argument or ${variable}), "
                         f"got {value!r}")
    return value


def check_flag(value, what: str) -> bool:
    """``value`` when it is True or False: a clear error otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be True or False, got {value!r}")
    return value


def env_switch(variable: str) -> bool:
    """Whether ``$variable`` leaves a feature on: unless it says "0", "false", "off", "no"."""
    return os.environ.get(variable, "").strip().lower() not in _FALSE
