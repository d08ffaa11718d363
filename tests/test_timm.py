"""seqpar.integrations.timm: tiny random ViT / DeiT / EVA models, full image in / full logits out.

timm imports torchvision at import time (``timm/layers/create_norm.py``: ``from torchvision.ops.misc
import FrozenBatchNorm2d``; ``timm.data`` subclasses torchvision transforms), and the registry has no
torchvision built for the CPU torch 2.13 (torchvision 0.28.0's wheel links ``libtorch_cuda.so``).
None of that is on the ViT/EVA forward path, so when no working torchvision is importable, timm is
imported behind a stand-in for torchvision whose every object raises when used
(``seqpar.tools.torchvision_stub.import_timm``; a warning in the test summary says so). The module
is skipped, with the reason shown by ``pytest -rs``, only if timm itself is missing.
"""

import importlib.util
import warnings

import pytest
import torch

if importlib.util.find_spec("timm") is None:
    pytest.skip(
        "timm is not installed; install it without its torchvision dependency: "
        "pip install --no-deps timm==1.0.31 (see docs/howto-timm.md)",
        allow_module_level=True,
    )

from seqpar.tools.torchvision_stub import import_timm  # noqa: E402

timm, _why = import_timm(stand_in=True)
if _why:
    warnings.warn(
        f"timm imported with a stand-in for torchvision ({_why}); only torchvision-free timm code (the "
        "ViT/EVA models) is exercised",
        stacklevel=1,
    )

import seqpar  # noqa: E402
from seqpar.integrations.timm import parallelize  # noqa: E402

pytestmark = pytest.mark.slow  # long multi-rank runs: not in the quick subset

ATOL = 1e-4
GRAD_RTOL = 1e-3  # fp32, relative to the largest entry of each gradient


def _vit():
    from timm.models.vision_transformer import VisionTransformer

    # 5 x 7 = 35 patches behind a class token and 2 register tokens
    return VisionTransformer(img_size=(20, 28), patch_size=4, embed_dim=24, depth=2, num_heads=4, num_classes=5,
                             reg_tokens=2), (20, 28)


def _vit_avg():
    from timm.models.vision_transformer import VisionTransformer

    # no prefix token at all, mean pooling over the 35 patches
    return VisionTransformer(img_size=(20, 28), patch_size=4, embed_dim=24, depth=2, num_heads=4, num_classes=5,
                             class_token=False, global_pool="avg"), (20, 28)


def _deit_distilled():
    from timm.models.deit import VisionTransformerDistilled

    model = VisionTransformerDistilled(img_size=(20, 28), patch_size=4, embed_dim=24, depth=2, num_heads=4,
                                       num_classes=5)
    model.set_distilled_training(True)  # forward returns (class logits, distillation logits)
    return model, (20, 28)


def _eva(rope_type: str):
    from timm.models.eva import Eva

    # EVA-02 style: rotary embeddings on the 35 patch tokens, SwiGLU, a class token
    return Eva(img_size=(20, 28), patch_size=4, embed_dim=32, depth=2, num_heads=4, num_classes=5,
               swiglu_mlp=True, use_rot_pos_emb=True, rope_type=rope_type, ref_feat_shape=(5, 7),
               global_pool="token"), (20, 28)


MODELS = {
    "vit-reg": _vit,
    "vit-avg": _vit_avg,
    "deit-distilled": _deit_distilled,
    "eva02": lambda: _eva("cat"),
    "eva-rope-mixed": lambda: _eva("mixed"),
}


def _forward_backward(name: str, state: "seqpar.ParallelState | None"):
    torch.manual_seed(0)
    model, (h, w) = MODELS[name]()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    images = torch.randn(2, 3, h, w, generator=g, requires_grad=True)
    if state is not None:
        parallelize(model, state)
    out = model(images)
    outs = out if isinstance(out, tuple) else (out,)
    weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(7)) for o in outs]
    n = 1 if state is None else state.cp_size
    (sum((o * wt).sum() for o, wt in zip(outs, weights)) / n).backward()
    grads = {f"param {k}": p.grad for k, p in model.named_parameters() if p.grad is not None}
    grads["input images"] = images.grad
    return torch.cat([o.detach().flatten() for o in outs]), grads


def _compare_models(names: list[str], layouts: list[tuple[int, int]]) -> dict:
    import torch.distributed as dist

    results = {}
    for name in names:
        ref_out, ref_grads = _forward_backward(name, None)
        for R, U in layouts:
            state = seqpar.ParallelState(ring_size=R, ulysses_size=U)
            out, grads = _forward_backward(name, state)
            grad_err = 0.0
            for key, ref in ref_grads.items():
                got = grads[key].clone()
                dist.all_reduce(got, group=state.cp_group)
                grad_err = max(grad_err, float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)))
            results[(name, R, U)] = (float((out - ref_out).abs().max()), grad_err, len(ref_grads),
                                     sorted(set(ref_grads) - set(grads)))
    return results


