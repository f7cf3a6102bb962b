"""Parameter and byte accounting on the meta device: no memory is allocated, even for k3-2.8t.

The model is built under accelerate's `init_empty_weights`, then every parameter is
assigned to a component by where it lives in the module tree. "Active" counts the
parameters one token touches: everything except the embeddings, with routed experts
scaled by top_k / num_experts (each token runs top_k of the E experts in a layer).
The vision tower counts as active: it is dense, and every image token comes out of all of it. The MTP head
(config.mtp_depth) counts in total, not in active: a token of the main model does not run it.
"""
from __future__ import annotations

from accelerate import init_empty_weights

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.param_components import COMPONENTS, component_of

# Bits per weight. MXFP4: 4-bit values plus one 8-bit shared scale per block of 32.
# FP8: 8 bits plus one fp32 scale per 128x128 block.
BITS_PER_WEIGHT = {"bf16": 16.0, "fp8": 8.0 + 32.0 / (128 * 128), "mxfp4": 4.0 + 8.0 / 32}

# k3-public: the K3 report's Table 1 (arXiv 2607.24653: 2.78T total, 104.2B activated).
PUBLISHED = {"k3-2.8t": {"total": 2.78e12, "active": 104e9}, "k3-public": {"total": 2.78e12, "active": 104.2e9}}


def build_meta_model(config: ModelConfig):
    """The full model with parameters on the meta device (shapes only, no storage)."""
    with init_empty_weights(include_buffers=True):  # also puts torch.empty & co. on meta
        return LatentMoEForCausalLM(config)


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
        elif component not in ("embeddings", "mtp"):
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


# ------------------------------------------------------------------ exact bytes under a quantization recipe
HIGH_PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def quantized_weight_bytes(fmt: str, stack: int, out_features: int, in_features: int) -> int:
    """Exact bytes of `stack` matrices [out, in] packed in `fmt` (layouts: latentmoe_lab/quant/weight_*.py).

    fp8: 1 byte per value + one fp32 scale per 128 x 128 block (ragged edge blocks count whole);
    int8: 1 byte per value + one fp32 scale per output row; mxfp4: per row, ceil(in / 32) blocks of
    16 bytes of values + 1 E8M0 scale byte (a ragged last block is padded).
    """
    def blocks(n: int, size: int) -> int:
        return -(-n // size)

    per_matrix = {"fp8": out_features * in_features + 4 * blocks(out_features, 128) * blocks(in_features, 128),
                  "int8": out_features * in_features + 4 * out_features,
                  "mxfp4": out_features * blocks(in_features, 32) * 17}
    if fmt not in per_matrix:
        raise ValueError(f"fmt: must be one of {sorted(per_matrix)}, got {fmt!r}")
    return stack * per_matrix[fmt]


def recipe_bytes(config: ModelConfig, recipe, dtype: str = "bf16") -> dict:
    """Bytes a model quantized with `recipe` holds (parameters + buffers), from shapes only (meta device).

    recipe: a latentmoe_lab.quant Recipe or its name. dtype: the high-precision parts' storage ("bf16" |
    "fp16" | "fp32"). Packed weights follow `quantized_weight_bytes` (stacked experts as [E, out, in]);
    a static activation scale adds 4 bytes per packed weight, SmoothQuant 4 bytes per input channel of a
    packed linear (neither for weight-only layers, see `recipe.quantizes_activations`). Returns {"total",
    "by_component": {component: bytes}, "buffers"} (buffers: the fp32 routing biases).
    """
    from torch import nn

    from latentmoe_lab.layers.moe import LatentExperts
    from latentmoe_lab.quant.recipes import get_recipe

    if dtype not in HIGH_PRECISION_BYTES:
        raise ValueError(f"dtype: must be one of {sorted(HIGH_PRECISION_BYTES)}, got {dtype!r}")
    recipe = get_recipe(recipe)
    model = build_meta_model(config)
    by_component = dict.fromkeys(COMPONENTS, 0)
    for name, param in model.named_parameters():
        component = component_of(name, model)
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        fmt = recipe.weight_format(component, name)
        if isinstance(module, nn.Linear) and leaf == "weight":
            stack, out_features, in_features = 1, *param.shape
        elif isinstance(module, LatentExperts):
            stack, in_features, out_features = param.shape  # [E, D_in, D_out], packed as [E, out, in]
        else:
            fmt = None
        if fmt is None:
            by_component[component] += param.numel() * HIGH_PRECISION_BYTES[dtype]
            continue
        by_component[component] += quantized_weight_bytes(fmt, stack, out_features, in_features)
        quantized_input = recipe.quantizes_activations(name)
        if quantized_input and recipe.activations == "static":
            by_component[component] += 4  # one input scale per packed tensor (experts: w13 and w2)
        if quantized_input and recipe.smooth_alpha is not None and isinstance(module, nn.Linear):
            by_component[component] += 4 * in_features
    buffers = sum(buf.numel() * buf.element_size() for buf in model.buffers())
    return {"total": sum(by_component.values()) + buffers, "by_component": by_component, "buffers": buffers}
