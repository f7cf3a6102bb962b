"""Grouped GEMM / SwiGLU / combine kernels (latentmoe_kernels.grouped_gemm) against the torch ops."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from latentmoe_lab.ops.routing import (combine, grouped_matmul, grouped_matmul_reference, grouped_swiglu,  # noqa: E402
                                       plan_dispatch)

COUNT_PATTERNS = {
    "ragged_with_empty_expert": [5, 0, 17, 3],  # 17 rows: one full 16-row tile plus one row
    "all_rows_to_one_expert": [0, 0, 37, 0],
    "one_row": [1, 0],
}


def _swiglu_reference(x, w13, offsets, clamp):
    gate, up = grouped_matmul_reference(x, w13, offsets).chunk(2, dim=-1)
    if clamp is not None:  # docs/design.md §1.2: the bound acts on gate and up, before the product
        gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
    return F.silu(gate) * up


@pytest.mark.parametrize("pattern", COUNT_PATTERNS)
@pytest.mark.parametrize("width", [60, 64])
def test_grouped_swiglu_then_down_projection(pattern, width):
    offsets = torch.tensor(COUNT_PATTERNS[pattern]).cumsum(0)
    num_experts, rows, inter = offsets.shape[0], int(offsets[-1]), 24
    x = torch.randn(rows, width)
    w13 = torch.randn(num_experts, width, 2 * inter) * width ** -0.5
    w2 = torch.randn(num_experts, inter, width) * inter ** -0.5
    for clamp in (None, 0.5):
        hidden = grouped_swiglu(x, w13, offsets, clamp=clamp, backend="triton")
        torch.testing.assert_close(hidden, _swiglu_reference(x, w13, offsets, clamp))
    out = grouped_matmul(hidden, w2, offsets, backend="triton")
    torch.testing.assert_close(out, grouped_matmul_reference(hidden, w2, offsets))


def test_grouped_gemm_16_bit_accumulates_in_fp32():
    # fp16, not bf16: numpy has no bfloat16, and the interpreter's tl.dot multiplies raw bf16 bits.
    offsets = torch.tensor([3, 3, 40])
    x = torch.randn(40, 64, dtype=torch.float16)
    w = torch.randn(3, 64, 48, dtype=torch.float16)
    out = grouped_matmul(x, w, offsets, backend="triton")
    assert out.dtype == torch.float16
    expected = grouped_matmul_reference(x.float(), w.float(), offsets)
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize("num_tokens, top_k, num_experts", [(13, 3, 5), (1, 2, 4)])
def test_combine_matches_torch(num_tokens, top_k, num_experts):
    indices = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k)
    plan = plan_dispatch(indices, num_experts)
    y = torch.randn(num_tokens * top_k, 70)
    got = combine(y, weights, plan, num_tokens, backend="triton")
    torch.testing.assert_close(got, combine(y, weights, plan, num_tokens, backend="torch"))
