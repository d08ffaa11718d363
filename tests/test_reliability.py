"""Issue #19 "Never silently wrong", round 3: integrations, state and training.

Each test holds one finding (``docs/troubleshooting.md`` lists them): the case either works
exactly, against a single-device reference, or raises the same clear error on every rank within
the timeout, never a wrong number, a hang or a process abort. Cases are adversarial for the
class of the finding (the culprit on the first or the last rank, several dtypes, every layout),
not only its first instance.
"""

import pytest
import torch
import torch.distributed as dist

import seqpar
from seqpar import ParallelState
from seqpar.training import all_reduce_gradients, fully_shard_cp


# --- training: a gradient missing on some ranks (finding 7) ------------------------------------


class _Partly(torch.nn.Module):
    """Two layers and two gains; ``skip`` ranks never reach ``gain`` (as sinks of query heads a
    rank does not hold), no rank reaches ``unused``. ``out.0.weight`` is float32 (in a module of
    its own, as FSDP wants one dtype per module), the rest float64."""

    def __init__(self, skip: bool) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4).double(), torch.nn.Linear(4, 3).double()])
        for p in self.layers.parameters():
            p.data.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
        self.gain = torch.nn.Parameter(torch.randn(4, generator=g, dtype=torch.float64))
        self.out = torch.nn.ModuleList([torch.nn.Linear(3, 3, bias=False)])
        self.out[0].weight.data.copy_(torch.randn(3, 3, generator=g))
        self.unused = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
        self.skip = skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x)
        if not self.skip:
            x = x * self.gain
        return self.out[0](self.layers[1](x).float()).double()


def _loss(model: torch.nn.Module, rank: int) -> torch.Tensor:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    return (model(x) ** 2).sum()


def _reference_grads(skipping: set[int], world: int, dp_size: int) -> dict[str, torch.Tensor | None]:
    """Sum over CP, mean over DP of every rank's gradient, computed on this rank alone."""
    total: dict[str, torch.Tensor | None] = {}
    for rank in range(world):
        model = _Partly(rank in skipping)
        _loss(model, rank).backward()
        for name, p in model.named_parameters():
            if p.grad is None:
                total.setdefault(name, None)
            else:
                total[name] = p.grad / dp_size + (0 if total.get(name) is None else total[name])
    return total


def _missing_grads(ring, ulysses, skipping, kind):
    state = ParallelState(ring, ulysses)
    rank = dist.get_rank()
    model = _Partly(rank in skipping)
    if kind == "fsdp":
        fully_shard_cp(model, state)
    _loss(model, rank).backward()
    if kind == "all_reduce":
        all_reduce_gradients(model.parameters(), state)
    want = _reference_grads(set(skipping), dist.get_world_size(), state.dp_size)
    errors = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        if want[name] is None:  # no rank has a gradient: None, or zeros where FSDP reduced zeros
            errors[name] = None if grad is None else float(grad.abs().max())
        else:
            errors[name] = float((grad - want[name]).abs().max() / want[name].abs().max().clamp_min(1))
    state.close()
    return errors


@pytest.mark.parametrize("kind", ["all_reduce", "fsdp"])
@pytest.mark.parametrize("skipping", [(1,), (0,), (3,), (0, 1, 2)], ids=["cp1", "rank0", "last", "all-but-one"])
def test_gradient_missing_on_some_ranks(pools, kind, skipping):
    # 4 ranks: ring 2 (CP) x 2 replicas (DP); before: gloo aborted the process (different buffers)
    for rank, errors in enumerate(pools(4).run(_missing_grads, 2, 1, skipping, kind)):
        # on one device "unused" has no gradient; all_reduce_gradients keeps it so, FSDP has zeros
        assert errors.pop("unused") == (None if kind == "all_reduce" else 0.0), (rank, kind)
        for name, err in errors.items():
            assert err < (1e-6 if name.startswith("out") else 1e-12), (rank, kind, name, err)


def _sinks_over_fewer_heads(ring, ulysses, heads):
    """Attention sinks with fewer query heads than Ulysses ranks: a rank that holds no head after
    the all-to-all may end backward without ``sinks.grad``; all_reduce_gradients then sums the
    others' shares into the exact gradient on every rank."""
    state = ParallelState(ring, ulysses)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 11, heads, 4, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.nn.Parameter(torch.randn(heads, generator=g, dtype=torch.float64))
    ref_sinks = torch.nn.Parameter(sinks.detach().clone())
    out = seqpar.attention(*(seqpar.shard(t, state) for t in (q, k, v)), state, causal=True, sinks=sinks)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1 + state.cp_rank), dtype=torch.float64)
    (out * weight).sum().backward()
    all_reduce_gradients([sinks], state)
    full = seqpar.attention(q, k, v, ParallelState(), causal=True, sinks=ref_sinks)
    (full * seqpar.unshard(weight, state, size=11)).sum().backward()
    state.close()
    return float((sinks.grad - ref_sinks.grad).abs().max())


@pytest.mark.parametrize("ring,ulysses,heads", [(1, 4, 3), (1, 4, 1), (2, 2, 1)])
def test_sinks_with_fewer_heads_than_ulysses_ranks(pools, ring, ulysses, heads):
    assert max(pools(4).run(_sinks_over_fewer_heads, ring, ulysses, heads)) < 1e-12


def _different_parameters():
    state = ParallelState(2, 1)
    params = [torch.nn.Parameter(torch.ones(3 + (dist.get_rank() == 1)))]
    params[0].grad = torch.ones_like(params[0])
    try:
        all_reduce_gradients(params, state)
        return None
    except ValueError as e:
        return str(e)
    finally:
        state.close()


def test_different_parameters_raise_on_every_rank(pools):
    for msg in pools(2).run(_different_parameters):
        assert msg is not None and "the ranks pass different parameters" in msg and "rank 1 has 1 with 4" in msg


# --- state: a closed state at every public entry (finding 11) ----------------------------------


def _closed_state_entries():
    state = ParallelState(2, 1)
    state.close()
    x = torch.zeros(1, 6, 2)
    calls = {
        "shard_positions": lambda: seqpar.shard_positions(6, state),
        "shard": lambda: seqpar.shard(x, state),
        "unshard": lambda: seqpar.unshard(x, state),
        "shard_packed": lambda: seqpar.shard_packed(x[0], state, [2, 4]),
        "shard_packed_positions": lambda: seqpar.shard_packed_positions([2, 4], state),
        "global_loss": lambda: seqpar.training.global_loss(torch.zeros(()), state),
        "all_reduce_gradients": lambda: all_reduce_gradients([], state),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def test_closed_state_refused_everywhere(pools):
    for per_entry in pools(2).run(_closed_state_entries):
        for name, msg in per_entry.items():
            assert msg is not None and "was closed" in msg and msg.startswith(name), (name, msg)


def test_position_fingerprint_is_no_linear_moment():
    """The transformers guard compares each rank's positions with its placement by a fingerprint:
    rows that share a weighted sum of positions (once the fingerprint) must still differ."""
    from seqpar.integrations.transformers_guard import _fingerprint

    right = torch.tensor([0, 1, 2, 3])
    for wrong in ([1, 0, 1, 4], [1, 0, 3, 2], [0, 2, 1, 3], [3, 2, 1, 0], [0, 1, 2, 4]):
        assert _fingerprint(torch.tensor(wrong)) != _fingerprint(right), wrong
    assert _fingerprint(right[None]) == _fingerprint(right)  # one row, any leading shape
