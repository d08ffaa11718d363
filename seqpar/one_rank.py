"""Moved to seqpar.tools.one_rank; this alias is kept for existing imports.

``python -m seqpar.one_rank`` runs ``python -m seqpar.tools.one_rank``.
"""

from .tools.one_rank import (
    MaxLenSearch,
    OneRankConfig,
    fake_world,
    instrument,
    main,
    max_seq_len,
    measure,
    mixed_doc_lens,
    rank_work,
    run_one_rank,
    run_tasks,
    search_max_seq_len,
)

__all__ = [
    "OneRankConfig",
    "MaxLenSearch",
    "run_one_rank",
    "search_max_seq_len",
    "run_tasks",
    "measure",
    "max_seq_len",
    "fake_world",
    "mixed_doc_lens",
    "rank_work",
    "instrument",
]

if __name__ == "__main__":
    main()
