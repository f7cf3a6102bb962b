"""KDA layer: gate ranges, cache shapes, and prefill + decode == one full forward."""
import pytest
import torch

from latentmoe_lab.cache import KDALayerCache
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.kda import KimiDeltaAttention


def tiny_config(**kda_changes):
    config = ModelConfig.from_preset("tiny")
    kda = {**config.to_dict()["kda"], "head_dim_k": 16, "head_dim_v": 12, "chunk_size": 8, **kda_changes}
    return config.replace(kda=kda)


def make_layer(seed=0, **kda_changes):
    torch.manual_seed(seed)
    return KimiDeltaAttention(tiny_config(**kda_changes))


@pytest.mark.parametrize("gate_form", ["lower_bound", "softplus"])
def test_forget_gate_range(gate_form):
    layer = make_layer(gate_form=gate_form, gate_lower_bound=-5.0)
    x = 3.0 * torch.randn(2, 30, layer.q_proj.in_features)
    g = layer.forget_gate(x)
    assert g.shape == (2, 30, layer.num_heads, layer.head_dim_k) and g.dtype == torch.float32
    assert torch.isfinite(g).all() and (g <= 0).all()
    if gate_form == "lower_bound":
        assert (g >= -5.0).all()


def test_initial_gate_parameters():
    layer = make_layer()
    rate = layer.A_log.exp()
    assert ((rate >= 1.0) & (rate <= 16.0)).all()
    dt = torch.nn.functional.softplus(layer.dt_bias)
    assert ((dt >= 0.999e-3) & (dt <= 0.1001)).all()


@pytest.mark.parametrize("output_gate_rank", [None, 8])
def test_output_shape_and_cache_shapes(output_gate_rank):
    layer = make_layer(output_gate_rank=output_gate_rank)
    x = torch.randn(3, 11, layer.q_proj.in_features)
    cache = KDALayerCache()
    out = layer(x, cache=cache)
    assert out.shape == x.shape and torch.isfinite(out).all()
    channels = layer.num_heads * (2 * layer.head_dim_k + layer.head_dim_v)
    assert cache.conv_state.shape == (3, channels, layer.conv_kernel - 1)
    assert cache.recurrent_state.shape == (3, layer.num_heads, layer.head_dim_k, layer.head_dim_v)
    assert cache.recurrent_state.dtype == torch.float32


@pytest.mark.parametrize("gate_form", ["lower_bound", "softplus"])
@pytest.mark.parametrize("prefill_len", [1, 2, 5, 13])
def test_prefill_then_decode_matches_full_forward(gate_form, prefill_len):
    layer = make_layer(seed=1, gate_form=gate_form)
    x = torch.randn(2, 20, layer.q_proj.in_features)
    with torch.no_grad():
        full = layer(x)
        cache = KDALayerCache()
        pieces = [layer(x[:, :prefill_len], cache=cache)]
        pieces += [layer(x[:, t : t + 1], cache=cache) for t in range(prefill_len, x.shape[1])]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


def test_multi_token_steps_after_prefill():
    """Chunks of several tokens after prefill also continue the same sequence."""
    layer = make_layer(seed=2)
    x = torch.randn(2, 25, layer.q_proj.in_features)
    with torch.no_grad():
        full = layer(x)
        cache = KDALayerCache()
        pieces = [layer(x[:, a:b], cache=cache) for a, b in ((0, 9), (9, 11), (11, 12), (12, 25))]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise():
    layer = make_layer()
    hidden = layer.q_proj.in_features
    with pytest.raises(ValueError, match="x: expected shape"):
        layer(torch.randn(2, 3, hidden + 1))
    with pytest.raises(TypeError, match="cache: expected KDALayerCache"):
        layer(torch.randn(2, 3, hidden), cache={})
    with pytest.raises(ValueError, match="cache.conv_state: expected shape"):
        layer(torch.randn(2, 3, hidden), cache=KDALayerCache(conv_state=torch.zeros(1, 4, 3)))
