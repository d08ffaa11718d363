"""Training frameworks (Hugging Face ``Trainer``, accelerate, Lightning, DeepSpeed) with seqpar.

Each framework runs seqpar's context parallelism exactly once three things are right (four with
masked labels under data parallelism or gradient accumulation), and each of them fails silently when
it is not (Note [Three traps of framework training loops], Note [The token count of a step]). The
helpers here do them:

- :func:`dp_sampler`: a ``DistributedSampler`` over the **data-parallel** ranks only, so every CP
  rank of a group reads the same samples;
- :func:`causal_lm_loss_share`: shards a batch of whole sequences, shifts the labels on the global
  sequence and returns this rank's loss share ``L_c`` (``sum_c L_c = L``);
- :func:`loss_scale`: the factor (``cp_size``) a loss share must be multiplied by where the
  framework's DDP divides the summed gradients by the world size;
- :func:`num_items_in_batch`: the valid-target count of one optimizer step's batches over every DP
  replica, for a share normalised as the single-device loss is (Note [The token count of a step]);
- :class:`SeqparTrainer` (``transformers.Trainer`` with all four, and an ``evaluate()`` that shards
  each sequence over its CP group; built on first access so that transformers is imported only
  then; also :func:`seqpar_trainer_class`).

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

Note [The token count of a step]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
On one device, transformers' ``Trainer`` divides the summed token losses of a whole optimizer step
(every micro-batch of gradient accumulation) by their number of valid targets, ``num_items_in_batch``
(its default for every model whose ``forward`` takes loss kwargs, which is every causal LM of
transformers); the loss of a micro-batch is then *not* divided by the accumulation steps. With
masked labels (``-100``, a different number per sequence: instruction tuning) the token mean of
each DP replica, or of each micro-batch, weighs the tokens differently: averaging those means over
replicas or steps is another loss, with another gradient, and nothing fails.

So a share is normalised by the count of the **step**, summed over the DP replicas (each CP group
counted once): ``L_r = dp_size * (sum of rank r's token losses) / N``. Its sum over CP and mean over
DP (seqpar's gradient rule), summed over the micro-batches, is the single-device loss of the global
batch; :func:`loss_scale` is unchanged. The count is one exchange over the parent group before the
step's first forward (:func:`num_items_in_batch`), which also checks that the CP ranks of a group
hold the same sequences (a hash of ids and labels) and that every replica runs as many micro-batches:
a rank whose data loader splits over all ranks, or a dataset built differently on one rank, makes
every rank raise instead of returning a loss of sequences cut from different samples. A model
without loss kwargs (``Trainer.model_accepts_loss_kwargs`` false) is normalised per micro-batch on
one device and divided by the accumulation steps; :class:`SeqparTrainer` then uses the count of each
micro-batch over the DP replicas.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .comm import all_reduce, exchange_ints
from .sharding import shard, shard_positions
from .state import ParallelState, _group_device, require_state
from .training import sharded_cross_entropy, shift_labels

# SeqparTrainer is served by the module's __getattr__ (it imports transformers), so it is not in
# __all__: `from seqpar.trainers import *` imports no framework.
__all__ = [
    "causal_lm_loss_share",
    "dp_sampler",
    "loss_scale",
    "num_items_in_batch",
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


def _checked_batch(batch: Any, where: str) -> tuple[Tensor, Tensor]:
    """``(input_ids, labels)`` of a batch of whole sequences, or a ``ValueError`` naming what is wrong."""
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
    return input_ids, labels


def _target_count(labels: Tensor, ignore_index: int) -> int:
    """Valid next-token targets of whole sequences: what the global shift leaves (``labels[:, 1:]``)."""
    return int((labels[:, 1:] != ignore_index).sum())


def _share_and_outputs(
    model: torch.nn.Module, batch: Mapping[str, Any], state: ParallelState, ignore_index: int, where: str,
    num_items: int | None = None,
) -> tuple[Tensor, Any]:
    input_ids, labels = _checked_batch(batch, where)
    seq_len = input_ids.shape[1]
    targets = shift_labels(labels, ignore_index=ignore_index)  # on the GLOBAL sequence, then shard
    ids = shard(input_ids, state)
    pos = shard_positions(seq_len, state, device=input_ids.device)[None]
    outputs = model(input_ids=ids, position_ids=pos, use_cache=False)
    logits = outputs.logits if hasattr(outputs, "logits") else outputs[0]
    share = sharded_cross_entropy(logits, shard(targets, state), state, ignore_index=ignore_index)
    if num_items is not None:
        # sharded_cross_entropy divides by this replica's count (at least 1); the step's count over
        # every replica replaces it (Note [The token count of a step]).
        local = max(1, _target_count(labels, ignore_index))
        share = share * (local * state.dp_size / max(1, num_items))
    return share, outputs


def causal_lm_loss_share(
    model: torch.nn.Module, batch: Mapping[str, Tensor], state: ParallelState, *, ignore_index: int = -100,
    num_items_in_batch: int | None = None,
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
        num_items_in_batch: ``None``: normalise by this batch's own valid targets (the token mean of
            this DP replica's batch). An int from :func:`num_items_in_batch` (the optimizer step's
            count over every DP replica and micro-batch): normalise as one device does for the
            global batch (Note [The token count of a step]); needed with ``dp_size > 1`` or
            gradient accumulation whenever labels are masked.

    Returns:
        Scalar share ``L_c``. Without ``num_items_in_batch``, ``sum_c L_c`` = the token-mean loss of
        the batch; with it, the shares summed over CP, averaged over DP and summed over the step's
        micro-batches are the single-device loss of the global batch (do not divide by the
        accumulation steps). Either way multiply by :func:`loss_scale` before ``backward`` where
        the framework averages over all ranks.

    Raises:
        ValueError: no ``input_ids``, not ``[B, S]``, labels of another shape, padding in
            ``attention_mask``, other batch keys, or a bad ``state``.
    """
    require_state(state, "causal_lm_loss_share")
    return _share_and_outputs(model, batch, state, ignore_index, "causal_lm_loss_share", num_items_in_batch)[0]


