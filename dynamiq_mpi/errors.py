"""Exceptions raised by the collective.  Every input error is decided from
data all ranks share after the agreement, so every rank raises the same one
and none is left waiting in a collective."""


class DynamiQError(Exception):
    """Base class of the library's errors."""


class InputMismatchError(DynamiQError, ValueError):
    """Ranks passed different lengths, dtypes, codecs, topologies, ops or seeds."""


class InvalidInputError(DynamiQError, ValueError):
    """Some rank's input is unusable (dtype, layout, topology at this size...)."""


class NonFiniteInputError(DynamiQError, ValueError):
    """Some rank's input holds NaN or Inf."""


class SumOverflowError(DynamiQError, OverflowError):
    """Finite inputs whose sum leaves the float32 range."""
