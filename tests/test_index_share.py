"""Issue 29 part A: dsa.index_share_every, DSA layers that reuse the previous indexer layer's top-k selection."""
import pytest
import torch
from einops import einsum

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.dsa import GatedDSA
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.ops.sparse_attention import sparse_attention
from latentmoe_lab.paged_pools import PagedPools, paged_pool_bytes
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig


def _config(share: int | None) -> ModelConfig:
    data = ModelConfig.from_preset("tiny").to_dict() | {"dsa_interval": 2, "layer_types": None}
    if share is None:
        data.pop("dsa")  # a config written before the field existed
    else:
        data["dsa"] = {"index_share_every": share}
    return ModelConfig.from_dict(data)  # DSA at layers 1 and 3


def _model(config):
    torch.manual_seed(0)
    return LatentMoEForCausalLM(config).eval()


@torch.no_grad()
def test_share_every_one_is_the_model_without_the_field():
    old, new = _model(_config(None)), _model(_config(1))
    assert list(old.state_dict()) == list(new.state_dict())
    assert all(layer.attn.selection_role == "own" for layer in new.layers if isinstance(layer.attn, GatedDSA))
    ids = torch.randint(0, 512, (2, 90))
    assert torch.equal(old(ids).logits, new(ids).logits)


@torch.no_grad()
def test_shared_layer_attends_over_its_source_layers_selection():
    config = _config(2)
    assert [config.index_source(i) for i in (1, 3)] == [1, 1] and config.num_indexer_layers == 1
    model = _model(config)
    source, reuser = model.layers[1].attn, model.layers[3].attn
    assert reuser.indexer is None and not any(".3.attn.indexer." in name for name in model.state_dict())
    seen = {}
    source.register_forward_hook(lambda module, args, out: seen.__setitem__("source", args[0]))
    reuser.register_forward_hook(lambda module, args, out: seen.update(reuser_in=args[0], reuser_out=out))
    model(torch.randint(0, 512, (2, 150)))  # 150 > top-k 32 and several query blocks of 64
    x_source, x = seen["source"], seen["reuser_in"]
    c_q, _, _, _, _, keys = source.project(x_source)
    selection = source.indexer.select(x_source, c_q, keys, 0)  # [B, T, top-k], independent of the query blocks
    _, q_nope, q_rope, latent, k_rope, _ = reuser.project(x)
    w_kb, w_vb = reuser._absorb_weights()
    q, k, v = reuser._absorbed_qkv(q_nope, q_rope, torch.cat([latent, k_rope], dim=-1), w_kb)
    attn = einsum(sparse_attention(q, k, v, selection, scale=reuser.scale), w_vb, "b t h c, h v c -> b t h v")
    torch.testing.assert_close(seen["reuser_out"], reuser._gated_output(attn, x))
    with pytest.raises(RuntimeError, match="dsa.index_share_every: this layer reuses layer 1"):
        _model(config).layers[3].attn(x)  # a reuser whose source did not run first


@torch.no_grad()
def test_paged_serving_with_shared_indexers_equals_generate_and_counts_index_keys_once():
    config = _config(2)
    model = _model(config)
    pools = PagedPools(config, 8, 16, 2)
    assert pools.layers[1].index.numel() > 0 and pools.layers[3].index.numel() == 0
    kinds = paged_pool_bytes(config, 8, 16, 2)
    assert kinds["dsa_index"] == 1 * 8 * 16 * 16 * 4 and kinds["dsa_latent"] == 2 * 8 * 16 * 24 * 4
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (120, 9)]
    service = ServiceConfig.from_dict({"model": {"max_model_len": 256}, "scheduler": {"prefill_chunk_size": 48},
                                       "memory": {"max_num_seqs": 2, "block_size": 16, "cache_bytes": 2_000_000,
                                                  "offload": {"host_cache_bytes": 1_000_000}}})
    tokens = [o.token_ids for o in Engine(model, service).generate(prompts, SamplingParams(max_tokens=5),
                                                                     use_tqdm=False)]
    for prompt, got in zip(prompts, tokens):
        assert got == model.generate(torch.tensor([prompt]), max_new_tokens=5)[0, len(prompt):].tolist()
