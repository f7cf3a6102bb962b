"""Parameter and byte accounting on the meta device: no memory is allocated, even for k3-2.8t.

The model is built under accelerate's `init_empty_weights`, then every parameter is
assigned to a component by where it lives in the module tree. "Active" counts the
parameters one token touches: everything except the embeddings, with routed experts
scaled by top_k / num_experts (each token runs top_k of the E experts in a layer).
The vision tower counts as active: it is dense, and every image token comes out of all of it.
"""
from __future__ import annotations

from accelerate import init_empty_weights

from latentmoe_lab.config import ModelConfig

COMPONENTS = ("embeddings", "kda", "mla", "indexer", "router", "latent_projection", "routed_experts",
              "shared_experts", "dense_ffn", "norms", "vision")

# Bits per weight. MXFP4: 4-bit values plus one 8-bit shared scale per block of 32.
# FP8: 8 bits plus one fp32 scale per 128x128 block.
BITS_PER_WEIGHT = {"bf16": 16.0, "fp8": 8.0 + 32.0 / (128 * 128), "mxfp4": 4.0 + 8.0 / 32}

PUBLISHED = {"k3-2.8t": {"total": 2.78e12, "active": 104e9}}


def build_meta_model(config: ModelConfig):
    """The full model with parameters on the meta device (shapes only, no storage)."""
    from latentmoe_lab.model import LatentMoEForCausalLM

    with init_empty_weights(include_buffers=True):  # also puts torch.empty & co. on meta
        return LatentMoEForCausalLM(config)


def component_of(param_name: str, model) -> str:
    """Map a parameter name of LatentMoEForCausalLM to one of COMPONENTS."""
    parts = param_name.split(".")
    if parts[0] == "vision":
        return "vision"
    if parts[0] in ("embed_tokens", "lm_head"):
        return "embeddings"
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


def count_parameters(config: ModelConfig) -> dict:
    """Parameter counts for `config`.

    Returns {"total", "active", "total_non_embedding", "by_component": {name: {"total", "active"}},
    "bytes": {scheme: bytes}} with ints for the counts. Schemes: "bf16" (all weights bf16),
    "experts_fp8" and "experts_mxfp4" (routed experts quantised, the rest bf16).
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config: expected a ModelConfig, got {type(config).__name__}")
    model = build_meta_model(config)
    by_component = {name: {"total": 0, "active": 0} for name in COMPONENTS}
    active_fraction = config.moe.top_k / config.moe.num_experts
    for name, param in model.named_parameters():
        component = component_of(name, model)
        by_component[component]["total"] += param.numel()
        if component == "routed_experts":
            by_component[component]["active"] += round(param.numel() * active_fraction)
        elif component != "embeddings":
            by_component[component]["active"] += param.numel()
    total = sum(c["total"] for c in by_component.values())
    experts = by_component["routed_experts"]["total"]
    rest = total - experts
    return {
        "total": total,
        "active": sum(c["active"] for c in by_component.values()),
        "total_non_embedding": total - by_component["embeddings"]["total"],
        "by_component": by_component,
        "bytes": {
            "bf16": round(total * BITS_PER_WEIGHT["bf16"] / 8),
            "experts_fp8": round((experts * BITS_PER_WEIGHT["fp8"] + rest * BITS_PER_WEIGHT["bf16"]) / 8),
            "experts_mxfp4": round((experts * BITS_PER_WEIGHT["mxfp4"] + rest * BITS_PER_WEIGHT["bf16"]) / 8),
        },
    }


def format_count(n: float) -> str:
    """1234567 -> '1.23M'; 2.78e12 -> '2.78T'."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def format_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def parameter_table(config: ModelConfig) -> str:
    """A plain-text table of the counts, with the published figures when the preset has them."""
    counts = count_parameters(config)
    lines = [f"{'component':<20}{'total':>12}{'active/token':>15}"]
    for name, c in counts["by_component"].items():
        lines.append(f"{name:<20}{format_count(c['total']):>12}{format_count(c['active']):>15}")
    lines.append(f"{'TOTAL':<20}{format_count(counts['total']):>12}{format_count(counts['active']):>15}")
    lines.append(f"(active excludes the {format_count(counts['by_component']['embeddings']['total'])} "
                 f"embedding + LM-head parameters)")
    lines.append("")
    lines.append("weight bytes: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in counts["bytes"].items()))
    published = PUBLISHED.get(config.name)
    if published:
        lines.append(f"published: ~{format_count(published['total'])} total, ~{format_count(published['active'])} "
                     f"active; ours: {counts['total'] / published['total']:.4f}x total, "
                     f"{counts['active'] / published['active']:.4f}x active")
    return "\n".join(lines)
