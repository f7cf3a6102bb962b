"""The CPU expert path (ops.grouped_experts: torch._grouped_mm with a hand-written SwiGLU backward) against its
plain twin (one matmul per expert slice), outputs and gradients, on ragged routing."""
import pytest
import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.moe import LatentExperts, LatentMoE
from latentmoe_lab.ops import batch_invariant, grouped_experts

TOL = dict(rtol=1e-5, atol=1e-5)

# rows per expert: ragged, empty experts (first, inner, last), one expert taking every row, no rows at all
RAGGED = {
    "ragged": [3, 0, 5, 1, 0, 7, 2, 0],
    "one_expert_takes_all": [0, 0, 0, 0, 0, 13, 0, 0],
    "first_and_last_only": [4, 0, 0, 0, 0, 0, 0, 9],
    "no_rows": [0] * 8,
}


def _experts(clamp=None, dtype=torch.float32) -> LatentExperts:
    torch.manual_seed(0)
    experts = LatentExperts(8, 16, 12, activation_clamp=clamp).to(dtype)
    with torch.no_grad():
        experts.w13.normal_(std=0.5)
        experts.w2.normal_(std=0.5)
    return experts


def _grads(out: torch.Tensor, tensors: list[torch.Tensor], seed: int = 2) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    return list(torch.autograd.grad(out, tensors, torch.randn_like(out)))


@pytest.mark.parametrize("clamp", [None, 0.7], ids=["no_clamp", "clamp"])
@pytest.mark.parametrize("tile_rows", [4096, 5], ids=["one_tile", "tiles_of_5"])
@pytest.mark.parametrize("counts", list(RAGGED.values()), ids=list(RAGGED))
def test_fast_experts_equal_the_twin(monkeypatch, counts, tile_rows, clamp):
    """Tiles of 5 rows: experts grouped several to a tile, and a 13-row expert alone in an oversized tile."""
    monkeypatch.setattr("latentmoe_lab.ops.routing.CPU_TILE_ROWS", tile_rows)
    experts = _experts(clamp)
    counts = torch.tensor(counts)
    torch.manual_seed(1)
    z = torch.randn(int(counts.sum()), 16, requires_grad=True)
    assert grouped_experts.fits(z, experts.w13, experts.w2)
    out, ref = experts(z, counts), experts.forward_reference(z, counts)
    torch.testing.assert_close(out, ref, **TOL)
    if counts.sum():
        params = [z, experts.w13, experts.w2]
        for fast, twin in zip(_grads(out, params), _grads(ref, params)):
            torch.testing.assert_close(fast, twin, **TOL)
    else:  # no rows: the weights stay in the graph with a zero gradient, as in the twin
        assert out.shape == (0, 16) and out.requires_grad


def test_the_clamp_blocks_gradients_where_it_binds():
    """A clamp of 0.05 binds on most entries: the fast backward must zero the same gradients as torch.clamp."""
    experts = _experts(clamp=0.05)
    counts = torch.tensor([6, 0, 2, 0, 0, 4, 0, 1])
    z = torch.randn(13, 16, requires_grad=True)
    params = [z, experts.w13, experts.w2]
    for fast, twin in zip(_grads(experts(z, counts), params), _grads(experts.forward_reference(z, counts), params)):
        torch.testing.assert_close(fast, twin, **TOL)


def test_the_layer_with_one_expert_taking_every_token_matches_its_reference():
    """A whole LatentMoE layer (routing, dispatch, fast experts, combine) against its per-token twin, gradients
    of the input and of every parameter; the correction bias forces every token onto expert 3 first."""
    config = ModelConfig.from_preset("tiny")
    config = config.replace(moe={**config.to_dict()["moe"], "n_group": 1, "topk_group": 1})
    torch.manual_seed(0)
    layer = LatentMoE(config)
    layer.correction_bias[3] = 10.0
    x = torch.randn(2, 7, config.hidden_size, requires_grad=True)
    out, ref = layer(x), layer.reference_forward(x)
    assert int(layer.last_expert_counts[3]) == 14 and int((layer.last_expert_counts == 0).sum()) > 0
    torch.testing.assert_close(out, ref, **TOL)
    params = [x] + [p for p in layer.parameters()]
    for fast, twin in zip(_grads(out, params), _grads(ref, params)):
        torch.testing.assert_close(fast, twin, **TOL)


def test_batch_invariant_mode_keeps_its_own_path(monkeypatch):
    """In batch-invariant mode the experts run forward_tiles (the fast path's bits depend on the batch)."""
    experts = _experts()
    calls = []
    monkeypatch.setattr(grouped_experts, "grouped_swiglu_experts", lambda *a, **k: calls.append(a))
    counts = torch.tensor(RAGGED["ragged"])
    z = torch.randn(int(counts.sum()), 16)
    with batch_invariant.batch_invariant_mode():
        out = experts(z, counts)
    assert not calls
    torch.testing.assert_close(out, experts.forward_reference(z, counts), **TOL)


def test_bad_shapes_are_refused_naming_the_argument():
    experts = _experts()
    z = torch.randn(5, 16)
    with pytest.raises(ValueError, match="^w2:"):
        grouped_experts.grouped_swiglu_experts(z, torch.tensor([5] + [0] * 7), experts.w13, experts.w2[:, :6])
    with pytest.raises(ValueError, match="^offsets:"):
        grouped_experts.grouped_swiglu_experts(z, torch.tensor([4] + [0] * 7), experts.w13, experts.w2)
    with pytest.raises(ValueError, match="^z:"):
        grouped_experts.grouped_swiglu_experts(z.double(), torch.tensor([5] + [0] * 7), experts.w13, experts.w2)


def test_frozen_experts_pass_the_input_gradient_only():
    """Weights without requires_grad (frozen experts): the input gradient still equals the twin's."""
    experts = _experts()
    experts.requires_grad_(False)
    counts = torch.tensor(RAGGED["ragged"])
    z = torch.randn(int(counts.sum()), 16, requires_grad=True)
    (fast,), (twin,) = _grads(experts(z, counts), [z]), _grads(experts.forward_reference(z, counts), [z])
    torch.testing.assert_close(fast, twin, **TOL)
    assert experts.w13.grad is None and experts.w2.grad is None
