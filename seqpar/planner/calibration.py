"""Measure a :class:`~seqpar.planner.CostModel` on the ranks that will run the job.

Note [Planner calibration]
~~~~~~~~~~~~~~~~~~~~~~~~~~
``calibrate(state)`` is a collective over ``state.cp_group``. Every time is the median of
``repeats`` calls after a warm-up; transfers are timed with every rank busy at once (as in
training) and taken from the slowest rank.

- **kernels**, on CP rank 0 *alone* while the others wait (one rank's full speed): the attention
  kernel (``get_backend("auto")``) forward and backward on a small block (the fixed cost per
  call), a large unmasked block (FLOP/s: every pair of it is attended) and large causal and
  sliding-window blocks (their ``extra_keys`` per query row at that rate); an element-wise pass
  (``add_`` over fp32 buffers larger than caches) for ``memory_bandwidth``;
- the large unmasked block on every rank at once: its slowdown over the alone time says how many
  ranks of a node compute at full speed at once (``compute_capacity``; ``None`` when each rank
  keeps its speed, e.g. one GPU per rank);
- a **ring step**: K and V sent to one peer and received from another with ``seqpar.comm.post``
  (the ring driver's transfer) at a small and a large size -- latency and bytes per second --
  inside a node and, when the group spans nodes, across;
- the large ring step while the unmasked kernel runs: the fraction of the shorter of the two
  that is hidden (``overlap``);
- ``seqpar.comm.all_to_all`` over the CP group at a small and a large size (latency per
  collective, bytes per second);
- a real causal ring over the whole group (``seqpar.parallel.ring``, forward and backward): what
  it takes beyond the model of it built from the numbers above, per step, is ``ring_step_s``.

What a group cannot show (links across nodes on a single node, an all-to-all inside one node
when the group spans nodes) is taken from the preset of the device type and listed in
``CostModel.notes``. All ranks return the same model.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..backends import get_backend
from ..comm import Workspace, all_to_all, group_rank, group_size, post, reduce_
from ..parallel.ring import RingSetup, ring_backward, ring_forward
from ..placement import Mask, Placement, ring_plan
from ..placement.cost import kernel_flops, square_pairs
from ..state import ParallelState, require_state
from .cost import KINDS, CostModel, KernelRates, Link
from .predict import Shape, predict
from .timing import median_seconds, sync

__all__ = ["calibrate"]

# (kernel block tokens, kernel heads, all-to-all and ring-step bytes per rank) per device type.
_SIZES = {"cpu": (1024, 2, 8 << 20), "cuda": (8192, 8, 256 << 20)}
_ELEMENTWISE_BYTES = {"cpu": 64 << 20, "cuda": 1 << 30}  # larger than caches
_RING_TOKENS = {"cpu": 512, "cuda": 4096}  # per rank, for the real ring
_SMALL_BLOCK = 32
_SMALL_BYTES = 4096


def _median(fn, repeats: int, device: torch.device, group, *, together: bool = True) -> float:
    """This rank's median of ``repeats`` calls after a warm-up, all ranks starting each call
    together unless ``together`` is off (the slowest rank is taken later, for every time at once)."""
    return median_seconds(fn, repeats, device, group, warmup=1, barrier=together, over_ranks=False)


def _elementwise_seconds(nbytes: int, device: torch.device, repeats: int, group) -> float:
    """This rank's median time of ``acc.add_(x)`` over fp32 buffers of ``nbytes`` each."""
    acc = torch.zeros(nbytes // 4, device=device, dtype=torch.float32)
    x = torch.ones_like(acc)
    return _median(lambda: acc.add_(x), repeats, device, group, together=False)


def calibrate(
    state: ParallelState,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    head_dim: int = 64,
    ranks_per_node: int | None = None,
    repeats: int = 5,
) -> CostModel:
    """Measure the cost model on ``state``'s CP group (Note [Planner calibration]).

    Collective: every rank of ``state.cp_group`` calls it with the same arguments. Takes a few
    seconds (more on CPU ranks that share cores).

    Args:
        state: the parallel state; its CP group is measured (e.g. ``ParallelState(1, N)``).
        dtype: the training dtype (default bfloat16 on CUDA, float32 on CPU).
        device: where tensors live (default: the current CUDA device if CUDA is available, else CPU).
        head_dim: ``D`` of the kernel measurements.
        ranks_per_node: consecutive CP ranks that share a node (default: all of them on CPU,
            ``torch.cuda.device_count()`` on CUDA); must divide ``cp_size`` when smaller.
        repeats: timed calls per measurement (median taken).

    Returns:
        A :class:`CostModel`, the same on every rank; ``cost.save(path)`` keeps it.

    Raises:
        ValueError: a bad ``state``, ``repeats < 1`` or a ``ranks_per_node`` that does not fit.
    """
    require_state(state, "calibrate")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"calibrate: repeats must be an int >= 1, got {repeats!r}")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    group = state.cp_group
    N, me = group_size(group), group_rank(group)
    if ranks_per_node is None:
        ranks_per_node = N if device.type != "cuda" else max(1, min(N, torch.cuda.device_count()))
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1 or (
        ranks_per_node < N and N % ranks_per_node
    ):
        raise ValueError(
            f"calibrate: ranks_per_node={ranks_per_node!r} must be a positive int dividing the "
            f"cp_size {N} (or at least {N})"
        )
    base = CostModel.preset("h100" if device.type == "cuda" else "cpu")
    block, heads, big_bytes = _SIZES.get(device.type, _SIZES["cpu"])
    esize = torch.empty((), dtype=dtype).element_size()
    times: dict[str, float] = {}

    # -- kernels and element-wise passes, on cp rank 0 alone (full speed) ------------------------
    backend = get_backend("auto", device, dtype, window=True)
    scale = head_dim ** -0.5

    def kernel_case(n: int, window: tuple[int, int]):
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v, dout = (torch.randn(1, n, heads, head_dim, generator=g, device=device, dtype=dtype) for _ in range(4))
        out, lse = backend.forward(q, k, v, causal=False, scale=scale, window=window)
        return (
            lambda: backend.forward(q, k, v, causal=False, scale=scale, window=window),
            lambda: backend.backward(dout, q, k, v, out, lse, causal=False, scale=scale, window=window),
        )

    cases = {
        "small": (_SMALL_BLOCK, (-1, -1)),
        "full": (block, (-1, -1)),
        "causal": (block, (-1, 0)),
        "window": (block, (block // 8, 0)),
    }
    elem_bytes = _ELEMENTWISE_BYTES.get(device.type, _ELEMENTWISE_BYTES["cpu"])
    alone: dict[str, float] = {}
    if me == 0:  # the others wait in the next barrier
        for name, (n, window) in cases.items():
            fwd, bwd = kernel_case(n, window)
            alone[f"kernel.{name}.fwd"] = _median(fwd, repeats, device, group, together=False)
            alone[f"kernel.{name}.bwd"] = _median(bwd, repeats, device, group, together=False)
        alone["elementwise"] = _elementwise_seconds(elem_bytes, device, repeats, group)
    # The same large kernel on every rank at once: how many ranks of a node compute at full speed.
    big_fwd, _ = kernel_case(block, (-1, -1))
    times["kernel.busy"] = _median(big_fwd, repeats, device, group)

    # -- transfers -------------------------------------------------------------------------------
    def exchange(nbytes: int, send_to: int, recv_from: int):
        """Post one ring step: K and V (``nbytes`` together) to ``send_to``, from ``recv_from``."""
        n = max(1, nbytes // (2 * esize))
        k_out, v_out = torch.ones(n, device=device, dtype=dtype), torch.ones(n, device=device, dtype=dtype)
        k_in, v_in = torch.empty_like(k_out), torch.empty_like(v_out)
        return lambda: post(group, [(send_to, k_out), (send_to, v_out)], [(recv_from, k_in), (recv_from, v_in)])

    peers: dict[str, tuple[int, int]] = {}  # link -> (send to, receive from)
    if N > 1:
        first, local = me - me % ranks_per_node, min(ranks_per_node, N)
        if local > 1:
            peers["intra"] = (first + (me - first + 1) % local, first + (me - first - 1) % local)
        if N > ranks_per_node:
            peers["inter"] = ((me + ranks_per_node) % N, (me - ranks_per_node) % N)
    for link, (dst, src) in peers.items():
        for size, nbytes in (("small", _SMALL_BYTES), ("big", big_bytes)):
            start = exchange(nbytes, dst, src)
            times[f"ring.{link}.{size}"] = _median(lambda start=start: start().wait(), repeats, device, group)
    if peers:
        link = "intra" if "intra" in peers else "inter"
        start = exchange(big_bytes, *peers[link])

        def step_during_kernel() -> None:
            pending = start()
            big_fwd()
            pending.wait()

        times[f"overlap.{link}"] = _median(step_during_kernel, repeats, device, group)
    a2a_bytes = 0
    if N > 1:
        # x [1, n, N * heads, D]: every peer gets this rank's n tokens of its `heads` heads.
        tokens = max(1, big_bytes // ((N - 1) * heads * head_dim * esize))
        a2a_bytes = tokens * (N - 1) * heads * head_dim * esize  # sent to others, per rank
        for size, n in (("small", 1), ("big", tokens)):
            x = torch.ones(1, n, N * heads, head_dim, device=device, dtype=dtype)
            times[f"a2a.{size}"] = _median(lambda x=x: all_to_all(x, group, 2, 1), repeats, device, group)
            del x

    # -- a real causal ring over the group: what a step costs beyond the rest of the model -------
    ring_tokens = 0
    if N > 1:
        ring_tokens = _RING_TOKENS.get(device.type, _RING_TOKENS["cpu"]) * N
        placement = Placement.dense(ring_tokens, N, 1)
        plan = ring_plan(placement, me, Mask(causal=True), varlen=True)
        g = torch.Generator(device=device).manual_seed(1)
        L = placement.ring_lengths[me]
        q, k, v, dout = (torch.randn(1, L, heads, head_dim, generator=g, device=device, dtype=dtype) for _ in range(4))
        run = RingSetup(group, plan, backend, scale, 0.0, Workspace())

        def ring_step() -> None:  # forward and backward, as in training
            out, lse = ring_forward(q, k, v, None, None, run)
            ring_backward(dout, q, [k, v], None, None, out, lse, run)

        times["ring.real"] = _median(ring_step, repeats, device, group)

    # -- the slowest rank's medians, the same on every rank --------------------------------------
    names = sorted(times) + sorted(f"alone.{k}" for k in _alone_names(cases))
    mine = {**times, **{f"alone.{k}": v for k, v in alone.items()}}
    values = torch.tensor([mine.get(n, 0.0) for n in names], dtype=torch.float64, device=device)
    reduce_(values, group, op="max")  # the slowest rank's medians; rank 0's alone times
    sync(device)
    got = dict(zip(names, values.tolist()))
    return _model(got, cases, base, N, ranks_per_node, heads, head_dim, big_bytes, a2a_bytes, elem_bytes,
                  ring_tokens, esize, device, dtype, backend.name)


def _alone_names(cases: dict) -> list[str]:
    """Names of the times rank 0 measures alone."""
    return [f"kernel.{name}.{d}" for name in cases for d in ("fwd", "bwd")] + ["elementwise"]


def _extra_keys(seconds: float, pairs: int, rows: int, rate: float, flops_per_pair: float) -> float:
    """Keys computed per query row beyond the ``pairs`` attended, from a block's time at ``rate``."""
    return max(0.0, (seconds * rate / flops_per_pair - pairs) / rows)


def _model(
    t: dict[str, float], cases: dict, base: CostModel, N: int, ranks_per_node: int, heads: int, head_dim: int,
    big_bytes: int, a2a_bytes: int, elem_bytes: int, ring_tokens: int, esize: int, device: torch.device,
    dtype: torch.dtype, backend: str,
) -> CostModel:
    """The cost model from the measured times (seconds: the slowest rank's medians, and cp rank
    0's alone)."""
    notes = []
    # Kernels: latency from the small block, the rate from the unmasked one (whose tiles are all
    # attended), each masked kind's extra keys per row at that rate.
    latency = max(0.0, min(t["alone.kernel.small.fwd"], t["alone.kernel.small.bwd"]))
    n, _ = cases["full"]
    (_, (left, _)) = cases["window"]
    pairs = {"full": square_pairs(n, False), "causal": square_pairs(n, True),
             "window": sum(min(i, left) + 1 for i in range(n))}
    per_pair = {"fwd": kernel_flops(heads, head_dim), "bwd": kernel_flops(heads, head_dim, backward=True)}
    seconds = {(k, d): max(t[f"alone.kernel.{k}.{d}"] - latency, 1e-9) for k in KINDS for d in per_pair}
    rate = {d: per_pair[d] * pairs["full"] / seconds["full", d] for d in per_pair}
    rates = {}
    for kind in KINDS:
        extra = [_extra_keys(seconds[kind, d], pairs[kind], n, rate[d], per_pair[d]) for d in per_pair]
        rates[kind] = KernelRates(rate["fwd"], rate["bwd"], 0.0 if kind == "full" else sum(extra) / 2)
    # Ranks of a node computing at once: the large unmasked kernel on every rank vs alone.
    capacity: float | None = None
    local = min(N, ranks_per_node)
    busy = t["kernel.busy"] / max(t["alone.kernel.full.fwd"], 1e-9)
    if local > 1 and busy > 1.2:
        capacity = max(1.0, local / busy)
    memory_bandwidth = 3 * elem_bytes / max(t["alone.elementwise"], 1e-9)  # add_: two reads, a write

    def link(prefix: str, fallback: Link, messages: int, nbytes: float) -> Link:
        if f"{prefix}.big" not in t:
            return fallback
        small, big = t[f"{prefix}.small"], t[f"{prefix}.big"]
        return Link(max(0.0, small / messages), nbytes / max(big - small, 1e-9))

    ring_intra = link("ring.intra", base.ring_intra, 2, big_bytes)
    ring_inter = link("ring.inter", base.ring_inter, 2, big_bytes)
    a2a = link("a2a", base.ulysses_inter if N > ranks_per_node else base.ulysses_intra, 1, a2a_bytes)
    ulysses_intra, ulysses_inter = base.ulysses_intra, base.ulysses_inter
    if N == 1:
        notes.append("one rank: links and overlap from the preset")
    elif N > ranks_per_node:
        ulysses_inter = a2a
        notes.append("ulysses_intra from the preset: the group spans nodes")
    else:
        ulysses_intra = a2a
        notes.append("ulysses_inter and ring_inter from the preset: the group fits in one node")
    overlap = base.overlap
    for where in ("intra", "inter"):
        if f"overlap.{where}" in t:
            k_time, x_time = t["kernel.busy"], t[f"ring.{where}.big"]
            hidden = k_time + x_time - t[f"overlap.{where}"]
            overlap = min(1.0, max(0.0, hidden / max(min(k_time, x_time), 1e-9)))
            break
    cost = CostModel(
        name=f"calibrated on {N} {device.type} ranks ({str(dtype).removeprefix('torch.')}, backend {backend})",
        device=device.type,
        dtype=str(dtype).removeprefix("torch."),
        kernel=rates,
        kernel_latency_s=latency,
        compute_capacity=capacity,
        ulysses_intra=ulysses_intra,
        ulysses_inter=ulysses_inter,
        ring_intra=ring_intra,
        ring_inter=ring_inter,
        overlap=overlap,
        ring_step_s=0.0,
        memory_bandwidth=memory_bandwidth,
        notes=tuple(notes),
    )
    if "ring.real" in t:
        # The real ring against the model of it without a fixed step cost: the rest, per step.
        shape = Shape(ring_tokens, heads, heads, head_dim, 1, True, (-1, -1), esize)
        modelled = predict(shape, N, 1, ranks_per_node, cost).time_s
        cost = replace(cost, ring_step_s=max(0.0, (t["ring.real"] - modelled) / (2 * N)))
    else:
        cost = replace(cost, ring_step_s=base.ring_step_s)
    return cost
