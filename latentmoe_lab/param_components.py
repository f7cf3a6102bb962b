"""Which component of LatentMoEForCausalLM a parameter belongs to, from its name: the vocabulary of
meta.count_parameters' table and of quant recipes (a weight format per component).

It reads names and the model's blocks (attention_type, is_moe) only, so modules below model.py (quant's
quantize_model, which from_pretrained can reach) use it without importing the model.
"""
from __future__ import annotations

COMPONENTS = ("embeddings", "kda", "mla", "indexer", "router", "latent_projection", "routed_experts",
              "shared_experts", "dense_ffn", "norms", "attn_res", "vision", "mtp")


def component_of(param_name: str, model) -> str:
    """Map a parameter name of LatentMoEForCausalLM to one of COMPONENTS."""
    parts = param_name.split(".")
    if parts[0] == "vision":
        return "vision"
    if parts[0] in ("embed_tokens", "lm_head"):
        return "embeddings"
    if parts[0] == "mtp":  # the multi-token prediction head (mtp.py): drafting and training only
        return "mtp"
    if parts[0] == "attn_res_final" or (parts[0] == "layers" and parts[2] == "attn_res"):  # Block AttnRes (§18)
        return "attn_res"
    if parts[0] == "norm" or parts[2] in ("attn_norm", "ffn_norm"):
        return "norms"
    block = model.layers[int(parts[1])]
    where, child = parts[2], parts[3]
    if where == "attn":
        if block.attention_type == "kda":
            return "kda"
        return "indexer" if child == "indexer" else "mla"
    if not block.is_moe:
        return "dense_ffn"
    return {"router": "router", "experts": "routed_experts", "shared": "shared_experts"}.get(
        child, "latent_projection")
