"""The SwiGLU activation clamp of docs/design.md §1.2: act(min(gate, c)) * clamp(up, -c, c), in routed AND
shared experts, checked against a per-token loop written from the formula (outputs and gradients)."""
import pytest
import torch
import torch.nn.functional as F

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.ffn import SwiGLU
from latentmoe_lab.layers.moe import LatentMoE
from latentmoe_lab.ops.routing import grouped_matmul_reference, grouped_swiglu, route_topk_reference

CLAMP = 0.05  # small enough that most gates and ups of the tiny preset hit it (asserted below)


def _formula(gate: torch.Tensor, up: torch.Tensor, c: float) -> torch.Tensor:
    return F.silu(torch.minimum(gate, torch.full_like(gate, c))) * up.clamp(-c, c)


def _layer() -> LatentMoE:
    cfg = ModelConfig.from_preset("tiny")
    cfg = cfg.replace(moe={**cfg.to_dict()["moe"], "activation_clamp": CLAMP})
    torch.manual_seed(0)
    layer = LatentMoE(cfg)
    with torch.no_grad():  # larger weights so pre-activations spread well past +-CLAMP
        for p in (layer.experts.w13, layer.shared.w1.weight, layer.shared.w3.weight, layer.down.weight):
            p.mul_(8.0)
    return layer


def _per_token_reference(layer: LatentMoE, x: torch.Tensor) -> torch.Tensor:
    """Route each token alone, run each selected expert and the shared experts from the formula."""
    x_nd = x.flatten(0, 1)
    weights, indices = route_topk_reference(layer.router_logits(x_nd), layer.top_k, bias=layer.correction_bias,
                                            n_group=layer.n_group, topk_group=layer.topk_group,
                                            scaling=layer.routed_scaling)
    inter = layer.experts.w2.shape[1]
    rows = []
    for n, x_row in enumerate(x_nd):
        z = layer.down(x_row)
        acc = torch.zeros(z.shape[-1])
        for w, e in zip(weights[n], indices[n].tolist()):
            gate_up = z @ layer.experts.w13[e]
            acc = acc + w * (_formula(gate_up[:inter], gate_up[inter:], CLAMP) @ layer.experts.w2[e])
        shared = layer.shared
        shared_out = shared.w2(_formula(shared.w1(x_row), shared.w3(x_row), CLAMP))
        rows.append(layer.up(layer.latent_norm(acc)) + shared_out)
    return torch.stack(rows).reshape(x.shape)


def test_clamp_is_active_in_routed_and_shared_experts():
    layer = _layer()
    x = torch.randn(2, 5, layer.hidden_size)
    gate_up = layer.down(x.flatten(0, 1)) @ layer.experts.w13[0]
    assert (gate_up.abs() > CLAMP).float().mean() > 0.5
    assert (layer.shared.w1(x).abs() > CLAMP).float().mean() > 0.5
    assert layer.shared.activation_clamp == CLAMP


@pytest.mark.parametrize("tokens", [1, 7])
def test_layer_and_its_twin_match_the_formula_outputs_and_gradients(tokens):
    layer = _layer()
    x = torch.randn(2, tokens, layer.hidden_size)
    outs, grads = [], []
    for fn in (layer.forward, layer.reference_forward, lambda v: _per_token_reference(layer, v)):
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        out = fn(xi)
        out.square().sum().backward()
        outs.append(out.detach())
        grads.append([xi.grad] + [p.grad.clone() for p in (layer.experts.w13, layer.experts.w2,
                                                           layer.shared.w1.weight, layer.shared.w3.weight)])
    for out, grad in zip(outs[:2], grads[:2]):
        torch.testing.assert_close(out, outs[2], rtol=1e-5, atol=1e-5)
        for g, g_ref in zip(grad, grads[2]):
            torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-5)


def test_clamp_acts_before_the_product():
    gate = torch.tensor([[4.0, -4.0, 0.01]])
    up = torch.tensor([[4.0, 4.0, -4.0]])
    ffn = SwiGLU(1, 3, activation_clamp=1.0)
    with torch.no_grad():
        ffn.w1.weight.copy_(gate.T)
        ffn.w3.weight.copy_(up.T)
        ffn.w2.weight.fill_(1.0)
    # silu(min(4, 1)) * 1 + silu(-4) * 1 + silu(0.01) * -1; clamping the product instead gives 1 + ... != this
    expected = F.silu(torch.tensor(1.0)) + F.silu(torch.tensor(-4.0)) - F.silu(torch.tensor(0.01))
    torch.testing.assert_close(ffn(torch.ones(1, 1)), expected.reshape(1, 1))


def test_grouped_swiglu_torch_path_uses_the_same_clamp():
    torch.manual_seed(3)
    offsets = torch.tensor([5, 5, 12])
    x, w13 = torch.randn(12, 16), torch.randn(3, 16, 2 * 8)
    gate, up = grouped_matmul_reference(x, w13, offsets).chunk(2, dim=-1)
    torch.testing.assert_close(grouped_swiglu(x, w13, offsets, clamp=0.5, backend="torch"),
                               _formula(gate, up, 0.5))
