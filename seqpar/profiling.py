"""Moved to seqpar.tools.profiling; this alias is kept for existing imports."""

from .tools.profiling import *  # noqa: F403 (the moved module's public names)
from .tools.profiling import __all__  # noqa: F401
