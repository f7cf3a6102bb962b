"""Routing, dispatch and grouped matmul against their reference twins (docs/design.md §1.2)."""
import pytest
import torch

from latentmoe_lab.ops.routing import (
    combine, grouped_matmul, grouped_matmul_reference, permute, plan_dispatch, route_topk, route_topk_reference,
)


def _offsets(counts):
    return torch.tensor(counts).cumsum(0)


# ------------------------------------------------------------------ route_topk
@pytest.mark.parametrize("scaling", [1.0, 2.5])
def test_weights_sum_to_scaling_when_renormalised(scaling):
    torch.manual_seed(0)
    weights, indices = route_topk(torch.randn(7, 12), top_k=3, scaling=scaling)
    assert weights.dtype == torch.float32 and indices.dtype == torch.int64
    assert weights.shape == indices.shape == (7, 3)
    torch.testing.assert_close(weights.sum(-1), torch.full((7,), scaling))


def test_without_renormalisation_weights_are_scaled_sigmoid_scores():
    torch.manual_seed(0)
    logits = torch.randn(5, 8)
    weights, indices = route_topk(logits, top_k=2, renormalize=False, scaling=3.0)
    torch.testing.assert_close(weights, 3.0 * torch.sigmoid(logits).gather(-1, indices))


def test_bias_changes_selection_but_not_the_weight_formula():
    torch.manual_seed(0)
    logits = torch.randn(6, 8, dtype=torch.bfloat16)
    bias = torch.zeros(8)
    bias[5] = 10.0
    _, plain_idx = route_topk(logits, top_k=2)
    weights, indices = route_topk(logits, top_k=2, bias=bias)
    assert (indices == 5).any(-1).all() and not (plain_idx == 5).any(-1).all()
    scores = torch.sigmoid(logits.float()).gather(-1, indices)
    torch.testing.assert_close(weights, scores / scores.sum(-1, keepdim=True))
    assert weights.max() < 1.0  # a bias of 10 never reaches the weights