def _fingerprint(input_ids: Tensor, labels: Tensor) -> int:
    """A 62-bit hash of a batch's ids and labels: the CP ranks of a group must hold the same ones."""
    h = hashlib.blake2b(digest_size=8)
    for t in (input_ids, labels):
        h.update(repr(tuple(t.shape)).encode())
        h.update(t.detach().to("cpu", torch.long).contiguous().numpy().tobytes())
    return int.from_bytes(h.digest(), "little") & ((1 << 62) - 1)


def _step_counts(
    batches: Sequence[Any], state: ParallelState, ignore_index: int, where: str, *, slots: int | None = None,
    same_length: bool = True,
) -> tuple[int, list[int]]:
    """``(N, per_batch)``: the valid targets of this step's batches summed over the DP replicas (each
    CP group once), in total and, with ``slots``, per micro-batch (``slots`` >= the number of
    batches, the same on every rank). One exchange over the parent group; every rank raises the same
    ``ValueError`` when a rank's batch is bad, the CP ranks of a group hold different sequences or
    (``same_length``) the replicas pass different numbers of batches."""
    error: Exception | None = None
    counts: list[int] = []
    digest = 0
    try:
        for batch in batches:
            ids, labels = _checked_batch(batch, where)
            counts.append(_target_count(labels, ignore_index))
            digest = (digest * 1000003 + _fingerprint(ids, labels)) & ((1 << 62) - 1)
    except ValueError as e:
        error = e
    if slots is not None and len(counts) > slots and error is None:
        error = ValueError(f"{where}: {len(counts)} batches in one step, more than the {slots} expected")
    width = 1 if slots is None else slots
    per = [sum(counts)] if slots is None else counts + [0] * (width - len(counts))
    row = [state.dp_rank, int(error is not None), len(batches), digest, *per[:width]]
    if state.parent_group is None or state.dp_size * state.cp_size == 1:
        rows = [row]
    else:
        rows = exchange_ints(row, state.parent_group, _group_device(state.parent_group))
    if error is not None:
        raise error
    bad = [r for r, x in enumerate(rows) if x[1]]
    if bad:
        raise ValueError(f"{where}: rank {bad[0]} refused its batch (its own error says why); every rank raises "
                         "so that none waits for it")
    lengths = sorted({x[2] for x in rows})
    if same_length and len(lengths) > 1:
        raise ValueError(
            f"{where}: the ranks hold {lengths} batches for this step; every DP replica must run as many "
            "micro-batches (a DistributedSampler over the DP ranks pads to equal lengths: dp_sampler)"
        )
    groups: dict[int, list[list[int]]] = {}
    for x in rows:
        groups.setdefault(x[0], []).append(x)
    for dp, members in sorted(groups.items()):
        if any(m[2:] != members[0][2:] for m in members):
            raise ValueError(
                f"{where}: the {len(members)} CP ranks of DP replica {dp} hold different sequences (batch hashes or "
                "counts differ); every CP rank of a group must read the same samples: split the data over the DP "
                "ranks only (seqpar.trainers.dp_sampler), not over all ranks, and build the dataset alike on every rank"
            )
    per_batch = [sum(members[0][4 + i] for members in groups.values()) for i in range(width)]
    return sum(per_batch), per_batch


