"""seqpar.trainers: framework recipes (HF Trainer, accelerate, Lightning, DeepSpeed) vs one device, 3 steps.

Each case runs in the session's 2-rank gloo pool: the framework runs with cp_size 2 (ring 2) on
both ranks, and every rank also runs the framework's stock single-process path on the whole batch
(the reference). Losses and parameters after 3 steps must agree within 1e-5 (fp32). The optimizer
is SGD without clipping: Adam, and clipping, would hide a gradient that is cp_size times too small
(measured: without the loss scale the parameters differ by 3e-2 after 3 steps, with HF Trainer and
with DeepSpeed alike).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

from seqpar import ParallelState
from seqpar.trainers import causal_lm_loss_share, dp_sampler, loss_scale

VOCAB, SEQ, BATCH, STEPS = 61, 21, 2, 3


def _model(attn_implementation: str):
    from transformers import LlamaForCausalLM

    from seqpar.tools.models import tiny_llama_config

    torch.manual_seed(0)
    config = tiny_llama_config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
    return LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation)


def _dataset():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH * STEPS, SEQ), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


@contextlib.contextmanager
def _env(**values: str):
    """Set environment variables for the block, then restore them (the pool's ranks are shared)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _params(model) -> dict:
    model = getattr(model, "module", model)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


# --- HF Trainer -----------------------------------------------------------------------------------


def _trainer_args(tmp: str, batch: int):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=tmp, per_device_train_batch_size=batch, max_steps=STEPS, learning_rate=0.5, optim="sgd",
        weight_decay=0.1, max_grad_norm=0.0, use_cpu=True, report_to=[], save_strategy="no",
        logging_steps=1, seed=0, dataloader_drop_last=False, disable_tqdm=True,
    )


