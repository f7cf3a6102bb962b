"""A pipeline stage: some decoder blocks of LatentMoEForCausalLM under their global names.

`layers` is a ModuleDict keyed by the global layer index, so a stage's state-dict names
("layers.5.attn.q_proj.weight", "lm_head.weight") are the full model's, and a checkpoint saved by
any layout loads into any other. The first stage embeds, the last normalises and projects.
The first stage also keeps the vision tower (text-only steps leave it untouched), so the stages'
checkpoint holds every tensor of the model and its export loads with from_pretrained.

forward(x) -> y: first stage ids [b, t] int64, else hidden [b, t, hidden]; last stage fp32 logits
[b, t, vocab], else hidden. Each MoE layer's aux and z losses ride on the hidden state backwards
(`attach_aux_loss`): the pipeline's loss function only sees the logits, and this way every stage
still receives the gradient of its own router losses.
"""
from __future__ import annotations

import torch
from torch import nn

from latentmoe_lab.model import LatentMoEForCausalLM


def named_blocks(model: nn.Module):
    """(global layer index, block) pairs of a LatentMoEForCausalLM (ModuleList) or a PipelineStageModule (ModuleDict)."""
    layers = model.layers
    return [(int(k), b) for k, b in layers.items()] if isinstance(layers, nn.ModuleDict) else list(enumerate(layers))


class _AttachAux(torch.autograd.Function):
    """Identity on x; in backward also returns d(aux)/d(aux) = 1, so aux's graph gets its gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape = aux.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.new_ones(ctx.aux_shape, dtype=torch.float32)


def attach_aux_loss(x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    return _AttachAux.apply(x, aux) if aux.requires_grad else x


class PipelineStageModule(nn.Module):
    """Blocks `layer_ids` of `model` (taken, not copied: build on the meta device), plus embeddings / head."""

    def __init__(self, model: LatentMoEForCausalLM, layer_ids: range, first: bool, last: bool):
        super().__init__()
        self.config = model.config
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        self.embed_tokens = model.embed_tokens if first else None
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.vision = model.vision if first else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        for _, block in named_blocks(self):
            x = block(x)
            if block.is_moe:
                x = attach_aux_loss(x, block.ffn.last_aux_loss + block.ffn.last_z_loss)
        return self.lm_head(self.norm(x)).float() if self.lm_head is not None else x
