"""Training frameworks (Hugging Face ``Trainer``, accelerate, Lightning, DeepSpeed) with seqpar.

Each framework runs seqpar's context parallelism exactly once three things are right, and each of
them fails silently when it is not (Note [Three traps of framework training loops]). The helpers
here do them:

- :func:`dp_sampler`: a ``DistributedSampler`` over the **data-parallel** ranks only, so every CP
  rank of a group reads the same samples;
- :func:`causal_lm_loss_share`: shards a batch of whole sequences, shifts the labels on the global
  sequence and returns this rank's loss share ``L_c`` (``sum_c L_c = L``);
- :func:`loss_scale`: the factor (``cp_size``) a loss share must be multiplied by where the
  framework's DDP divides the summed gradients by the world size;
- :class:`SeqparTrainer` (``transformers.Trainer`` with all three, built on first access so that
  transformers is imported only then; also :func:`seqpar_trainer_class`).

No optional framework is imported at module level. ``docs/howto-trainers.md`` has the recipes.

Note [Three traps of framework training loops]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
1. *The sampler.* Frameworks split the dataset over **all** ranks (``DistributedSampler`` with
   ``num_replicas=world_size``, accelerate's ``BatchSamplerShard``, Lightning's automatic sampler).
   Under context parallelism the ``cp_size`` ranks of a group must hold shards of the **same**
   sequences; only DP replicas read different samples. Split over ``dp_size`` with ``dp_rank``.
2. *The labels.* A model that shifts its labels internally (``labels=`` in transformers) shifts
   them within the shard: the last token of every shard loses its target and the others are fine,
   so the loss looks plausible. Shift on the global sequence (``seqpar.training.shift_labels``),
   then shard, and return a loss share (``sharded_cross_entropy``: local sum / global count).
3. *The gradient average.* seqpar's gradient rule is the sum over CP and the mean over DP (Note
   [Loss shares and gradient sync] in ``seqpar/training.py``). Stock DDP -- and so HF ``Trainer``,
   accelerate, Lightning's ``DDPStrategy`` and DeepSpeed's engine, which all all-reduce over every
   rank and divide by the world size ``dp_size * cp_size`` -- gives gradients ``cp_size`` times
   too small. Multiply the loss share by ``cp_size`` (:func:`loss_scale`). Adam's (and AdamW's)
   update is nearly invariant to a constant gradient scale, and clipping hides it while the norm
   exceeds the threshold, so the run looks normal; SGD, the logged gradient norm and unclipped
   steps are not (tests/test_trainers.py trains with SGD for that reason). DeepSpeed also clips at
   norm 1.0 by default (``gradient_clipping``), which a single-device reference must match.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .sharding import shard, shard_positions
from .state import ParallelState, require_state
from .training import sharded_cross_entropy, shift_labels

# SeqparTrainer is served by the module's __getattr__ (it imports transformers), so it is not in
# __all__: `from seqpar.trainers import *` imports no framework.
__all__ = [
    "causal_lm_loss_share",
    "dp_sampler",
    "loss_scale",
    "seqpar_trainer_class",
]

_AVERAGES = ("all", "dp", "none")


def dp_sampler(
    dataset: Any, state: ParallelState, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False
) -> torch.utils.data.DistributedSampler:
    """A ``DistributedSampler`` that splits ``dataset`` over the data-parallel ranks only.

    Every CP rank of a group gets the same indices (its sequences are then sharded by the model
    code), and DP replica ``d`` gets the ``d``-th part. Call ``set_epoch(epoch)`` on it every epoch
    when shuffling, as for any ``DistributedSampler``.

    Args:
        dataset: a map-style dataset (``len(dataset)`` samples).
        state: the parallel state (``dp_size`` replicas, this rank's ``dp_rank``).
        shuffle: shuffle the indices (the same permutation on every rank, seeded by ``seed`` and
            the epoch).
        seed: the shuffling seed; the same on every rank.
        drop_last: drop the tail that does not divide ``dp_size`` instead of repeating samples.

    Returns:
        ``torch.utils.data.DistributedSampler(dataset, num_replicas=state.dp_size,
        rank=state.dp_rank, ...)``.

    Raises:
        ValueError: a bad ``state``, or a dataset without ``len``.
    """
    require_state(state, "dp_sampler")
    try:
        n = len(dataset)
    except TypeError:
        raise ValueError(
            f"dp_sampler: the dataset ({type(dataset).__name__}) has no len(); an iterable dataset must "
            f"yield the same samples on every CP rank and split over dp_rank {state.dp_rank} of "
            f"dp_size {state.dp_size} itself"
        ) from None
    if drop_last and n < state.dp_size:
        raise ValueError(f"dp_sampler: drop_last with {n} samples for dp_size {state.dp_size} leaves none")
    return torch.utils.data.DistributedSampler(
        dataset, num_replicas=state.dp_size, rank=state.dp_rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )


def loss_scale(state: ParallelState, framework_averages_over: str = "all") -> int:
    """The factor to multiply a loss share by, given how the framework reduces gradients.

    Args:
        state: the parallel state.
        framework_averages_over: what the framework divides the summed gradients by:
            ``"all"`` -- all ``dp_size * cp_size`` ranks (stock DDP: HF ``Trainer``, accelerate,
            Lightning's ``DDPStrategy``, DeepSpeed's engine); ``"dp"`` -- the DP replicas only
            (``seqpar.training.wrap_ddp``, ``all_reduce_gradients``, ``fully_shard_cp``);
            ``"none"`` -- a plain sum over all ranks.

    Returns:
        ``cp_size`` for ``"all"``, ``1`` for ``"dp"``; ``1 / dp_size`` is not an int, so
        ``"none"`` raises (divide by ``dp_size`` yourself, or let the framework average).

    Raises:
        ValueError: an unknown ``framework_averages_over``, ``"none"`` with ``dp_size > 1``, or a
            bad ``state``.
    """
    require_state(state, "loss_scale")
    if framework_averages_over not in _AVERAGES:
        raise ValueError(
            f"loss_scale: framework_averages_over must be one of {_AVERAGES}, got {framework_averages_over!r}"
        )
    if framework_averages_over == "all":
        return state.cp_size
    if framework_averages_over == "none" and state.dp_size > 1:
        raise ValueError(
            f"loss_scale: a framework that sums gradients over all ranks needs the loss divided by "
            f"dp_size {state.dp_size}; that is no integer scale"
        )
    return 1


def _share_and_outputs(
    model: torch.nn.Module, batch: Mapping[str, Any], state: ParallelState, ignore_index: int, where: str
) -> tuple[Tensor, Any]:
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        keys = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise ValueError(f"{where}: batch must be a mapping with 'input_ids' (and optionally 'labels'), got {keys}")
    input_ids = batch["input_ids"]
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        raise ValueError(
            f"{where}: input_ids must be a [B, S] tensor of whole sequences, got "
            f"{tuple(getattr(input_ids, 'shape', ())) or type(input_ids).__name__}"
        )
    labels = batch.get("labels")
    labels = input_ids if labels is None else labels
    if not isinstance(labels, Tensor) or labels.shape != input_ids.shape:
        raise ValueError(
            f"{where}: labels {tuple(getattr(labels, 'shape', ()))} must have input_ids' shape "
            f"{tuple(input_ids.shape)} (unshifted, as transformers takes them)"
        )
    mask = batch.get("attention_mask")
    if mask is not None and not bool(mask.bool().all()):
        raise ValueError(
            f"{where}: attention_mask has {int((~mask.bool()).sum())} padded positions of {mask.numel()}; "
            "seqpar's transformers integration refuses padding: pack the sequences without padding"
        )
    extra = sorted(set(batch) - {"input_ids", "labels", "attention_mask"})
    if extra:
        raise ValueError(f"{where}: batch keys {extra} are not sharded here; pass input_ids and labels only")
    seq_len = input_ids.shape[1]
    targets = shift_labels(labels, ignore_index=ignore_index)  # on the GLOBAL sequence, then shard
    ids = shard(input_ids, state)
    pos = shard_positions(seq_len, state, device=input_ids.device)[None]
    outputs = model(input_ids=ids, position_ids=pos, use_cache=False)
    logits = outputs.logits if hasattr(outputs, "logits") else outputs[0]
    share = sharded_cross_entropy(logits, shard(targets, state), state, ignore_index=ignore_index)
    return share, outputs


def causal_lm_loss_share(
    model: torch.nn.Module, batch: Mapping[str, Tensor], state: ParallelState, *, ignore_index: int = -100
) -> Tensor:
    """This rank's share of a causal LM's token-mean cross-entropy on a batch of whole sequences.

    The labels are shifted on the global sequence (``seqpar.training.shift_labels``), ids, labels
    and positions are sharded (``seqpar.shard``, ``seqpar.shard_positions``) and the model runs
    on the shard with ``position_ids`` and ``use_cache=False`` (a transformers causal LM whose
    attention is registered with ``seqpar.integrations.transformers.register(state)``, possibly
    wrapped in DDP).

    Args:
        model: called as ``model(input_ids=[B, S_local], position_ids=[1, S_local],
            use_cache=False)`` and returning ``.logits`` (or a tuple whose first item is the logits)
            ``[B, S_local, V]``.
        batch: ``{"input_ids": [B, S]}`` the **same whole** sequences on every CP rank, optionally
            ``"labels"`` ``[B, S]`` unshifted as transformers takes them (``-100`` is ignored;
            default: ``input_ids``) and an all-ones ``"attention_mask"``.
        state: the parallel state.
        ignore_index: label value excluded from the loss and the token count.

    Returns:
        Scalar share ``L_c`` with ``sum_c L_c`` = the token-mean loss of the batch. Multiply by
        :func:`loss_scale` before ``backward`` where the framework averages over all ranks.

    Raises:
        ValueError: no ``input_ids``, not ``[B, S]``, labels of another shape, padding in
            ``attention_mask``, other batch keys, or a bad ``state``.
    """
    require_state(state, "causal_lm_loss_share")
    return _share_and_outputs(model, batch, state, ignore_index, "causal_lm_loss_share")[0]


_TRAINER_CLASS: type | None = None


def seqpar_trainer_class() -> type:
    """The ``transformers.Trainer`` subclass :class:`SeqparTrainer` (imports transformers).

    ``SeqparTrainer(model, args, *, state, shuffle=True, **trainer_kwargs)``:

    - the training batches come from :func:`dp_sampler` (same samples on every CP rank, split over
      DP) with ``args.per_device_train_batch_size`` sequences per DP replica; the data loader is
      not passed through accelerate's ``prepare`` (which would split it over all ranks again);
    - ``compute_loss`` returns :func:`causal_lm_loss_share` times :func:`loss_scale` (``cp_size``:
      the Trainer's DDP averages over all ranks), so the gradients are the single-device ones and
      the logged loss (the Trainer's mean over ranks) is the global loss;
    - gradient accumulation divides each micro-batch's token mean by the number of steps, as the
      Trainer does for a model without loss kwargs (the single-device reference must do the same).

    Evaluation loops are not adapted (their loader would again be split over all ranks): evaluate
    with :func:`causal_lm_loss_share` and ``seqpar.training.global_loss`` in your own loop.

    Raises:
        ImportError: transformers is not installed (``pip install seqpar[hf]``).
    """
    global _TRAINER_CLASS
    if _TRAINER_CLASS is not None:
        return _TRAINER_CLASS
    from transformers import Trainer

    class SeqparTrainer(Trainer):
        """``transformers.Trainer`` for a model registered with seqpar: see
        :func:`seqpar.trainers.seqpar_trainer_class`."""

        def __init__(self, *args: Any, state: ParallelState, shuffle: bool = True, **kwargs: Any) -> None:
            require_state(state, "SeqparTrainer")
            super().__init__(*args, **kwargs)
            world = self.args.world_size
            if world != state.dp_size * state.cp_size:
                raise ValueError(
                    f"SeqparTrainer: the Trainer runs on {world} process(es) but the state has dp_size "
                    f"{state.dp_size} x cp_size {state.cp_size} = {state.dp_size * state.cp_size} ranks"
                )
            self.seqpar_state = state
            self.seqpar_shuffle = shuffle
            # The share is a token mean over this batch: no num_items_in_batch, and the Trainer
            # divides it by the gradient-accumulation steps itself.
            self.model_accepts_loss_kwargs = False
            self.loss_is_scaled_for_ga = False

        def get_train_dataloader(self) -> torch.utils.data.DataLoader:
            if self.train_dataset is None:
                raise ValueError("SeqparTrainer: training requires a train_dataset.")
            dataset, collator = self.train_dataset, self.data_collator
            try:
                import datasets

                is_hf_dataset = isinstance(dataset, datasets.Dataset)
            except ImportError:
                is_hf_dataset = False
            if is_hf_dataset:
                dataset = self._remove_unused_columns(dataset, description="training")
            else:
                collator = self._get_collator_with_removed_columns(collator, description="training")
            sampler = dp_sampler(
                dataset, self.seqpar_state, shuffle=self.seqpar_shuffle, seed=self.args.seed,
                drop_last=self.args.dataloader_drop_last,
            )
            return _EpochLoader(
                dataset, batch_size=self._train_batch_size, sampler=sampler, collate_fn=collator,
                drop_last=self.args.dataloader_drop_last, num_workers=self.args.dataloader_num_workers,
                pin_memory=self.args.dataloader_pin_memory,
            )

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            state = self.seqpar_state
            share, outputs = _share_and_outputs(model, inputs, state, -100, "SeqparTrainer.compute_loss")
            loss = share * loss_scale(state, "all")
            return (loss, outputs) if return_outputs else loss

    _TRAINER_CLASS = SeqparTrainer
    return SeqparTrainer


class _EpochLoader(torch.utils.data.DataLoader):
    """A ``DataLoader`` whose ``set_epoch`` reaches its ``DistributedSampler`` (the Trainer calls it)."""

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


def __getattr__(name: str) -> Any:
    if name == "SeqparTrainer":  # built on first access: imports transformers
        return seqpar_trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