def _hf_trainer(tmp: str, ring_size: int = 2):
    from transformers import Trainer, default_data_collator

    from seqpar.integrations.transformers import register
    from seqpar.trainers import SeqparTrainer

    data = _dataset()
    losses: dict[str, list[float]] = {"ref": [], "cp": []}

    class Reference(Trainer):  # stock Trainer, one process, the whole batch, sequential order
        def _get_train_sampler(self, dataset=None):
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def compute_loss(self, model, inputs, **kwargs):
            loss = super().compute_loss(model, inputs, **kwargs)
            losses["ref"].append(loss.item())
            return loss

    class Recorded(SeqparTrainer):
        def compute_loss(self, model, inputs, **kwargs):
            loss = super().compute_loss(model, inputs, **kwargs)
            total = loss.detach().clone()  # the Trainer's logged loss: the mean over all ranks
            dist.all_reduce(total)
            losses["cp"].append(total.item() / dist.get_world_size())
            return loss

    _reset_accelerate()  # no LOCAL_RANK / WORLD_SIZE: accelerate sees one process
    ref = _model("eager")
    Reference(model=ref, args=_trainer_args(os.path.join(tmp, "ref"), BATCH), train_dataset=data,
              data_collator=default_data_collator).train()
    _reset_accelerate()

    state = ParallelState(ring_size=ring_size)  # ring 2: cp 2; ring 1: dp 2 (one sequence per replica)
    rank, world = dist.get_rank(), dist.get_world_size()
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
           "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    try:
        with _env(**env):
            model = _model(register(state))
            trainer = Recorded(model=model, args=_trainer_args(os.path.join(tmp, "cp"), BATCH // state.dp_size),
                               train_dataset=data, data_collator=default_data_collator, state=state, shuffle=False)
            trainer.train()
            ddp = trainer.model_wrapped
    finally:
        _reset_accelerate()
    assert len(losses["cp"]) == len(losses["ref"]) == STEPS, losses
    return (
        max(abs(a - b) for a, b in zip(losses["cp"], losses["ref"])),
        _max_diff(_params(model), _params(ref)),
        type(ddp).__name__,
    )


@pytest.mark.slow  # a framework's multi-rank run: not in the quick subset
@pytest.mark.parametrize("ring_size", [2, 1], ids=["cp2", "dp2"])
def test_hf_trainer_matches_one_device(pools, tmp_path, ring_size):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (pip install seqpar[trainers])")
    results = pools(2).run(_hf_trainer, str(tmp_path), ring_size)
    for loss_diff, param_diff, wrapper in results:
        assert wrapper == "DistributedDataParallel"  # the Trainer's own DDP over both ranks
        assert loss_diff < 1e-5 and param_diff < 1e-5, results


# --- accelerate (a manual loop) -------------------------------------------------------------------


def _one_device_sgd(lr: float) -> tuple[list[float], dict]:
    """The single-device reference: the model's own loss (it shifts labels itself), plain SGD."""
    model = _model("eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    data = _dataset()
    losses = []
    for step in range(STEPS):
        rows = data[step * BATCH : (step + 1) * BATCH]
        ids = torch.stack([r["input_ids"] for r in rows])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, _params(model)


def _accelerate(tmp: str):
    from accelerate import Accelerator
    from transformers import default_data_collator

    from seqpar.integrations.transformers import register
    from seqpar.training import global_loss

    ref_losses, ref_params = _one_device_sgd(0.5)
    rank, world = dist.get_rank(), dist.get_world_size()
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
           "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    _reset_accelerate()
    try:
        with _env(**env):
            accelerator = Accelerator(cpu=True)
            state = ParallelState(ring_size=2)
            model = _model(register(state))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
            data = _dataset()
            loader = torch.utils.data.DataLoader(
                data, batch_size=BATCH, sampler=dp_sampler(data, state, shuffle=False),
                collate_fn=default_data_collator,
            )
            model, optimizer = accelerator.prepare(model, optimizer)  # not the loader
            losses = []
            for batch in loader:
                batch = {k: v.to(accelerator.device) for k, v in batch.items()}
                share = causal_lm_loss_share(model, batch, state)
                accelerator.backward(share * loss_scale(state, "all"))
                optimizer.step()
                optimizer.zero_grad()
                losses.append(global_loss(share, state).item())
            wrapper = type(model).__name__
    finally:
        _reset_accelerate()
    assert len(losses) == STEPS, losses
    return max(abs(a - b) for a, b in zip(losses, ref_losses)), _max_diff(_params(model), ref_params), wrapper


@pytest.mark.slow  # a framework's multi-rank run: not in the quick subset
def test_accelerate_matches_one_device(pools, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="pip install seqpar[trainers]")
    results = pools(2).run(_accelerate, str(tmp_path))
    for loss_diff, param_diff, wrapper in results:
        assert wrapper == "DistributedDataParallel"  # accelerate's own DDP over both ranks
        assert loss_diff < 1e-5 and param_diff < 1e-5, results


# --- Lightning (DDP strategy) --------------------------------------------------------------------


def _lightning(tmp: str):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
    from transformers import default_data_collator

    from seqpar.integrations.transformers import register
    from seqpar.training import global_loss

    ref_losses, ref_params = _one_device_sgd(0.5)
    losses: list[float] = []
    wrappers: set[str] = set()

    class CausalLM(L.LightningModule):
        def __init__(self, state):
            super().__init__()
            self.state = state
            self.model = _model(register(state))
            self.data = _dataset()

        def training_step(self, batch, batch_idx):
            share = causal_lm_loss_share(self.model, batch, self.state)
            losses.append(global_loss(share, self.state).item())
            wrappers.add(type(self.trainer.strategy.model).__name__)
            return share * loss_scale(self.state, "all")

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(self.data, batch_size=BATCH, collate_fn=default_data_collator,
                                               sampler=dp_sampler(self.data, self.state, shuffle=False))

    rank, world = dist.get_rank(), dist.get_world_size()
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "NODE_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}
    with _env(**env):  # as under torchrun: Lightning finds the process group already initialised
        state = ParallelState(ring_size=2)
        module = CausalLM(state)
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=DDPStrategy(process_group_backend="gloo"),
                            use_distributed_sampler=False, max_steps=STEPS, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=tmp)
        trainer.fit(module)
    (wrapper,) = wrappers
    assert len(losses) == STEPS, losses
    return max(abs(a - b) for a, b in zip(losses, ref_losses)), _max_diff(_params(module.model), ref_params), wrapper


@pytest.mark.slow  # a framework's multi-rank run: not in the quick subset
def test_lightning_matches_one_device(pools, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("lightning", reason="pip install seqpar[trainers]")
    results = pools(2).run(_lightning, str(tmp_path))
    for loss_diff, param_diff, wrapper in results:
        assert wrapper == "DistributedDataParallel"  # Lightning's own DDP over both ranks
        assert loss_diff < 1e-5 and param_diff < 1e-5, results


# --- DeepSpeed ZeRO -------------------------------------------------------------------------------


def _deepspeed(tmp: str, stage: int):
    import deepspeed
    import deepspeed.utils.groups
    from transformers import default_data_collator

    from seqpar.integrations.transformers import register
    from seqpar.training import global_loss

    ref_losses, ref_params = _one_device_sgd(0.5)
    rank, world = dist.get_rank(), dist.get_world_size()
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29513"}
    deepspeed.utils.groups._WORLD_GROUP = None  # its clone of the world group from an earlier call is gone
    with _env(**env):
        state = ParallelState(ring_size=2)
        model = _model(register(state))
        data = _dataset()
        loader = torch.utils.data.DataLoader(data, batch_size=BATCH, collate_fn=default_data_collator,
                                             sampler=dp_sampler(data, state, shuffle=False))
        config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
                  "gradient_clipping": 0.0}  # DeepSpeed clips at 1.0 unless told; the reference does not
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                               dist_init_required=False)
        losses = []
        for batch in loader:
            share = causal_lm_loss_share(engine, batch, state)
            engine.backward(share * loss_scale(state, "all"))  # the engine averages over all ranks
            engine.step()
            losses.append(global_loss(share, state).item())
    assert len(losses) == STEPS, losses
    return max(abs(a - b) for a, b in zip(losses, ref_losses)), _max_diff(_params(engine.module), ref_params)


