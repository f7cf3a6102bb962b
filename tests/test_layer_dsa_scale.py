"""Gated DSA at scale: blocked prefill selection, decode == prefill over many steps, the growing cache."""
import copy
import dataclasses

import pytest
import torch

from latentmoe_lab.cache import DSALayerCache
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.dsa import GatedDSA


@pytest.fixture(autouse=True)
def _inference_mode():
    with torch.no_grad():
        yield


def _layer(topk: int = 5, query_block: int = 64, seed: int = 0) -> GatedDSA:
    base = ModelConfig.from_preset("tiny")
    config = base.replace(indexer=dataclasses.asdict(base.indexer) | {"topk": topk})
    torch.manual_seed(seed)
    return GatedDSA(config, query_block=query_block).double()


def _inputs(batch: int, seq_len: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, seq_len, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("block", [1, 4, 16, 100])
@pytest.mark.parametrize("offset", [0, 9])
def test_blocked_prefill_selection_equals_unblocked(block, offset):
    layer, x = _layer(), _inputs(2, 37 + offset)
    c_q, *_, index_keys = layer.project(x)
    new = slice(offset, None)  # the last 37 tokens are the chunk; the first `offset` are already cached
    unblocked = layer.indexer.select(x[:, new], c_q[:, new], index_keys, offset)
    pieces = list(layer.indexer.select_blocks(x[:, new], c_q[:, new], index_keys, offset, block))
    assert [(start, stop) for start, stop, _ in pieces] == [(s, min(s + block, 37)) for s in range(0, 37, block)]
    assert torch.equal(torch.cat([indices for *_, indices in pieces], dim=1), unblocked)
    assert (unblocked >= 0).sum(-1).min() == min(5, offset + 1)  # really selecting, -1 only where it must


def test_query_block_size_does_not_change_the_output():
    x = _inputs(2, 29)
    outputs = [_layer(query_block=block)(x) for block in (1, 7, 64)]
    for out in outputs[1:]:
        torch.testing.assert_close(out, outputs[0])


@pytest.mark.parametrize("steps", [1, 2, 100])
def test_decode_steps_equal_one_prefill(steps):
    layer, x = _layer(topk=6), _inputs(2, 11 + steps)
    full = layer(x)
    cache = DSALayerCache()
    outputs = [layer(x[:, :11], cache=cache)]
    outputs += [layer(x[:, t:t + 1], cache=cache) for t in range(11, 11 + steps)]
    assert cache.length == 11 + steps
    torch.testing.assert_close(torch.cat(outputs, dim=1), full)


def test_cache_entries_are_views_of_buffers_that_double():
    layer, x = _layer(), _inputs(1, 40)
    cache = DSALayerCache()
    layer(x[:, :3], cache=cache)
    capacities = set()
    for t in range(3, 40):
        layer(x[:, t:t + 1], cache=cache)
        capacities.add(cache._keys.shape[1])
        assert cache.absorbed_keys.data_ptr() == cache.latent.data_ptr() == cache._keys.data_ptr()
    assert capacities == {6, 12, 24, 48}  # log-many reallocations, not one per token
    torch.testing.assert_close(cache.absorbed_keys, torch.cat([cache.latent, cache.k_rope], dim=-1))


def test_a_copied_or_rebuilt_cache_decodes_the_same():
    layer, x = _layer(), _inputs(2, 14)
    cache = DSALayerCache()
    layer(x[:, :12], cache=cache)
    copied = copy.deepcopy(cache)
    rebuilt = DSALayerCache(cache.latent.clone(), cache.k_rope.clone(), cache.index_keys.clone())
    expected = layer(x[:, 12:], cache=cache)
    torch.testing.assert_close(layer(x[:, 12:], cache=copied), expected)
    torch.testing.assert_close(layer(x[:, 12:], cache=rebuilt), expected)
    assert copied.length == rebuilt.length == 14 and cache.length == 14


def test_attention_probs_are_the_dense_attention_weights():
    layer, x = _layer(), _inputs(2, 9)
    probs = layer.attention_probs(x)
    assert probs.shape == (2, layer.num_heads, 9, 9)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, layer.num_heads, 9, dtype=probs.dtype))
    assert (probs.triu(diagonal=1) == 0).all()


def test_query_block_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="query_block: expected a positive integer"):
        GatedDSA(ModelConfig.from_preset("tiny"), query_block=0)
