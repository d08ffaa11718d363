"""SeqparTrainer (and the accelerate recipe) train and evaluate as the stock Trainer does on one device.

"The same training" (issue 42): ``dp_size`` replicas of ``b`` sequences per device with gradient
accumulation ``g`` are one device with ``dp_size * b`` sequences per device and the same ``g``: the
same optimizer (SGD, constant learning rate, no clipping), the same sequences in each optimizer step
(``dp_sampler`` without shuffling gives replica ``d`` samples ``d, d + dp, ...``; the one-device
reference reads them in order, so step ``k`` covers the same ``dp * b * g`` samples on both), and
the stock Trainer's normalisation on one device: the summed token losses of the whole accumulated
batch divided by its valid-target count (``num_items_in_batch``) for a model that takes loss kwargs
(every transformers causal LM), or each micro-batch's token mean divided by ``g`` for one that does
not. The labels mask a different number of tokens per sequence (instruction tuning), so the token
mean of a replica or micro-batch is not the global one. Evaluation: ``per_device_eval_batch_size``
``e`` on ``dp_size`` replicas is one device's ``dp * e``, over an evaluation set that does not fill
the last batch. Models in float64: parameters after 2 optimizer steps within 1e-6, logged and
evaluation losses within 2e-6, four float32 ulps of a loss near 4 (measured 1e-8, 5e-7 and 7e-7: the
stock causal LM loss casts the logits to float32 and the Trainer's running loss is a float32 tensor,
so the reference itself is float32-exact).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

from seqpar import ParallelState
from seqpar.trainers import causal_lm_loss_share, dp_sampler, loss_scale, num_items_in_batch

pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (pip install seqpar[trainers])")

VOCAB, SEQ, PER_DEVICE, ACCUM, STEPS, EVAL_PER_DEVICE, EVAL_SAMPLES, LR = 61, 24, 2, 2, 2, 2, 7, 0.5


def _model(attn_implementation: str, loss_kwargs: bool):
    from transformers import LlamaForCausalLM

    from seqpar.tools.models import tiny_llama_config

    torch.manual_seed(0)
    config = tiny_llama_config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
    model = LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation).to(torch.float64)
    if not loss_kwargs:
        model.accepts_loss_kwargs = False  # the Trainer then normalises per micro-batch and divides by g
    return model


def _dataset(n: int, seed: int) -> list[dict]:
    """Sequences whose labels mask a prompt of a different length each (one masks every target)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    prompts = torch.randint(0, SEQ - 2, (n,), generator=g)
    prompts[n // 2] = SEQ  # no target at all
    rows = []
    for row, p in zip(ids, prompts.tolist()):
        labels = row.clone()
        labels[:p] = -100
        rows.append({"input_ids": row, "labels": labels})
    return rows


def _args(tmp: str, batch: int, eval_batch: int, accum: int = ACCUM):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=tmp, per_device_train_batch_size=batch, per_device_eval_batch_size=eval_batch,
        gradient_accumulation_steps=accum, max_steps=STEPS, learning_rate=LR, optim="sgd", weight_decay=0.0,
        lr_scheduler_type="constant", max_grad_norm=0.0, use_cpu=True, report_to=[], save_strategy="no",
        logging_steps=1, seed=0, disable_tqdm=True,
    )


@contextlib.contextmanager
def _torchrun_env():
    """RANK, WORLD_SIZE, ... as torchrun sets them (accelerate reads them), restored afterwards, with
    accelerate's process-wide state reset around the block (the pool's ranks are reused)."""
    from accelerate.state import AcceleratorState

    rank, world = dist.get_rank(), dist.get_world_size()
    values = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
              "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    old = {k: os.environ.get(k) for k in values}
    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        AcceleratorState._reset_state(reset_partial_state=True)


