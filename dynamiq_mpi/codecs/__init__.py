"""Codecs: one module per codec, all behind the interface of ``base``."""
from .dynamiq import DynamiQ
from .mxfp import MXFP
from .omnireduce import OmniReduce
from .plain import BF16, Exact
from .thc import THC

DEFAULT_CODEC = DynamiQ()       # of calls that name none (immutable: one serves all)

__all__ = ["DynamiQ", "Exact", "BF16", "MXFP", "THC", "OmniReduce", "codec_from_string"]


def _value(text: str):
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def codec_from_string(spec: str):
    """A codec from a command-line spelling: ``exact``, ``bf16``, ``dynamiq``,
    ``dynamiq:5`` (bits), ``dynamiq:5:correlated=0:small_input=0`` (fields),
    ``mxfp:e4m3`` (element format), ``thc``, ``thc:agg_bits=8``, ``omnireduce``,
    ``omnireduce:0.25`` (density)."""
    name, *rest = spec.strip().split(":")
    name = name.lower()
    kwargs, positional = {}, []
    for item in rest:
        if "=" in item:
            key, val = item.split("=", 1)
            kwargs[key.strip()] = _value(val.strip())
        elif item:
            positional.append(_value(item))
    registry = {"exact": (Exact, []), "bf16": (BF16, []), "dynamiq": (DynamiQ, ["bits"]),
                "mxfp": (MXFP, ["fmt"]), "thc": (THC, []),
                "omnireduce": (OmniReduce, ["density"])}
    if name not in registry:
        raise ValueError(f"unknown codec {name!r} in {spec!r}; known: {sorted(registry)}")
    cls, names = registry[name]
    if len(positional) > len(names):
        raise ValueError(f"codec {spec!r}: too many ':' arguments (takes {names})")
    kwargs.update(zip(names, positional))
    return cls(**kwargs)
