"""LatentMoE's routed strategies ("fused": ops.routed_experts, "steps": dispatch / experts / combine) against each
other and the per-token loop reference: outputs, the input's gradient and every parameter's gradient, on ragged
routing (experts without tokens, one expert taking every token), fp32 and fp64, with several tiles."""
import pytest
import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.moe import LatentExperts, LatentMoE
from latentmoe_lab.ops import batch_invariant, routed_experts
from latentmoe_lab.ops.routing import combine, permute, plan_dispatch

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-6, atol=1e-6)}
ROUTING = ["realistic", "empty_experts", "one_expert_takes_all"]
ACTIVATIONS = [{}, {"activation_clamp": 0.3}, {"activation": "situ"}]


def _layer(dtype, routing: str, **moe_changes) -> LatentMoE:
    """The tiny preset (group-limited sigmoid routing, renormalised top-2, a shared expert) with routing skewed by
    the correction bias: experts 0-3 unreachable, or expert 5 first choice of every token."""
    config = ModelConfig.from_preset("tiny")
    config = config.replace(moe={**config.to_dict()["moe"], **moe_changes})
    torch.manual_seed(0)
    layer = LatentMoE(config).to(dtype)
    with torch.no_grad():
        layer.router.weight.normal_(std=0.5)  # router scores spread as a trained router's do
        if routing == "empty_experts":
            layer.correction_bias[:4] = -10.0
        elif routing == "one_expert_takes_all":
            layer.correction_bias[5] = 10.0
    return layer


def _gradients(out: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    torch.manual_seed(2)
    return list(torch.autograd.grad(out, inputs, torch.randn_like(out)))


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=["swiglu", "clamp", "situ"])
@pytest.mark.parametrize("routing", ROUTING)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_every_strategy_equals_the_reference(monkeypatch, dtype, routing, activation):
    """Tiles of 5 rows: several experts to a tile, and an expert with more rows alone in an oversized tile."""
    monkeypatch.setattr(routed_experts, "FUSED_TILE_ROWS", 5)
    layer = _layer(dtype, routing, **activation)
    torch.manual_seed(1)
    x = torch.randn(2, 9, layer.hidden_size, dtype=dtype, requires_grad=True)
    params = [x] + list(layer.parameters())
    reference = layer.reference_forward(x)
    expected = _gradients(reference, params)
    counts = None
    for strategy in ("fused", "steps"):
        layer.routed_strategy = strategy
        out = layer(x)
        assert layer.strategy(x[0]) == strategy
        torch.testing.assert_close(out, reference, **TOL[dtype])
        for got, want in zip(_gradients(out, params), expected):
            torch.testing.assert_close(got, want, **TOL[dtype])
        counts = layer.last_expert_counts
    if routing == "empty_experts":
        assert int(counts[:4].sum()) == 0
    if routing == "one_expert_takes_all":
        assert int(counts[5]) == 18


@pytest.mark.parametrize("tile_rows", [4096, 3])
def test_fused_step_equals_the_steps_twin_with_router_weight_gradients(tile_rows):
    """fused_routed_experts against permute + forward_reference + combine: the routing weights' gradient too."""
    torch.manual_seed(0)
    experts = LatentExperts(8, 16, 12)
    with torch.no_grad():
        experts.w13.normal_(std=0.5)
        experts.w2.normal_(std=0.5)
    indices = torch.tensor([[5, 1], [5, 0], [5, 7], [5, 1], [2, 5], [5, 1], [7, 5]])  # experts 3, 4, 6 get no rows
    plan = plan_dispatch(indices, 8)
    z = torch.randn(7, 16, requires_grad=True)
    weights = torch.rand(7, 2, requires_grad=True)
    fused = routed_experts.fused_routed_experts(z, weights, plan, experts.w13, experts.w2, tile_rows=tile_rows)
    twin = combine(experts.forward_reference(permute(z, plan), plan.counts), weights, plan, 7)
    torch.testing.assert_close(fused, twin, **TOL[torch.float32])
    inputs = [z, weights, experts.w13, experts.w2]
    for got, want in zip(_gradients(fused, inputs), _gradients(twin, inputs)):
        torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_auto_takes_fused_where_it_applies_and_steps_elsewhere():
    layer = _layer(torch.float32, "realistic")
    z = torch.randn(4, layer.latent_size)
    assert layer.strategy(z) == "fused"
    with torch.no_grad():  # inference too: the fused forward beats steps and the per-expert loop (bench_moe.py)
        assert layer.strategy(z) == "fused"
    with batch_invariant.batch_invariant_mode():
        assert layer.strategy(z) == "steps"
        layer.routed_strategy = "fused"
        with pytest.raises(ValueError, match="^routed_strategy:"):
            layer.strategy(z)
    layer.routed_strategy = "auto"
    layer.dispatcher = type("Recording", (), {})()  # an expert-parallel or recording dispatcher
    assert layer.strategy(z) == "steps"
    layer.routed_strategy = "fastest"
    with pytest.raises(ValueError, match="^routed_strategy:"):
        layer.strategy(z)


def test_bad_arguments_are_refused_naming_them():
    experts = LatentExperts(4, 16, 8)
    plan = plan_dispatch(torch.tensor([[0, 1], [2, 3]]), 4)
    z, weights = torch.randn(2, 16), torch.rand(2, 2)
    call = routed_experts.fused_routed_experts
    with pytest.raises(ValueError, match="^weights:"):
        call(z, torch.rand(2, 3), plan, experts.w13, experts.w2)
    with pytest.raises(ValueError, match="^w2:"):
        call(z, weights, plan, experts.w13, experts.w2[:, :4])
    with pytest.raises(TypeError, match="^w13, w2:"):
        call(z.double(), weights, plan, experts.w13, experts.w2)
    with pytest.raises(ValueError, match="^plan:"):
        call(z, weights, plan_dispatch(torch.tensor([[0, 1], [2, 3]]), 5), experts.w13, experts.w2)
    with pytest.raises(ValueError, match="^tile_rows:"):
        call(z, weights, plan, experts.w13, experts.w2, tile_rows=0)


@pytest.mark.parametrize("routing", ROUTING)
def test_a_fused_forward_without_a_graph_equals_the_recorded_one_and_steps(monkeypatch, routing):
    """Under no_grad the fused pass reuses one workspace per tile instead of keeping every tile for a backward
    (its parameters still require grad): the same bits as the recorded forward, and steps' values."""
    monkeypatch.setattr(routed_experts, "FUSED_TILE_ROWS", 5)
    layer = _layer(torch.float32, routing)
    x = torch.randn(3, 7, layer.hidden_size)
    recorded = layer(x)
    assert recorded.requires_grad
    with torch.no_grad():
        inference = layer(x)
        layer.routed_strategy = "steps"
        steps = layer(x)
    assert torch.equal(inference, recorded.detach())
    torch.testing.assert_close(inference, steps, **TOL[torch.float32])
