"""The degree planner: which ring x Ulysses split of a CP group runs a layer fastest.

::

    cost = seqpar.planner.calibrate(seqpar.ParallelState(1, world))   # once per cluster, collective
    choice = seqpar.plan(8, seq_len=131072, num_heads=32, num_kv_heads=8, head_dim=128, cost=cost)
    print(choice)                                                      # every candidate + why
    state = choice.state()                                             # ParallelState(R, U)

- :mod:`.cost`: :class:`CostModel`, what bytes, messages and FLOPs cost (Note [Planner cost
  model]), presets and JSON;
- :mod:`.predict`: one factorisation's bytes, memory, balance and time from the exact placement
  and ring plan (Note [Planner prediction]);
- :mod:`.choose`: :func:`plan` and :class:`DegreePlan`; the recommended ``head_groups``
  (:func:`recommend_head_groups`, :func:`auto_head_groups` for ``head_groups="auto"``);
- :mod:`.memory`: :func:`longest_context` and :class:`ModelShape`, the whole model's memory per
  rank and the longest context that fits (Note [Memory model]);
- :mod:`.calibration`: :func:`calibrate`, the measurements (Note [Planner calibration]), timed
  with :mod:`.timing`; imported when called, so that ``import seqpar`` loads no timing code.

``docs/planner.md`` describes the model and its limits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .choose import HEAD_GROUPS_RTOL, TIE_RTOL, DegreePlan, auto_head_groups, plan, recommend_head_groups
from .cost import PRESETS, CostModel, KernelRates, Link
from .memory import CPU_CALIBRATION, GPU_CALIBRATION, Calibration, MemoryPrediction, ModelShape, longest_context
from .predict import Candidate, GroupPrediction, Shape, predict

if TYPE_CHECKING:
    from ..state import ParallelState

__all__ = [
    "plan",
    "DegreePlan",
    "Candidate",
    "Shape",
    "predict",
    "CostModel",
    "KernelRates",
    "Link",
    "PRESETS",
    "TIE_RTOL",
    "HEAD_GROUPS_RTOL",
    "GroupPrediction",
    "recommend_head_groups",
    "auto_head_groups",
    "calibrate",
    "longest_context",
    "ModelShape",
    "MemoryPrediction",
    "Calibration",
    "CPU_CALIBRATION",
    "GPU_CALIBRATION",
]


def calibrate(state: ParallelState, **options: Any) -> CostModel:
    """Measure a :class:`CostModel` on ``state``'s CP group; a collective (every rank calls it).

    The measurement is :func:`seqpar.planner.calibration.calibrate` (its keyword options:
    ``dtype``, ``device``, ``head_dim``, ``ranks_per_node``, ``repeats``; Note [Planner
    calibration]), imported by this call, so that ``import seqpar`` loads no timing code.
    """
    from .calibration import calibrate as measure

    return measure(state, **options)