def num_items_in_batch(
    batches: Mapping[str, Tensor] | Sequence[Mapping[str, Tensor]], state: ParallelState, *, ignore_index: int = -100
) -> int:
    """The valid next-token targets of one optimizer step's batches, over every DP replica.

    What transformers' ``Trainer`` computes as ``num_items_in_batch`` on one device for the global
    batch: the count of labels that are not ``ignore_index`` after the shift (``labels[:, 1:]``), over
    every micro-batch of the step (gradient accumulation) and every DP replica, each CP group counted
    once. Pass it to :func:`causal_lm_loss_share` for every micro-batch of the step (Note [The token
    count of a step]).

    A **collective** over the parent group (one all-gather of a few ints): every rank calls it, with
    this replica's batches for the step, before their forward passes. It also checks that the CP
    ranks of each group hold the same sequences and that every rank passes as many batches.

    Args:
        batches: this DP replica's batches of the step (a list), or one batch; each like
            :func:`causal_lm_loss_share`'s ``batch`` (whole sequences, ``labels`` optional).
        state: the parallel state.
        ignore_index: label value that is no target.

    Returns:
        The count ``N`` (an int, the same on every rank; 0 when every label is masked, and the shares
        then are 0).

    Raises:
        ValueError: on every rank, when a rank's batch is bad (see :func:`causal_lm_loss_share`), the
            CP ranks of a group hold different sequences, or the ranks pass different numbers of
            batches.
    """
    require_state(state, "num_items_in_batch")
    if isinstance(batches, Mapping):
        batches = [batches]
    return _step_counts(list(batches), state, ignore_index, "num_items_in_batch")[0]


_TRAINER_CLASS: type | None = None

# Trainer options whose loss SeqparTrainer does not compute (it computes the loss itself on shards).
_REFUSED_OPTIONS = (
    "label_smoothing_factor is {label_smoothing}: the loss here is plain cross-entropy on the shards; "
    "set it to 0",
    "a compute_loss_func is set: it would be handed sharded logits; set compute_loss_func=None (the loss is "
    "the causal LM cross-entropy) or compute a loss share yourself",
)


