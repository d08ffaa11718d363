"""Where tokens live and which blocks meet: pure host maths, no communication.

- :mod:`.sizes`: ``split_sizes`` and validated integer inputs;
- :mod:`.layout`: :class:`Placement`, the token placement (Note [Sharding placement]);
- :mod:`.heads`: :func:`head_assignments`, the query and K/V heads of every Ulysses rank;
- :mod:`.masks`: :class:`Mask`, attention masks in global positions (Note [Masks]);
- :mod:`.ring`: the ring plan, which blocks every ring step computes (Note [Ring blocks]);
- :mod:`.work`: attention work per rank, for balance checks.
"""

from .ring import RingPlan, ring_plan
from .heads import HeadAssignment, head_assignments
from .masks import Mask, MaskSlices
from .layout import Placement
from .sizes import check_seq_lens, offsets, split_sizes
from .work import attention_work, imbalance

__all__ = [
    "Placement",
    "Mask",
    "MaskSlices",
    "HeadAssignment",
    "head_assignments",
    "RingPlan",
    "ring_plan",
    "attention_work",
    "imbalance",
    "split_sizes",
    "offsets",
    "check_seq_lens",
]
