"""ops.balancing.quantile_bias (K3's router-bias rule): its twin, its meaning, and the six imbalance workloads."""
import pytest
import torch

from latentmoe_lab.ops.balancing import bias_update, expert_counts, quantile_bias, quantile_bias_reference
from latentmoe_lab.ops.routing import route_topk
from latentmoe_lab.routing_workloads import WORKLOADS, make_workload


@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 4, 2), (37, 8, 3), (256, 16, 4), (100, 6, 6)])
def test_matches_its_twin_and_is_mean_centred(num_tokens, num_experts, top_k):
    scores = torch.sigmoid(torch.randn(num_tokens, num_experts) * 2 + torch.randn(num_experts))
    bias = quantile_bias(scores, top_k)
    torch.testing.assert_close(bias, quantile_bias_reference(scores, top_k), rtol=0, atol=1e-6)
    assert bias.dtype == torch.float32 and abs(float(bias.mean())) < 1e-6


def test_each_expert_clears_the_common_threshold_on_its_share():
    num_tokens, num_experts, top_k = 400, 8, 2  # a share K/E = 100 tokens per expert
    scores = torch.sigmoid(torch.randn(num_tokens, num_experts) + torch.linspace(-2, 2, num_experts))
    bias = quantile_bias(scores, top_k)
    # b_i = mean(Q) - Q_i, so s_i + b_i > mean(Q) exactly where s_i > Q_i: one threshold for all experts.
    threshold = torch.quantile(scores, 1 - top_k / num_experts, dim=0).mean()
    above = ((scores + bias) > threshold).sum(0)
    assert (above - num_tokens * top_k / num_experts).abs().max() <= 1


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_one_quantile_step_balances_every_imbalance_workload(name):
    """Route, apply the rule once to the batch's scores, route again: the busiest expert carries at most
    1.5x the mean on every workload, where one sign step (rate 1e-3, the full-scale rate) changes nothing."""
    num_tokens, num_experts, top_k = 2048, 32, 4
    workload = make_workload(name, num_tokens, num_experts, top_k, seed=1)
    _, before = route_topk(workload.logits, top_k)
    load_before = expert_counts(before, num_experts).float()
    bias = quantile_bias(torch.sigmoid(workload.logits), top_k)
    _, after = route_topk(workload.logits, top_k, bias=bias)
    load_after = expert_counts(after, num_experts).float()
    assert float(load_after.max() / load_after.mean()) <= 1.5, (name, load_after.tolist())
    assert float(load_after.min()) > 0, name  # the dead expert comes back
    sign = bias_update(torch.zeros(num_experts), expert_counts(before, num_experts), 1e-3)
    _, sign_after = route_topk(workload.logits, top_k, bias=sign)
    load_sign = expert_counts(sign_after, num_experts).float()
    if float(load_before.max() / load_before.mean()) > 1.5:  # the five skewed workloads
        assert float(load_sign.max() / load_sign.mean()) > 1.5, name


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="scores"):
        quantile_bias(torch.rand(8), 2)
    with pytest.raises(ValueError, match="scores"):
        quantile_bias(torch.rand(0, 8), 2)
    for bad in (0, 9, 2.0, True):
        with pytest.raises(ValueError, match="top_k"):
            quantile_bias(torch.rand(5, 8), bad)
