"""ops/rotary.py: RoPE / YaRN against the complex-product twin, transformers' frequencies, and gradients."""
import math

import pytest
import torch

from latentmoe_lab.ops.rotary import (inverse_frequencies, rotary_cos_sin, rotate, rotate_reference,
                                      yarn_attention_factor, yarn_softmax_scale)


@pytest.mark.parametrize("pairing", ["interleaved", "half"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rotate_matches_complex_twin_on_ragged_shapes(pairing, dtype):
    for batch, tokens, heads, dim in [(1, 1, 1, 2), (2, 7, 3, 8), (3, 13, 2, 16)]:
        x = torch.randn(batch, tokens, heads, dim, dtype=dtype)
        positions = torch.randint(0, 5000, (batch, tokens))
        cos, sin = rotary_cos_sin(positions, inverse_frequencies(dim, 10000.0), attention_factor=0.9)
        atol = 1e-12 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(rotate(x, cos, sin, pairing), rotate_reference(x, cos, sin, pairing),
                                   rtol=1e-6, atol=atol)


@pytest.mark.parametrize("pairing", ["interleaved", "half"])
def test_rotation_by_explicit_angles_and_relative_position(pairing):
    """Pair (a, b) at position p turns by p * theta^(-2i/dim); scores depend on p_q - p_k only."""
    dim, theta = 8, 500.0
    x = torch.randn(1, 1, 1, dim, dtype=torch.float64)
    p = 7
    cos, sin = rotary_cos_sin(torch.tensor([[p]]), inverse_frequencies(dim, theta))
    out = rotate(x, cos.double(), sin.double(), pairing)[0, 0, 0]
    for i in range(dim // 2):
        a_at, b_at = (2 * i, 2 * i + 1) if pairing == "interleaved" else (i, i + dim // 2)
        angle = p * theta ** (-2 * i / dim)
        a, b = x[0, 0, 0, a_at].item(), x[0, 0, 0, b_at].item()
        assert out[a_at].item() == pytest.approx(a * math.cos(angle) - b * math.sin(angle), abs=1e-6)
        assert out[b_at].item() == pytest.approx(b * math.cos(angle) + a * math.sin(angle), abs=1e-6)
    q, k = torch.randn(2, 1, 1, 1, dim, dtype=torch.float64).unbind(0)
    inv_freq = inverse_frequencies(dim, theta)

    def score(pq, pk):
        cq, sq = rotary_cos_sin(torch.tensor([[pq]]), inv_freq)
        ck, sk = rotary_cos_sin(torch.tensor([[pk]]), inv_freq)
        return (rotate(q, cq.double(), sq.double(), pairing) * rotate(k, ck.double(), sk.double(), pairing)).sum()

    torch.testing.assert_close(score(10, 3), score(107, 100), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(score(10, 3), score(10, 4))


@pytest.mark.parametrize("pairing", ["interleaved", "half"])
def test_rotate_gradients_match_autograd_through_the_twin(pairing):
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = rotary_cos_sin(torch.randint(0, 300, (2, 5)), inverse_frequencies(8, 10000.0))
    cos, sin = cos.double(), sin.double()
    torch.autograd.gradcheck(lambda t: rotate(t, cos, sin, pairing), (x,))
    upstream = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    grad, = torch.autograd.grad((rotate(x, cos, sin, pairing) * upstream).sum(), x)
    x_ref = x.detach().clone().requires_grad_(True)
    first, second = ((x_ref[..., 0::2], x_ref[..., 1::2]) if pairing == "interleaved"
                     else (x_ref[..., :4], x_ref[..., 4:]))
    c, s = cos[..., None, :], sin[..., None, :]
    plain = (first * c - second * s, second * c + first * s)
    plain = torch.stack(plain, -1).flatten(-2) if pairing == "interleaved" else torch.cat(plain, -1)
    grad_ref, = torch.autograd.grad((plain * upstream).sum(), x_ref)
    torch.testing.assert_close(grad, grad_ref)


def _hf_rope(rope_parameters, dim=16, max_position=8192):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale
    config = transformers.DeepseekV32Config(
        qk_rope_head_dim=dim, qk_nope_head_dim=16, max_position_embeddings=max_position,
        rope_parameters=dict(rope_parameters))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    return inv_freq, factor, yarn_apply_mscale(config.rope_parameters, 1.0)


@pytest.mark.parametrize("params", [
    dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
         mscale_all_dim=1.0),
    dict(factor=4.0, original_max_position_embeddings=512, mscale=0.707, mscale_all_dim=1.0, truncate=False),
    dict(factor=8.0, original_max_position_embeddings=1024, beta_fast=16, beta_slow=2),
    dict(factor=2.0, original_max_position_embeddings=1024, attention_factor=1.3),
])
def test_yarn_frequencies_and_factors_equal_transformers(params):
    inv_freq, attention_factor, softmax_scale = _hf_rope(dict(rope_type="yarn", rope_theta=50000.0, **params))
    ours = inverse_frequencies(16, 50000.0, params["factor"], params["original_max_position_embeddings"],
                               params.get("beta_fast", 32), params.get("beta_slow", 1), params.get("truncate", True),
                               yarn=True)
    torch.testing.assert_close(ours, inv_freq, rtol=0, atol=0)
    assert yarn_attention_factor(params["factor"], params.get("mscale"), params.get("mscale_all_dim"),
                                 params.get("attention_factor")) == pytest.approx(attention_factor, rel=1e-12)
    assert yarn_softmax_scale(params["factor"], params.get("mscale_all_dim")) == pytest.approx(softmax_scale,
                                                                                               rel=1e-12)


def test_plain_frequencies_and_bad_arguments():
    torch.testing.assert_close(inverse_frequencies(8, 10000.0),
                               torch.tensor([10000.0 ** (-i / 8) for i in range(0, 8, 2)]))
    x = torch.randn(1, 2, 1, 8)
    cos, sin = rotary_cos_sin(torch.arange(2)[None], inverse_frequencies(8, 10000.0))
    with pytest.raises(ValueError, match="pairing"):
        rotate(x, cos, sin, "spiral")
    with pytest.raises(ValueError, match="cos, sin"):
        rotate(torch.randn(1, 2, 1, 6), cos, sin, "half")
    with pytest.raises(ValueError, match="dim"):
        inverse_frequencies(7, 10000.0)
    with pytest.raises(ValueError, match="original_max_position"):
        inverse_frequencies(8, 10000.0, 4.0, None, yarn=True)
    with pytest.raises(TypeError, match="positions"):
        rotary_cos_sin(torch.zeros(2), inverse_frequencies(8, 10000.0))
