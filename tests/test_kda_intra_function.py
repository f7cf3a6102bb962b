"""The fused intra-chunk node (`chunk_decays_and_scores`, ops/kda_intra.py) against its plain twin, ChunkDecays +
intra_chunk_scores (autograd through DecayProduct, GrownKeys and the products): the five outputs and the gradients
of q, k, beta and g, on ragged shapes, at K3's default lower-bound gates (-5 sigmoid(x), and x ~ N(0, 25), which
sits near the bound -5), with g = -1000 resets, and with the growth limit lowered so that safe and halved chunks mix.
"""
import pytest
import torch

import latentmoe_lab.ops.kda as kda_ops
import latentmoe_lab.ops.kda_intra as kda_intra
from latentmoe_lab.ops.kda import kda_chunked
from latentmoe_lab.ops.kda_intra import ChunkDecays, chunk_decays_and_scores, intra_chunk_scores
from latentmoe_lab.ops.norms import l2_norm

GATES = ["mild", "lower_bound", "near_lower_bound", "resets"]


def make_gates(kind: str, shape, gen: torch.Generator, dtype) -> torch.Tensor:
    x = torch.randn(shape, generator=gen, dtype=dtype)
    if kind == "mild":
        return -0.05 * torch.sigmoid(x)
    if kind == "lower_bound":
        return -5.0 * torch.sigmoid(x)
    g = -5.0 * torch.sigmoid(5.0 * x)  # most entries within 0.1 of -5
    if kind == "resets":
        g[..., shape[-2] // 2, :] = -1000.0
    return g


def make_inputs(gates: str, lead, chunk: int, dim: int, dtype=torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = l2_norm(torch.randn(*lead, chunk, dim, generator=gen, dtype=dtype))
    k = l2_norm(torch.randn(*lead, chunk, dim, generator=gen, dtype=dtype))
    beta = torch.rand(*lead, chunk, generator=gen, dtype=dtype)
    g = make_gates(gates, (*lead, chunk, dim), gen, dtype)
    return [t.requires_grad_() for t in (q, k, beta, g)]


def fused(q, k, beta, g):
    decays, attn_qk, attn_kk = chunk_decays_and_scores(q, k, beta, g)
    return attn_qk, attn_kk, decays.from_start, decays.to_end, decays.whole_chunk


def twin(q, k, beta, g):
    decays = ChunkDecays(g)
    attn_qk, attn_kk = intra_chunk_scores(q, k, beta, decays)
    return attn_qk, attn_kk, decays.from_start, decays.to_end, decays.whole_chunk


def outputs_and_grads(op, inputs, weights):
    outputs = op(*inputs)
    loss = sum((out * weight).sum() for out, weight in zip(outputs, weights))
    return [out.detach() for out in outputs], torch.autograd.grad(loss, inputs)


def assert_close_rel(actual, expected, rtol):
    assert torch.isfinite(actual).all()
    assert (actual - expected).norm() <= rtol * expected.norm() + 1e-12


@pytest.mark.parametrize("gates", GATES)
@pytest.mark.parametrize("lead, chunk, dim", [((3,), 5, 7), ((2, 3), 16, 9), ((1, 2), 32, 16)])
@pytest.mark.parametrize("safe_growth", [1e20, 1e4])
def test_outputs_and_every_gradient_match_the_twin_in_fp64(monkeypatch, gates, lead, chunk, dim, safe_growth):
    monkeypatch.setattr(kda_intra, "SAFE_GROWTH", safe_growth)  # 1e4: chunks halved beside one-block chunks
    inputs = make_inputs(gates, lead, chunk, dim)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        weights = [torch.randn(out.shape, generator=gen, dtype=out.dtype) for out in twin(*inputs)]
    fused_out, fused_grads = outputs_and_grads(fused, inputs, weights)
    twin_out, twin_grads = outputs_and_grads(twin, inputs, weights)
    for actual, expected in zip(fused_out, twin_out):
        assert torch.equal(actual, expected)
    for actual, expected in zip(fused_grads, twin_grads):
        assert_close_rel(actual, expected, 1e-12)


@pytest.mark.parametrize("gates", GATES)
def test_fp32_outputs_are_the_twins_bits_and_gradients_stay_finite(gates):
    inputs = make_inputs(gates, (4, 6), 32, 64, dtype=torch.float32)
    gen = torch.Generator().manual_seed(2)
    weights = [torch.randn(out.shape, generator=gen) for out in twin(*inputs)]
    fused_out, fused_grads = outputs_and_grads(fused, inputs, weights)
    twin_out, twin_grads = outputs_and_grads(twin, inputs, weights)
    for actual, expected in zip(fused_out, twin_out):
        assert torch.equal(actual, expected)
    for actual, expected in zip(fused_grads, twin_grads):
        assert_close_rel(actual, expected, 1e-5)


@pytest.mark.parametrize("safe_growth", [1e20, 1e2])
def test_gradcheck_in_fp64(monkeypatch, safe_growth):
    monkeypatch.setattr(kda_intra, "SAFE_GROWTH", safe_growth)
    inputs = make_inputs("lower_bound", (2,), 12, 3)
    assert torch.autograd.gradcheck(fused, inputs)


@pytest.mark.parametrize("seq_len", [1, 45, 70])
@pytest.mark.parametrize("gates", ["lower_bound", "near_lower_bound"])
def test_kda_chunked_on_ragged_lengths_matches_it_through_the_twin(monkeypatch, seq_len, gates):
    """T not a multiple of the chunk: the whole op with the fused node, then with the twin patched in."""
    gen = torch.Generator().manual_seed(3)
    batch, heads, dim_k, dim_v = 2, 3, 16, 8
    q = l2_norm(torch.randn(batch, seq_len, heads, dim_k, generator=gen, dtype=torch.float64))
    k = l2_norm(torch.randn(batch, seq_len, heads, dim_k, generator=gen, dtype=torch.float64))
    v = torch.randn(batch, seq_len, heads, dim_v, generator=gen, dtype=torch.float64)
    g = make_gates(gates, (batch, seq_len, heads, dim_k), gen, torch.float64)
    beta = torch.rand(batch, seq_len, heads, generator=gen, dtype=torch.float64)
    state = torch.randn(batch, heads, dim_k, dim_v, generator=gen, dtype=torch.float64)
    inputs = [t.requires_grad_() for t in (q, k, v, g, beta, state)]
    out_weight = torch.randn(batch, seq_len, heads, dim_v, generator=gen, dtype=torch.float64)
    state_weight = torch.randn(batch, heads, dim_k, dim_v, generator=gen, dtype=torch.float64)

    def run():
        out, final = kda_chunked(*inputs[:5], initial_state=inputs[5], output_final_state=True, chunk_size=32)
        loss = (out * out_weight).sum() + (final * state_weight).sum()
        return out.detach(), torch.autograd.grad(loss, inputs)

    out, grads = run()
    monkeypatch.setattr(kda_ops, "chunk_decays_and_scores", lambda q, k, beta, g: (
        lambda decays: (decays, *intra_chunk_scores(q, k, beta, decays)))(ChunkDecays(g)))
    twin_out, twin_grads = run()
    assert torch.allclose(out, twin_out, rtol=1e-12, atol=1e-12)
    for actual, expected in zip(grads, twin_grads):
        assert_close_rel(actual, expected, 1e-10)
