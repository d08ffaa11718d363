"""Moved to seqpar.tools.models.dit; this alias is kept for existing imports."""

from ..tools.models.dit import *  # noqa: F403 (the moved module's public names)
from ..tools.models.dit import __all__  # noqa: F401