def seqpar_trainer_class() -> type:
    """The ``transformers.Trainer`` subclass :class:`SeqparTrainer` (imports transformers).

    ``SeqparTrainer(model, args, *, state, shuffle=True, **trainer_kwargs)`` trains and evaluates
    exactly as the stock ``Trainer`` does on **one device** for the same global batch: ``dp_size``
    replicas of ``per_device_train_batch_size`` sequences are one device's batch of ``dp_size`` times
    as many, with the same ``gradient_accumulation_steps`` (and likewise for evaluation):

    - the training batches come from :func:`dp_sampler` (same samples on every CP rank, split over
      DP); the data loader is not passed through accelerate's ``prepare`` (which would split it over
      all ranks again);
    - each optimizer step's valid-target count over every DP replica and micro-batch is exchanged
      once before the step (:func:`num_items_in_batch`, which also checks that the CP ranks hold the
      same sequences), and ``compute_loss`` returns the share normalised by it times
      :func:`loss_scale` (``cp_size``: the Trainer's DDP averages over all ranks), so the gradients
      are the single-device ones with masked labels, data parallelism and gradient accumulation,
      and the logged loss (the Trainer's mean over ranks) is the single-device loss (Note [The token
      count of a step]). For a model without loss kwargs (``model_accepts_loss_kwargs`` false) the
      count is per micro-batch and the Trainer divides by the accumulation steps, as on one device.
      ``average_tokens_across_devices`` is not consulted: the count is always the global one;
    - ``evaluate()`` splits the evaluation set over the DP replicas only, in global batches of
      ``dp_size * per_device_eval_batch_size`` sequences, and returns one device's ``eval_loss``:
      the mean of the global batches' token means weighted by their numbers of sequences (non-finite
      ones dropped under ``logging_nan_inf_filter``). Metrics from predictions (``compute_metrics``)
      and ``predict()`` are refused: the logits are sharded over the CP ranks.

    Raises:
        ImportError: transformers is not installed (``pip install seqpar[hf]``).
    """
    global _TRAINER_CLASS
    if _TRAINER_CLASS is not None:
        return _TRAINER_CLASS
    from transformers import Trainer
    from transformers.trainer_utils import EvalLoopOutput

    class SeqparTrainer(Trainer):
        """``transformers.Trainer`` for a model registered with seqpar: see
        :func:`seqpar.trainers.seqpar_trainer_class`."""

        def __init__(self, *args: Any, state: ParallelState, shuffle: bool = True, **kwargs: Any) -> None:
            require_state(state, "SeqparTrainer")
            super().__init__(*args, **kwargs)
            world = self.args.world_size
            problems = [
                self.args.label_smoothing_factor != 0,
                self.compute_loss_func is not None,
            ]
            mine = [int(world != state.dp_size * state.cp_size), *map(int, problems)]
            # The options are the same on every rank in a sane script; exchanged anyway, so that a
            # rank that would refuse cannot leave the others waiting in the first step.
            rows = _exchange_all(mine, state)
            if any(row[0] for row in rows):
                raise ValueError(
                    f"SeqparTrainer: the Trainer runs on {world} process(es) but the state has dp_size "
                    f"{state.dp_size} x cp_size {state.cp_size} = {state.dp_size * state.cp_size} ranks"
                )
            for i, template in enumerate(_REFUSED_OPTIONS):
                if any(row[1 + i] for row in rows):
                    raise ValueError("SeqparTrainer: " + template.format(
                        label_smoothing=self.args.label_smoothing_factor))
            self.seqpar_state = state
            self.seqpar_shuffle = shuffle
            # On one device the Trainer normalises by the count of the whole accumulated batch when
            # the model takes loss kwargs (and then does not divide by the steps), else per
            # micro-batch; model_accepts_loss_kwargs is the Trainer's own decision.
            self.loss_is_scaled_for_ga = bool(self.model_accepts_loss_kwargs)
            self._seqpar_counts: deque[int] = deque()

        def get_train_dataloader(self) -> torch.utils.data.DataLoader:
            if self.train_dataset is None:
                raise ValueError("SeqparTrainer: training requires a train_dataset.")
            dataset, collator = self._dataset_and_collator(self.train_dataset, "training")
            sampler = dp_sampler(
                dataset, self.seqpar_state, shuffle=self.seqpar_shuffle, seed=self.args.seed,
                drop_last=self.args.dataloader_drop_last,
            )
            return _EpochLoader(
                dataset, batch_size=self._train_batch_size, sampler=sampler, collate_fn=collator,
                drop_last=self.args.dataloader_drop_last, num_workers=self.args.dataloader_num_workers,
                pin_memory=self.args.dataloader_pin_memory,
            )

        def _dataset_and_collator(self, dataset: Any, description: str) -> tuple[Any, Any]:
            collator = self.data_collator
            try:
                import datasets

                is_hf_dataset = isinstance(dataset, datasets.Dataset)
            except ImportError:
                is_hf_dataset = False
            if is_hf_dataset:
                dataset = self._remove_unused_columns(dataset, description=description)
            else:
                collator = self._get_collator_with_removed_columns(collator, description=description)
            return dataset, collator

        def get_batch_samples(self, epoch_iterator, num_batches, device):
            batches = []
            for _ in range(num_batches):
                try:
                    batches.append(next(epoch_iterator))
                except StopIteration:
                    break
            total, per_batch = _step_counts(
                batches, self.seqpar_state, -100, "SeqparTrainer", slots=max(num_batches, 1)
            )
            if self.model_accepts_loss_kwargs:
                self._seqpar_counts = deque([total] * len(batches))
                return batches, torch.tensor(total, device=device)
            self._seqpar_counts = deque(per_batch[: len(batches)])
            return batches, None

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            state = self.seqpar_state
            if self._seqpar_counts:
                count = self._seqpar_counts.popleft()
            else:  # called outside the training loop: the batch on its own (a collective)
                count = _step_counts([inputs], state, -100, "SeqparTrainer.compute_loss")[0]
            share, outputs = _share_and_outputs(model, inputs, state, -100, "SeqparTrainer.compute_loss", count)
            loss = share * loss_scale(state, "all")
            return (loss, outputs) if return_outputs else loss

        def get_eval_dataloader(self, eval_dataset=None) -> torch.utils.data.DataLoader:
            if eval_dataset is None and self.eval_dataset is None:
                raise ValueError("SeqparTrainer: evaluation requires an eval_dataset.")
            if isinstance(eval_dataset, str):
                eval_dataset = self.eval_dataset[eval_dataset]
            elif eval_dataset is None:
                eval_dataset = self.eval_dataset
            dataset, collator = self._dataset_and_collator(eval_dataset, "evaluation")
            try:
                n = len(dataset)
            except TypeError:
                raise ValueError(
                    f"SeqparTrainer.evaluate: the evaluation dataset ({type(dataset).__name__}) has no len(); "
                    "the global batches are split over the DP replicas by index"
                ) from None
            slices = _ReplicaSlices(n, self.args.eval_batch_size, self.seqpar_state, self.args.dataloader_drop_last)
            return torch.utils.data.DataLoader(
                dataset, batch_sampler=slices, collate_fn=collator, num_workers=self.args.dataloader_num_workers,
                pin_memory=self.args.dataloader_pin_memory,
            )

        def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                            metric_key_prefix="eval"):
            state = self.seqpar_state
            slices = getattr(dataloader, "batch_sampler", None)
            problem = 0
            if not isinstance(slices, _ReplicaSlices):
                problem = 1
            elif self.compute_metrics is not None or self.preprocess_logits_for_metrics is not None:
                problem = 2
            elif description != "Evaluation":
                problem = 3
            sizes = (slices.n, slices.per_replica, slices.steps) if problem == 0 else (0, 0, 0)
            rows = _exchange_all([problem, *sizes], state)
            problems = sorted({row[0] for row in rows} - {0})
            if problems:
                raise ValueError("SeqparTrainer.evaluate: " + {
                    1: "the evaluation loader is not the one get_eval_dataloader builds (split over the DP "
                       "replicas only); do not override it",
                    2: "compute_metrics / preprocess_logits_for_metrics need the logits, which are sharded over "
                       "the CP ranks; evaluate the loss only (compute_metrics=None) or gather them yourself",
                    3: f"{description!r} (predict()) needs the logits, which are sharded over the CP ranks",
                }[problems[0]])
            if any(row[1:] != rows[0][1:] for row in rows):
                raise ValueError(
                    f"SeqparTrainer.evaluate: the ranks disagree on (samples, per-device eval batch size, global "
                    f"batches): {sorted({tuple(row[1:]) for row in rows})}; build the evaluation set and "
                    "TrainingArguments alike on every rank"
                )
            model = self.model  # not DDP: a replica without a part of the last batch skips the forward
            model.eval()
            device = _group_device(state.parent_group) if state.parent_group is not None else self.args.device
            batches = iter(dataloader)
            losses: list[tuple[float, int]] = []
            for step in range(slices.steps):
                mine = [next(batches)] if slices.part(step) else []
                mine = [self._prepare_inputs(b) for b in mine]
                count = _step_counts(mine, state, -100, "SeqparTrainer.evaluate", same_length=False)[0]
                total = torch.zeros((), dtype=torch.float64, device=device)
                if mine:
                    with torch.no_grad():
                        share, _ = _share_and_outputs(model, mine[0], state, -100, "SeqparTrainer.evaluate")
                    local = max(1, _target_count(_checked_batch(mine[0], "SeqparTrainer.evaluate")[1], -100))
                    total = (share.detach().to(torch.float64) * local).to(device)
                if state.parent_group is not None and state.dp_size * state.cp_size > 1:
                    total = all_reduce(total, state.parent_group)
                # One device's loss of the global batch, weighted by its sequences as the Trainer's
                # gather_for_metrics weighs the last, shorter batch; 0/0 is nan there too.
                losses.append((total.item() / count if count else math.nan, slices.global_size(step)))
                self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)
            finite = [(v, w) for v, w in losses if math.isfinite(v)]
            if self.args.logging_nan_inf_filter and finite:
                losses = finite
            weight = sum(w for _, w in losses)
            metrics = {f"{metric_key_prefix}_loss": sum(v * w for v, w in losses) / weight} if weight else {}
            return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics, num_samples=slices.n)

        def predict(self, test_dataset, ignore_keys=None, metric_key_prefix="test"):
            raise ValueError(
                "SeqparTrainer.predict: the logits are sharded over the CP ranks; evaluate the loss with "
                "evaluate(), or run the model on shards and gather the logits yourself"
            )

    _TRAINER_CLASS = SeqparTrainer
    return SeqparTrainer


