"""Gated DSA layer: sparse == dense when top-k covers everything, absorbed == expanded, cached decode == full."""
import copy
import dataclasses

import pytest
import torch

from latentmoe_lab.cache import DSALayerCache
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.dsa import GatedDSA


@pytest.fixture(autouse=True)
def _inference_mode():
    with torch.no_grad():  # caches hold non-leaf tensors otherwise, and deepcopy refuses those
        yield


def _layer(topk: int, seed: int = 0) -> GatedDSA:
    base = ModelConfig.from_preset("tiny")
    config = base.replace(indexer=dataclasses.asdict(base.indexer) | {"topk": topk})
    torch.manual_seed(seed)
    return GatedDSA(config).double()


def _inputs(B: int, T: int, seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(B, T, 64, dtype=torch.float64)


def test_topk_covering_the_sequence_equals_dense_attention():
    layer, x = _layer(topk=32), _inputs(2, 13)
    dense = layer(x, dense=True)
    assert dense.shape == x.shape
    torch.testing.assert_close(layer(x), dense)
    torch.testing.assert_close(layer(x, absorb=True), dense)


def test_small_topk_really_selects():
    layer, x = _layer(topk=3), _inputs(2, 13)
    assert not torch.allclose(layer(x), layer(x, dense=True))
    # The first topk queries see at most topk keys, so they still match dense attention.
    torch.testing.assert_close(layer(x)[:, :3], layer(x, dense=True)[:, :3])


@pytest.mark.parametrize("dense", [False, True])
def test_absorbed_equals_expanded_in_prefill_and_decode(dense):
    layer, x = _layer(topk=4), _inputs(2, 9)
    torch.testing.assert_close(layer(x, absorb=True, dense=dense), layer(x, absorb=False, dense=dense))

    cache = DSALayerCache()
    layer(x[:, :7], cache=cache)
    other = copy.deepcopy(cache)
    step = x[:, 7:8]
    torch.testing.assert_close(layer(step, cache=cache, absorb=True, dense=dense),
                               layer(step, cache=other, absorb=False, dense=dense))


@pytest.mark.parametrize("absorb", [None, True, False])
def test_prefill_then_decode_steps_equals_full_forward(absorb):
    layer, x = _layer(topk=4), _inputs(2, 12)
    full = layer(x)
    cache = DSALayerCache()
    chunks, start = [], 0
    for size in (5, 1, 2, 1, 3):  # prefill, then decode steps of one, two and several tokens
        chunks.append(layer(x[:, start:start + size], cache=cache, absorb=absorb))
        start += size
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(chunks, dim=1), full)


def test_cache_holds_only_latent_rope_and_index_keys():
    layer, x = _layer(topk=4), _inputs(2, 6)
    mla, idx = ModelConfig.from_preset("tiny").mla, ModelConfig.from_preset("tiny").indexer
    cache = DSALayerCache()
    layer(x[:, :5], cache=cache)
    layer(x[:, 5:], cache=cache)
    assert [f.name for f in dataclasses.fields(cache)] == ["latent", "k_rope", "index_keys"]
    assert cache.latent.shape == (2, 6, mla.kv_lora_rank)
    assert cache.k_rope.shape == (2, 6, mla.qk_rope_head_dim)
    assert cache.index_keys.shape == (2, 6, idx.head_dim)
    # c_kv is stored after its RMSNorm (weight 1 at init), so every token's latent has unit RMS.
    torch.testing.assert_close(cache.latent.pow(2).mean(-1), torch.ones(2, 6, dtype=torch.float64),
                               rtol=1e-4, atol=1e-4)


def test_bfloat16_forward_keeps_dtype_and_stays_finite():
    layer, x = _layer(topk=4).to(torch.bfloat16), _inputs(1, 7).to(torch.bfloat16)
    out = layer(x, cache=DSALayerCache())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_validation_errors_name_the_argument():
    layer = _layer(topk=4)
    with pytest.raises(ValueError, match=r"x: expected 3 dims \[B, T, hidden=64\]"):
        layer(torch.randn(2, 5, 32, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"x: expected a floating-point"):
        layer(torch.ones(2, 5, 64, dtype=torch.long))
    cache = DSALayerCache()
    layer(_inputs(2, 3), cache=cache)
    with pytest.raises(ValueError, match=r"cache: holds batch size 2 but x has 1"):
        layer(_inputs(1, 1), cache=cache)
    with pytest.raises(TypeError, match=r"cache: expected a DSALayerCache"):
        layer(_inputs(2, 1), cache={})
    with pytest.raises(TypeError, match=r"absorb: expected a bool"):
        layer(_inputs(2, 1), absorb="yes")