LAYOUTS = {2: [(2, 1)], 3: [(1, 3)], 4: [(2, 2)]}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_models_match_one_device(pools, world):
    results = pools(world).run(_compare_models, list(MODELS), LAYOUTS[world])
    assert all(r == results[0] for r in results), "CP ranks disagree on the full output"
    failures = [
        f"{name} ring={R} ulysses={U}: output error {o:.2e}, gradient error {gr:.2e}, missing {missing}"
        for (name, R, U), (o, gr, n, missing) in results[0].items()
        if o > ATOL or gr > GRAD_RTOL or missing or n < 10
    ]
    assert not failures, "\n".join(failures)


# --- fewer patches than CP ranks (issue #19, finding 9) ---------------------------------------------


def _few_patches(kind: str, patches: int):
    """A ViT / EVA on a 4 x (4 * patches) image: ``patches`` patch tokens behind its prefix tokens."""
    from timm.models.eva import Eva
    from timm.models.vision_transformer import VisionTransformer

    size = (4, 4 * patches)
    if kind == "vit-avg":  # no prefix token: a rank may hold no token at all
        return VisionTransformer(img_size=size, patch_size=4, embed_dim=24, depth=2, num_heads=4, num_classes=5,
                                 class_token=False, global_pool="avg"), size
    if kind == "vit-reg":
        return VisionTransformer(img_size=size, patch_size=4, embed_dim=24, depth=2, num_heads=4, num_classes=5,
                                 reg_tokens=2), size
    return Eva(img_size=size, patch_size=4, embed_dim=32, depth=2, num_heads=4, num_classes=5, swiglu_mlp=True,
               use_rot_pos_emb=True, ref_feat_shape=(1, patches), global_pool="token"), size


def _few_patches_cases(cases):
    """Per (kind, patches): (output error, summed-gradient error) against one device, or the error."""
    import torch.distributed as dist

    out = {}
    for kind, patches in cases:
        results = []
        for state in (None, seqpar.ParallelState(2, 2)):
            torch.manual_seed(0)
            model, (h, w) = _few_patches(kind, patches)
            g = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            images = torch.randn(2, 3, h, w, generator=g)
            if state is not None:
                parallelize(model, state)
            try:
                logits = model(images)
            except ValueError as e:
                results.append(str(e))
                state.close()
                break
            (logits.sum() / (1 if state is None else state.cp_size)).backward()
            grads = torch.cat([p.grad.flatten() for p in model.parameters()])
            if state is not None:
                dist.all_reduce(grads, group=state.cp_group)
                state.close()
            results.append((logits.detach(), grads))
        if isinstance(results[-1], str):
            out[(kind, patches)] = results[-1]
        else:
            (want, want_g), (got, got_g) = results
            out[(kind, patches)] = (float((got - want).abs().max()), float((got_g - want_g).abs().max()))
    return out


def test_fewer_patches_than_cp_ranks(pools):
    cases = [("vit-avg", 3), ("vit-avg", 1), ("vit-avg", 4), ("vit-reg", 3), ("vit-reg", 1), ("eva", 3)]
    per_rank = pools(4).run(_few_patches_cases, cases)
    for rank, results in enumerate(per_rank):
        for (kind, patches), got in results.items():
            if kind == "vit-avg" and patches < 4:  # a rank with no token at all: refused on every rank
                assert isinstance(got, str) and f"{patches} tokens, fewer than the 4 CP ranks" in got, (rank, got)
                assert got == per_rank[0][(kind, patches)], "every rank raises the same error"
            else:  # replicated prefix tokens keep every rank busy: exact
                assert not isinstance(got, str) and got[0] < ATOL and got[1] < 1e-3, (rank, kind, patches, got)


def test_one_rank_state_is_the_plain_model():
    ref_out, ref_grads = _forward_backward("eva02", None)
    out, grads = _forward_backward("eva02", seqpar.ParallelState())
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-6)
    for key, g in ref_grads.items():
        torch.testing.assert_close(grads[key], g, rtol=0, atol=1e-6)


def test_refusals():
    state = seqpar.ParallelState()
    with pytest.raises(ValueError, match="expected a timm VisionTransformer or Eva"):
        parallelize(torch.nn.Linear(2, 2), state)

    model, _ = _vit()
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = False
    with pytest.raises(ValueError, match="fused_attn=False"):
        parallelize(model, state)

    from timm.models.vision_transformer import VisionTransformer

    model = parallelize(VisionTransformer(img_size=8, patch_size=4, embed_dim=8, depth=2, num_heads=2,
                                          drop_path_rate=0.1), state)
    with pytest.raises(ValueError, match="already applied"):
        parallelize(model, state)
    with pytest.raises(NotImplementedError, match="DropPath"):
        model.train()(torch.randn(1, 3, 8, 8))
    model.eval()(torch.randn(1, 3, 8, 8))  # no randomness in eval mode