@pytest.mark.parametrize("bias_shift", [0.0, -5.0])
def test_group_limited_routing_picks_only_kept_groups(bias_shift):
    torch.manual_seed(0)
    logits = torch.randn(20, 16)
    bias = torch.randn(16) * 0.1 + bias_shift  # all-negative biased scores must still win over dropped groups
    weights, indices = route_topk(logits, top_k=3, bias=bias, n_group=4, topk_group=2)
    choice = (torch.sigmoid(logits) + bias).view(20, 4, 4)
    best_groups = choice.topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices  # [N, 2]
    assert ((indices // 4).unsqueeze(-1) == best_groups.unsqueeze(1)).any(-1).all()
    ref_w, ref_idx = route_topk_reference(logits, top_k=3, bias=bias, n_group=4, topk_group=2)
    torch.testing.assert_close(indices.sort(-1).values, ref_idx.sort(-1).values)
    torch.testing.assert_close(weights.sum(-1), ref_w.sum(-1))


@pytest.mark.parametrize("n_group,topk_group,top_k", [(1, 1, 1), (1, 1, 4), (2, 1, 3), (4, 3, 5)])
def test_route_topk_matches_per_row_reference(n_group, topk_group, top_k):
    torch.manual_seed(n_group * 10 + top_k)
    logits, bias = torch.randn(9, 12), torch.randn(12) * 0.3
    weights, indices = route_topk(logits, top_k, bias=bias, n_group=n_group, topk_group=topk_group, scaling=1.5)
    ref_w, ref_idx = route_topk_reference(logits, top_k, bias=bias, n_group=n_group, topk_group=topk_group,
                                          scaling=1.5)
    torch.testing.assert_close(indices, ref_idx)  # both return the experts in descending choice order
    torch.testing.assert_close(weights, ref_w)


def test_all_zero_scores_give_zero_weights_not_nan():
    weights, _ = route_topk(torch.full((2, 4), -200.0), top_k=2)
    assert torch.isfinite(weights).all() and (weights == 0).all()


@pytest.mark.parametrize("kwargs,name,error", [
    (dict(logits=torch.randn(2, 3, 4)), "logits", ValueError),
    (dict(logits=torch.ones(2, 4, dtype=torch.int64)), "logits", TypeError),
    (dict(logits=torch.tensor([[0.0, float("nan"), 0.0, 0.0]])), "logits", ValueError),
    (dict(top_k=5), "top_k", ValueError),
    (dict(top_k=0), "top_k", ValueError),
    (dict(n_group=3), "n_group", ValueError),
    (dict(n_group=4), "n_group", ValueError),  # one expert per group: no top-2 group score
    (dict(n_group=2, topk_group=3), "topk_group", ValueError),
    (dict(top_k=3, n_group=2, topk_group=1), "top_k", ValueError),
    (dict(bias=torch.zeros(3)), "bias", ValueError),
    (dict(bias=torch.zeros(4, dtype=torch.int64)), "bias", TypeError),
])
def test_route_topk_validation_names_the_argument(kwargs, name, error):
    args = dict(logits=torch.randn(2, 4), top_k=2) | kwargs
    with pytest.raises(error, match=f"^{name}:"):
        route_topk(**args)


# --------------------------------------------------------- permute / combine
def test_permute_is_expert_major_and_combine_round_trips():
    torch.manual_seed(0)
    x = torch.randn(5, 3)
    indices = torch.tensor([[2, 0], [0, 3], [3, 2], [2, 0], [0, 2]])
    plan = plan_dispatch(indices, num_experts=5)
    assert plan.counts.tolist() == [4, 0, 4, 2, 0] and plan.offsets.tolist() == [4, 4, 8, 10, 10]
    x_perm = permute(x, plan)
    row_expert = indices.reshape(-1)[plan.order]
    assert torch.equal(row_expert, row_expert.sort().values)
    torch.testing.assert_close(x_perm, x[plan.token_index])
    weights = torch.full((5, 2), 0.5)
    torch.testing.assert_close(combine(x_perm, weights, plan, num_tokens=5), x)


def test_combine_weights_each_pair_and_accumulates_in_fp32():
    torch.manual_seed(0)
    indices = torch.tensor([[1, 0], [0, 1], [1, 0]])
    plan = plan_dispatch(indices, num_experts=2)
    y = torch.randn(6, 4, dtype=torch.bfloat16)
    weights = torch.rand(3, 2)
    out = combine(y, weights, plan, num_tokens=3)
    assert out.dtype == torch.float32
    per_pair = torch.empty(6, 4)
    per_pair[plan.order] = y.float()  # back to (token, slot) order
    torch.testing.assert_close(out, (per_pair.view(3, 2, 4) * weights.unsqueeze(-1)).sum(1))
    # 1 + 2^-9 + 2^-9 is exact in fp32 but rounds back to 1 in bf16.
    tiny = torch.tensor([[1.0], [2 ** -9], [2 ** -9]], dtype=torch.bfloat16)
    plan_one = plan_dispatch(torch.zeros(1, 3, dtype=torch.int64), num_experts=1)
    total = combine(tiny, torch.ones(1, 3), plan_one, num_tokens=1)
    assert total.item() == 1 + 2 ** -8


def test_dispatch_validation_names_the_argument():
    with pytest.raises(ValueError, match="^indices:"):
        plan_dispatch(torch.tensor([[0, 4]]), num_experts=4)
    with pytest.raises(TypeError, match="^indices:"):
        plan_dispatch(torch.zeros(2, 2), num_experts=4)
    with pytest.raises(ValueError, match="^num_experts:"):
        plan_dispatch(torch.zeros(2, 2, dtype=torch.int64), num_experts=0)
    plan = plan_dispatch(torch.zeros(2, 2, dtype=torch.int64), num_experts=3)
    with pytest.raises(ValueError, match="^x:"):
        permute(torch.randn(3, 4), plan)
    with pytest.raises(ValueError, match="^weights:"):
        combine(torch.randn(4, 4), torch.ones(2, 3), plan, num_tokens=2)
    with pytest.raises(ValueError, match="^num_tokens:"):
        combine(torch.randn(4, 4), torch.ones(2, 2), plan, num_tokens=3)


# ------------------------------------------------------------- grouped matmul
COUNT_CASES = {
    "ragged_with_empty": [3, 0, 5, 1, 0],
    "all_to_one": [0, 0, 9, 0, 0],
    "first_and_last_empty": [0, 2, 2, 3, 0],
    "no_rows": [0, 0, 0, 0, 0],
}


@pytest.mark.parametrize("counts", COUNT_CASES.values(), ids=COUNT_CASES.keys())
@pytest.mark.parametrize("impl", ["grouped_mm", "padded", "auto"])
def test_grouped_matmul_matches_reference(counts, impl):
    torch.manual_seed(0)
    x, w = torch.randn(sum(counts), 8), torch.randn(5, 8, 12)
    offsets = _offsets(counts)
    torch.testing.assert_close(grouped_matmul(x, w, offsets, impl=impl), grouped_matmul_reference(x, w, offsets))


@pytest.mark.parametrize("counts", COUNT_CASES.values(), ids=COUNT_CASES.keys())
def test_grouped_matmul_unaligned_dims_fall_back(counts):
    torch.manual_seed(0)
    x, w = torch.randn(sum(counts), 6), torch.randn(5, 6, 3)
    offsets = _offsets(counts)
    torch.testing.assert_close(grouped_matmul(x, w, offsets), grouped_matmul_reference(x, w, offsets))
    with pytest.raises(ValueError, match="^impl:"):
        grouped_matmul(x, w, offsets, impl="grouped_mm")


def test_grouped_matmul_bf16_fast_path():
    torch.manual_seed(0)
    x, w = torch.randn(7, 16, dtype=torch.bfloat16), torch.randn(3, 16, 8, dtype=torch.bfloat16)
    offsets = _offsets([4, 0, 3])
    out = grouped_matmul(x, w, offsets, impl="grouped_mm")
    torch.testing.assert_close(out, grouped_matmul_reference(x, w, offsets), rtol=2e-2, atol=2e-2)


def test_grouped_matmul_gradients_match_reference():
    torch.manual_seed(0)
    x, w = torch.randn(9, 8, requires_grad=True), torch.randn(5, 8, 4, requires_grad=True)
    offsets = _offsets([3, 0, 5, 1, 0])
    grouped_matmul(x, w, offsets).square().sum().backward()  # auto must avoid the CPU grouped_mm backward
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    grouped_matmul_reference(x, w, offsets).square().sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)


@pytest.mark.parametrize("args,name,error", [
    ((torch.randn(4), torch.randn(2, 4, 3), torch.tensor([2, 4])), "x", ValueError),
    ((torch.randn(4, 4), torch.randn(2, 5, 3), torch.tensor([2, 4])), "w", ValueError),
    ((torch.randn(4, 4), torch.randn(2, 4, 3, dtype=torch.float64), torch.tensor([2, 4])), "w", TypeError),
    ((torch.randn(4, 4), torch.randn(2, 4, 3), torch.tensor([4])), "offsets", ValueError),
    ((torch.randn(4, 4), torch.randn(2, 4, 3), torch.tensor([2.0, 4.0])), "offsets", TypeError),
    ((torch.randn(4, 4), torch.randn(2, 4, 3), torch.tensor([3, 2])), "offsets", ValueError),
    ((torch.randn(4, 4), torch.randn(2, 4, 3), torch.tensor([2, 3])), "offsets", ValueError),
])
def test_grouped_matmul_validation_names_the_argument(args, name, error):
    with pytest.raises(error, match=f"^{name}:"):
        grouped_matmul(*args)


def test_auto_takes_grouped_mm_only_without_autograd(monkeypatch):
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, w = torch.randn(5, 8), torch.randn(2, 8, 4, requires_grad=True)
    offsets = _offsets([2, 3])
    with torch.no_grad():
        grouped_matmul(x, w, offsets)
    assert len(calls) == 1
    grouped_matmul(x, w, offsets)
    assert len(calls) == 1
