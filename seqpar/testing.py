"""Moved to seqpar.tools.testing; this alias is kept for existing imports."""

from .tools.testing import DistPool, DistributedError

__all__ = ["DistPool", "DistributedError"]