def _params(model) -> dict:
    model = getattr(model, "module", model)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _logged(trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def _reference(tmp: str, dp: int, loss_kwargs: bool, accum: int = ACCUM):
    """The stock Trainer on one process: dp * b sequences per step of accumulation, read in order."""
    from accelerate.state import AcceleratorState
    from transformers import Trainer, default_data_collator

    class InOrder(Trainer):
        def _get_train_sampler(self, dataset=None):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    AcceleratorState._reset_state(reset_partial_state=True)  # no RANK / WORLD_SIZE: one process
    model = _model("eager", loss_kwargs)
    trainer = InOrder(model=model, args=_args(os.path.join(tmp, "ref"), PER_DEVICE * dp, EVAL_PER_DEVICE * dp, accum),
                      train_dataset=_dataset(PER_DEVICE * dp * accum * STEPS, 1), data_collator=default_data_collator)
    assert trainer.model_accepts_loss_kwargs == loss_kwargs
    trainer.train()
    eval_loss = trainer.evaluate(_dataset(EVAL_SAMPLES, 2))["eval_loss"]
    AcceleratorState._reset_state(reset_partial_state=True)
    return _params(model), _logged(trainer), eval_loss


def _seqpar_trainer(tmp: str, state: ParallelState, loss_kwargs: bool):
    from transformers import default_data_collator

    from seqpar.integrations.transformers import register
    from seqpar.trainers import SeqparTrainer

    with _torchrun_env():
        model = _model(register(state), loss_kwargs)
        trainer = SeqparTrainer(
            model=model, args=_args(os.path.join(tmp, "cp"), PER_DEVICE, EVAL_PER_DEVICE),
            train_dataset=_dataset(PER_DEVICE * state.dp_size * ACCUM * STEPS, 1),
            data_collator=default_data_collator, state=state, shuffle=False,
        )
        eval_before = trainer.evaluate(_dataset(EVAL_SAMPLES, 2))["eval_loss"]  # before DDP wraps the model
        trainer.train()
        eval_loss = trainer.evaluate(_dataset(EVAL_SAMPLES, 2))["eval_loss"]
        wrapper = type(trainer.model_wrapped).__name__
    return _params(model), _logged(trainer), eval_loss, eval_before, wrapper


def _accelerate_loop(state: ParallelState):
    """The accelerate recipe with gradient accumulation: one count per optimizer step, no division by g."""
    from accelerate import Accelerator
    from transformers import default_data_collator

    from seqpar.integrations.transformers import register

    with _torchrun_env():
        accelerator = Accelerator(cpu=True)
        model = _model(register(state), True)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        data = _dataset(PER_DEVICE * state.dp_size * ACCUM * STEPS, 1)
        loader = torch.utils.data.DataLoader(data, batch_size=PER_DEVICE, collate_fn=default_data_collator,
                                             sampler=dp_sampler(data, state, shuffle=False))
        model, optimizer = accelerator.prepare(model, optimizer)
        batches = iter(loader)
        for _ in range(STEPS):
            step = [next(batches) for _ in range(ACCUM)]
            n = num_items_in_batch(step, state)  # every rank, before the step's forwards
            for i, batch in enumerate(step):
                context = accelerator.no_sync(model) if i < ACCUM - 1 else contextlib.nullcontext()
                with context:
                    share = causal_lm_loss_share(model, batch, state, num_items_in_batch=n)
                    accelerator.backward(share * loss_scale(state))
            optimizer.step()
            optimizer.zero_grad()
    return _params(model)


def _run(tmp: str, ring_size: int, loss_kwargs: bool, accelerate: bool):
    state = ParallelState(ring_size=ring_size)
    ref_params, ref_logged, ref_eval = _reference(tmp, state.dp_size, loss_kwargs)
    params, logged, eval_loss, eval_before, wrapper = _seqpar_trainer(tmp, state, loss_kwargs)
    assert len(logged) == len(ref_logged) == STEPS, (logged, ref_logged)
    out = {
        "params": _max_diff(params, ref_params),
        "update": _max_diff(ref_params, _params(_model("eager", loss_kwargs))),  # how far the 2 steps moved
        "logged": max(abs(a - b) for a, b in zip(logged, ref_logged)),
        "eval": abs(eval_loss - ref_eval),
        "eval_moved": abs(eval_before - ref_eval),
        "wrapper": wrapper,
    }
    if accelerate:
        out["accelerate"] = _max_diff(_accelerate_loop(state), ref_params)
    state.close()
    return out


def _check(results: list[dict]) -> None:
    for r in results:
        assert r["wrapper"] == "DistributedDataParallel", r  # the Trainer's own DDP over every rank
        assert r["update"] > 1e-2, r  # the steps moved the parameters: agreement below means something
        assert r["params"] < 1e-6 and r["logged"] < 2e-6 and r["eval"] < 2e-6, r
        assert r["eval_moved"] > 1e-6, r  # evaluate() sees the trained parameters, not stale ones
        assert r.get("accelerate", 0.0) < 1e-6, r


def test_dataset_discriminates():
    """The masked labels give the DP replicas and the micro-batches different valid-target counts, so
    a per-replica or per-micro-batch token mean is another loss (issue 42: 23% of the update)."""
    data = _dataset(PER_DEVICE * 2 * ACCUM * STEPS, 1)
    counts = [int((r["labels"][1:] != -100).sum()) for r in data]
    replicas = [sum(counts[d::2][:PER_DEVICE * ACCUM]) for d in range(2)]
    assert len(set(counts)) > 4 and replicas[0] != replicas[1] and 0 in counts


@pytest.mark.slow
def test_cp2_dp2_accumulation_matches_one_device(pools, tmp_path):
    """CP 2 x DP 2 (4 ranks), accumulation 2: SeqparTrainer (model with and without loss kwargs) and
    the accelerate recipe against the stock Trainer on one device."""
    pool = pools(4)
    _check(pool.run(_run, str(tmp_path / "kw"), 2, True, True))
    _check(pool.run(_run, str(tmp_path / "nokw"), 2, False, False))


def test_cp2_dp1_accumulation_matches_one_device(pools, tmp_path):
    _check(pools(2).run(_run, str(tmp_path), 2, True, False))


@pytest.mark.slow
def test_cp3_accumulation_matches_one_device(pools, tmp_path):
    _check(pools(3).run(_run, str(tmp_path), 3, True, False))


def _refusals(tmp: str):
    """Every rank gets the same ValueError: CP ranks given different sequences, metrics from sharded
    logits, predict()."""
    from transformers import default_data_collator

    from seqpar.integrations.transformers import register
    from seqpar.trainers import SeqparTrainer

    state = ParallelState(ring_size=2)
    errors = []
    with _torchrun_env():
        model = _model(register(state), True)
        seed = 1 + dist.get_rank()  # a dataset built differently on each rank
        trainer = SeqparTrainer(model=model, args=_args(os.path.join(tmp, "a"), PER_DEVICE, EVAL_PER_DEVICE),
                                train_dataset=_dataset(8, seed), eval_dataset=_dataset(3, seed),
                                data_collator=default_data_collator, state=state, shuffle=False)
        for call in (trainer.train, trainer.evaluate, lambda: trainer.predict(_dataset(3, 1))):
            with pytest.raises(ValueError) as e:
                call()
            errors.append(str(e.value))
        trainer.compute_metrics = lambda p: {}
        with pytest.raises(ValueError) as e:
            trainer.evaluate(_dataset(3, 1))
        errors.append(str(e.value))
    state.close()
    return errors


def test_refusals_on_every_rank(pools, tmp_path):
    results = pools(2).run(_refusals, str(tmp_path))
    assert results[0] == results[1], results  # the same error on every rank, none left waiting
    train, evaluate, predict, metrics = results[0]
    assert "CP ranks of DP replica 0 hold different sequences" in train
    assert "CP ranks of DP replica 0 hold different sequences" in evaluate
    assert "SeqparTrainer.predict" in predict and "compute_metrics" in metrics


def test_num_items_in_batch_one_process():
    state = ParallelState()
    batch = {"input_ids": torch.arange(12).view(2, 6), "labels": torch.tensor([[-100, -100, 1, 2, 3, 4], [-100] * 6])}
    assert num_items_in_batch(batch, state) == 4 == num_items_in_batch([batch], state)
    assert num_items_in_batch([batch, {"input_ids": torch.zeros(1, 5, dtype=torch.long)}], state) == 8
    with pytest.raises(ValueError, match=r"labels \(2, 4\) must have input_ids' shape \(2, 5\)"):
        num_items_in_batch({"input_ids": torch.zeros(2, 5, dtype=torch.long),
                            "labels": torch.zeros(2, 4, dtype=torch.long)}, state)


def _lightning(tmp: str):
    """The Lightning recipe (DDPStrategy, no accumulation) on CP 2 x DP 2 with masked labels."""
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
    from transformers import default_data_collator

    from seqpar.integrations.transformers import register

    state = ParallelState(ring_size=2)
    ref_params, _, _ = _reference(tmp, state.dp_size, True, accum=1)

    class CausalLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _model(register(state), True)
            self.data = _dataset(PER_DEVICE * state.dp_size * STEPS, 1)

        def training_step(self, batch, batch_idx):
            n = num_items_in_batch(batch, state)  # over the DP replicas: every rank, every step
            return causal_lm_loss_share(self.model, batch, state, num_items_in_batch=n) * loss_scale(state)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(self.data, batch_size=PER_DEVICE, collate_fn=default_data_collator,
                                               sampler=dp_sampler(self.data, state, shuffle=False))

    rank, world = dist.get_rank(), dist.get_world_size()
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "NODE_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # as under torchrun: Lightning finds the process group already initialised
    try:
        module = CausalLM()
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=DDPStrategy(process_group_backend="gloo"),
                            use_distributed_sampler=False, max_steps=STEPS, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp)
        trainer.fit(module)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return _max_diff(_params(module.model), ref_params), _max_diff(ref_params, _params(_model("eager", True)))


@pytest.mark.slow  # Lightning's DDP start-up on 4 ranks
def test_lightning_cp2_dp2_matches_one_device(pools, tmp_path):
    pytest.importorskip("lightning", reason="pip install seqpar[trainers]")
    for diff, update in pools(4).run(_lightning, str(tmp_path)):
        assert update > 1e-2 and diff < 1e-6, (diff, update)
