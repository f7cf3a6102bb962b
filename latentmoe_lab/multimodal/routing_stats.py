"""Which experts do image tokens and text tokens pick? Per-layer expert load split by modality.

Image and text tokens share every MoE layer (docs/design.md §1.5), so a serving engineer wants to know whether
they also share experts: if image tokens concentrate on a few experts, an image-heavy batch overloads
those experts' devices. A forward hook on every LatentMoE re-runs its (deterministic) router on the
layer's input and keeps the top-k expert indices of each token; the token's modality comes from
input_ids (placeholders are image tokens, everything else, the image start / end tokens included, is text).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange

from latentmoe_lab.layers.moe import LatentMoE
from latentmoe_lab.multimodal.processor import MultimodalBatch


@dataclass
class ModalityRouting:
    """text_load, image_load: [L, E] int64, expert assignments per MoE layer from text / image tokens."""

    layer_labels: list[str]
    text_load: torch.Tensor
    image_load: torch.Tensor
    text_tokens: int
    image_tokens: int

    def fractions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Load normalised per layer and modality: (text [L, E], image [L, E]), each row sums to 1 (or 0)."""
        def normalise(load: torch.Tensor) -> torch.Tensor:
            return load.float() / load.sum(dim=1, keepdim=True).clamp(min=1)
        return normalise(self.text_load), normalise(self.image_load)

    def shared_experts(self, min_fraction: float = 0.0) -> list[int]:
        """Per layer, how many experts take more than `min_fraction` of both modalities' assignments."""
        text, image = self.fractions()
        return ((text > min_fraction) & (image > min_fraction)).sum(dim=1).tolist()

    def overlap(self) -> list[float]:
        """Per layer, sum_e min(text_e, image_e) of the load fractions: 1 = same distribution, 0 = disjoint experts."""
        text, image = self.fractions()
        return torch.minimum(text, image).sum(dim=1).tolist()

    def summary(self, min_fraction: float = 0.0) -> str:
        experts = self.text_load.shape[1]
        lines = [f"{self.text_tokens} text and {self.image_tokens} image tokens; experts per layer: {experts}"]
        for label, shared, overlap in zip(self.layer_labels, self.shared_experts(min_fraction), self.overlap()):
            lines.append(f"  {label}: {shared}/{experts} experts used by both modalities, load overlap {overlap:.2f}")
        return "\n".join(lines)


@torch.no_grad()
def routing_by_modality(model, batch: MultimodalBatch) -> ModalityRouting:
    """Run `model` on `batch` once and split every MoE layer's expert assignments by token modality."""
    moe_layers = {f"layer {i}": block.ffn for i, block in enumerate(model.layers) if isinstance(block.ffn, LatentMoE)}
    if not moe_layers:
        raise ValueError("model: has no LatentMoE layer to take routing statistics from")
    indices: dict[str, torch.Tensor] = {}

    def keep_indices(label: str):
        def hook(module, args, output):
            indices[label] = module.route(rearrange(args[0], "b t d -> (b t) d"))[1]  # [B*T, K]
        return hook

    hooks = [moe.register_forward_hook(keep_indices(label)) for label, moe in moe_layers.items()]
    try:
        model(**batch.model_inputs())
    finally:
        for hook in hooks:
            hook.remove()

    real = batch.attention_mask.flatten()
    is_image = (batch.input_ids == model.config.vision.image_token_id).flatten()
    num_experts = model.config.moe.num_experts
    text_load, image_load = [], []
    for label in moe_layers:
        chosen = indices[label]
        text_load.append(torch.bincount(chosen[real & ~is_image].flatten(), minlength=num_experts))
        image_load.append(torch.bincount(chosen[real & is_image].flatten(), minlength=num_experts))
    return ModalityRouting(layer_labels=list(moe_layers), text_load=torch.stack(text_load),
                           image_load=torch.stack(image_load), text_tokens=int((real & ~is_image).sum()),
                           image_tokens=int((real & is_image).sum()))
