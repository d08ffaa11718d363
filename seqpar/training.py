"""Losses and gradient synchronisation for training on sequence shards.

Note [Loss shares and gradient sync]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
seqpar's gradient convention (``docs/api.md``): on a CP group, rank ``c`` backpropagates its *share*
``L_c`` of the loss with ``sum_c L_c = L``, and the true gradient of every parameter is the sum
over the CP group of the per-rank gradients. For a token-mean loss the share is

    L_c = (sum of the loss over rank c's valid tokens) / (number of valid tokens in the sequence)

where the denominator is global: one all-reduce of a count over the CP group
(:func:`sharded_cross_entropy`, :func:`sharded_mean`). The value of ``L_c`` on its own is not the
loss; :func:`global_loss` adds the shares up -- a collective (all-reduces over the CP and DP
groups), so every rank calls it, also when only one rank prints the result.

With data parallelism on top (``dp_size`` replicas of ``cp_size`` ranks, parameters identical on
all ``dp_size * cp_size`` ranks), the objective is the mean over replicas,
``L = (1/dp_size) sum_d sum_c L_{d,c}``, so the gradient every rank needs is

    g = (1/dp_size) * sum over all ranks of the parent group of g_{d,c}

i.e. **sum over CP, mean over DP** -- one all-reduce over the parent group of the gradients
divided by ``dp_size``. PyTorch's DDP all-reduces over its group and divides by the group size
(``dp_size * cp_size``), which would be ``cp_size`` times too small; :func:`wrap_ddp` installs a
communication hook that divides by ``dp_size`` instead (the alternative, multiplying each loss
share by ``cp_size`` under stock DDP, gives the same gradients). :func:`all_reduce_gradients` is
the same rule for a training loop without DDP.

Causal LM labels: shift on the **global** sequence before sharding (:func:`shift_labels`), so the
label of a shard's last token is the first token of the next shard, which this rank does not hold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .placement.sizes import check_seq_lens, offsets
from .attention import collective_checks
from .comm import all_reduce, exchange_ints
from .state import ParallelState, require_state
from .tiled import TiledTokenwise, linear_cross_entropy_sum

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "shift_labels",
    "sharded_cross_entropy",
    "linear_cross_entropy",
    "TiledTokenwise",
    "sharded_mean",
    "global_loss",
    "wrap_ddp",
    "all_reduce_gradients",
    "fully_shard_cp",
]



def _checks_parent(state: ParallelState, device: torch.device) -> bool:
    """Whether a collective over the whole parent group (CP x DP) checks agreement first:
    ``state.checks`` as for attention calls (Note [Global length]), also with ``cp_size == 1``
    (data parallelism alone), where ``collective_checks`` has no CP group to check."""
    if state.parent_group is None or state.cp_size * state.dp_size == 1:
        return False
    return state.checks == "always" or (state.checks == "auto" and device.type == "cpu")


def _global_count(count: Tensor, state: ParallelState) -> Tensor:
    """Sum a count over the CP group (no gradient), clamped to at least 1."""
    count = count.detach()
    if state.cp_size > 1:
        count = all_reduce(count, state.cp_group)
    return count.clamp_min(1)


def shift_labels(
    labels: Tensor, *, ignore_index: int = -100, seq_lens: Sequence[int] | None = None
) -> Tensor:
    """Next-token labels of a **global** (unsharded) sequence: ``out[..., i] = labels[..., i + 1]``.

    Shift before sharding: the label of a shard's last token lives on another rank.

    Args:
        labels: ``(..., S)`` token ids (usually ``input_ids``), sequence along the last dim.
        ignore_index: label given to the last token (of each packed sequence).
        seq_lens: lengths of packed sequences along the last dim; the last token of every
            sequence gets ``ignore_index`` (no prediction across a document boundary).

    Returns:
        ``(..., S)`` int64 labels.

    Raises:
        ValueError: if ``labels`` has no dims, or ``seq_lens`` does not sum to ``S``.
    """
    if labels.dim() == 0:
        raise ValueError("shift_labels: labels must have a sequence dim, got a scalar")
    out = torch.full_like(labels, ignore_index, dtype=torch.long)
    out[..., :-1] = labels[..., 1:]
    if seq_lens is not None:
        lens = list(check_seq_lens(seq_lens))
        if sum(lens) != labels.shape[-1]:
            raise ValueError(
                f"shift_labels: seq_lens sum to {sum(lens)} but labels have {labels.shape[-1]} tokens"
            )
        ends = [e - 1 for s, e in zip(offsets(lens), offsets(lens)[1:]) if e > s]
        out[..., ends] = ignore_index
    return out


def sharded_cross_entropy(
    logits: Tensor, labels: Tensor, state: ParallelState, *, ignore_index: int = -100
) -> Tensor:
    """This rank's share of the global token-mean cross-entropy (Note [Loss shares and gradient sync]).

    Args:
        logits: ``(..., S_local, V)``, the model's output on this rank's shard (any float dtype;
            computed in at least float32).
        labels: ``(..., S_local)`` int64, the shard of the *globally shifted* labels
            (``seqpar.shard(shift_labels(input_ids), state)``); ``ignore_index`` marks no target.
        state: the parallel state (one collective over ``cp_group``: an all-reduce of the
            valid-token count, or, where ``seqpar.attention`` checks collectively (CPU, or
            ``checks="always"``), an all-gather of counts and per-rank verdicts so that bad labels
            on one rank raise on every rank).
        ignore_index: label value excluded from the loss and the count (any int, also one >= V).

    Returns:
        Scalar ``L_c = sum(local token losses) / global valid-token count``; ``sum_c L_c`` is the
        mean loss over the whole sequence. Backpropagate it on every rank. If no token is valid
        the count is taken as 1 (loss 0, zero gradients) instead of dividing by zero.

    Raises:
        ValueError: mismatched shapes, non-integer labels, labels outside ``[0, V)`` that are not
            ``ignore_index``, a non-int ``ignore_index``, or a bad ``state``; CP ranks that
            disagree on ``V`` or ``ignore_index``. Raised on every CP rank, naming the rank and
            the bad label, where the call checks collectively (on an accelerator with the default
            ``checks="auto"`` only on the rank that has it).
    """
    require_state(state, "sharded_cross_entropy")
    error = None
    if logits.dim() < 1 or logits.shape[:-1] != labels.shape:
        error = ValueError(
            f"sharded_cross_entropy: logits {tuple(logits.shape)} must be labels {tuple(labels.shape)} "
            "plus a trailing vocab dim"
        )
    elif labels.dtype.is_floating_point or labels.dtype == torch.bool:
        error = ValueError(f"sharded_cross_entropy: labels must be integer class ids, got {labels.dtype}")
    elif isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        error = ValueError(f"sharded_cross_entropy: ignore_index must be an int (e.g. -100), got {ignore_index!r}")

    def local_sum(target: Tensor) -> Tensor:
        return F.cross_entropy(_float_logits(logits), target, ignore_index=ignore_index, reduction="sum")

    vocab = logits.shape[-1] if logits.dim() else 0
    return _loss_share(local_sum, labels, error, state, logits.device, ignore_index, vocab, "sharded_cross_entropy")


def linear_cross_entropy(
    hidden: Tensor, weight: Tensor, labels: Tensor, state: ParallelState, *, chunk_size: int | None = None,
    ignore_index: int = -100,
) -> Tensor:
    """:func:`sharded_cross_entropy` of ``hidden @ weight.T`` without the ``[T, V]`` logits: the
    lm-head projection fused with the loss and tiled over tokens, recomputed in backward (Note
    [Tiled token-wise work] in ``seqpar/tiled.py``). The same loss share, to rounding.

    Args:
        hidden: ``(..., S_local, hidden_size)``, the final hidden states of this rank's shard.
        weight: ``(V, hidden_size)``, the lm-head weight (replicated: its gradient is partial,
            summed over CP by the gradient rule like every parameter's).
        labels: ``(..., S_local)``, the shard of the globally shifted labels.
        state: the parallel state (the valid-token count is one collective, as in
            :func:`sharded_cross_entropy`).
        chunk_size: tokens per chunk; ``None`` keeps one chunk's fp32 logits near 64 MiB.
        ignore_index: label value excluded from the loss and the count (any int, also one >= V).

    Returns:
        Scalar ``L_c = sum(local token losses) / global valid-token count`` (float32; float64 for
        float64 inputs). Peak extra memory ``chunk_size x V`` floats instead of ``T x V``.

    Raises:
        ValueError: shapes or dtypes that do not match, non-integer labels or labels outside
            ``[0, V)`` that are not ``ignore_index``, a bad ``chunk_size``, ``ignore_index`` or
            ``state`` (raised on every CP rank where the call checks collectively, as in
            :func:`sharded_cross_entropy`).
    """
    require_state(state, "linear_cross_entropy")
    where = "linear_cross_entropy"
    # Every check that can fail on one rank runs before the collective (linear_cross_entropy_sum
    # repeats some of them after it, where they can no longer fail).
    error = None
    if not isinstance(hidden, Tensor) or not isinstance(labels, Tensor) or hidden.shape[:-1] != labels.shape:
        error = ValueError(
            f"{where}: hidden {tuple(getattr(hidden, 'shape', ()))} must be labels "
            f"{tuple(getattr(labels, 'shape', ()))} plus a trailing hidden_size dim"
        )
    elif labels.dtype.is_floating_point or labels.dtype == torch.bool:
        error = ValueError(f"{where}: labels must be integer class ids, got {labels.dtype}")
    elif not isinstance(weight, Tensor) or weight.dim() != 2 or hidden.dim() < 1 or weight.shape[1] != hidden.shape[-1]:
        error = ValueError(
            f"{where}: weight {tuple(getattr(weight, 'shape', ()))} must be (vocab_size, hidden_size) with "
            f"hidden's hidden_size {hidden.shape[-1] if hidden.dim() else '?'}"
        )
    elif not hidden.dtype.is_floating_point or weight.dtype != hidden.dtype:
        error = ValueError(f"{where}: hidden ({hidden.dtype}) and weight ({weight.dtype}) must share one float dtype")
    elif chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        error = ValueError(f"{where}: chunk_size must be a positive int or None, got {chunk_size!r}")
    elif isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        error = ValueError(f"{where}: ignore_index must be an int (e.g. -100), got {ignore_index!r}")

    def local_sum(target: Tensor) -> Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        return linear_cross_entropy_sum(flat, weight, target, chunk_size=chunk_size, ignore_index=ignore_index)

    device = hidden.device if isinstance(hidden, Tensor) else torch.device("cpu")
    vocab = weight.shape[0] if error is None else 0
    return _loss_share(local_sum, labels, error, state, device, ignore_index, vocab, where)


_REFUSED, _BAD_LABEL = 1, 2  # verdicts of a rank in the loss's exchange (0: fine)


def _label_verdict(target: Tensor, vocab_size: int, ignore_index: int) -> tuple[int, int | None]:
    """``(valid-token count, first label outside [0, V) that is not ignore_index, or None)``;
    one host synchronisation when the labels are valid."""
    valid = target != ignore_index
    bad = valid & ((target < 0) | (target >= vocab_size))
    count, n_bad = torch.stack([valid.sum(), bad.sum()]).tolist()
    return count, (int(target[bad][0]) if n_bad else None)


def _bad_label_error(where: str, rank: int | None, label: int, vocab_size: int, ignore_index: int) -> ValueError:
    at = "" if rank is None else f"cp rank {rank} has "
    return ValueError(
        f"{where}: {at}label {label}, outside [0, {vocab_size}) and not ignore_index={ignore_index}; labels are "
        f"class ids below the vocab size {vocab_size} or ignore_index"
        + ("" if rank is None else " (raised on every CP rank)")
    )


def _loss_share(
    local_sum: Callable[[Tensor], Tensor], labels: Tensor, error: Exception | None, state: ParallelState,
    device: torch.device, ignore_index: int, vocab_size: int, where: str,
) -> Tensor:
    """``local_sum(target) / global valid-token count``. A local ``error`` (found before any
    collective), labels outside ``[0, vocab_size)`` that are not ``ignore_index``, and ranks with
    other vocab sizes or ``ignore_index`` raise on every CP rank where calls check collectively:
    the count's all-reduce becomes one all-gather of ``[count, verdict, bad label, V,
    ignore_index]`` per rank, so every rank reads the same rows and raises the same error."""
    if state.cp_size > 1 and collective_checks(state, device, lengths_known=True):
        target, count, verdict, label = None, 0, _REFUSED, 0
        if not error:
            target = labels.reshape(-1).long()
            count, bad = _label_verdict(target, vocab_size, ignore_index)
            verdict, label = (0, 0) if bad is None else (_BAD_LABEL, bad)
        shared = [vocab_size, ignore_index] if not error else [-1, -1]
        rows = exchange_ints([count, verdict, label, *shared], state.cp_group, device)
        if error:
            raise error
        refused = [c for c, row in enumerate(rows) if row[1] == _REFUSED]
        if refused:
            raise ValueError(
                f"{where}: cp rank {refused[0]} refused its inputs/labels (its own error says why); every rank "
                "raises so that none waits for it"
            )
        other = next((c for c, row in enumerate(rows) if row[3:] != rows[0][3:]), None)
        if other is not None:
            raise ValueError(
                f"{where}: the CP ranks disagree on (vocab size, ignore_index): {tuple(rows[0][3:])} on cp rank 0, "
                f"{tuple(rows[other][3:])} on cp rank {other}; pass the same lm head / logits width and "
                "ignore_index on every rank (raised on every CP rank)"
            )
        bad = next((c for c, row in enumerate(rows) if row[1] == _BAD_LABEL), None)
        if bad is not None:
            raise _bad_label_error(where, bad, rows[bad][2], vocab_size, ignore_index)
        return local_sum(target) / max(1, sum(row[0] for row in rows))
    if error:
        raise error
    target = labels.reshape(-1).long()
    if device.type == "cpu":  # a ValueError instead of the kernel's IndexError; no synchronisation cost here
        bad = _label_verdict(target, vocab_size, ignore_index)[1]
        if bad is not None:
            raise _bad_label_error(where, None, bad, vocab_size, ignore_index)
    total = local_sum(target)
    count = _global_count((target != ignore_index).sum(), state)
    return total / count.to(total.dtype)


def _float_logits(logits: Tensor) -> Tensor:
    """``(N, V)`` logits, half precision computed in float32."""
    flat = logits.reshape(-1, logits.shape[-1])
    return flat.float() if flat.dtype in (torch.float16, torch.bfloat16) else flat


def sharded_mean(values: Tensor, state: ParallelState) -> Tensor:
    """This rank's share of the mean of ``values`` over every CP rank's elements.

    Args:
        values: per-element losses of this rank's shard, any shape (e.g. ``(B, S_local, C)``
            squared errors); shards may differ in size.
        state: the parallel state (one all-reduce of the element count over ``cp_group``).

    Returns:
        Scalar ``values.sum() / (total number of elements over the CP group)``; the shares sum to
        the global mean.

    Raises:
        ValueError: a bad ``state``.
    """
    require_state(state, "sharded_mean")
    count = _global_count(torch.tensor(values.numel(), device=values.device), state)
    return values.sum() / count.to(values.dtype)


def global_loss(share: Tensor, state: ParallelState) -> Tensor:
    """The loss of the step: shares summed over CP, averaged over DP (detached, same on every rank).

    A **collective** over ``state.cp_group`` and ``state.dp_group`` (one all-reduce each): every
    rank of the parent group must call it, in the same order as its other collectives. To print
    it on one rank, call it on all and print on one::

        loss = global_loss(share, state)        # every rank
        if dist.get_rank() == 0:
            print(loss.item())

    Called under ``if rank == 0:`` it waits for the other ranks until the process group's timeout
    (gloo: "Connection closed by peer" once they exit).

    Args:
        share: this rank's scalar loss share (e.g. from :func:`sharded_cross_entropy`).
        state: the parallel state.

    Returns:
        Detached scalar tensor.

    Raises:
        ValueError: a bad ``state``; a ``share`` that is not a tensor, or ranks whose shares differ
            in element count or dtype (their all-reduces would not pair up: a gloo abort), raised
            on every rank where calls check collectively (on the CPU or with ``checks="always"``;
            one more small all-gather over the parent group).
    """
    require_state(state, "global_loss")
    error = None
    if not isinstance(share, Tensor):
        error = ValueError(f"global_loss: share must be this rank's loss share as a tensor, got {type(share).__name__}")
    device = share.device if error is None else torch.device("cpu")
    if _checks_parent(state, device):
        mine = [-1, -1] if error else [share.numel(), _DTYPE_CODES.get(share.dtype, 0)]
        rows = exchange_ints([int(error is not None), *mine], state.parent_group, device)
        if error:
            raise error
        refused = [r for r, row in enumerate(rows) if row[0]]
        if refused:
            raise ValueError(
                f"global_loss: rank {refused[0]} of the parent group refused its share (its own error says why); "
                "every rank raises so that none waits for it"
            )
        other = next((r for r, row in enumerate(rows) if row[1:] != rows[0][1:]), None)
        if other is not None:
            names = {c: str(d).removeprefix("torch.") for d, c in _DTYPE_CODES.items()}
            shown = [f"{row[1]} element(s) of {names.get(row[2], 'another dtype')}" for row in (rows[0], rows[other])]
            raise ValueError(
                f"global_loss: the ranks' shares differ: rank 0 of the parent group has {shown[0]}, rank {other} has "
                f"{shown[1]}; pass every rank's scalar loss share, of one dtype (raised on every rank)"
            )
    elif error:
        raise error
    value = share.detach().clone()
    if state.cp_size > 1:
        value = all_reduce(value, state.cp_group)
    if state.dp_size > 1:
        value = all_reduce(value, state.dp_group) / state.dp_size
    return value


def _cp_sum_dp_mean_hook(hook_state, bucket):  # no annotations: DDP checks them as objects
    """DDP communication hook: all-reduce (sum) a gradient bucket and divide by ``dp_size``.

    ``hook_state`` is ``(process group, dp_size)``, ``bucket`` a ``dist.GradBucket``; returns a
    ``torch.futures.Future`` of the reduced buffer, as DDP requires.
    """
    group, dp_size = hook_state
    buffer = bucket.buffer()
    if dp_size > 1:
        buffer.div_(dp_size)
    work = dist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def wrap_ddp(model: nn.Module, state: ParallelState, **ddp_kwargs) -> nn.Module:
    """Wrap ``model`` in DDP over all ``dp_size * cp_size`` ranks with seqpar's gradient rule.

    Gradients after ``backward`` are summed over the CP group and averaged over data-parallel
    replicas (Note [Loss shares and gradient sync]), i.e. equal to the single-device gradient of
    the mean loss over the DP replicas, when every rank backpropagates its loss share. DDP
    broadcasts the parameters from the first rank at construction, so all ranks start identical.

    Args:
        model: the module (on this rank's device).
        state: the parallel state; DDP runs over ``state.parent_group``.
        ddp_kwargs: passed to ``torch.nn.parallel.DistributedDataParallel`` (``process_group``
            is set here).

    Returns:
        The ``DistributedDataParallel`` module, or ``model`` itself when ``torch.distributed`` is
        not initialised (a size-1 state).

    Raises:
        ValueError: a bad ``state`` or a ``process_group`` in ``ddp_kwargs``.
    """
    require_state(state, "wrap_ddp")
    if "process_group" in ddp_kwargs:
        raise ValueError("wrap_ddp: process_group is taken from state.parent_group; do not pass it")
    if state.parent_group is None:
        return model
    ddp = nn.parallel.DistributedDataParallel(model, process_group=state.parent_group, **ddp_kwargs)
    ddp.register_comm_hook((state.parent_group, state.dp_size), _cp_sum_dp_mean_hook)
    return ddp


@torch.no_grad()
def all_reduce_gradients(parameters: Iterable[nn.Parameter], state: ParallelState) -> None:
    """In place: every ``p.grad`` becomes its sum over CP and mean over DP (no DDP needed).

    Call after ``backward`` and before the optimizer step, on every rank of the parent group with
    the same parameters (a collective). Every parameter that requires grad takes part, whether or
    not this rank has a gradient for it: a missing gradient counts as zeros (a rank whose tokens
    did not reach a parameter, e.g. sinks of heads it does not hold), so every rank reduces
    the same buffers and ends with the same ``p.grad``. A parameter without a gradient on *every*
    rank keeps ``p.grad = None``, as on one device.

    Raises:
        ValueError: a bad ``state``; ranks passing different parameters (counts, sizes or dtypes;
            checked with one small collective where ``seqpar.attention`` checks collectively,
            i.e. on the CPU or with ``checks="always"``).
    """
    require_state(state, "all_reduce_gradients")
    if state.parent_group is None:
        return
    groups: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for p in parameters:
        if p.requires_grad:
            groups.setdefault((p.dtype, p.device), []).append(p)
    _check_same_parameters(groups, state)
    for params in groups.values():  # one flat all-reduce per dtype/device
        _reduce_group(params, state)


def _reduce_group(params: list[nn.Parameter], state: ParallelState) -> None:
    """All-reduce the gradients of ``params`` (one dtype and device) as one flat buffer.

    The buffer is every gradient (zeros where ``p.grad is None``) followed by one flag per
    parameter (1 where this rank has a gradient), so the same buffer size on every rank and,
    after the sum, whether any rank had a gradient.
    """
    flags = torch.tensor([float(p.grad is not None) for p in params], dtype=params[0].dtype, device=params[0].device)
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
    flat = all_reduce(torch.cat([*grads, flags]), state.parent_group)
    body, flags = flat[: flat.numel() - len(params)], flat[flat.numel() - len(params):]
    if state.dp_size > 1:
        body /= state.dp_size
    offset = 0
    for p, had in zip(params, flags.tolist()):
        part = body[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
        if p.grad is not None:
            p.grad.copy_(part)
        elif had > 0:
            p.grad = part.clone()


def _check_same_parameters(groups: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]], state: ParallelState) -> None:
    """Raise ``ValueError`` on every rank if the ranks' parameters (count, elements, dtype/shape
    fingerprint) differ, instead of all-reducing buffers of different sizes (a gloo abort)."""
    params = [p for ps in groups.values() for p in ps]
    device = params[0].device if params else torch.device("cpu")
    if not _checks_parent(state, device):
        return
    shapes = [d for p in params for d in (_DTYPE_CODES.get(p.dtype, 0), p.dim(), *p.shape)]
    fingerprint = sum((i + 1) * 2654435761 * v for i, v in enumerate(shapes)) % (1 << 61)
    mine = [len(params), sum(p.numel() for p in params), fingerprint]
    rows = exchange_ints(mine, state.parent_group, device)
    bad = [r for r, row in enumerate(rows) if row != rows[0]]
    if bad:
        raise ValueError(
            f"all_reduce_gradients: the ranks pass different parameters: rank 0 of the parent group has "
            f"{rows[0][0]} parameters requiring grad with {rows[0][1]} elements, rank {bad[0]} has "
            f"{rows[bad[0]][0]} with {rows[bad[0]][1]} (or other shapes or dtypes); pass the same "
            "model's parameters on every rank"
        )


_DTYPE_CODES = {torch.float64: 1, torch.float32: 2, torch.bfloat16: 3, torch.float16: 4}


def _mesh_device_type(model: nn.Module) -> str:
    """Device type of ``model``'s first parameter (``"cpu"`` without parameters)."""
    for p in model.parameters():
        if p.device.type == "meta":
            raise ValueError(
                "fully_shard_cp: the model is on the meta device; pass device_type= (e.g. 'cuda') or mesh="
            )
        return p.device.type
    return "cpu"


