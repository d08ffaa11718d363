"""The cost model of the degree planner: what one byte, one message and one FLOP cost here.

Note [Planner cost model]
~~~~~~~~~~~~~~~~~~~~~~~~~
A :class:`CostModel` holds a few numbers, measured by :func:`seqpar.planner.calibrate` on the
machines that will run the job, or taken from a preset:

- **links**: an all-to-all costs ``latency + bytes / bandwidth`` per rank (``bytes``: what the
  rank sends or receives, whichever is larger, self excluded); a ring step's transfer costs
  ``2 * latency + bytes / bandwidth`` (K and V). Each exists twice, inside a node (``intra``) and
  across nodes (``inter``); a collective that uses both takes the slower part.
- **kernels**: a call costs ``latency + flops / rate``, with forward ``4 * D`` and backward
  ``10 * D`` FLOPs per computed (query, key) pair and head (flash-attention's count). A kernel
  computes more pairs than the mask attends: the tiles that a mask edge cuts are computed whole.
  That waste grows with the rows, not the pairs, so each block kind -- ``full`` (unmasked),
  ``causal`` (square, causal), ``window`` (any other band: a sliding window, a trimmed corner) --
  has a rate and ``extra_keys``, the keys computed per query row beyond those attended (about
  half a tile for ``causal``; on CPU, where windows run as masked tiles, a few hundred).
- **compute_capacity**: how many ranks of a node compute at full speed at the same time.
  ``None`` means each rank has its own device (GPUs); on CPU ranks share cores, so a phase lasts
  at least ``(sum of the node's kernel time) / capacity``.
- **overlap**: the fraction of ``min(compute, transfer)`` of a ring step that runs concurrently
  (1: the shorter one is hidden entirely, 0: they add up).
- **ring_step_s**: what one ring step costs beyond its kernels, transfers and merges -- Python,
  posting and waiting, and on time-shared CPUs waiting for a peer that is not running. It is
  what a real ring (``seqpar.parallel.ring``) takes on top of the rest of the model.
- **memory_bandwidth**: bytes per second of the element-wise passes around the kernels (LSE
  merges, fp32 accumulators, gradient sums).

Rates are per rank and for one dtype (``dtype``): calibrate with the dtype you train in.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

__all__ = ["Link", "KernelRates", "CostModel", "PRESETS"]

KINDS: tuple[str, ...] = ("full", "causal", "window")


def _positive(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"CostModel: {name} must be a positive finite number, got {value!r}")
    return float(value)


def _non_negative(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"CostModel: {name} must be a finite number >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Link:
    """One kind of transfer: ``latency_s`` per message (all-to-all: per collective) and
    ``bandwidth`` in bytes per second per rank."""

    latency_s: float
    bandwidth: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "latency_s", _non_negative(self.latency_s, "latency_s"))
        object.__setattr__(self, "bandwidth", _positive(self.bandwidth, "bandwidth"))

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        """Time of ``messages`` messages carrying ``nbytes`` in all (0 when nothing moves)."""
        if nbytes <= 0:
            return 0.0
        return messages * self.latency_s + nbytes / self.bandwidth


@dataclass(frozen=True)
class KernelRates:
    """One block kind of the attention kernel: FLOP/s per rank forward and backward, and the keys
    computed per query row beyond the attended ones (``extra_keys``)."""

    forward: float
    backward: float
    extra_keys: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "forward", _positive(self.forward, "forward rate"))
        object.__setattr__(self, "backward", _positive(self.backward, "backward rate"))
        object.__setattr__(self, "extra_keys", _non_negative(self.extra_keys, "extra_keys"))


@dataclass(frozen=True)
class CostModel:
    """What communication and compute cost on one cluster (Note [Planner cost model]).

    Attributes:
        name: where the numbers come from (a preset's name, or a calibration's description).
        device, dtype: the device type and dtype the kernels were measured with.
        kernel: ``{"full" | "causal" | "window": KernelRates}``.
        kernel_latency_s: fixed cost of one kernel call (launch, Python), forward or backward.
        compute_capacity: ranks of a node that compute at full speed at once; ``None``: every
            rank has its own device.
        ulysses_intra, ulysses_inter: all-to-all links inside / across nodes.
        ring_intra, ring_inter: point-to-point links inside / across nodes.
        overlap: fraction of ``min(compute, transfer)`` hidden in a ring step, in ``[0, 1]``.
        ring_step_s: fixed cost of one ring step (forward or backward) beyond the rest.
        memory_bandwidth: bytes per second of element-wise passes (merges, accumulators).

    Serialise with :meth:`to_json` / :meth:`from_json` (or :meth:`save` / :meth:`load`).
    """

    name: str
    device: str
    dtype: str
    kernel: dict[str, KernelRates]
    kernel_latency_s: float
    compute_capacity: float | None
    ulysses_intra: Link
    ulysses_inter: Link
    ring_intra: Link
    ring_inter: Link
    overlap: float
    ring_step_s: float
    memory_bandwidth: float
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if set(self.kernel) != set(KINDS):
            raise ValueError(f"CostModel: kernel must have rates for {list(KINDS)}, got {sorted(self.kernel)}")
        _non_negative(self.kernel_latency_s, "kernel_latency_s")
        if self.compute_capacity is not None:
            _positive(self.compute_capacity, "compute_capacity")
        if not 0.0 <= float(self.overlap) <= 1.0:
            raise ValueError(f"CostModel: overlap must be in [0, 1], got {self.overlap!r}")
        _non_negative(self.ring_step_s, "ring_step_s")
        _positive(self.memory_bandwidth, "memory_bandwidth")
        object.__setattr__(self, "notes", tuple(self.notes))

    # -- presets --------------------------------------------------------------------

    @staticmethod
    def preset(name: str) -> CostModel:
        """A built-in cost model (see :data:`PRESETS`).

        Raises:
            ValueError: an unknown name, listing the valid ones.
        """
        if name not in PRESETS:
            raise ValueError(f"CostModel.preset: unknown preset {name!r}; valid presets: {sorted(PRESETS)}")
        return PRESETS[name]

    # -- JSON ----------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """A JSON-compatible dict (:meth:`from_dict` reads it back)."""
        out = asdict(self)
        out["notes"] = list(self.notes)
        return out

    @staticmethod
    def from_dict(data: dict) -> CostModel:
        """The cost model of :meth:`to_dict`'s output.

        Raises:
            ValueError: missing or unknown keys, or values out of range.
        """
        if not isinstance(data, dict):
            raise ValueError(f"CostModel.from_dict: expected a dict, got {type(data).__name__}")
        names = {f.name for f in fields(CostModel)}
        required = names - {"notes"}
        unknown, missing = set(data) - names, required - set(data)
        if unknown or missing:
            raise ValueError(
                f"CostModel.from_dict: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}; "
                f"valid keys: {sorted(names)}"
            )
        values = dict(data)
        try:
            values["kernel"] = {k: KernelRates(**v) for k, v in data["kernel"].items()}
            for key in ("ulysses_intra", "ulysses_inter", "ring_intra", "ring_inter"):
                values[key] = Link(**data[key])
        except TypeError as e:
            raise ValueError(f"CostModel.from_dict: malformed entry ({e})") from None
        values["notes"] = tuple(data.get("notes", ()))
        return CostModel(**values)

    def to_json(self) -> str:
        """The model as indented JSON text."""
        return json.dumps(self.to_dict(), indent=2)

    @staticmethod
    def from_json(text: str) -> CostModel:
        """The model of :meth:`to_json`'s text."""
        return CostModel.from_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        """Write :meth:`to_json` to ``path``."""
        Path(path).write_text(self.to_json() + "\n")

    @staticmethod
    def load(path: str | Path) -> CostModel:
        """Read a model written by :meth:`save`."""
        return CostModel.from_json(Path(path).read_text())


