"""Moved to seqpar.tools.testing; this alias is kept for existing imports."""

from .tools.testing import *  # noqa: F403 (the moved module's public names)
from .tools.testing import __all__  # noqa: F401
