"""A published DeepSeek-V3.2 directory's MTP layer (model.layers.{num_hidden_layers}.*) is refused by name, not
dropped (docs/design.md §17.9): its decoder block's FFN is MoE, our MTP depth's is dense, so no name mapping
expresses it, and a load that silently left it out would serve a model without the drafts it was shipped with.
"""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from latentmoe_lab.model import LatentMoEForCausalLM

transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4,
              kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=1,
              topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, index_topk=4, index_head_dim=16,
              index_n_heads=2, max_position_embeddings=64)


def _with_mtp_layer(directory) -> str:
    """Extend the saved state dict with an MTP layer as DeepSeek publishes it: enorm, hnorm, eh_proj, the shared
    head, and a full decoder layer (a copy of the last one, MoE) at index num_hidden_layers. Returns one of its
    names that our table would have to hold."""
    weights = directory / "model.safetensors"
    tensors = load_file(str(weights))
    layers, d = CONFIG["num_hidden_layers"], CONFIG["hidden_size"]
    mtp = f"model.layers.{layers}."
    for name in [n for n in tensors if n.startswith(f"model.layers.{layers - 1}.")]:
        tensors[mtp + name.split(".", 3)[3]] = tensors[name].clone()
    tensors |= {mtp + "enorm.weight": torch.ones(d), mtp + "hnorm.weight": torch.ones(d),
                mtp + "eh_proj.weight": torch.randn(d, 2 * d), mtp + "shared_head.norm.weight": torch.ones(d),
                mtp + "shared_head.head.weight": tensors["lm_head.weight"].clone()}
    save_file(tensors, str(weights), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    assert any(".mlp.experts." in name for name in tensors if name.startswith(mtp))  # the MoE FFN we cannot hold
    return mtp


def test_the_published_mtp_layer_is_refused_by_name(tmp_path):
    torch.manual_seed(0)
    config = transformers.DeepseekV32Config(**CONFIG)
    transformers.DeepseekV32ForCausalLM(config).float().save_pretrained(tmp_path)
    LatentMoEForCausalLM.from_pretrained(tmp_path)  # loads without the MTP layer
    mtp = _with_mtp_layer(tmp_path)
    with pytest.raises(ValueError) as caught:
        LatentMoEForCausalLM.from_pretrained(tmp_path)
    message = str(caught.value)
    assert f"unexpected tensor '{mtp}" in message and "\n" not in message