def _rates(forward: float, backward: float, causal_extra: float, window_extra: float) -> dict[str, KernelRates]:
    return {
        "full": KernelRates(forward, backward),
        "causal": KernelRates(forward, backward, causal_extra),
        "window": KernelRates(forward, backward, window_extra),
    }


PRESETS: dict[str, CostModel] = {
    # One H100 SXM per rank, 8 per node on NVLink 4, one 400 Gb/s NIC per GPU; bf16
    # flash-attention at ~350 / ~300 TFLOP/s forward / backward. Order-of-magnitude numbers for
    # choosing degrees before a calibration; calibrate for anything you will report.
    "h100": CostModel(
        name="preset h100 (NVLink inside nodes, 400 Gb/s InfiniBand across)",
        device="cuda",
        dtype="bfloat16",
        kernel=_rates(3.5e14, 3.0e14, causal_extra=64, window_extra=128),
        kernel_latency_s=2e-5,
        compute_capacity=None,
        ulysses_intra=Link(3e-5, 1.5e11),
        ulysses_inter=Link(6e-5, 2.5e10),
        ring_intra=Link(2e-5, 1.5e11),
        ring_inter=Link(3e-5, 4.0e10),
        overlap=0.9,
        ring_step_s=3e-5,
        memory_bandwidth=2.0e12,
        notes=("not measured: numbers from public H100 / NVLink / InfiniBand figures",),
    ),
    # Local gloo ranks on a few CPU cores (what the tests run): loopback TCP, one thread per rank.
    "cpu": CostModel(
        name="preset cpu (local gloo ranks sharing 2 cores)",
        device="cpu",
        dtype="float32",
        kernel=_rates(7.0e10, 7.0e10, causal_extra=256, window_extra=420),
        kernel_latency_s=5e-5,
        compute_capacity=2.0,
        ulysses_intra=Link(4e-3, 2.0e8),
        ulysses_inter=Link(8e-3, 5.0e7),
        ring_intra=Link(1e-3, 5.0e8),
        ring_inter=Link(2e-3, 5.0e7),
        overlap=0.3,
        ring_step_s=2e-3,
        memory_bandwidth=2.0e9,
        notes=("not measured: rough numbers for local CPU ranks; calibrate instead",),
    ),
}
