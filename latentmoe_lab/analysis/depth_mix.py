"""Where each sublayer of a Block AttnRes model reads from: the depth softmax averaged over tokens.

For every mix of the model (before the attention and before the MLP of each layer, and the final one) the
weights p_i over its candidates (layers/attn_res.py) are recorded during one forward and averaged over
the tokens. Columns line up by source: the embedding, finished block 1, 2, ..., and last the current
block's partial sum; a cell is None where that source does not exist at that depth (a later block, or
the partial sum right after a block boundary).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from latentmoe_lab.layers.attn_res import DepthMix


@dataclass(frozen=True)
class DepthWeights:
    """sublayers [R] row labels, sources [C] column labels, weights [R][C] mean softmax (None = no source)."""

    sublayers: list[str]
    sources: list[str]
    weights: list[list[float | None]]


@torch.no_grad()
def attn_res_depth_weights(model, input_ids: torch.Tensor) -> DepthWeights:
    """One forward of `model` (a LatentMoEForCausalLM with config.attn_res_block_size) on input_ids [B, T]."""
    block_size = model.config.attn_res_block_size
    if block_size is None:
        raise ValueError("model: has no Block AttnRes (config.attn_res_block_size is None)")
    mixes: list[tuple[str, DepthMix, bool]] = []  # (label, module, its candidates end with the partial sum)
    for i, block in enumerate(model.layers):
        mixes.append((f"layer {i} attention", block.attn_res.attn, i % block_size != 0))
        mixes.append((f"layer {i} MLP", block.attn_res.mlp, True))
    mixes.append(("final", model.attn_res_final, True))
    rows: dict[str, tuple[list[float], bool]] = {}

    def recorder(label: str, has_partial: bool):
        def hook(module, args) -> None:  # returns None: the input is left as it is
            rows[label] = (module.weights(args[0]).flatten(1).mean(1).tolist(), has_partial)
        return hook

    handles = [module.register_forward_pre_hook(recorder(label, partial)) for label, module, partial in mixes]
    try:
        model(input_ids)
    finally:
        for handle in handles:
            handle.remove()
    most_blocks = max(len(w) - partial for w, partial in rows.values())
    sources = ["embedding", *(f"block {j}" for j in range(1, most_blocks)), "partial sum"]
    table = []
    for label, _, _ in mixes:
        weights, partial = rows[label]
        blocks = weights[:len(weights) - partial]
        row = [*blocks, *([None] * (most_blocks - len(blocks))), weights[-1] if partial else None]
        table.append(row)
    return DepthWeights(sublayers=[label for label, _, _ in mixes], sources=sources, weights=table)
