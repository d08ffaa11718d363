"""Moved to seqpar.tools.models.hf_configs; this alias is kept for existing imports."""

from ..tools.models.hf_configs import *  # noqa: F403 (the moved module's public names)
from ..tools.models.hf_configs import __all__  # noqa: F401