def _exchange_all(values: list[int], state: ParallelState) -> list[list[int]]:
    """Every rank's ``values`` over the parent group (just ours without process groups)."""
    if state.parent_group is None or state.dp_size * state.cp_size == 1:
        return [list(values)]
    return exchange_ints(values, state.parent_group, _group_device(state.parent_group))


class _ReplicaSlices:
    """Batch sampler for evaluation: global batch ``k`` is samples ``[k G, (k+1) G)`` with ``G =
    dp_size * per_replica`` (one device's batch), and DP replica ``d`` reads its ``d``-th part of
    ``per_replica`` samples (none, at the end of a short last batch). Every CP rank of a replica reads
    the same part; ``steps`` global batches on every rank."""

    def __init__(self, n: int, per_replica: int, state: ParallelState, drop_last: bool) -> None:
        self.n, self.per_replica, self.dp_size, self.dp_rank = n, per_replica, state.dp_size, state.dp_rank
        self.size = per_replica * state.dp_size
        self.steps = n // self.size if drop_last else -(-n // self.size)

    def global_size(self, step: int) -> int:
        return min(self.size, self.n - step * self.size)

    def part(self, step: int) -> list[int]:
        start = step * self.size + self.dp_rank * self.per_replica
        return list(range(start, min(start + self.per_replica, (step + 1) * self.size, self.n)))

    def __iter__(self):
        for step in range(self.steps):
            part = self.part(step)
            if part:
                yield part

    def __len__(self) -> int:
        return sum(1 for step in range(self.steps) if self.part(step))


class _EpochLoader(torch.utils.data.DataLoader):
    """A ``DataLoader`` whose ``set_epoch`` reaches its ``DistributedSampler`` (the Trainer calls it)."""

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


def __getattr__(name: str) -> Any:
    if name == "SeqparTrainer":  # built on first access: imports transformers
        return seqpar_trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
