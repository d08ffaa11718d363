"""seqpar.training: loss shares, gradient sync (DDP) and the training scripts' --check runs."""

import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import seqpar
from seqpar import ParallelState, parallel_sdpa, shard
from seqpar.tools.models import VideoDiT, patchify
from seqpar.training import (
    all_reduce_gradients,
    global_loss,
    sharded_cross_entropy,
    sharded_mean,
    shift_labels,
    wrap_ddp,
)

ROOT = Path(__file__).resolve().parents[1]


def test_shift_labels():
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    assert shift_labels(ids).tolist() == [[6, 7, 8, 9, 10, -100]]
    assert shift_labels(ids, seq_lens=[2, 0, 4], ignore_index=-1).tolist() == [[6, -1, 8, 9, 10, -1]]
    with pytest.raises(ValueError, match="seq_lens sum to 5 but labels have 6"):
        shift_labels(ids, seq_lens=[2, 3])


def test_loss_input_errors():
    state = ParallelState()
    with pytest.raises(ValueError, match="trailing vocab dim"):
        sharded_cross_entropy(torch.randn(2, 5, 7), torch.zeros(2, 4, dtype=torch.long), state)
    with pytest.raises(ValueError, match="integer class ids"):
        sharded_cross_entropy(torch.randn(2, 5, 7), torch.zeros(2, 5), state)
    with pytest.raises(ValueError, match="ParallelState"):
        sharded_mean(torch.randn(3), None)
    with pytest.raises(ValueError, match="process_group"):
        wrap_ddp(torch.nn.Linear(2, 2), state, process_group=None)


def test_single_process_state_is_plain_mean():
    state = ParallelState()
    logits, labels = torch.randn(2, 9, 11), torch.randint(0, 11, (2, 9))
    labels[0, :4] = -100
    torch.testing.assert_close(
        sharded_cross_entropy(logits, labels, state), F.cross_entropy(logits.transpose(1, 2), labels)
    )
    assert sharded_cross_entropy(logits, torch.full_like(labels, -100), state).item() == 0.0  # no NaN
    model = torch.nn.Linear(2, 2)
    assert wrap_ddp(model, state) is model


def _loss_cases(ring, ulysses):
    state = ParallelState(ring, ulysses)
    g = torch.Generator().manual_seed(5)
    out = []
    for seq_len in (37, 6):
        logits = torch.randn(2, seq_len, 13, generator=g, dtype=torch.float64)
        labels = shift_labels(torch.randint(0, 13, (2, seq_len), generator=g))
        labels[1, : seq_len // 2] = -100
        full = logits.clone().requires_grad_(True)
        ref = F.cross_entropy(full.reshape(-1, 13), labels.reshape(-1), ignore_index=-100)
        (ref_grad,) = torch.autograd.grad(ref, full)
        x = logits.clone().requires_grad_(True)
        share = sharded_cross_entropy(shard(x, state), shard(labels, state), state)
        (grad,) = torch.autograd.grad(share, x)
        dist.all_reduce(grad, group=state.cp_group)  # partial gradients sum to the exact one
        out.append(
            (
                abs(global_loss(share, state).item() - ref.item()),
                (grad - ref_grad).abs().max().item(),
            )
        )
        values = torch.randn(2, seq_len, 3, generator=g, dtype=torch.float64)
        out.append(
            (
                abs(
                    global_loss(sharded_mean(shard(values, state), state), state).item()
                    - values.mean().item()
                ),
                0.0,
            )
        )
    return out


@pytest.mark.parametrize("ring,ulysses", [(2, 2), (1, 2)])
def test_sharded_losses(pools, ring, ulysses):
    for per_rank in pools(4).run(_loss_cases, ring, ulysses):
        for loss_err, grad_err in per_rank:
            assert loss_err < 1e-12 and grad_err < 1e-12, (loss_err, grad_err)


def _dit_and_data(dp_size):
    torch.manual_seed(0)
    model = VideoDiT(in_channels=2, patch=(1, 2, 2), grid=(3, 3, 3), dim=24, depth=1, heads=3).double()
    data = []
    for replica in range(dp_size):
        g = torch.Generator().manual_seed(100 + replica)
        x = patchify(torch.randn(2, 2, 3, 6, 6, generator=g, dtype=torch.float64), model.patch)
        data.append(
            (
                x,
                torch.rand(2, generator=g, dtype=torch.float64),
                torch.randn(x.shape, generator=g, dtype=torch.float64),
            )
        )
    return model, data


def _ddp_case(ring, ulysses, use_ddp):
    state = ParallelState(ring, ulysses)
    # Single device: the mean over DP replicas of each replica's mean loss.
    ref_model, data = _dit_and_data(state.dp_size)
    for x, t, y in data:
        (((ref_model(x, t) - y) ** 2).mean() / state.dp_size).backward()

    model, _ = _dit_and_data(state.dp_size)
    wrapped = wrap_ddp(model, state) if use_ddp else model
    x, t, y = data[state.dp_rank]
    with parallel_sdpa(state):
        pred = wrapped(shard(x, state), t, seqpar.shard_positions(x.shape[1], state))
    sharded_mean((pred - shard(y, state)) ** 2, state).backward()
    if not use_ddp:
        all_reduce_gradients(model.parameters(), state)
    return max(
        (p.grad - r.grad).abs().max().item() for p, r in zip(model.parameters(), ref_model.parameters())
    )


@pytest.mark.parametrize("ring,ulysses", [(1, 2), (2, 2), (2, 1)])
@pytest.mark.parametrize("use_ddp", [True, False], ids=["wrap_ddp", "all_reduce_gradients"])
def test_gradient_sync_matches_single_device(pools, ring, ulysses, use_ddp):
    errs = pools(4).run(_ddp_case, ring, ulysses, use_ddp)
    assert max(errs) < 1e-10, errs


def _torchrun(script, *args, timeout=240):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = ["torchrun", "--standalone", "--nproc_per_node", "4", str(ROOT / "scripts" / script), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.tools
def test_train_lm_check(tmp_path):
    plot = tmp_path / "lm.png"
    proc = _torchrun(
        # 131 tokens: not a multiple of the 2 * 2 zig-zag chunks nor of the 4 ranks
        "train_lm.py", "--ring", "2", "--ulysses", "2", "--steps", "3", "--seq-len", "131", "--check",
        "--plot", str(plot),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "train_lm --check OK" in proc.stdout
    assert plot.stat().st_size > 0


@pytest.mark.tools
def test_train_dit_check_with_data_parallel(tmp_path):
    plot = tmp_path / "dit.png"
    # ring 2 x ulysses 1 on 4 ranks: 2 data-parallel replicas.
    proc = _torchrun(
        "train_dit.py", "--ring", "2", "--ulysses", "1", "--steps", "3", "--grid", "5", "6", "10", "--check",
        "--plot", str(plot),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "train_dit --check OK" in proc.stdout
    assert plot.stat().st_size > 0


@pytest.mark.tools
def test_train_dit_check_fails_loudly():
    # A zero tolerance cannot be met by fp32 arithmetic in a different order.
    proc = _torchrun("train_dit.py", "--steps", "2", "--grid", "5", "6", "10", "--check", "--tol", "0")
    assert proc.returncode != 0
    assert "train_dit --check FAILED" in proc.stderr
