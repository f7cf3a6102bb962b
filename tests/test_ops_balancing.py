"""Balancing ops (docs/design.md §1.2): bias update, sequence aux loss, z-loss, routing statistics; layer hooks."""
import math

import pytest
import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.moe import LatentMoE
from latentmoe_lab.ops.balancing import (bias_update, expert_counts, load_stats, router_z_loss, routing_stats,
                                         sequence_aux_loss, sequence_aux_loss_reference)
from latentmoe_lab.ops.routing import route_topk


# ------------------------------------------------------------- bias update
def test_bias_update_moves_towards_balance_and_is_pure():
    bias = torch.tensor([0.0, 0.1, -0.1, 0.0])
    counts = torch.tensor([10, 2, 4, 4])  # mean 5
    new = bias_update(bias, counts, rate=0.01)
    torch.testing.assert_close(new, bias + torch.tensor([-0.01, 0.01, 0.01, 0.01]))
    assert bias.tolist() == pytest.approx([0.0, 0.1, -0.1, 0.0])  # input untouched
    assert new.dtype == torch.float32 and not new.requires_grad


def test_bias_update_lowers_the_overloaded_experts_share_in_the_next_routing():
    torch.manual_seed(0)
    logits = torch.randn(256, 8)
    logits[:, 3] += 2.0  # expert 3 is everyone's favourite
    bias = torch.zeros(8)
    _, indices = route_topk(logits, 2, bias=bias)
    before = expert_counts(indices, 8)
    for _ in range(200):
        bias = bias_update(bias, expert_counts(route_topk(logits, 2, bias=bias)[1], 8), rate=0.01)
    after = expert_counts(route_topk(logits, 2, bias=bias)[1], 8)
    assert bias[3] < 0 and bias[3] == bias.min()
    assert after.max() / after.float().mean() < before.max() / before.float().mean()


def test_bias_shift_common_to_all_experts_changes_nothing_and_bias_gets_no_gradient():
    torch.manual_seed(0)
    logits = torch.randn(6, 8, requires_grad=True)
    bias = torch.randn(8) * 0.1
    w1, i1 = route_topk(logits, 3, bias=bias)
    w1.square().sum().backward()
    grad = logits.grad.clone()
    logits.grad = None
    w2, i2 = route_topk(logits, 3, bias=bias + 0.3)
    w2.square().sum().backward()
    assert torch.equal(i1, i2) and torch.equal(w1, w2) and torch.equal(grad, logits.grad)


def test_layer_update_bias_uses_the_rule_and_leaves_gradients_alone(tiny_config):
    layer = LatentMoE(tiny_config.replace(moe={**tiny_config.to_dict()["moe"], "bias_update_rate": 0.05}))
    layer(torch.randn(2, 8, 64)).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    counts = layer.last_expert_counts
    expected = bias_update(layer.correction_bias, counts, 0.05)
    layer.update_bias(counts)
    torch.testing.assert_close(layer.correction_bias, expected)
    assert "correction_bias" not in dict(layer.named_parameters())
    assert all(torch.equal(grads[n], p.grad) for n, p in layer.named_parameters())


# -------------------------------------------------------------- aux loss
def test_aux_loss_matches_hand_computed_closed_form():
    # One sequence, T=2, E=2, K=1. logits (0, ln 3) -> sigmoid (1/2, 3/4) -> normalised (0.4, 0.6).
    ln3 = math.log(3.0)
    logits = torch.tensor([[[0.0, ln3], [0.0, ln3]]])
    # Both tokens on expert 1: f = E/(K T) * counts = (0, 2), P = (0.4, 0.6) -> L = alpha * 2 * 0.6.
    torch.testing.assert_close(sequence_aux_loss(logits, torch.tensor([[[1], [1]]]), alpha=0.1), torch.tensor(0.12))
    # One token each: f = (1, 1) -> L = alpha * (0.4 + 0.6) = alpha, the balanced value.
    torch.testing.assert_close(sequence_aux_loss(logits, torch.tensor([[[1], [0]]]), alpha=0.1), torch.tensor(0.1))


def test_aux_loss_is_per_sequence_matches_reference_and_reaches_only_the_scores():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 8, requires_grad=True)
    _, indices = route_topk(logits.detach().reshape(-1, 8), 2)
    indices = indices.view(3, 5, 2)
    loss = sequence_aux_loss(logits, indices, alpha=0.3)
    torch.testing.assert_close(loss, sequence_aux_loss_reference(logits, indices, alpha=0.3))
    per_sequence = torch.stack([sequence_aux_loss(logits[b:b + 1], indices[b:b + 1]) for b in range(3)])
    torch.testing.assert_close(loss, 0.3 * per_sequence.mean())
    loss.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


