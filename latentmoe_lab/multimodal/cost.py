"""What an image costs the text model: sequence length, latent-cache bytes and vision-tower work per image size.

At full scale (k3-2.8t, patch 14, 2x2 merge) an H x W image becomes (H/14)(W/14)/4 tokens plus the
start and end tokens (sides rounded to multiples of 28). Each token then costs what a text token
costs: per Gated DSA layer the cache keeps (kv_lora + rope) latent values and one index key
(docs/design.md §1.6); the KDA layers' state does not grow with the sequence. Before that, the vision tower
runs on the un-merged patches: 4x more positions than the text model sees, with attention quadratic
in them inside the image.
"""
from __future__ import annotations

from dataclasses import dataclass

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.multimodal.images import grid_size

# Storage assumed for the cache: latent and rope key in bf16; index keys in FP8 with one fp32 scale per token.
LATENT_BYTES = 2
INDEX_KEY_BYTES = 1
INDEX_SCALE_BYTES = 4


@dataclass
class ImageCost:
    """One image size: patches the tower sees, tokens the text model sees, and what those cost."""

    height: int
    width: int
    patches: int
    image_tokens: int  # placeholders, one per merged window
    sequence_tokens: int  # image_tokens + start and end tokens
    cache_bytes: int  # DSA latent + rope + index cache the image's tokens add, all layers
    tower_flops: float  # vision tower forward (matmuls and in-image attention), 2 FLOPs per multiply-add


def cache_bytes_per_token(config: ModelConfig) -> int:
    """Bytes one token adds to the hybrid cache, summed over the Gated DSA layers (KDA state is fixed-size)."""
    per_layer = ((config.mla.kv_lora_rank + config.mla.qk_rope_head_dim) * LATENT_BYTES
                 + config.indexer.head_dim * INDEX_KEY_BYTES + INDEX_SCALE_BYTES)
    return config.num_dsa_layers * per_layer


def kda_state_bytes(config: ModelConfig) -> int:
    """fp32 recurrent state of all KDA layers: independent of how many tokens (or images) came before."""
    return config.num_kda_layers * config.kda.num_heads * config.kda.head_dim_k * config.kda.head_dim_v * 4


def tower_flops(config: ModelConfig, patches: int) -> float:
    """Forward FLOPs of the vision tower on one image of `patches` patches (biases and norms ignored)."""
    v = config.vision
    per_patch_matmuls = (v.in_channels * v.patch_size ** 2 * v.hidden_size  # patch embedding
                         + v.num_layers * (4 * v.hidden_size ** 2 + 2 * v.hidden_size * v.intermediate_size))
    merged = v.merge_size ** 2 * v.hidden_size
    projector = (merged * merged + merged * config.hidden_size) * patches / v.merge_size ** 2
    attention = v.num_layers * 2 * patches ** 2 * v.hidden_size  # scores and weighted sum
    return 2.0 * (per_patch_matmuls * patches + projector + attention)


def image_cost(config: ModelConfig, height: int, width: int, max_side: int | None = None) -> ImageCost:
    """Cost of one H x W image for `config` (which must have a vision part)."""
    if config.vision is None:
        raise ValueError("config.vision: image costs need a config with a vision tower")
    v = config.vision
    rows, cols = grid_size(height, width, v.patch_size, v.merge_size, max_side)
    tokens = rows * cols // v.merge_size ** 2
    return ImageCost(height=height, width=width, patches=rows * cols, image_tokens=tokens,
                     sequence_tokens=tokens + 2, cache_bytes=(tokens + 2) * cache_bytes_per_token(config),
                     tower_flops=tower_flops(config, rows * cols))


def image_cost_table(config: ModelConfig, sides: list[int]) -> list[ImageCost]:
    """image_cost for square images of each side length."""
    return [image_cost(config, side, side) for side in sides]
