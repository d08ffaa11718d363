"""Moved to seqpar.tools.models; this alias is kept for existing imports."""

from ..tools.models import *  # noqa: F403 (the moved module's public names)
from ..tools.models import __all__  # noqa: F401
