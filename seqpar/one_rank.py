"""Moved to seqpar.tools.one_rank; this alias is kept for existing imports.

``python -m seqpar.one_rank`` runs ``python -m seqpar.tools.one_rank``.
"""

from .tools.one_rank import *  # noqa: F403 (the moved module's public names)
from .tools.one_rank import __all__  # noqa: F401

if __name__ == "__main__":
    from .tools.one_rank import main

    main()
