"""LSE merge (seqpar.merge): merging key blocks reproduces full attention, -inf handling, dtypes."""

from __future__ import annotations

import pytest
import torch

from seqpar.backends.reference import reference_attention
from seqpar.parallel.merge import accumulator_dtype, merge, merge_, new_accumulators

NEG_INF = float("-inf")


def _inputs(b, sq, sk, h, hkv, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, sk, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, sk, hkv, d, generator=gen, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("splits", [(5, 32), (1, 0, 36), (12, 12, 13), (0, 37), (37,)])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3)])
@pytest.mark.parametrize("acc_dtype", [torch.float64, torch.float32])
def test_merging_key_blocks_reproduces_full_attention(splits, heads, acc_dtype):
    h, hkv = heads
    q, k, v = _inputs(2, 9, sum(splits), h, hkv, 16)
    out_ref, lse_ref = reference_attention(q, k, v, return_lse=True)
    out_acc, lse_acc = new_accumulators(q.shape, device="cpu", dtype=acc_dtype)
    assert out_acc.dtype == lse_acc.dtype == acc_dtype
    assert lse_acc.shape == (2, h, 9) and bool((lse_acc == NEG_INF).all())
    for kb, vb in zip(k.split(list(splits), dim=1), v.split(list(splits), dim=1), strict=True):
        out_blk, lse_blk = reference_attention(q, kb, vb, return_lse=True)
        merge_(out_acc, lse_acc, out_blk.to(acc_dtype), lse_blk.to(acc_dtype))
    tol = 1e-12 if acc_dtype == torch.float64 else 2e-6
    torch.testing.assert_close(out_acc.double(), out_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse_acc.double(), lse_ref, atol=tol, rtol=tol)


def test_merge_order_does_not_matter():
    q, k, v = _inputs(1, 7, 20, 2, 2, 8, seed=1)
    blocks = [reference_attention(q, kb, vb, return_lse=True)
              for kb, vb in zip(k.split(5, dim=1), v.split(5, dim=1))]
    results = []
    for order in ([0, 1, 2, 3], [3, 1, 0, 2]):
        out_acc, lse_acc = new_accumulators(q.shape, device="cpu", dtype=torch.float64)
        for i in order:
            merge_(out_acc, lse_acc, *blocks[i])
        results.append((out_acc, lse_acc))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-13, rtol=0)
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-13, rtol=0)


def test_minus_inf_on_either_side_is_exact():
    # Rows: acc empty / block empty / both empty / both present.
    out_acc = torch.tensor([[[[0.0]], [[2.0]], [[0.0]], [[1.0]]]])  # [1, S=4, H=1, D=1]
    lse_acc = torch.tensor([[[NEG_INF, 0.5, NEG_INF, 0.0]]])  # [1, H=1, S=4]
    out_blk = torch.tensor([[[[3.0]], [[0.0]], [[0.0]], [[3.0]]]])
    lse_blk = torch.tensor([[[1.5, NEG_INF, NEG_INF, 0.0]]])
    merge_(out_acc, lse_acc, out_blk, lse_blk)
    assert not torch.isnan(out_acc).any() and not torch.isnan(lse_acc).any()
    assert out_acc.flatten().tolist() == [3.0, 2.0, 0.0, 2.0]
    assert lse_acc[0, 0, 0].item() == 1.5 and lse_acc[0, 0, 1].item() == 0.5
    assert lse_acc[0, 0, 2].item() == NEG_INF
    assert lse_acc[0, 0, 3].item() == pytest.approx(torch.log(torch.tensor(2.0)).item())


def test_extreme_lse_gap_is_stable():
    out_acc = torch.ones(1, 2, 1, 3)
    lse_acc = torch.tensor([[[1000.0, -1000.0]]])
    out_blk = torch.full((1, 2, 1, 3), 5.0)
    lse_blk = torch.tensor([[[-1000.0, 1000.0]]])
    merge_(out_acc, lse_acc, out_blk, lse_blk)
    assert torch.isfinite(out_acc).all() and torch.isfinite(lse_acc).all()
    assert out_acc[0, 0].tolist() == [[1.0, 1.0, 1.0]]
    assert out_acc[0, 1].tolist() == [[5.0, 5.0, 5.0]]
    assert lse_acc.tolist() == [[[1000.0, 1000.0]]]


