"""Codecs: one module per codec, all behind the interface of ``base``."""
from .dynamiq import DynamiQ
from .plain import BF16, Exact

__all__ = ["DynamiQ", "Exact", "BF16"]
