"""Gated DSA with RoPE / YaRN on (mla.rope, ops/rotary.py): the layer's equalities still hold, and positions
follow each token's own sequence (cache offset, packed sequences)."""
import dataclasses

import pytest
import torch

from latentmoe_lab.cache import DSALayerCache
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.dsa import GatedDSA
from latentmoe_lab.model import LatentMoEForCausalLM

YARN = dict(rope="yarn", rope_theta=800.0, yarn_factor=4.0, yarn_original_max_position=16, yarn_mscale=0.9,
            yarn_mscale_all_dim=1.0)


def _config(topk: int, rope: dict) -> ModelConfig:
    base = ModelConfig.from_preset("tiny")
    return base.replace(mla=dataclasses.asdict(base.mla) | rope, vision=None,
                        indexer=dataclasses.asdict(base.indexer) | {"topk": topk})


@torch.no_grad()
@pytest.mark.parametrize("rope", [dict(rope="rope", rope_theta=100.0), YARN])
def test_cached_chunks_and_forms_equal_the_full_forward(rope):
    torch.manual_seed(0)
    layer = GatedDSA(_config(5, rope)).double()
    x = torch.randn(2, 19, 64, dtype=torch.float64)
    full = layer(x)
    torch.testing.assert_close(layer(x, absorb=True), layer(x, absorb=False))
    cache, parts = DSALayerCache(), []
    for start, stop in [(0, 7), (7, 8), (8, 15), (15, 16), (16, 19)]:
        parts.append(layer(x[:, start:stop], cache))
    torch.testing.assert_close(torch.cat(parts, dim=1), full)
    wide = GatedDSA(_config(64, rope)).double()
    wide.load_state_dict(layer.state_dict())
    torch.testing.assert_close(wide(x), wide(x, dense=True))  # top-k past the context: dense causal MLA


@torch.no_grad()
def test_rope_turns_by_position_and_keys_are_cached_rotated():
    torch.manual_seed(0)
    layer = GatedDSA(_config(5, YARN)).double()
    x = torch.randn(1, 6, 64, dtype=torch.float64)
    _, _, q_at_0, _, k_at_0, index_at_0 = layer.project(x)
    _, _, q_at_9, _, k_at_9, index_at_9 = layer.project(x, torch.arange(9, 15)[None])
    assert not torch.allclose(k_at_0, k_at_9) and not torch.allclose(index_at_0, index_at_9)
    # a rotation keeps norms (up to the YaRN attention factor, the same at every position)
    torch.testing.assert_close(q_at_0.norm(dim=-1), q_at_9.norm(dim=-1))
    # the indexer rotates only its first qk_rope_head_dim dims
    rope = layer.rope_dim
    torch.testing.assert_close(index_at_0[..., rope:], index_at_9[..., rope:])
    cache = DSALayerCache()
    layer(x, cache)
    torch.testing.assert_close(cache.absorbed_keys[..., layer.kv_lora_rank:], k_at_0)


@torch.no_grad()
def test_packed_sequences_with_rope_equal_each_alone():
    """Positions restart at every packed sequence (t - sequence_start), for MLA and the indexer alike."""
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(_config(6, YARN)).eval()
    lengths = (11, 4, 17)
    sequences = [torch.randint(0, 500, (1, n)) for n in lengths]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packed = model(torch.cat(sequences, dim=1), cu_seqlens=cu_seqlens).logits
    alone = torch.cat([model(ids).logits for ids in sequences], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_bf16_layer_keeps_fp32_frequencies_far_into_the_context():
    """Cast to bf16, the angles p * f at p ~ 4000 still come from fp32 frequencies (a bf16 f would be off by
    whole turns there), so the rotated keys stay within bf16 rounding of the fp64 layer's."""
    torch.manual_seed(0)
    exact = GatedDSA(_config(6, YARN)).double()
    low = GatedDSA(_config(6, YARN))
    low.load_state_dict(exact.state_dict())
    low.to(torch.bfloat16)
    assert low.rotary.inv_freq.dtype == torch.float32 and low.indexer.rotary.inv_freq.dtype == torch.float32
    x = torch.randn(1, 6, 64, dtype=torch.float64)
    positions = torch.arange(4000, 4006)[None]
    _, _, _, _, k_exact, index_exact = exact.project(x, positions)
    _, _, _, _, k_low, index_low = low.project(x.bfloat16(), positions)
    for ours, reference in ((k_low, k_exact), (index_low, index_exact)):
        assert (ours.double() - reference).abs().max() <= 0.03 * reference.abs().max()
