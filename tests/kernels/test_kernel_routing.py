"""Fused routing kernel (latentmoe_kernels.routing) against route_topk_reference + plan_dispatch."""
import pytest
import torch

pytest.importorskip("triton")

from latentmoe_lab.ops.routing import plan_dispatch, route_and_plan, route_topk, route_topk_reference  # noqa: E402


def _check_against_reference(logits, top_k, bias=None, n_group=1, topk_group=1, scaling=1.0):
    kwargs = dict(bias=bias, n_group=n_group, topk_group=topk_group, renormalize=True, scaling=scaling)
    weights, indices, plan = route_and_plan(logits, top_k, backend="triton", **kwargs)
    ref_weights, ref_indices = route_topk_reference(logits, top_k, **kwargs)
    ref_plan = plan_dispatch(ref_indices, logits.shape[1])
    torch.testing.assert_close(weights, ref_weights)
    assert torch.equal(indices, ref_indices)
    for field in ("order", "token_index", "counts", "offsets"):
        assert torch.equal(getattr(plan, field), getattr(ref_plan, field)), field
    return plan


@pytest.mark.parametrize("num_tokens, num_experts, top_k, n_group, topk_group", [
    (37, 16, 4, 1, 1),   # tokens not a multiple of the 16-token block
    (1, 8, 2, 1, 1),     # one token
    (29, 16, 4, 4, 2),   # group-limited
    (3, 896, 16, 1, 1),  # full-scale expert count: E pads to 1024, two tokens per block
])
def test_fused_route_matches_reference(num_tokens, num_experts, top_k, n_group, topk_group):
    logits = torch.randn(num_tokens, num_experts) * 3
    bias = torch.randn(num_experts) * 0.1
    _check_against_reference(logits, top_k, bias, n_group, topk_group, scaling=2.5)


def test_expert_with_no_tokens_and_all_tokens_to_one_expert():
    logits = torch.randn(21, 8)
    bias = torch.zeros(8)
    bias[5] = -10.0  # nobody picks expert 5
    bias[2] = 10.0   # everybody picks expert 2
    plan = _check_against_reference(logits, 2, bias)
    assert plan.counts[5] == 0 and plan.counts[2] == 21


def test_route_topk_triton_and_empty_batch():
    logits = torch.randn(10, 12)
    weights, indices = route_topk(logits, 3, backend="triton")
    ref_weights, ref_indices = route_topk_reference(logits, 3)
    torch.testing.assert_close(weights, ref_weights)
    assert torch.equal(indices, ref_indices)
    weights, indices, plan = route_and_plan(torch.randn(0, 8), 2, backend="triton")
    assert weights.shape == (0, 2) and indices.shape == (0, 2) and plan.order.numel() == 0
    assert torch.equal(plan.counts, torch.zeros(8, dtype=torch.int64))


def test_route_and_plan_torch_backend_is_the_reference_pair():
    logits = torch.randn(9, 8)
    weights, indices, plan = route_and_plan(logits, 2, backend="torch")
    ref_weights, ref_indices = route_topk(logits, 2)
    assert torch.equal(weights, ref_weights) and torch.equal(indices, ref_indices)
    assert torch.equal(plan.order, plan_dispatch(ref_indices, 8).order)
