"""Where tokens live and which blocks meet: pure host maths, no communication.

- :mod:`.sizes`: ``split_sizes`` and validated integer inputs;
- :mod:`.rule`: :class:`Placement`, the token placement (Note [Sharding placement]);
- :mod:`.masks`: :class:`Mask`, attention masks in global positions (Note [Masks]);
- :mod:`.blocks`: the ring plan, which blocks every ring step computes (Note [Ring blocks]);
- :mod:`.work`: attention work per rank, for balance checks.
"""

from .blocks import RingPlan, ring_plan
from .masks import Mask
from .rule import Placement
from .sizes import check_seq_lens, offsets, split_sizes
from .work import attention_work, imbalance

__all__ = [
    "Placement",
    "Mask",
    "RingPlan",
    "ring_plan",
    "attention_work",
    "imbalance",
    "split_sizes",
    "offsets",
    "check_seq_lens",
]
