"""Settings a caller may leave to the environment: an argument, else the
variable, else the default, checked alike (ground floor: imports nothing of
the package)."""
from __future__ import annotations

import os

_TRUE = ("1", "true", "on", "yes")


def env_choice(value, variable: str, choices: tuple, what: str, default: str = "auto") -> str:
    """``value``, else ``$variable``, else ``default``; a clear error for
    anything outside ``choices``."""
    if value is None:
        value = os.environ.get(variable, default).strip() or default
    if value not in choices:
        raise ValueError(f"{what} must be one of {choices} (argument or ${variable}), "
                         f"got {value!r}")
    return value


def env_flag(value, variable: str) -> bool:
    """``value``, else whether ``$variable`` says yes ("1", "true", "on")."""
    if value is None:
        return os.environ.get(variable, "").strip().lower() in _TRUE
    return bool(value)
