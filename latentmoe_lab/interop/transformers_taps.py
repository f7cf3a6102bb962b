"""A transformers model as an alignment candidate: its intermediate tensors under our tap names
(alignment/taps.py), so `alignment.compare(ours, TransformersCandidate(theirs, ours.config), ids)` walks a real
checkpoint layer by layer against transformers and names the first divergent tap (docs/design.md §8, §17).

Their modules, as kimi_linear and deepseek_v32 name them, and the taps they fill:

    model.embed_tokens                 embed
    model.layers.{i}.self_attn         layers.{i}.attn            (the first output when it returns a tuple)
    model.layers.{i}.mlp.gate          layers.{i}.moe.router_logits and layers.{i}.moe.experts
                                       (their router returns fp32 logits [N, E], weights [N, K], indices [N, K])
    model.layers.{i}.mlp               layers.{i}.ffn
    model.layers.{i}                   layers.{i}.residual
    model.norm, lm_head                norm, logits
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from latentmoe_lab.alignment.taps import ExpertChoice, Recording, TokenSubset, tap_points
from latentmoe_lab.config import ModelConfig


class TransformersCandidate:
    """record(inputs, subset) -> Recording of a transformers causal LM of the same config as ours."""

    def __init__(self, model: nn.Module, config: ModelConfig, name: str = "transformers"):
        if not isinstance(getattr(model, "model", None), nn.Module) or not hasattr(model.model, "layers"):
            raise TypeError(f"model: expected a transformers causal LM with .model.layers, got {type(model).__name__}")
        if len(model.model.layers) != config.num_layers:
            raise ValueError(f"model: has {len(model.model.layers)} layers, the config {config.num_layers}")
        self.model, self.config, self.name = model, config, name

    def record(self, inputs, subset: TokenSubset = TokenSubset()) -> Recording:
        recording = Recording(tap_points(self.config))
        offsets: dict[str, int] = {}
        batch = {}

        def kept(name: str, length: int) -> tuple[torch.Tensor, torch.Tensor]:
            offset = offsets.get(name, 0)
            offsets[name] = offset + length
            local = subset.keep(offset, length)
            return local, local + offset

        def dense(name: str):
            def hook(module, args, output):
                tensor = output[0] if isinstance(output, tuple) else output
                local, positions = kept(name, tensor.shape[1])
                recording.add(name, tensor.detach().index_select(1, local).float().cpu(), positions)
            return hook

        def router(layer: int):
            def hook(module, args, output):
                logits, weights, indices = output
                shape = (batch["size"], -1)
                local, positions = kept(f"layers.{layer}.moe.experts", logits.shape[0] // batch["size"])
                recording.add(f"layers.{layer}.moe.router_logits",
                              logits.detach().reshape(*shape, logits.shape[-1]).index_select(1, local).float(),
                              positions)
                recording.add(f"layers.{layer}.moe.experts",
                              ExpertChoice(indices.detach().reshape(*shape, indices.shape[-1]).index_select(1, local),
                                           weights.detach().reshape(*shape, weights.shape[-1]).index_select(1, local)
                                           .float()), positions)
            return hook

        inner = self.model.model
        modules = [("embed", inner.embed_tokens), ("norm", inner.norm), ("logits", self.model.lm_head)]
        for i, layer in enumerate(inner.layers):
            modules += [(f"layers.{i}.attn", layer.self_attn), (f"layers.{i}.ffn", layer.mlp),
                        (f"layers.{i}.residual", layer)]
        handles = [module.register_forward_hook(dense(name)) for name, module in modules]
        handles += [layer.mlp.gate.register_forward_hook(router(i)) for i, layer in enumerate(inner.layers)
                    if self.config.is_moe_layer(i)]
        ids = inputs["input_ids"] if isinstance(inputs, Mapping) else inputs
        batch["size"] = ids.shape[0]
        try:
            with torch.no_grad():
                self.model(**inputs) if isinstance(inputs, Mapping) else self.model(inputs)
        finally:
            for handle in handles:
                handle.remove()
        return recording