def test_bf16_block_outputs_are_upcast():
    q, k, v = _inputs(1, 11, 24, 4, 1, 32, seed=2)
    out_ref, lse_ref = reference_attention(q, k, v, return_lse=True)
    out_acc, lse_acc = new_accumulators(q.shape, device="cpu", dtype=torch.bfloat16)
    assert out_acc.dtype == torch.float32
    err_blocks = 0.0
    for kb, vb in zip(k.split(8, dim=1), v.split(8, dim=1)):
        out_blk, lse_blk = reference_attention(q, kb, vb, return_lse=True)
        out_bf16 = out_blk.to(torch.bfloat16)
        err_blocks = max(err_blocks, (out_bf16.double() - out_blk).abs().max().item())
        merge_(out_acc, lse_acc, out_bf16, lse_blk.float())
    # The merged result is a convex combination of the rounded blocks: no worse than their rounding.
    assert (out_acc.double() - out_ref).abs().max().item() <= err_blocks + 1e-6
    torch.testing.assert_close(lse_acc.double(), lse_ref, atol=1e-5, rtol=0)


def test_in_place_on_slices_of_larger_buffers():
    q, k, v = _inputs(2, 12, 10, 2, 2, 8, seed=3)
    out_ref, lse_ref = reference_attention(q, k, v, return_lse=True)
    out_acc, lse_acc = new_accumulators((2, 20, 2, 8), device="cpu", dtype=torch.float64)
    rows = slice(4, 16)  # merge rows 4..15 of the buffers only
    for kb, vb in zip(k.split(4, dim=1), v.split(4, dim=1)):
        out_blk, lse_blk = reference_attention(q, kb, vb, return_lse=True)
        merge_(out_acc[:, rows], lse_acc[:, :, rows], out_blk, lse_blk)
    torch.testing.assert_close(out_acc[:, rows], out_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse_acc[:, :, rows], lse_ref, atol=1e-12, rtol=0)
    assert (out_acc[:, :4] == 0).all() and (out_acc[:, 16:] == 0).all()
    assert (lse_acc[:, :, :4] == NEG_INF).all() and (lse_acc[:, :, 16:] == NEG_INF).all()


def test_varlen_layout_and_functional_merge():
    # Varlen accumulators: out [T, H, D] with lse [H, T].
    q, k, v = _inputs(1, 13, 18, 3, 3, 8, seed=4)
    out_ref, lse_ref = reference_attention(q, k, v, return_lse=True)
    parts = [reference_attention(q, kb, vb, return_lse=True)
             for kb, vb in zip(k.split(9, dim=1), v.split(9, dim=1))]
    (out_a, lse_a), (out_b, lse_b) = [(o[0], l[0]) for o, l in parts]
    out, lse = merge(out_a.float(), lse_a.float(), out_b.to(torch.bfloat16), lse_b.float())
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), out_ref[0], atol=1e-2, rtol=0)
    torch.testing.assert_close(lse.double(), lse_ref[0], atol=1e-5, rtol=0)
    out64, lse64 = merge(out_a, lse_a, out_b, lse_b)
    assert out64.dtype == torch.float64
    torch.testing.assert_close(out64, out_ref[0], atol=1e-12, rtol=0)
    torch.testing.assert_close(lse64, lse_ref[0], atol=1e-12, rtol=0)
    assert out_a.data_ptr() != out64.data_ptr()  # the functional form leaves inputs alone


def test_accumulator_dtype():
    assert accumulator_dtype(torch.float64) == torch.float64
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert accumulator_dtype(dtype) == torch.float32


@pytest.mark.parametrize(
    "out_shape, lse_shape, match",
    [
        ((2, 5, 3, 4), (2, 5, 3), "lse shape"),
        ((2, 5, 3, 4), (2, 3), "out must be"),
    ],
)
def test_shape_errors(out_shape, lse_shape, match):
    out_acc, lse_acc = new_accumulators((2, 5, 3, 4), device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match=match):
        merge_(out_acc, lse_acc, torch.zeros(out_shape), torch.zeros(lse_shape))


def test_accumulator_dtype_error():
    with pytest.raises(ValueError, match="float32 or float64"):
        merge_(torch.zeros(1, 2, 1, 1, dtype=torch.bfloat16),
               torch.zeros(1, 1, 2, dtype=torch.bfloat16),
               torch.zeros(1, 2, 1, 1), torch.zeros(1, 1, 2))
    with pytest.raises(ValueError, match="at least 3 dims"):
        new_accumulators((4, 2), device="cpu", dtype=torch.float32)
