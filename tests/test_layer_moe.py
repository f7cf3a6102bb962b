"""LatentMoE layer against its per-token reference (docs/design.md §1.2), plus the SwiGLU FFN."""
import pytest
import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.ffn import SwiGLU
from latentmoe_lab.layers.moe import LatentMoE, LocalDispatcher

TOL = dict(rtol=1e-5, atol=1e-5)


def _config(**moe_changes) -> ModelConfig:
    cfg = ModelConfig.from_preset("tiny")
    return cfg.replace(moe={**cfg.to_dict()["moe"], **moe_changes})


def _layer(seed=0, **moe_changes) -> LatentMoE:
    torch.manual_seed(seed)
    return LatentMoE(_config(**moe_changes))


def _input(layer, batch=2, tokens=5, seed=1):
    torch.manual_seed(seed)
    return torch.randn(batch, tokens, layer.hidden_size)


@pytest.mark.parametrize("grad", [False, True], ids=["grouped_mm", "padded"])
def test_forward_matches_reference(grad):
    layer = _layer()
    x = _input(layer)
    with torch.set_grad_enabled(grad):
        out = layer(x)
        ref = layer.reference_forward(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out, ref, **TOL)
    counts = layer.last_expert_counts
    assert counts.dtype == torch.int64 and counts.shape == (8,) and int(counts.sum()) == 10 * 2
    assert not counts.requires_grad


def test_expert_without_tokens_matches_reference():
    layer = _layer()
    layer.correction_bias[7] = -10.0  # expert 7 (and its group's score) sinks below every other choice
    x = _input(layer, batch=1, tokens=3)
    torch.testing.assert_close(layer(x), layer.reference_forward(x), **TOL)
    assert layer.last_expert_counts[7] == 0


@pytest.mark.parametrize("top_k,n_group,topk_group", [(1, 1, 1), (2, 4, 2)])
def test_every_token_on_one_expert_matches_reference(top_k, n_group, topk_group):
    layer = _layer(top_k=top_k, n_group=n_group, topk_group=topk_group)
    layer.correction_bias[3] = 10.0
    x = _input(layer, batch=2, tokens=4)
    torch.testing.assert_close(layer(x), layer.reference_forward(x), **TOL)
    assert layer.last_expert_counts[3] == 8


def test_single_token_without_shared_experts_with_clamp():
    layer = _layer(num_shared_experts=0, activation_clamp=1e-4)
    assert layer.shared is None
    x = _input(layer, batch=1, tokens=1)
    out = layer(x)
    torch.testing.assert_close(out, layer.reference_forward(x), **TOL)
    layer.experts.activation_clamp = None
    assert not torch.allclose(out, layer(x))  # the clamp was active


def test_swapped_dispatcher_sees_the_four_steps():
    class CountingDispatcher(LocalDispatcher):
        calls = []

        def dispatch(self, z, indices):
            self.calls.append(("dispatch", tuple(z.shape), tuple(indices.shape)))
            return super().dispatch(z, indices)

        def combine(self, y_perm, weights, ctx):
            self.calls.append(("combine", tuple(y_perm.shape), tuple(weights.shape)))
            return super().combine(y_perm, weights, ctx)

    layer = _layer()
    x = _input(layer)
    expected = layer(x)
    layer.dispatcher = CountingDispatcher(layer.num_experts)
    torch.testing.assert_close(layer(x), expected)
    assert CountingDispatcher.calls == [("dispatch", (10, 32), (10, 2)), ("combine", (20, 32), (10, 2))]


def test_backward_matches_reference_gradients():
    layer = _layer()
    x = _input(layer).requires_grad_(True)
    layer(x).square().sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    grad_x = x.grad.clone()
    layer.zero_grad()
    x.grad = None
    layer.reference_forward(x).square().sum().backward()
    assert set(grads) >= {"router.weight", "down.weight", "up.weight", "experts.w13", "experts.w2",
                          "latent_norm.weight", "shared.w1.weight"}
    for name, p in layer.named_parameters():
        assert torch.isfinite(grads[name]).all(), name
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=name)
    torch.testing.assert_close(grad_x, x.grad, **TOL)


def test_update_bias_favours_underloaded_experts_and_leaves_gradients_alone():
    layer = _layer(bias_update_rate=0.01)
    x = _input(layer)
    layer(x).sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    counts = torch.tensor([0, 5, 5, 10, 0, 5, 10, 5])  # mean 5
    layer.update_bias(counts)
    torch.testing.assert_close(layer.correction_bias, torch.tensor([1, 0, 0, -1, 1, 0, -1, 0]) * 0.01)
    assert not layer.correction_bias.requires_grad
    for name, p in layer.named_parameters():
        assert torch.equal(grads[name], p.grad), name
    layer.update_bias(layer.last_expert_counts)  # the counts a training loop would feed back
    assert layer.correction_bias.dtype == torch.float32


def test_bias_stays_fp32_and_is_saved():
    layer = _layer().to(torch.bfloat16)
    assert layer.correction_bias.dtype == torch.float32 and layer.router.weight.dtype == torch.bfloat16
    assert "correction_bias" in layer.state_dict()
    x = _input(layer).to(torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_validation_names_the_argument():
    layer = _layer()
    with pytest.raises(TypeError, match="^config:"):
        LatentMoE("tiny")
    with pytest.raises(ValueError, match="^x:"):
        layer(torch.randn(2, 5, 63))
    with pytest.raises(ValueError, match="^x:"):
        layer(torch.randn(10, 64))
    with pytest.raises(TypeError, match="^x:"):
        layer(torch.ones(1, 2, 64, dtype=torch.int64))
    with pytest.raises(ValueError, match="^counts:"):
        layer.update_bias(torch.ones(7))


def test_swiglu_formula_and_validation():
    torch.manual_seed(0)
    ffn = SwiGLU(6, 10)
    x = torch.randn(2, 3, 6)
    expected = ffn.w2.weight @ (torch.nn.functional.silu(ffn.w1.weight @ x[0, 0]) * (ffn.w3.weight @ x[0, 0]))
    torch.testing.assert_close(ffn(x)[0, 0], expected)
    assert all(m.bias is None for m in (ffn.w1, ffn.w2, ffn.w3))
    with pytest.raises(ValueError, match="^intermediate:"):
        SwiGLU(6, 0)
    with pytest.raises(ValueError, match="^x:"):
        ffn(torch.randn(2, 5))


@pytest.mark.parametrize("grad", [False, True], ids=["grouped_mm", "padded"])
@pytest.mark.parametrize("tile_rows", [1, 3, 7])
def test_cpu_row_tiles_match_the_reference(monkeypatch, grad, tile_rows):
    """Tiles of 1, 3 and 7 permuted rows: experts split across tiles, tiles with one expert, an empty expert."""
    monkeypatch.setattr("latentmoe_lab.ops.routing.CPU_TILE_ROWS", tile_rows)
    layer = _layer()
    layer.correction_bias[7] = -10.0
    x = _input(layer, batch=2, tokens=5).requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        out, ref = layer(x), layer.reference_forward(x)
    torch.testing.assert_close(out, ref, **TOL)
    assert layer.last_expert_counts[7] == 0
    if grad:
        (grad_x, grad_w13), (ref_x, ref_w13) = (torch.autograd.grad(y.square().sum(), [x, layer.experts.w13])
                                                for y in (out, ref))
        torch.testing.assert_close(grad_x, ref_x, **TOL)
        torch.testing.assert_close(grad_w13, ref_w13, **TOL)