def _deepspeed_usable() -> str | None:
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # noqa: BLE001 - not installed, or installed without a usable accelerator
        return f"deepspeed does not import here ({type(e).__name__}: {e}); .ci/run installs it"
    return None


@pytest.mark.slow  # a framework's multi-rank run: not in the quick subset
@pytest.mark.parametrize("stage", [0, 2])
def test_deepspeed_matches_one_device(pools, tmp_path, stage):
    pytest.importorskip("transformers")
    reason = _deepspeed_usable()
    if reason:
        pytest.skip(reason)
    results = pools(2).run(_deepspeed, str(tmp_path), stage)
    for loss_diff, param_diff in results:
        assert loss_diff < 1e-5 and param_diff < 1e-5, results


# --- helpers --------------------------------------------------------------------------------------


def test_loss_scale_and_errors():
    state = ParallelState()
    assert loss_scale(state) == 1 and loss_scale(state, "dp") == 1 and loss_scale(state, "none") == 1
    with pytest.raises(ValueError, match="must be one of"):
        loss_scale(state, "world")
    with pytest.raises(ValueError, match="has no len"):
        dp_sampler(iter(range(3)), state)
    assert list(dp_sampler(list(range(5)), state, shuffle=False)) == [0, 1, 2, 3, 4]
    model = torch.nn.Identity()
    with pytest.raises(ValueError, match=r"input_ids must be a \[B, S\] tensor"):
        causal_lm_loss_share(model, {"input_ids": torch.zeros(5, dtype=torch.long)}, state)
    with pytest.raises(ValueError, match=r"labels \(2, 4\) must have input_ids' shape \(2, 5\)"):
        causal_lm_loss_share(model, {"input_ids": torch.zeros(2, 5, dtype=torch.long),
                                     "labels": torch.zeros(2, 4, dtype=torch.long)}, state)
    with pytest.raises(ValueError, match="3 padded positions of 10"):
        mask = torch.ones(2, 5, dtype=torch.long)
        mask[0, :3] = 0
        causal_lm_loss_share(model, {"input_ids": torch.zeros(2, 5, dtype=torch.long), "attention_mask": mask},
                             state)


def _dp_sampler_cases():
    state = ParallelState(ring_size=1, ulysses_size=1)  # 2 ranks: dp_size 2
    data = list(range(7))
    mine = list(dp_sampler(data, state, shuffle=True, seed=3))
    cp_state = ParallelState(ring_size=2)  # 2 ranks: one CP group, dp_size 1
    return mine, list(dp_sampler(data, cp_state, shuffle=True, seed=3))


def test_dp_sampler_splits_over_dp_only(pools):
    (a_dp, a_cp), (b_dp, b_cp) = pools(2).run(_dp_sampler_cases)
    assert a_cp == b_cp and sorted(a_cp) == list(range(7))  # CP ranks read the same samples
    assert len(a_dp) == len(b_dp) == 4 and set(a_dp) | set(b_dp) == set(range(7))  # DP replicas split