def fully_shard_cp(
    model: nn.Module,
    state: ParallelState,
    *,
    blocks: Iterable[nn.Module] | None = None,
    mesh: DeviceMesh | None = None,
    device_type: str | None = None,
    **fsdp_kwargs,
) -> nn.Module:
    """Apply FSDP2 (``torch.distributed.fsdp.fully_shard``) over all ``dp_size * cp_size`` ranks
    with seqpar's gradient rule: sum over CP, mean over DP (Note [Loss shares and gradient sync]).

    Parameters are sharded over the state's parent group, so every CP rank holds ``1 / (dp_size *
    cp_size)`` of them. FSDP2 reduces gradients over its whole mesh and by default divides by the
    mesh size, which would be ``cp_size`` times too small; here every FSDP module gets
    ``set_gradient_divide_factor(dp_size)`` and ``set_force_sum_reduction_for_comms(True)``: a
    sum reduce-scatter (plus, with a 2-D HSDP mesh, a sum all-reduce) and one division of the
    reduced shard by ``dp_size``. Plain sums are what every backend supports: gloo rejects the
    ``PREMUL_SUM`` reduction FSDP2 would otherwise use for a custom factor. After ``backward``
    of every rank's loss share (:func:`sharded_cross_entropy`, :func:`sharded_mean`) the
    sharded gradients are those of the single-device model on the global batch (the mean over
    DP replicas). Parameters are not broadcast: build the model identically on every rank.

    Args:
        model: the module (on its device, or on the meta device with ``device_type`` given).
        state: the parallel state whose parent group (all ``dp_size * cp_size`` ranks) shards.
        blocks: modules to shard one by one before the root (each becomes one all-gather /
            reduce-scatter group), bottom-up. ``None``: the items of every ``nn.ModuleList`` in
            ``model`` (its transformer blocks), innermost lists first.
        mesh: the FSDP mesh. ``None``: a 1-D mesh over the state's parent group
            (``DeviceMesh.from_group``, axis ``"dp_cp"``). A given mesh must be 1-D (FSDP) or 2-D
            (HSDP: replicate over axis 0, shard over axis 1, e.g. ``state.device_mesh("cuda")``
            for ``("dp", "cp")``) and hold exactly the parent group's ranks.
        device_type: the default mesh's device type; ``None``: that of the model's parameters.
        fsdp_kwargs: passed to every ``fully_shard`` call (``reshard_after_forward``,
            ``mp_policy``, ...).

    Returns:
        ``model``, now an ``FSDPModule`` (parameters are ``DTensor`` shards; optimizers built
        afterwards), or ``model`` unchanged for a state without process groups.

    Raises:
        ValueError: a bad ``state``, ``mesh`` and ``device_type`` both given, a mesh of the
            wrong shape or ranks, or a meta-device model without ``device_type``.
    """
    require_state(state, "fully_shard_cp")
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if state.parent_group is None:
        return model
    ranks = dist.get_process_group_ranks(state.parent_group)
    if mesh is None:
        device_type = device_type if device_type is not None else _mesh_device_type(model)
        mesh = DeviceMesh.from_group(state.parent_group, device_type, mesh_dim_names=("dp_cp",))
    elif device_type is not None:
        raise ValueError("fully_shard_cp: pass mesh= or device_type=, not both (the mesh has its device type)")
    elif not isinstance(mesh, DeviceMesh) or mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard_cp: mesh must be a 1-D (FSDP) or 2-D (HSDP) DeviceMesh, got "
            f"{getattr(mesh, 'ndim', type(mesh).__name__)}{'-D' if isinstance(mesh, DeviceMesh) else ''}"
        )
    elif sorted(mesh.mesh.reshape(-1).tolist()) != sorted(ranks):
        raise ValueError(
            f"fully_shard_cp: the mesh holds ranks {sorted(mesh.mesh.reshape(-1).tolist())} but the "
            f"state's dp x cp ranks are {sorted(ranks)} (dp_size={state.dp_size}, cp_size={state.cp_size}); "
            "the gradient rule divides by dp_size only when the mesh spans exactly those ranks: use "
            "mesh=None or state.device_mesh(device_type)"
        )
    if blocks is None:  # pre-order lists the outer blocks first; shard bottom-up
        blocks = [b for m in model.modules() if isinstance(m, nn.ModuleList) for b in m][::-1]
    for block in blocks:
        fully_shard(block, mesh=mesh, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(state.dp_size))
            module.set_force_sum_reduction_for_comms(True)
            _reduce_unused_parameters(module)
    return model


def _reduce_unused_parameters(module: nn.Module) -> None:
    """Make FSDP reduce-scatter zeros for parameters without a gradient on this rank.

    FSDP2 reduce-scatters only the parameters that have a gradient; a parameter that one CP rank's
    tokens did not reach (sinks of heads that rank does not hold) would make the ranks reduce
    buffers of different sizes (a gloo abort, an NCCL hang). A torch whose FSDP2 lacks
    ``set_reduce_scatter_unused_params`` keeps that behaviour.
    """
    setter = getattr(module, "set_reduce_scatter_unused_params", None)
    if setter is not None:
        setter(True, recurse=False)
