"""Moved to seqpar.tools.models.llama; this alias is kept for existing imports."""

from ..tools.models.llama import *  # noqa: F403 (the moved module's public names)
from ..tools.models.llama import __all__  # noqa: F401