def test_z_loss_closed_form():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]], dtype=torch.bfloat16)
    expected = (math.log(2.0) ** 2 + math.log(4.0) ** 2) / 2
    assert router_z_loss(logits).dtype == torch.float32
    assert router_z_loss(logits).item() == pytest.approx(expected, rel=1e-2)  # bf16 inputs


def test_layer_exposes_scaled_losses_of_the_last_forward(tiny_config):
    moe = {**tiny_config.to_dict()["moe"], "aux_loss_alpha": 0.5, "z_loss_coef": 0.01}
    layer = LatentMoE(tiny_config.replace(moe=moe))
    x = torch.randn(2, 6, 64)
    layer(x)
    logits = layer.router_logits(x.reshape(-1, 64))
    _, indices = layer.route(x.reshape(-1, 64))
    torch.testing.assert_close(layer.last_aux_loss, sequence_aux_loss(logits.view(2, 6, 8), indices.view(2, 6, 2), 0.5))
    torch.testing.assert_close(layer.last_z_loss, 0.01 * router_z_loss(logits))
    layer.last_aux_loss.backward()
    assert layer.router.weight.grad.abs().sum() > 0
    plain = LatentMoE(tiny_config)
    plain(x)
    assert plain.last_aux_loss.item() == 0 and not plain.last_aux_loss.requires_grad


# ------------------------------------------------------------- statistics
def test_routing_stats_on_a_hand_made_step():
    indices = torch.tensor([[0, 1], [0, 2], [0, 1], [0, 3]])  # counts [4, 2, 1, 1], mean 2
    stats = routing_stats(indices, 4, capacity_factor=1.0, logits=torch.zeros(4, 4))
    assert stats.counts.tolist() == [4, 2, 1, 1]
    assert stats.max_over_mean == 2.0 and stats.min_over_mean == 0.5
    assert stats.capacity == 2 and stats.dropped_fraction == 2 / 8
    p = torch.tensor([0.5, 0.25, 0.125, 0.125])
    assert stats.load_entropy == pytest.approx(float(-(p * p.log()).sum() / math.log(4)))
    assert stats.router_entropy == pytest.approx(1.0)  # equal scores: uniform
    from_counts = load_stats(stats.counts, capacity_factor=1.0)
    assert (from_counts.max_over_mean, from_counts.dropped_fraction, from_counts.load_entropy) == (
        stats.max_over_mean, stats.dropped_fraction, stats.load_entropy)
    one = routing_stats(torch.zeros(3, 1, dtype=torch.int64), 4)
    assert one.load_entropy == 0.0 and one.dropped_fraction == 0.0 and one.router_entropy is None


@pytest.mark.parametrize("call,name,error", [
    (lambda: bias_update(torch.zeros(4), torch.zeros(3), 0.1), "counts", ValueError),
    (lambda: bias_update(torch.zeros(4), torch.zeros(4), -1.0), "rate", ValueError),
    (lambda: sequence_aux_loss(torch.zeros(4, 8), torch.zeros(4, 2, dtype=torch.int64)), "logits", ValueError),
    (lambda: sequence_aux_loss(torch.zeros(1, 4, 8), torch.zeros(1, 3, 2, dtype=torch.int64)), "indices", ValueError),
    (lambda: sequence_aux_loss(torch.zeros(1, 4, 8), torch.full((1, 4, 2), 8)), "indices", ValueError),
    (lambda: router_z_loss(torch.zeros(3, dtype=torch.int64)), "logits", TypeError),
    (lambda: routing_stats(torch.zeros(2, 2), 4), "indices", TypeError),
    (lambda: routing_stats(torch.zeros(2, 2, dtype=torch.int64), 4, capacity_factor=0), "capacity_factor", ValueError),
    (lambda: routing_stats(torch.zeros(2, 2, dtype=torch.int64), 4, logits=torch.zeros(2, 3)), "logits", ValueError),
    (lambda: routing_stats(torch.zeros(2, 2, dtype=torch.int64), 4, logits=torch.zeros(3, 4)), "logits", ValueError),
    (lambda: load_stats(torch.ones(4)), "counts", ValueError),
])
def test_validation_names_the_argument(call, name, error):
    with pytest.raises(error, match=f"^{name}:"):
        call()


def test_config_rejects_negative_coefficients():
    with pytest.raises(ValueError, match="^moe.aux_loss_alpha:"):
        ModelConfig.from_preset("tiny").replace(moe={**ModelConfig.from_preset("tiny").to_dict()["moe"],
                                                     "aux_loss_alpha": -1.0})
